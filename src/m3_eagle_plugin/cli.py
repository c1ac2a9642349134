"""The `m3-eagle` command line: one sub-command per job, each owned by its own module.

Every sub-command module exposes `add_arguments(parser)` and `main(args) -> int`; this file only
wires them, so `m3-eagle --help` stays cheap (the modules are imported on use).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "doctor": ("m3_eagle_plugin.doctor", "report plugin, host, manifest and patch state"),
    "make-tiny": ("m3_eagle_plugin.models.tiny", "write a tiny random MiniMax-M3 target and Eagle3 head"),
    "run": ("m3_eagle_plugin.host.reference.cli", "greedy generation with one-model Eagle3 on the reference host"),
    "bench": ("m3_eagle_plugin.bench.cli", "kernel and end-to-end performance suite"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3-eagle", description=__doc__.splitlines()[0])
    from m3_eagle_plugin._version import __version__

    parser.add_argument("--version", action="version", version=f"m3-eagle-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        p.set_defaults(_add_arguments_pending=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # Two-pass: find the sub-command first, then let its module add its own arguments.
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        sub = argparse.ArgumentParser(prog=f"m3-eagle {argv[0]}", description=COMMANDS[argv[0]][1])
        module.add_arguments(sub)
        args = sub.parse_args(argv[1:])
        return int(module.main(args) or 0)
    args = parser.parse_args(argv)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
