"""Suite-wide policy: one torch thread per test, and no replayed kernel recordings across tests.

CI has two shared cores and the suite's models are tiny: intra-op threads only add contention
(the reference host ran a tiny model ~50x slower with two threads than with one). Every test
starts from the ordinary launch path: no recording (`msa/kernels/replay.py`) made by an earlier
test, perhaps under other patched helpers, is replayed in it.
"""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_recordings_from_other_tests():
    replay = sys.modules.get("m3_eagle_plugin.msa.kernels.replay")
    if replay is not None:
        replay.clear_all()
    yield


@pytest.fixture
def fake_current_device(monkeypatch):
    """(current, entered): torch's current CUDA device as `current[0]` and `torch.cuda.device(d)`
    switching it (each `d` entered is appended to `entered`), for device-switch tests without GPUs."""
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
    return current, entered
