"""The kernel dispatchers run with their tensors' CUDA device current (`backend.on_first_argument_device`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from m3_eagle_plugin.msa.kernels import backend

ROOT = Path(__file__).resolve().parents[3]


def test_a_call_on_another_device_runs_with_that_device_current_and_restores_it(fake_current_device):
    current, entered = fake_current_device
    seen = []
    fn = backend.on_first_argument_device(lambda x, *, y=0: seen.append((current[0], y)) or "out")
    assert fn(SimpleNamespace(device=torch.device("cuda:1")), y=5) == "out"
    assert fn(SimpleNamespace(device="cuda:0")) == "out"      # already current: no switch
    assert fn(SimpleNamespace(device=torch.device("cuda"))) == "out"  # the current one, unnamed
    assert fn(x=torch.zeros(1)) == "out"                          # a CPU tensor, by keyword
    assert seen == [(1, 5), (0, 0), (0, 0), (0, 0)] and entered == [1] and current == [0]


def test_every_dispatcher_is_guarded():
    guard_code = backend.on_first_argument_device(lambda x: x).__code__
    for name in backend.KERNELS + ("sparse_layer_attention",):
        fn = getattr(backend, name)
        assert fn.__code__ is guard_code and fn.__wrapped__.__name__ == name, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_kernels_on_the_second_gpu_while_the_first_is_current():
    env = {**os.environ, "M3_EAGLE_PLUGIN": "off"}
    out = subprocess.run([sys.executable, "-m", "tests.msa.kernels.two_gpu_guard"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr


def test_the_first_parameter_is_found_by_name_when_every_argument_is_a_keyword():
    """Keywords come in the caller's order: `on_update_kv_lens(kv_lens=None, meta=meta)` must read
    `meta`'s device, not `kv_lens`; a call missing the first argument gets the function's TypeError."""
    calls = []
    fn = backend.on_first_argument_device(lambda meta, kv_lens=None: calls.append(kv_lens) or "out")
    cpu_meta = SimpleNamespace(device=torch.device("cpu"))
    assert fn(kv_lens=None, meta=cpu_meta) == "out"
    assert fn(kv_lens=7, meta=cpu_meta) == "out" and calls == [None, 7]
    with pytest.raises(TypeError, match="meta"):
        fn()
    with pytest.raises(TypeError, match="meta"):
        fn(kv_lens=None)
