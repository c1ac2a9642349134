"""Fixtures of the multi-rank tests: one tiny checkpoint pair and one two-rank run per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """`m3-eagle make-tiny` output: (target dir, draft dir); 2 KV heads and 2 index heads, so TP2 splits."""
    from m3_eagle_plugin.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("parallel_tiny"), seed=3)


@pytest.fixture(scope="session")
def two_rank_run(tiny_pair, tmp_path_factory):
    """Directory holding what the two gloo ranks observed (TP2 vs TP1, payload echo, disaggregation)."""
    from ._spawn import run_ranks
    from ._workers import all_workers

    out = tmp_path_factory.mktemp("two_rank_run")
    run_ranks(all_workers, 2, str(tiny_pair[0]), str(tiny_pair[1]), str(out), timeout_s=240)
    return out
