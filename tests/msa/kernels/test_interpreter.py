"""The Triton kernels checked on CPU through Triton's interpreter, so CI (which has no GPU) runs
the kernels' own code against the torch references on the hostile cases (stale tail slots,
unmapped pages, selections of invisible blocks) and not only the reference path."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(Version(numpy.__version__) >= Version("2.4"),
                    reason="Triton's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 rejects")
def test_triton_kernels_pass_the_hostile_cases_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "M3_EAGLE_PLUGIN": "off"}
    out = subprocess.run([sys.executable, "-m", "tests.msa.kernels.interpret_hostile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert out.returncode == 0 and lines and all(line.startswith("PASS") for line in lines), (
        out.stdout[-3000:] + out.stderr[-3000:])
    assert len(lines) >= 3, lines
