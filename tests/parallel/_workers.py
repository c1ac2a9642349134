"""Rank bodies for the multi-process tests (module level, so spawned processes can import them).

Each writes what it observed to ``out_dir``; the test process compares, so a wrong value shows
up as a test failure, not as a hung peer.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from m3_eagle_plugin.kv import PagedKVCache
from m3_eagle_plugin.msa import MsaDecodeMetadata

NUM_BLOCKS = 32
TP_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [200, 17, 3, 99, 17, 3, 42, 17, 3]]
VERIFY_STEPS, DRAFT_LEN = 6, 2


def _cache(cfg, num_blocks=NUM_BLOCKS, num_draft_layers=0, draft_heads=None) -> PagedKVCache:
    return PagedKVCache.for_minimax_m3(cfg.num_layers, cfg.sparse_layer_ids, cfg.num_kv_heads, cfg.head_dim,
                                       cfg.index_dim, cfg.block_size, num_blocks, num_draft_layers=num_draft_layers,
                                       draft_num_kv_heads=draft_heads, dtype=torch.float32)


@torch.no_grad()
def greedy_verify_loop(model, prompts=TP_PROMPTS, steps=VERIFY_STEPS, k=DRAFT_LEN) -> dict:
    """Prefill, then ``steps`` verify chunks of ``1 + k`` tokens with rule-made drafts and greedy
    acceptance; returns the tokens and every logits row the steps computed."""
    cfg = model.config
    cache = _cache(cfg)
    meta = MsaDecodeMetadata(len(prompts), 64, NUM_BLOCKS, cfg.block_size, "cpu", max_draft_len=k,
                             num_index_heads=cfg.index_heads)
    rids = list(range(len(prompts)))
    kv = [len(p) for p in prompts]
    for rid in rids:
        cache.add_request(rid)
        cache.reserve(rid, kv[rid])
    meta.prepare(kv, kv, cache.block_table(rids, NUM_BLOCKS), num_context_requests=len(rids))
    logits = model.compute_logits(model(torch.tensor(sum(prompts, [])), meta, cache))
    last = torch.tensor(kv).cumsum(0) - 1
    all_logits = [logits[last]]
    tokens = [[int(t)] for t in logits[last].argmax(-1)]
    for step in range(steps):
        ids = []
        for rid in rids:
            prev = tokens[rid][-1]
            ids += [prev] + [(prev * 31 + 7 * j + step) % cfg.vocab_size for j in range(k)]
        staged = [n + 1 + k for n in kv]
        for rid in rids:
            cache.reserve(rid, staged[rid])
        meta.prepare([1 + k] * len(rids), staged, cache.block_table(rids, NUM_BLOCKS))
        logits = model.compute_logits(model(torch.tensor(ids), meta, cache))
        all_logits.append(logits)
        target = logits.argmax(-1).view(len(rids), 1 + k).tolist()
        for rid in rids:
            drafts = ids[rid * (1 + k) + 1: (rid + 1) * (1 + k)]
            accepted = 0
            while accepted < k and drafts[accepted] == target[rid][accepted]:
                accepted += 1
            tokens[rid] += target[rid][: accepted + 1]
            kv[rid] += accepted + 1
            cache.rewind(rid, kv[rid])
    return {"tokens": tokens, "logits": all_logits, "sparse_active": max(kv) > cfg.block_size * cfg.topk_blocks}


def engine_run(model, new_tokens: int = 10) -> tuple[list, dict]:
    """The reference host with a host-side drafter (prompt lookup) on ``model``: outputs, stats."""
    from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
    from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

    cfg = model.config
    engine = Engine(model, _cache(cfg), EngineConfig(draft_len=DRAFT_LEN, max_batch_size=2, max_tokens_per_step=64),
                    vocab_size=cfg.vocab_size, proposer=PromptLookupProposer(), num_index_heads=cfg.index_heads)
    result = engine.generate(TP_PROMPTS, new_tokens)
    stats = {key: value for key, value in result.stats.as_dict().items() if key not in ("elapsed_s", "tokens_per_s")}
    return result.outputs, stats


def tp_worker(rank: int, world_size: int, target_dir: str, out_dir: str) -> None:
    from m3_eagle_plugin.models.loader import load_target
    from m3_eagle_plugin.parallel.tp_model import shard_target

    full = load_target(target_dir, dtype=torch.float32).eval()
    shard = shard_target(full, rank, world_size)
    result = greedy_verify_loop(shard)
    result["engine_outputs"], result["engine_stats"] = engine_run(shard)
    torch.save(result, Path(out_dir) / f"tp2_rank{rank}.pt")
    dist.barrier()
    if rank == 0:  # TP1: the unsharded model, no collectives
        result = greedy_verify_loop(full)
        result["engine_outputs"], result["engine_stats"] = engine_run(full)
        torch.save(result, Path(out_dir) / "tp1.pt")


# ----- disaggregated serving: context engine on rank 0, generation engine on rank 1 -------------
DISAGG_PROMPTS = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13], [7, 300, 7, 301, 7, 300, 7, 301, 9]]
DISAGG_NEW, DISAGG_K = 12, 3


def _stats(result) -> dict:
    keep = ("verify_steps", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
            "per_position_acceptance")
    return {key: result.stats.as_dict()[key] for key in keep}


def disagg_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.parallel.disagg import (continue_generation, export_handoff, import_handoff, recv_handoff,
                                                 run_context_phase, send_handoff)
    from m3_eagle_plugin.parallel.transfer import recv_ints, send_ints

    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)

    def engine():
        return build_engine(target_dir, draft_dir, config, num_blocks=blocks + rank * 3)

    out = Path(out_dir)
    if rank == 0:
        aggregated = engine().generate(DISAGG_PROMPTS, DISAGG_NEW)
        context = engine()
        requests = run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)
        handoffs = [export_handoff(context, r) for r in requests]
        send_ints([len(handoffs)], 1)
        for handoff in handoffs:
            send_handoff(handoff, 1)
        sent = [[t.clone() for t in h.payload.pool_pages] for h in handoffs]
        torch.save({"outputs": aggregated.outputs, "stats": _stats(aggregated), "sent_pages": sent,
                    "context_outputs": [h.output for h in handoffs], "free_after": context.cache.num_free_blocks,
                    "total_blocks": context.cache.num_blocks}, out / "rank0.pt")
    else:
        handoffs = [recv_handoff(0) for _ in range(recv_ints(0)[0])]
        generation = engine()
        generation.cache.add_request("other")  # occupy pages, so imported pages get other ids
        generation.cache.reserve("other", 9)
        requests = [import_handoff(generation, h) for h in handoffs]
        pages = [generation.cache.pages(r.rid) for r in requests]
        result = continue_generation(generation, requests)
        torch.save({"outputs": result.outputs, "stats": _stats(result), "pages": pages,
                    "received_pages": [list(h.payload.pool_pages) for h in handoffs],
                    "errors": result.errors}, out / "rank1.pt")


# ----- payload round trips --------------------------------------------------------------------
def echo_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Rank 1 sends back every payload it gets until told to stop; rank 0 runs the property test."""
    from m3_eagle_plugin.parallel.transfer import recv_ints, recv_payload, send_ints, send_payload

    if rank == 1:
        while recv_ints(0) == [1]:
            send_payload(recv_payload(0), 0)
        return
    from hypothesis import given, settings, strategies as st

    from m3_eagle_plugin.kv.transfer import KVTransferPayload

    checked = []

    @settings(max_examples=20, deadline=None, derandomize=True)
    @given(num_pages=st.integers(0, 3), pools=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 16)),
                                                          min_size=1, max_size=3),
           text=st.text(min_size=1, max_size=20), num_tokens=st.integers(0, 50))
    def round_trip(num_pages, pools, text, num_tokens):
        gen = torch.Generator().manual_seed(num_pages * 7 + len(pools) + num_tokens)
        pages = tuple(torch.randint(0, 256, (num_pages, s, b), generator=gen, dtype=torch.uint8) for s, b in pools)
        sent = KVTransferPayload(text, num_tokens, pages)
        send_ints([1], 1)
        send_payload(sent, 1)
        back = recv_payload(1)
        assert back.fingerprint == text and back.num_tokens == num_tokens
        assert len(back.pool_pages) == len(pages)
        assert all(a.dtype == torch.uint8 and torch.equal(a, b) for a, b in zip(back.pool_pages, pages))
        checked.append(1)

    try:
        round_trip()
    finally:
        send_ints([0], 1)
    (Path(out_dir) / "echo.json").write_text(json.dumps({"checked": len(checked)}))
