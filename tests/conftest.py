"""Suite-wide policy: one torch thread per test.

CI has two shared cores and the suite's models are tiny: intra-op threads only add contention
(the reference host ran a tiny model ~50x slower with two threads than with one).
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
