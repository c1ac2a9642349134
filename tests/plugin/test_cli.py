"""The `m3-eagle` dispatcher (`m3_eagle_plugin.cli`): what an interrupted sub-command leaves."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from m3_eagle_plugin import cli

SCRIPT = "import sys; from m3_eagle_plugin.cli import main; sys.exit(main(sys.argv[1:]))"


def _default_sigint() -> None:  # a background job starts with SIGINT ignored; Ctrl-C reaches a shell's own
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, status, word", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "terminated")])
def test_an_interrupted_make_tiny_is_one_line_and_leaves_no_scratch(tmp_path, sig, status, word):
    """Ctrl-C printed a KeyboardInterrupt traceback; SIGTERM (its default action) killed the process
    before make-tiny's `finally` removed OUT_DIR/.make-tiny-* (2 MB of partial checkpoint) and OUT_DIR itself."""
    out = tmp_path / "tiny"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "make-tiny", str(out), "--train-steps", "1000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 60
    while not list(out.glob(".make-tiny-*/draft/model.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.1)  # interrupt once the scratch pair is written (training under way)
    time.sleep(0.5)
    proc.send_signal(sig)
    try:
        err = proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:  # dropped inside torch's C++ (a lazy import under load): a second Ctrl-C
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1]
    assert proc.returncode == status, err
    assert err == f"m3-eagle make-tiny: {word} ({'Ctrl-C / SIGINT' if word == 'interrupted' else 'SIGTERM'})\n"
    assert not out.exists()  # it made OUT_DIR: removed with the scratch pair, not left empty


def test_a_sigterm_handler_installed_by_someone_else_is_kept(monkeypatch, capsys):
    """The dispatcher turns SIGTERM into an exception only where nobody handles it already, and puts the
    default back afterwards."""
    seen = []
    monkeypatch.setattr(cli, "COMMANDS", {"probe": ("m3_eagle_plugin.tests_probe", "probe")})
    module = type(sys)("m3_eagle_plugin.tests_probe")
    module.add_arguments = lambda parser: None
    module.main = lambda args: seen.append(signal.getsignal(signal.SIGTERM)) or 0
    monkeypatch.setitem(sys.modules, module.__name__, module)
    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the test runner had: put back at the end
    try:
        _check_the_handler_is_kept(module, seen, capsys)
    finally:
        signal.signal(signal.SIGTERM, outer)


def _check_the_handler_is_kept(module, seen, capsys) -> None:
    assert cli.main(["probe"]) == 0
    assert seen == [cli._raise_terminated] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert cli.main(["probe"]) == 0
        assert seen[-1] is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    module.main = lambda args: (_ for _ in ()).throw(KeyboardInterrupt)
    assert cli.main(["probe"]) == 130 and capsys.readouterr().err == "m3-eagle probe: interrupted (Ctrl-C / SIGINT)\n"



@pytest.mark.parametrize("raised, status, line", [(KeyboardInterrupt, 130, "interrupted (Ctrl-C / SIGINT)"),
                                                  (cli.Terminated, 143, "terminated (SIGTERM)")])
def test_an_interrupt_python_drops_in_a_finalizer_still_ends_the_command(monkeypatch, capsys, raised, status, line):
    """A Ctrl-C that lands in a weakref callback or `__del__` (importlib's module-lock callback, seen in
    CI) was printed as "Exception ignored" and lost: make-tiny's training ran on until killed."""
    ran_on = []

    class Dropped:
        def __del__(self):
            raise raised(signal.SIGTERM) if raised is cli.Terminated else raised

    def main(args):
        Dropped()  # collected at once: its exception goes to sys.unraisablehook, not to this frame
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pass
        ran_on.append(True)
        return 0

    module = type(sys)("m3_eagle_plugin.tests_probe")
    module.add_arguments, module.main = (lambda parser: None), main
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(cli, "COMMANDS", {"probe": (module.__name__, "probe")})
    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    hook = sys.unraisablehook
    try:
        assert cli.main(["probe"]) == status
    finally:
        signal.signal(signal.SIGTERM, outer)
    assert ran_on == [] and capsys.readouterr().err == f"m3-eagle probe: {line}\n"
    assert sys.unraisablehook is hook  # put back


PROBE = """import sys, types
from m3_eagle_plugin import cli
probe = types.ModuleType("probe")
probe.add_arguments = lambda parser: None
probe.main = lambda args: print('{"outputs": [[1, 2, 3]]}') or 0
sys.modules["probe"] = probe
cli.COMMANDS["probe"] = ("probe", "probe")
sys.exit(cli.main(["probe"]))
"""


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
def test_output_whose_reader_has_gone_is_one_line_and_141(unbuffered):
    """`m3-eagle run --json | head -c 10`: a reader that closed the pipe gave a BrokenPipeError traceback
    (exit 1), or with stdout buffered an "Exception ignored" at exit (120)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              env=env, timeout=60)
    finally:
        os.close(write_end)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert proc.stderr == "m3-eagle probe: output closed by its reader (broken pipe)\n"


FULL_PROBE = """import sys, types
from m3_eagle_plugin import cli
probe = types.ModuleType("probe")
probe.add_arguments = lambda parser: None
def main(args):
    if sys.argv[1] == "own":
        open("/nonexistent-dir/input.json")
    if sys.argv[1] == "notice":
        print("m3-eagle probe: a notice for stderr", file=sys.stderr)
    print('{"outputs": [[1, 2, 3]]}')
probe.main = main
sys.modules["probe"] = probe
cli.COMMANDS["probe"] = ("probe", "probe")
sys.exit(cli.main(["probe"]))
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
def test_output_that_cannot_be_written_is_one_line_and_1(unbuffered):
    """`m3-eagle run --json > FILE` on a full disk: an OSError traceback (exit 1), with stdout buffered
    followed by an "Exception ignored" at exit (120). An OSError of the sub-command's own stays a
    traceback, not blamed on the output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", FULL_PROBE, "output"], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=60)
        assert (proc.returncode, proc.stderr) == (1, "m3-eagle probe: its output could not be written to stdout "
                                                     "(No space left on device)\n")
        proc = subprocess.run([sys.executable, "-c", FULL_PROBE, "own"], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("Traceback")
    assert proc.stderr.rstrip().endswith("No such file or directory: '/nonexistent-dir/input.json'")


def test_with_stderr_closed_the_lines_meant_for_it_stay_out_of_stdout():
    """`m3-eagle run --json 2>&-`: Python's sys.stderr is None and print(file=None) writes to stdout, so
    the default-prompt notice came first on stdout, before the one JSON object."""
    proc = subprocess.run([sys.executable, "-c", FULL_PROBE, "notice"], stdout=subprocess.PIPE, text=True,
                          timeout=60, preexec_fn=lambda: os.close(2))
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {"outputs": [[1, 2, 3]]}  # the whole of stdout is the one JSON object


UNDECODABLE_PROBE = """import os, sys, types
from m3_eagle_plugin import cli
probe = types.ModuleType("probe")
probe.add_arguments = lambda parser: None
probe.main = lambda args: print("wrote", os.fsdecode(b"out-\\xff/target"))
sys.modules["probe"] = probe
cli.COMMANDS["probe"] = ("probe", "probe")
sys.exit(cli.main(["probe"]))
"""


def test_a_path_with_undecodable_bytes_is_printed_escaped_on_a_strict_utf8_stdout():
    """A file name that is not UTF-8 (`make-tiny $'out-\\xff'`, a `--prompts` file whose line errors name
    it, `M3_EAGLE_PLUGIN` in doctor's table) reaches Python as a lone surrogate; written to a stdout
    that refuses it (a UTF-8 locale other than C: errors "strict") it was a UnicodeEncodeError
    traceback, exit 1, after the work was done. It is written as stderr writes it: backslash escapes."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    proc = subprocess.run([sys.executable, "-c", UNDECODABLE_PROBE], capture_output=True, env=env, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert proc.stdout == b"wrote out-\\udcff/target\n"
