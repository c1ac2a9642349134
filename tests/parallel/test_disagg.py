"""Disaggregated serving: prefill (and the first Eagle3 draft round) on rank 0, the rest on rank 1.

The request's pages cross processes with every pool (target K/V, index-K, the shared draft
layer); the generation side must then emit exactly the tokens and the acceptance statistics of
one aggregated engine.
"""
from pathlib import Path

import torch

from ._spawn import run_ranks
from ._workers import DISAGG_K, DISAGG_NEW, DISAGG_PROMPTS, disagg_worker


def test_handoff_continues_like_an_aggregated_run(tiny_pair, tmp_path):
    run_ranks(disagg_worker, 2, str(tiny_pair[0]), str(tiny_pair[1]), str(tmp_path), timeout_s=150)
    rank0 = torch.load(Path(tmp_path) / "rank0.pt")
    rank1 = torch.load(Path(tmp_path) / "rank1.pt")
    assert rank1["errors"] == [None] * len(DISAGG_PROMPTS)
    assert [len(o) for o in rank0["outputs"]] == [DISAGG_NEW] * len(DISAGG_PROMPTS)
    assert rank1["outputs"] == rank0["outputs"]
    assert [o[:1] for o in rank0["outputs"]] == rank0["context_outputs"]  # prefill emitted the first token
    assert rank1["stats"] == rank0["stats"]
    assert rank0["stats"]["verify_steps"] > 0 and rank0["stats"]["draft_tokens"] > 0
    assert rank0["free_after"] == rank0["total_blocks"]  # the context side released the request
    # what arrived is what left, with 2 pools (K/V + draft layer; index-K) of the tiny geometry
    for sent, got in zip(rank0["sent_pages"], rank1["received_pages"]):
        assert len(sent) == 2 and all(torch.equal(a, b) for a, b in zip(sent, got))
        assert sent[0].any() and sent[1].any()
    assert all(min(pages) >= 3 for pages in rank1["pages"])  # landed on other page ids
    # every draft proposal matches, token by token: the first round ran on rank 0, the rest on rank 1
    for i in range(len(DISAGG_PROMPTS)):
        assert rank0["context_drafts"][i] + rank1["drafts"][i] == rank0["drafts"][i]
        assert len(rank1["drafts"][i]) >= 2 and all(len(d) == DISAGG_K for d in rank1["drafts"][i])
    # with a drafter that is partly right, the acceptance statistics match too
    assert rank1["replay_outputs"] == rank0["replay_outputs"] == rank0["outputs"]
    assert rank1["replay_stats"] == rank0["replay_stats"]
    assert 0 < rank0["replay_stats"]["acceptance_rate"] < 1
    # negative control: without the draft layer's pages the target still decodes the same tokens
    # (greedy verification is lossless) but the drafter proposes something else
    assert rank1["control_outputs"] == rank0["outputs"]
    assert rank1["control_drafts"] != rank1["drafts"]
