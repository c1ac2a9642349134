"""Starting the local group, and the whole two-rank suite over NCCL on two GPUs (skipped without)."""
import os
from pathlib import Path

import pytest
import torch

from m3_eagle_plugin.parallel.process_group import init_local_group


def test_bad_arguments_are_refused_before_any_rendezvous():
    with pytest.raises(ValueError, match="outside"):
        init_local_group(2, 2, 12345)
    with pytest.raises(ValueError, match="backend"):
        init_local_group(0, 2, 12345, backend="mpi")


def test_nccl_without_a_gpu_per_rank_is_refused_naming_the_cause(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    with pytest.raises(ValueError, match="CUDA devices are visible"):
        init_local_group(0, torch.cuda.device_count() + 1, 12345, backend="nccl")
    assert "NCCL_NVLS_ENABLE" not in os.environ  # refused before touching anything


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_rank_checks_hold_over_nccl(tiny_pair, tmp_path):
    """The gloo checks' core claims with NCCL on cuda:0 / cuda:1 (NCCL_NVLS_ENABLE=0 by default)."""
    from ._spawn import run_ranks
    from ._workers import all_workers

    run_ranks(all_workers, 2, str(tiny_pair[0]), str(tiny_pair[1]), str(tmp_path), timeout_s=400, backend="nccl")
    tp1 = torch.load(Path(tmp_path) / "tp1_loop.pt")
    tp2 = torch.load(Path(tmp_path) / "tp2_rank0.pt")
    assert tp2["tokens"] == tp1["tokens"]
    assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(tp2["logits"], tp1["logits"]))
    rank1 = torch.load(Path(tmp_path) / "rank1.pt")
    assert rank1["outputs"] == rank1["aggregated_outputs"] and rank1["stats"] == rank1["aggregated_stats"]
    assert rank1["replay_stats"] == torch.load(Path(tmp_path) / "rank0.pt")["replay_stats"]
