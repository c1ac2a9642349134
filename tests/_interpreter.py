"""Run a test module's kernel checks on CPU through Triton's interpreter, in a subprocess.

TRITON_INTERPRET is read when `triton.jit` decorates, so it cannot be switched on inside a running
suite; the module prints one `PASS`/`FAIL` line per case and exits 1 if any failed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

_SKIPS = (
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(Version(numpy.__version__) >= Version("2.4"),
                       reason="Triton's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 rejects"),
)


def needs_interpreter(test):
    """Skip `test` where Triton's interpreter cannot run."""
    for skip in _SKIPS:
        test = skip(test)
    return test


def interpreter_case_lines(module: str, *args: str) -> list[str]:
    """The module's PASS/FAIL lines (`python -m module *args`); fails the test (with its output) on
    any FAIL or a bad exit."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "M3_EAGLE_PLUGIN": "off"}
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert out.returncode == 0 and lines and all(line.startswith("PASS") for line in lines), (
        out.stdout[-3000:] + out.stderr[-3000:])
    return lines


def run_cases(runs) -> int:
    """Inside the interpreter subprocess: call each `(name, fn, kwargs)` as `fn("cpu", **kwargs)`,
    print one PASS/FAIL line per case, and return the number that failed."""
    failed = 0
    for name, fn, kwargs in runs:
        try:
            fn("cpu", **kwargs)
            print("PASS", name)
        except Exception as exc:  # noqa: BLE001 - report every case
            failed += 1
            print("FAIL", name, f"{type(exc).__name__}: {exc}"[:600])
    return failed


def case_name(fn, kwargs) -> str:
    return f"{fn.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"


def check_module_cases(module: str) -> None:
    """Run `module.INTERPRETER_CASES` (`(fn, kwargs)` pairs, each called as `fn("cpu", **kwargs)`)
    in the interpreter through this file's `main`: every case must print one PASS line."""
    import importlib

    lines = interpreter_case_lines("tests._interpreter", module)
    assert len(lines) == len(importlib.import_module(module).INTERPRETER_CASES), lines


def main(argv: list[str]) -> int:
    """Inside the interpreter subprocess: run the INTERPRETER_CASES of the module named in argv."""
    import importlib

    import torch

    torch.set_num_threads(1)
    cases = importlib.import_module(argv[0]).INTERPRETER_CASES
    return 1 if run_cases([(case_name(fn, kw), fn, kw) for fn, kw in cases]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
