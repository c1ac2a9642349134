"""The `m3-eagle` command line: one sub-command per job, each owned by its own module.

Every sub-command module exposes `add_arguments(parser)` and `main(args) -> int`; this file only
wires them, so `m3-eagle --help` stays cheap (the modules are imported on use). An interrupt (Ctrl-C,
SIGTERM) ends a sub-command with one line on stderr and exit status 130 / 143, after its `finally`
blocks ran (make-tiny removes its scratch folder there), not with a traceback; so does output whose
reader has gone (`m3-eagle run --json | head -c 100`), with 141 as for SIGPIPE, and output that cannot be
written (`> FILE` on a full disk), with 1.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from typing import Any, Iterator, TextIO

COMMANDS = {
    "doctor": ("m3_eagle_plugin.doctor", "report plugin, host, manifest and patch state"),
    "make-tiny": ("m3_eagle_plugin.models.tiny", "write a tiny random MiniMax-M3 target and Eagle3 head"),
    "run": ("m3_eagle_plugin.host.reference.cli", "greedy generation with one-model Eagle3 on the reference host"),
    "bench": ("m3_eagle_plugin.bench.cli", "kernel and end-to-end performance suite"),
}


class Terminated(BaseException):
    """SIGTERM raised as an exception, so that `finally` blocks run as they do for Ctrl-C (the default
    action kills the process on the spot and leaves scratch output behind)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` inside the block; a handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _interrupts_kept() -> Iterator[None]:
    """An interrupt Python drops is delivered again inside the block. A KeyboardInterrupt (or
    `Terminated`) raised while a weakref callback or ``__del__`` runs (importlib's module-lock callback
    on an import, say) is only printed as "Exception ignored", and the command ran on: make-tiny's
    training went on for good after a Ctrl-C. `sys.unraisablehook` sees it; another thread simulates
    the signal again for the main thread a moment later (from within the hook it would raise in the
    hook, and be dropped again), where Python handles that signal."""
    import _thread
    import time

    def deliver(signum: int) -> None:
        time.sleep(0.05)  # the main thread has left the hook and the finalizer
        _thread.interrupt_main(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, (KeyboardInterrupt, Terminated)):
            signum = signal.SIGINT if issubclass(unraisable.exc_type, KeyboardInterrupt) else signal.SIGTERM
            threading.Thread(target=deliver, args=(signum,), daemon=True).start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


def positive_int(text: str) -> int:
    """argparse type of a count option: an integer >= 1, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def path_option(text: str) -> str:
    """argparse type of a path option: an empty value (`--draft "$UNSET"`) is refused, not read as the
    current directory (Path("") is "."), whose checkpoint or source tree was used without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (give a path, or leave the option out)")
    return text


@contextlib.contextmanager
def _stderr_open() -> Iterator[None]:
    """Started with stderr closed (`2>&-`), Python's sys.stderr is None and `print(..., file=sys.stderr)`
    writes to stdout, into the one JSON object `--json` prints there: inside the block it is /dev/null."""
    if sys.stderr is not None:
        yield
        return
    with open(os.devnull, "w") as devnull:
        sys.stderr = devnull
        try:
            yield
        finally:
            if sys.stderr is devnull:
                sys.stderr = None


class _Stdout:
    """sys.stdout while a sub-command runs: it keeps the OSError a write or flush raised (a full disk
    under `> FILE`), so that `run_command` tells a failed output from the sub-command's own errors.
    Text its encoding cannot hold (a path's undecodable bytes, which Python holds as lone surrogates,
    on a stdout with errors "strict") is written with backslash escapes, as stderr writes it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.error = stream, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        try:
            try:
                return self.stream.write(text)
            except UnicodeEncodeError:  # nothing was written: the whole text is encoded first
                encoding = getattr(self.stream, "encoding", None) or "utf-8"
                self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
                return len(text)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            self.error = error
            raise


def run_command(name: str, argv: list[str]) -> int:
    """Import sub-command `name`, parse `argv` with its arguments and run it. An interrupt, during the
    (slow) import included, is one line on stderr and the shell's 128 + signal number."""
    with _stderr_open():
        output = None if sys.stdout is None else _Stdout(sys.stdout)
        if output is not None:
            sys.stdout = output
        try:
            return _run_command(name, argv, output)
        finally:
            if output is not None and sys.stdout is output:
                sys.stdout = output.stream


def _run_command(name: str, argv: list[str], output: _Stdout | None) -> int:
    try:
        with _sigterm_raises(), _interrupts_kept():
            module = importlib.import_module(COMMANDS[name][0])
            parser = argparse.ArgumentParser(prog=f"m3-eagle {name}", description=COMMANDS[name][1])
            module.add_arguments(parser)
            status = int(module.main(parser.parse_args(argv)) or 0)
            if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
                sys.stdout.flush()  # here, not at exit, where a closed reader is an "Exception ignored" and 120
            return status
    except KeyboardInterrupt:
        print(f"m3-eagle {name}: interrupted (Ctrl-C / SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print(f"m3-eagle {name}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        _discard_stdout()
        with contextlib.suppress(OSError):  # stderr may be the closed pipe too
            print(f"m3-eagle {name}: output closed by its reader (broken pipe)", file=sys.stderr)
        return 128 + signal.SIGPIPE
    except OSError as error:
        if output is None or error is not output.error:  # the sub-command's own (a file it read)
            raise
        _discard_stdout()
        with contextlib.suppress(OSError):
            print(f"m3-eagle {name}: its output could not be written to stdout ({error.strerror or error})",
                  file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the closed pipe would fail again when
    Python flushes it at exit."""
    if sys.stdout is None:
        return
    with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor (captured)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


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
        return run_command(argv[0], argv[1:])
    args = parser.parse_args(argv)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
