"""Reference-host test fixtures: one torch thread (CI has 2 shared cores; tiny models only lose
to thread contention) and one tiny checkpoint pair per session."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """`m3-eagle make-tiny` output: (target dir, draft dir)."""
    from m3_eagle_plugin.models.tiny import make_tiny

    out = tmp_path_factory.mktemp("reference_host_tiny")
    return make_tiny(out, seed=5)
