"""Disaggregated serving: prefill (and the first draft round) on rank 0, the rest on rank 1.

The request's pages cross processes with every pool (target K/V, index-K, the shared Eagle3
draft layer); the generation side must then emit exactly the tokens, the draft proposals and
the acceptance statistics of one aggregated engine (run in a single process).
"""
from pathlib import Path

import torch

from ._workers import DISAGG_K, DISAGG_NEW, DISAGG_PROMPTS


def test_handoff_continues_like_an_aggregated_run(two_rank_run):
    tmp_path = two_rank_run
    rank0 = torch.load(Path(tmp_path) / "rank0.pt")
    rank1 = torch.load(Path(tmp_path) / "rank1.pt")
    aggregated = rank1["aggregated_outputs"]
    assert rank1["errors"] == [None] * len(DISAGG_PROMPTS)
    assert [len(o) for o in aggregated] == [DISAGG_NEW] * len(DISAGG_PROMPTS)
    assert [o[:1] for o in aggregated] == rank1["context_outputs"]  # the context server emitted token 1
    assert rank1["outputs"] == aggregated
    assert rank1["stats"] == rank1["aggregated_stats"]
    assert rank1["stats"]["verify_steps"] > 0 and rank1["stats"]["draft_tokens"] > 0
    assert rank0["free_after"] == rank0["total_blocks"]  # the context server released the requests
    # what arrived is what left: 2 pools in the tiny geometry (K/V + draft layer; index-K)
    for sent, got in zip(rank0["sent_pages"], rank1["received_pages"]):
        assert len(sent) == 2 and all(torch.equal(a, b) for a, b in zip(sent, got))
        assert sent[0].any() and sent[1].any()
    assert all(min(pages) >= 3 for pages in rank1["pages"])  # landed on other page ids
    # every Eagle3 draft proposal matches token by token: round 1 on rank 0, the rest on rank 1
    for i in range(len(DISAGG_PROMPTS)):
        assert rank0["context_drafts"][i] + rank1["drafts"][i] == rank1["aggregated_drafts"][i]
        assert len(rank1["drafts"][i]) >= 2 and all(len(d) == DISAGG_K for d in rank1["drafts"][i])
    # a drafter that is partly right: the acceptance statistics match as well
    assert rank1["replay_outputs"] == rank0["replay_outputs"] == aggregated
    assert rank1["replay_stats"] == rank0["replay_stats"]
    assert 0 < rank0["replay_stats"]["acceptance_rate"] < 1
    # negative control: without the draft layer's pages the target still decodes the same tokens
    # (greedy verification is lossless) but the Eagle3 head proposes something else
    assert rank1["control_outputs"] == aggregated
    assert rank1["control_drafts"] != rank1["drafts"]


def test_tensor_parallel_engines_hand_off_only_their_own_ranks_kv_heads(tiny_pair, tmp_path_factory):
    """Every TP2 rank's cache has one geometry, so rank 0's pages imported on rank 1 (a context rank
    wired to the wrong generation rank) decoded other tokens than the aggregated run, every one after
    the context server's first, without a word. An engine whose TP shard's cache does not say which
    shard it holds is refused by name before it registers anything; one whose cache does continues
    its own rank's handoff like the aggregated TP2 run and refuses the other rank's before its pages
    cross."""
    from ._spawn import ranks_evidence
    from ._workers import tp_disagg_worker

    ranks = ranks_evidence(tp_disagg_worker, tiny_pair, tmp_path_factory, "tp_disagg", timeout_s=25)
    for rank, seen in enumerate(ranks):
        assert seen["untagged"] == (f"HandoffError: the engine's target is rank {rank}'s shard of tensor-parallel "
                                    f"size 2 but its cache says None: build the cache with shard=({rank}, 2), so a "
                                    f"handoff's pages say whose KV heads they hold")
        assert seen["untagged clean"]
        assert [len(o) for o in seen["aggregated"]] == [DISAGG_NEW] * len(DISAGG_PROMPTS)
        assert seen["own"] == seen["aggregated"]
        assert seen["swapped received"].startswith(
            f"HandoffError: handoff from rank {1 - rank}, request 0: the KV geometry differs from this cache's in "
            f"shard (payload [{1 - rank}, 2], cache [{rank}, 2])")
        assert seen["swapped sent"].startswith(f"HandoffError: rank {1 - rank} refused the handoff of request 0")
        assert seen["swapped clean"]
    assert ranks[0]["aggregated"] == ranks[1]["aggregated"]


def test_ranks_receiving_together_accept_or_refuse_every_handoff_together(tiny_pair, tmp_path_factory):
    """A TP group's generation ranks each receive their shard's handoff on their own: one refusing
    what another accepted (its engine short of pages, a page damaged on its stream) left the group
    holding different requests, and their all-reduces then summed one request's attention on one
    rank with another request's on the other (wrong tokens on both without a word) or aborted the
    process (gloo: sizes differ). Received with ``agree``, every rank refuses what one refused, or
    requests that differ between the ranks, naming the rank and its reason, and every sender hears
    it; the engines stay untouched and the next handoff continues like the aggregated run."""
    from ._spawn import ranks_evidence
    from ._workers import agree_worker

    ranks = ranks_evidence(agree_worker, tiny_pair, tmp_path_factory, "agree", timeout_s=40)
    short = "handoff from rank 0, request 0: 4 pages, 1 of this cache's"
    # the control: alone, rank 0 accepts what rank 1 refuses
    assert ranks[0]["short, alone"] == "ok"
    assert ranks[1]["short, alone"].startswith(f"HandoffError: {short}")
    assert ranks[0]["short"].startswith("HandoffError: handoff from rank 1: refused with the receiving ranks of the "
                                        f"agree group: rank 1 refused it: {short}")
    assert ranks[1]["short"].startswith(f"HandoffError: {short}")
    assert ranks[1]["short sent"].startswith("HandoffError: rank 0 refused the handoff of request 0: handoff from "
                                             "rank 1: refused with the receiving ranks of the agree group: rank 1")
    assert ranks[0]["short sent"].startswith(f"HandoffError: rank 1 refused the handoff of request 0: {short}")
    corrupt = "the handoff from rank 0, request 0: page 0 of pool"
    assert ranks[1]["damaged"].startswith(f"TransferError: {corrupt}")
    assert ranks[0]["damaged"].startswith("TransferError: handoff from rank 1: refused with the receiving ranks of "
                                          f"the agree group: rank 1 refused it: {corrupt}")
    for rank, seen in enumerate(ranks):
        assert seen["damaged sent"].startswith(f"TransferError: rank {1 - rank} refused the pages of the handoff")
        assert seen["other request"] == (f"HandoffError: handoff from rank {1 - rank}: the receiving ranks got "
                                         f"different requests (rank 0: 1, rank 1: 0); every rank must receive the "
                                         f"same request at once")
        assert seen["other request sent"].startswith(f"HandoffError: rank {1 - rank} refused the handoff of request")
        assert seen["untouched"]
        assert seen["good"] == seen["good sent"] == "ok"
        assert seen["outputs"] == seen["aggregated"]
