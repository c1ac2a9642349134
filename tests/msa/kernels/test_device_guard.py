"""The kernel dispatchers run with their tensors' CUDA device current (`backend.on_first_argument_device`)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from m3_eagle_plugin.msa.kernels import backend

ROOT = Path(__file__).resolve().parents[3]


def test_a_call_on_another_device_runs_with_that_device_current_and_restores_it(monkeypatch):
    current, entered = [0], []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        before, current[0] = current[0], d
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []
    fn = backend.on_first_argument_device(lambda x, *, y=0: seen.append((current[0], y)) or "out")
    assert fn(SimpleNamespace(device=torch.device("cuda:1")), y=5) == "out"
    assert fn(SimpleNamespace(device="cuda:0")) == "out"      # already current: no switch
    assert fn(SimpleNamespace(device=torch.device("cuda"))) == "out"  # the current one, unnamed
    assert fn(x=torch.zeros(1)) == "out"                          # a CPU tensor, by keyword
    assert seen == [(1, 5), (0, 0), (0, 0), (0, 0)] and entered == [1] and current == [0]


def test_every_dispatcher_is_guarded():
    for name in backend.KERNELS + ("sparse_layer_attention",):
        assert getattr(getattr(backend, name), "__wrapped__", None) is not None, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_kernels_on_the_second_gpu_while_the_first_is_current():
    env = {**os.environ, "M3_EAGLE_PLUGIN": "off"}
    out = subprocess.run([sys.executable, "-m", "tests.msa.kernels.two_gpu_guard"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
