"""Rank bodies for the multi-process tests (module level, so spawned processes can import them).

Each writes what it observed to ``out_dir``; the test process compares, so a wrong value shows
up as a test failure, not as a hung peer.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

from m3_eagle_plugin.kv import PagedKVCache
from m3_eagle_plugin.msa import MsaDecodeMetadata

NUM_BLOCKS = 32
TP_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [200, 17, 3, 99, 17, 3, 42, 17, 3]]
VERIFY_STEPS, DRAFT_LEN = 6, 2


def _device() -> torch.device:
    """This rank's device: the CPU under gloo, its own GPU under NCCL."""
    from m3_eagle_plugin.parallel.process_group import comm_device

    return comm_device() if dist.is_initialized() else torch.device("cpu")


def _cache(cfg, device) -> PagedKVCache:
    return PagedKVCache.for_minimax_m3(cfg.num_layers, cfg.sparse_layer_ids, cfg.num_kv_heads, cfg.head_dim,
                                       cfg.index_dim, cfg.block_size, NUM_BLOCKS, dtype=torch.float32, device=device)


@torch.no_grad()
def greedy_verify_loop(model, prompts=TP_PROMPTS, steps=VERIFY_STEPS, k=DRAFT_LEN) -> dict:
    """Prefill, then ``steps`` verify chunks of ``1 + k`` tokens with rule-made drafts and greedy
    acceptance; returns the tokens and every logits row the steps computed."""
    cfg = model.config
    device = next(model.parameters()).device
    cache = _cache(cfg, device)
    meta = MsaDecodeMetadata(len(prompts), 64, NUM_BLOCKS, cfg.block_size, device, max_draft_len=k,
                             num_index_heads=cfg.index_heads)
    rids = list(range(len(prompts)))
    kv = [len(p) for p in prompts]
    for rid in rids:
        cache.add_request(rid)
        cache.reserve(rid, kv[rid])
    meta.prepare(kv, kv, cache.block_table(rids, NUM_BLOCKS), num_context_requests=len(rids))
    logits = model.compute_logits(model(torch.tensor(sum(prompts, []), device=device), meta, cache)).cpu()
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
        logits = model.compute_logits(model(torch.tensor(ids, device=device), meta, cache)).cpu()
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


def engine_run(model, references: dict[int, list[int]] | None, new_tokens: int = 10) -> tuple[list, dict]:
    """The reference host on ``model``: outputs and stats. With ``references`` (prompt + output per
    request) drafts replay them with seeded mistakes, so acceptance is neither 0 nor 1."""
    from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
    from m3_eagle_plugin.host.reference.proposers import ReplayProposer

    cfg = model.config
    proposer = None
    if references is not None:
        proposer = ReplayProposer.with_error_rate(references, cfg.vocab_size, 0.3, seed=1)
    device = next(model.parameters()).device
    engine = Engine(model, _cache(cfg, device),
                    EngineConfig(draft_len=DRAFT_LEN, max_batch_size=2, max_tokens_per_step=64),
                    vocab_size=cfg.vocab_size, proposer=proposer, num_index_heads=cfg.index_heads, device=device)
    result = engine.generate(TP_PROMPTS, new_tokens)
    stats = {key: value for key, value in result.stats.as_dict().items() if key not in ("elapsed_s", "tokens_per_s")}
    return result.outputs, stats


def eagle_engine_run(target, head, new_tokens: int = 10) -> dict:
    """The reference host with the Eagle3 head drafting: outputs, stats and every draft proposal."""
    from m3_eagle_plugin.eagle3.capture import AuxCapture
    from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig

    cfg, device = target.config, next(target.parameters()).device
    cache = PagedKVCache.for_minimax_m3(cfg.num_layers, cfg.sparse_layer_ids, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.index_dim, cfg.block_size, NUM_BLOCKS, num_draft_layers=1,
                                        draft_num_kv_heads=head.config.num_kv_heads, dtype=torch.float32,
                                        device=device)
    engine = Engine(target, cache, EngineConfig(draft_len=3, max_batch_size=2, max_tokens_per_step=64),
                    vocab_size=cfg.vocab_size, head=head, capture=AuxCapture(head.aux_layer_ids),
                    num_index_heads=cfg.index_heads, device=device)
    drafts = record_drafts(engine)
    result = engine.generate(TP_PROMPTS, new_tokens)
    return {"eagle_outputs": result.outputs, "eagle_stats": _stats(result), "eagle_drafts": drafts,
            "eagle_pools": len(cache.geometry.pools)}


def _replay_references(full) -> dict[int, list[int]]:
    outputs, _ = engine_run(full, None)
    return {i: prompt + out for i, (prompt, out) in enumerate(zip(TP_PROMPTS, outputs))}


def tp_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.models.loader import load_target
    from m3_eagle_plugin.parallel.tp_model import shard_draft_head, shard_target

    full = load_target(target_dir, dtype=torch.float32, device=_device()).eval()
    references = _replay_references(full)  # TP1 target-only output: what the drafter replays
    shard = shard_target(full, rank, world_size)
    result = greedy_verify_loop(shard)
    result["engine_outputs"], result["engine_stats"] = engine_run(shard, references)
    head = load_draft(draft_dir, full, dtype=torch.float32, device=_device()).eval()
    result.update(eagle_engine_run(shard, shard_draft_head(head, rank, world_size)))
    torch.save(result, Path(out_dir) / f"tp2_rank{rank}.pt")
    dist.barrier()
    # TP1 (the unsharded models, no collectives), split over the two processes to halve the wait
    if rank == 0:
        result = greedy_verify_loop(full)
        result.update(eagle_engine_run(full, head))
        torch.save(result, Path(out_dir) / "tp1_loop.pt")
    else:
        outputs, stats = engine_run(full, references)
        torch.save({"engine_outputs": outputs, "engine_stats": stats}, Path(out_dir) / "tp1_engine.pt")


# ----- disaggregated serving: context engine on rank 0, generation engine on rank 1 -------------
DISAGG_PROMPTS = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13], [7, 200, 7, 201, 7, 200, 7, 201, 9]]
DISAGG_NEW, DISAGG_K = 12, 3
#: The group timeout of the short-frame case: a bound, not a wait. Gloo delivers a short message
#: into the longer receive buffer at once (the zeroed trailer slot gives it away) and the sender,
#: waiting for its verdict, reads the framing abort at once; a regression shows as a timeout here.
SHORT_FRAME_TIMEOUT = datetime.timedelta(seconds=5)


def _stats(result) -> dict:
    keep = ("verify_steps", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
            "per_position_acceptance")
    return {key: result.stats.as_dict()[key] for key in keep}


def record_drafts(engine) -> dict[int, list[list[int]]]:
    """Log every draft proposal the engine's steps make, per request index (test instrumentation)."""
    log: dict[int, list[list[int]]] = {}
    launch = engine.runner.launch

    def logged(rows, step_id):
        out = launch(rows, step_id)
        proposals = out.next_inputs.tolist()
        for j, row_index in enumerate(out.drafting_rows):
            log.setdefault(out.rows[row_index].request.index, []).append(proposals[j][1:])
        return out

    engine.runner.launch = logged
    return log


def _without_draft_layer(handoff, cache):
    """The handoff with the shared draft layer's K/V pages zeroed (a negative control)."""
    import dataclasses

    pages = [t.clone() for t in handoff.payload.pool_pages]
    for role in ("k", "v"):
        where = cache.geometry.locate(cache.draft_layer_ids[0], role)
        pages[where.pool_id][:, where.offset] = 0
    payload = dataclasses.replace(handoff.payload, pool_pages=tuple(pages))
    return dataclasses.replace(handoff, payload=payload)


def disagg_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Rank 0 is the context server, rank 1 the generation server; rank 1 also runs the aggregated
    references (while rank 0 prefills). Scenario A drafts with the Eagle3 head (its draft layer's
    KV must travel), scenario B with a host drafter that is right ~70% of the time."""
    from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.host.reference.proposers import ReplayProposer
    from m3_eagle_plugin.parallel.disagg import (continue_generation, export_handoff, import_handoff, recv_handoff,
                                                 run_context_phase, send_handoff)
    from m3_eagle_plugin.parallel.transfer import recv_ints, send_ints

    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    n = len(DISAGG_PROMPTS)

    def engine(references=None):
        proposer = None
        if references is not None:
            proposer = ReplayProposer.with_error_rate(references, 256, 0.3, seed=2)
        return build_engine(target_dir, draft_dir, config, num_blocks=blocks + rank * 3, proposer=proposer,
                            device=_device())

    def prefill_and_send(context) -> list:
        handoffs = [export_handoff(context, r) for r in run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)]
        for handoff in handoffs:
            send_handoff(handoff, 1)
        return handoffs

    out = Path(out_dir)
    if rank == 0:
        context = engine()
        context_drafts = record_drafts(context)
        sent = [[t.clone() for t in h.payload.pool_pages] for h in prefill_and_send(context)]
        references = {i: recv_ints(1) for i in range(n)}
        replay = engine(references).generate(DISAGG_PROMPTS, DISAGG_NEW)
        prefill_and_send(engine(references))
        torch.save({"sent_pages": sent, "context_drafts": context_drafts,
                    "free_after": context.cache.num_free_blocks, "total_blocks": context.cache.num_blocks,
                    "replay_outputs": replay.outputs, "replay_stats": _stats(replay)}, out / "rank0.pt")
        return
    aggregated_engine = engine()
    aggregated_drafts = record_drafts(aggregated_engine)
    aggregated = aggregated_engine.generate(DISAGG_PROMPTS, DISAGG_NEW)
    handoffs = [recv_handoff(0) for _ in range(n)]
    for i in range(n):
        send_ints(DISAGG_PROMPTS[i] + aggregated.outputs[i], 0)
    generation = engine()
    generation.cache.add_request("other")  # occupy pages, so imported pages get other ids
    generation.cache.reserve("other", 9)
    drafts = record_drafts(generation)
    requests = [import_handoff(generation, h) for h in handoffs]
    pages = [generation.cache.pages(r.rid) for r in requests]
    result = continue_generation(generation, requests)
    control = engine()
    control_drafts = record_drafts(control)
    control_result = continue_generation(
        control, [import_handoff(control, _without_draft_layer(h, control.cache)) for h in handoffs])
    references = {i: DISAGG_PROMPTS[i] + aggregated.outputs[i] for i in range(n)}
    generation_b = engine(references)
    handoffs_b = [recv_handoff(0) for _ in range(n)]
    replay = continue_generation(generation_b, [import_handoff(generation_b, h) for h in handoffs_b])
    torch.save({"aggregated_outputs": aggregated.outputs, "aggregated_stats": _stats(aggregated),
                "aggregated_drafts": aggregated_drafts, "context_outputs": [h.output for h in handoffs],
                "outputs": result.outputs, "stats": _stats(result), "pages": pages, "errors": result.errors,
                "received_pages": [list(h.payload.pool_pages) for h in handoffs], "drafts": drafts,
                "control_drafts": control_drafts, "control_outputs": control_result.outputs,
                "replay_outputs": replay.outputs, "replay_stats": _stats(replay)}, out / "rank1.pt")


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


def all_workers(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Every two-rank check in one pair of processes (spawning costs more than the checks)."""
    tp_worker(rank, world_size, target_dir, draft_dir, out_dir)
    dist.barrier()
    echo_worker(rank, world_size, out_dir)
    dist.barrier()
    disagg_worker(rank, world_size, target_dir, draft_dir, out_dir)


# ----- the handoff wire under malformed and unfitting headers (rank 0 sends, rank 1 receives) ----
def _payload_ints(payload) -> list[int]:
    """A KV payload header body, written from `parallel.transfer`'s documented format."""
    data = list(payload.fingerprint.encode("utf-8"))
    return [payload.num_tokens, len(payload.pool_pages), *(int(x) for p in payload.pool_pages for x in p.shape),
            len(data), *data]


def _handoff_ints(h) -> list[int]:
    lists = [h.prompt, h.output, h.pending_inputs]
    return [h.index, h.max_new_tokens, h.kv_len, h.pending_draft_len, *map(len, lists), *sum(lists, []),
            *_payload_ints(h.payload)]


def _raw_frame(kind, values, group=None, *, magic=None, version=None, body=None) -> None:
    from m3_eagle_plugin.parallel import transfer as t

    magic = t.MAGIC if magic is None else magic
    version = t.VERSION if version is None else version
    dist.send(torch.tensor([magic, version, kind, len(values)], dtype=torch.int64), 1, group=group)
    dist.send(torch.tensor(values + [t.TRAILER] if body is None else body, dtype=torch.int64), 1, group=group)


def _raw_verdict(group=None) -> str:
    """The answer to a header sent raw: a verdict ("accepted" / "refused: ...") or a framing abort."""
    from m3_eagle_plugin.parallel import transfer as t

    preamble = torch.zeros(4, dtype=torch.int64)
    dist.recv(preamble, 1, group=group)
    magic, version, kind, n = preamble.tolist()
    assert (magic, version) == (t.MAGIC, t.VERSION) and kind in (t.KIND_VERDICT, t.KIND_ABORT), preamble
    body = torch.zeros(n + 1, dtype=torch.int64)
    dist.recv(body, 1, group=group)
    assert body[-1] == t.TRAILER
    if kind == t.KIND_ABORT:
        return "aborted: " + bytes(body[:-1].tolist()).decode()
    return "refused: " + bytes(body[:-1].tolist()).decode() if n else "accepted"


def _digest(payload) -> list:
    return [payload.num_tokens, [int(p.sum()) for p in payload.pool_pages], [list(p.shape) for p in payload.pool_pages]]


def _outcome(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what happened is the observation
        return f"{type(error).__name__}: {error}"
    return "ok"


def wire_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Scripted exchanges: each malformed or unfitting header from rank 0, then a good one that
    must arrive intact (the stream stayed in step); the last ones break the stream on purpose."""
    import dataclasses
    import json as json_
    import time

    from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.parallel import transfer as t
    from m3_eagle_plugin.parallel.disagg import (export_handoff, import_handoff, recv_handoff, run_context_phase,
                                                 send_handoff)

    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    engine = build_engine(target_dir, draft_dir, config, device=torch.device("cpu"),
                          num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    out = Path(out_dir)
    if rank == 0:
        h = [export_handoff(engine, r) for r in run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)][0]
        good, ints, block = h.payload, _payload_ints(h.payload), engine.cache.block_size
        fp = json_.loads(good.fingerprint)
        other_geometry = dataclasses.replace(good, fingerprint=json_.dumps({**fp, "block_size": block * 2},
                                                                           sort_keys=True, separators=(",", ":")))
        pages = tuple(torch.cat([p, torch.zeros_like(p[:1])]) for p in good.pool_pages)
        padded = dataclasses.replace(good, num_tokens=good.num_tokens + block, pool_pages=pages)
        n_pools, fp_at = len(good.pool_pages), 2 + 3 * len(good.pool_pages)
        payload_cases = {
            "version": lambda: _raw_frame(t.KIND_PAYLOAD, ints, version=t.VERSION + 1),
            "negative num_tokens": lambda: _raw_frame(t.KIND_PAYLOAD, [-4] + ints[1:]),
            "negative page size": lambda: _raw_frame(t.KIND_PAYLOAD, ints[:3] + [-1] + ints[4:]),
            "absurd page count": lambda: _raw_frame(t.KIND_PAYLOAD, [good.num_tokens, n_pools]
                                                    + [x if i % 3 else 1 << 40 for i, x in enumerate(ints[2:fp_at])]
                                                    + ints[fp_at:]),
            "pool count": lambda: _raw_frame(t.KIND_PAYLOAD, ints[:1] + [n_pools + 1] + ints[2:]),
            "fingerprint byte": lambda: _raw_frame(t.KIND_PAYLOAD, ints[:-1] + [300]),
        }
        api_payload_cases = {  # through the public API: the receiver's cache decides
            "geometry": lambda: t.send_payload(other_geometry, 1),
            "page count": lambda: t.send_payload(dataclasses.replace(good, num_tokens=good.num_tokens + 4 * block), 1),
            "a handoff where a payload belongs": lambda: send_handoff(h, 1),
        }
        hints = _handoff_ints(h)
        handoff_cases = {
            "token count": lambda: _raw_frame(t.KIND_HANDOFF, hints[:4] + [hints[4] + 1000] + hints[5:]),
            "negative output length": lambda: _raw_frame(t.KIND_HANDOFF, hints[:5] + [-1] + hints[6:]),
            "version": lambda: _raw_frame(t.KIND_HANDOFF, hints, version=0),
        }
        vocab = engine.vocab_size
        api_handoff_cases = {
            "token outside the vocabulary": dataclasses.replace(h, pending_inputs=h.pending_inputs[:-1] + [vocab]),
            "kv_len": dataclasses.replace(h, kv_len=h.kv_len + 1),
            "pages past the committed positions": dataclasses.replace(h, payload=padded),
            "geometry": dataclasses.replace(h, payload=other_geometry),
        }
        sender = {}
        for name, send in payload_cases.items():
            send()
            sender[f"payload {name}"] = _raw_verdict()
            t.send_payload(good, 1)
        for name, send in api_payload_cases.items():
            sender[f"payload {name}"] = _outcome(send)
            t.send_payload(good, 1)
        for name, send in handoff_cases.items():
            send()
            sender[f"handoff {name}"] = _raw_verdict()
            send_handoff(h, 1)
        for name, bad in api_handoff_cases.items():
            sender[f"handoff {name}"] = _outcome(lambda: send_handoff(bad, 1))
            send_handoff(h, 1)
        # breaking the stream: a short frame, a foreign one, pages cut off midway
        g1 = dist.new_group([0, 1], timeout=SHORT_FRAME_TIMEOUT)
        _raw_frame(t.KIND_HANDOFF, hints, group=g1, body=hints[:-3] + [t.TRAILER])
        try:  # it waits for a verdict, as `send_header` does
            sender["short frame"] = _raw_verdict(g1)
        except RuntimeError as error:  # no answer: the group's timeout (the stream is broken from here on)
            sender["short frame"] = f"{type(error).__name__}: {error}"
        g2 = dist.new_group([0, 1])
        dist.send(torch.tensor([0x1234, 1, t.KIND_HANDOFF, 5], dtype=torch.int64), 1, group=g2)
        g3 = dist.new_group([0, 1])
        _raw_frame(t.KIND_HANDOFF, hints, group=g3)
        sender["cut"] = _raw_verdict(g3)
        dist.send(good.pool_pages[0].contiguous(), 1, group=g3)
        (out / "wire_rank0.json").write_text(json_.dumps({"sender": sender, "good": _digest(good)}))
        return  # the stream ends in the middle of the payload

    outcomes, clean, followups = {}, {}, {}

    def is_clean() -> bool:
        return (engine.cache.num_free_blocks == engine.cache.num_blocks and engine.scheduler.admitted_blocks == 0
                and not engine.cache.allocator.request_ids)

    def follow_up_handoff(name):
        handoff = recv_handoff(0, engine=engine)
        request = import_handoff(engine, handoff)
        followups[name] = _digest(handoff.payload) + [engine.cache.num_tokens(request.rid)]
        engine.finish(request)

    for name in ("version", "negative num_tokens", "negative page size", "absurd page count", "pool count",
                 "fingerprint byte", "geometry", "page count", "a handoff where a payload belongs"):
        outcomes[f"payload {name}"] = _outcome(lambda: t.recv_payload(0, cache=engine.cache))
        followups[f"payload {name}"] = _digest(t.recv_payload(0, cache=engine.cache))
    for name in ("token count", "negative output length", "version", "token outside the vocabulary", "kv_len",
                 "pages past the committed positions", "geometry"):
        outcomes[f"handoff {name}"] = _outcome(lambda: recv_handoff(0, engine=engine))
        clean[f"handoff {name}"] = is_clean()
        follow_up_handoff(f"handoff {name}")
    g1 = dist.new_group([0, 1], timeout=SHORT_FRAME_TIMEOUT)
    start = time.monotonic()
    outcomes["short frame"] = _outcome(lambda: recv_handoff(0, g1, engine=engine))
    seconds = {"short frame": time.monotonic() - start}
    outcomes["after the short frame"] = _outcome(lambda: recv_handoff(0, g1, engine=engine))
    g2 = dist.new_group([0, 1])
    outcomes["foreign frame"] = _outcome(lambda: recv_handoff(0, g2, engine=engine))
    outcomes["after the foreign frame"] = _outcome(lambda: t.recv_ints(0, g2))
    g3 = dist.new_group([0, 1])
    outcomes["cut"] = _outcome(lambda: recv_handoff(0, g3, engine=engine))
    outcomes["after the cut"] = _outcome(lambda: t.recv_ints(0, g3))
    clean["cut"] = is_clean()
    (out / "wire_rank1.json").write_text(json_.dumps({"outcomes": outcomes, "clean": clean, "followups": followups,
                                                      "seconds": seconds}))


# ----- paths where one side waited for a message the other never sends (rank 0 sends) ----------
def wire_edges_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Each case on its own group with a short timeout, so a side left waiting shows up as a
    timeout outcome instead of a hung test; every case ends with a good payload that must arrive
    intact (the stream stayed in step). Outcomes are written after every case."""
    import dataclasses
    import datetime
    import json as json_

    from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.kv.transfer import KVTransferPayload
    from m3_eagle_plugin.parallel import transfer as t
    from m3_eagle_plugin.parallel.disagg import export_handoff, recv_handoff, run_context_phase, send_handoff

    names = ("header where ints belong", "long non-ascii refusal", "handoff that never fits", "pages that cannot be staged",
             "handoff with no budget left now")
    groups = {name: dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10)) for name in names}
    good = KVTransferPayload("fp", 5, (torch.arange(48, dtype=torch.uint8).view(2, 3, 8),))
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    engine = build_engine(target_dir, draft_dir, config, device=torch.device("cpu"),
                          num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    seen: dict[str, str | list] = {}
    out = Path(out_dir) / f"edges_rank{rank}.json"
    if rank == 0:  # prefill before the cases: on a loaded machine it outlasted rank 1's 10 s receive
        h = [export_handoff(engine, r) for r in run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)][0]
    dist.barrier()  # the default group's timeout (60 s), not a case's

    def observe(call):
        try:
            value = call()
        except Exception as error:  # noqa: BLE001 - what happened is the observation
            return f"{type(error).__name__}: {error}"
        return "ok" if value is None else value

    def case(name, call, follow_up=None):
        seen[name] = observe(call)
        if follow_up is not None:
            seen[f"{name}, then"] = observe(follow_up)
        out.write_text(json_.dumps(seen))
        dist.barrier()  # a side left waiting times out in its own case, not in the next one

    if rank == 0:
        g = groups["header where ints belong"]
        case("header where ints belong", lambda: t.send_payload(good, 1, g), lambda: t.send_payload(good, 1, g))
        g = groups["long non-ascii refusal"]
        keys = json_.dumps({("é" * 400 + str(i)): i for i in range(20)})  # a reason past 4096 bytes
        case("long non-ascii refusal", lambda: t.send_payload(dataclasses.replace(good, fingerprint=keys), 1, g),
             lambda: t.send_payload(good, 1, g))
        g = groups["handoff that never fits"]
        case("handoff that never fits", lambda: send_handoff(dataclasses.replace(h, max_new_tokens=10 ** 6), 1, g),
             lambda: t.send_payload(good, 1, g))
        g = groups["pages that cannot be staged"]
        meta = dataclasses.replace(good, pool_pages=(torch.empty(2, 3, 8, dtype=torch.uint8, device="meta"),))
        case("pages that cannot be staged", lambda: t.send_payload(meta, 1, g), lambda: t.send_payload(good, 1, g))
        g = groups["handoff with no budget left now"]
        dist.barrier()  # while rank 1 fills its engine's budget
        case("handoff with no budget left now", lambda: send_handoff(h, 1, g), lambda: send_handoff(h, 1, g))
        return
    cache = PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, 4, 8, dtype=torch.float32)
    g = groups["header where ints belong"]
    case("header where ints belong", lambda: t.recv_ints(0, g), lambda: _digest(t.recv_payload(0, g)))
    g = groups["long non-ascii refusal"]
    case("long non-ascii refusal", lambda: t.recv_payload(0, g, cache=cache), lambda: _digest(t.recv_payload(0, g)))
    g = groups["handoff that never fits"]

    def receive_and_import():
        from m3_eagle_plugin.parallel.disagg import import_handoff

        engine.finish(import_handoff(engine, recv_handoff(0, g, engine=engine)))

    case("handoff that never fits", receive_and_import, lambda: _digest(t.recv_payload(0, g)))
    g = groups["pages that cannot be staged"]
    seen["good"] = _digest(good)
    case("pages that cannot be staged", lambda: _digest(t.recv_payload(0, g)))
    g = groups["handoff with no budget left now"]
    from m3_eagle_plugin.parallel.disagg import import_handoff

    # the engine's whole budget held by requests of its own (decoding, numbered past the handoff's)
    held = run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW, first_index=10)
    before = (engine.scheduler.admitted_blocks, engine.cache.num_free_blocks, sorted(engine.cache.allocator.request_ids))
    seen["budget held"] = [r.state.value for r in held]
    dist.barrier()
    # then received without the engine, its pages cross: import_handoff's verdict is the oracle
    case("handoff with no budget left now", lambda: f"accepted request {recv_handoff(0, g, engine=engine).index}",
         lambda: observe(lambda: import_handoff(engine, recv_handoff(0, g))))
    seen["untouched"] = before == (engine.scheduler.admitted_blocks, engine.cache.num_free_blocks,
                                   sorted(engine.cache.allocator.request_ids))
    out.write_text(json_.dumps(seen))
    engine.stop_unfinished(held)


# ----- bytes damaged on the wire (rank 0 sends through a link that corrupts one message) ---------
def _through_corrupting_link(transfer, damaged_what: str, damage, call):
    """``call()`` with rank 0's `parallel.transfer` sending the message named ``damaged_what``
    through ``damage`` (a copy is changed, as a faulty link would): a test-side stand-in for
    corruption in transit."""
    send = transfer._send_tensor

    def send_through_link(tensor, dst, group, what):
        if what == damaged_what:
            tensor = tensor.clone()
            damage(tensor)
        send(tensor, dst, group, what)

    transfer._send_tensor = send_through_link
    try:
        return call()
    finally:
        transfer._send_tensor = send


def integrity_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Each case on its own group with a 10 s timeout: how long the sender took and what each side
    raised when a header's body or one page arrives damaged; then a good payload on the same
    group (the stream's state afterwards)."""
    import datetime
    import json as json_
    import time

    from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.kv.transfer import KVTransferPayload
    from m3_eagle_plugin.parallel import transfer as t
    from m3_eagle_plugin.parallel.disagg import export_handoff, recv_handoff, run_context_phase, send_handoff

    names = ("header body", "payload page", "handoff page")
    groups = {name: dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10)) for name in names}
    gen = torch.Generator().manual_seed(5)
    good = KVTransferPayload("fp", 5, (torch.randint(0, 256, (2, 3, 8), generator=gen, dtype=torch.uint8),
                                       torch.randint(0, 256, (2, 1, 16), generator=gen, dtype=torch.uint8)))
    seen: dict = {"good": _digest(good)}
    out = Path(out_dir) / f"integrity_rank{rank}.json"

    def case(name, call, follow_up):
        start = time.monotonic()
        seen[name] = _outcome(call)
        seen[f"{name} seconds"] = time.monotonic() - start
        seen[f"{name}, then"] = _outcome(follow_up) if rank == 0 else _digest_or_error(follow_up)
        out.write_text(json_.dumps(seen))
        dist.barrier()

    def flip_bit(tensor):  # page 1, sub-page 0, byte 3 of a [2, 1, 16] pool
        tensor[1, 0, 3] ^= 0x04

    if rank == 0:  # load and prefill before the cases: on a loaded machine they outlasted rank 1's 10 s receive
        config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
        engine = build_engine(target_dir, draft_dir, config, device=torch.device("cpu"),
                              num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
        h = [export_handoff(engine, r) for r in run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)][1]
    dist.barrier()  # the default group's timeout (60 s), not a case's
    if rank == 0:
        def bump_trailer(tensor):
            tensor[-1] += 1

        g = groups["header body"]
        case("header body", lambda: _through_corrupting_link(t, "a KV payload header", bump_trailer,
                                                             lambda: t.send_payload(good, 1, g)),
             lambda: t.send_payload(good, 1, g))
        g = groups["payload page"]
        case("payload page", lambda: _through_corrupting_link(t, "pool 1 of the KV payload", flip_bit,
                                                              lambda: t.send_payload(good, 1, g)),
             lambda: t.send_payload(good, 1, g))
        pool = len(h.payload.pool_pages) - 1

        def flip_page_0(tensor):
            tensor[0, 0, 0] ^= 0x80

        g = groups["handoff page"]
        seen["handoff pool"] = pool
        case("handoff page", lambda: _through_corrupting_link(t, f"pool {pool} of the handoff of request {h.index}",
                                                              flip_page_0, lambda: send_handoff(h, 1, g)),
             lambda: t.send_payload(good, 1, g))
        return
    g = groups["header body"]
    case("header body", lambda: t.recv_payload(0, g), lambda: t.recv_payload(0, g))
    g = groups["payload page"]
    case("payload page", lambda: t.recv_payload(0, g), lambda: t.recv_payload(0, g))
    g = groups["handoff page"]
    case("handoff page", lambda: recv_handoff(0, g), lambda: t.recv_payload(0, g))


def _digest_or_error(call):
    try:
        return _digest(call())
    except Exception as error:  # noqa: BLE001 - what happened is the observation
        return f"{type(error).__name__}: {error}"


# ----- disaggregation between tensor-parallel engines (each rank a TP2 context and generation engine) ----
def tp_disagg_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Both ranks run TP2 engines (target and Eagle3 head sharded). Every rank's cache has one
    geometry, so only the cache's shard tag tells rank 0's KV heads from rank 1's: an engine
    whose cache lacks it must be refused, a rank's own handoff must continue like the aggregated
    TP2 run, and the other rank's handoff must be refused before its pages cross."""
    import json as json_

    from m3_eagle_plugin.eagle3.capture import AuxCapture
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
    from m3_eagle_plugin.models.loader import load_target
    from m3_eagle_plugin.parallel.disagg import (continue_generation, export_handoff, import_handoff, recv_handoff,
                                                 run_context_phase, send_handoff)
    from m3_eagle_plugin.parallel.tp_model import shard_draft_head, shard_target

    full = load_target(target_dir, dtype=torch.float32).eval()
    target = shard_target(full, rank, world_size)
    head = shard_draft_head(load_draft(draft_dir, full, dtype=torch.float32).eval(), rank, world_size)
    cfg = target.config

    def engine(shard):
        cache = PagedKVCache.for_minimax_m3(cfg.num_layers, cfg.sparse_layer_ids, cfg.num_kv_heads, cfg.head_dim,
                                            cfg.index_dim, cfg.block_size, NUM_BLOCKS, num_draft_layers=1,
                                            draft_num_kv_heads=head.config.num_kv_heads, dtype=torch.float32,
                                            shard=shard)
        return Engine(target, cache, EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64),
                      vocab_size=cfg.vocab_size, head=head, capture=AuxCapture(head.aux_layer_ids),
                      num_index_heads=cfg.index_heads)

    def clean(e) -> bool:
        return (e.cache.num_free_blocks == e.cache.num_blocks and e.scheduler.admitted_blocks == 0
                and not e.cache.allocator.request_ids)

    seen: dict = {}
    out = Path(out_dir) / f"tp_disagg_rank{rank}.json"
    untagged = engine(None)
    seen["untagged"] = _outcome(lambda: run_context_phase(untagged, DISAGG_PROMPTS, DISAGG_NEW))
    seen["untagged clean"] = clean(untagged)
    out.write_text(json_.dumps(seen))
    seen["aggregated"] = engine((rank, world_size)).generate(DISAGG_PROMPTS, DISAGG_NEW).outputs
    context = engine((rank, world_size))
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)]
    own = engine((rank, world_size))
    seen["own"] = continue_generation(own, [import_handoff(own, h) for h in handoffs]).outputs
    out.write_text(json_.dumps(seen))
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    other = engine((rank, world_size))
    receive = lambda: recv_handoff(1 - rank, group, engine=other)  # noqa: E731
    send = lambda: send_handoff(handoffs[0], 1 - rank, group)  # noqa: E731
    steps = (("sent", send), ("received", receive))
    for name, call in steps if rank == 0 else steps[::-1]:
        seen[f"swapped {name}"] = _outcome(call)
    seen["swapped clean"] = clean(other)
    out.write_text(json_.dumps(seen))


# ----- ranks that receive together (a TP group's generation ranks) agree on every verdict --------
def agree_worker(rank: int, world_size: int, target_dir: str, draft_dir: str, out_dir: str) -> None:
    """Both ranks receive as one group (``agree``), each the handoff the other sends it (a thread
    sends while the main thread receives; one stream group per direction). Faults hit rank 1's
    receive only: its engine short of pages, a page damaged on its stream, another request; then
    a good handoff, which both import and continue like the aggregated run."""
    import json as json_
    import threading

    from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.parallel import transfer as t
    from m3_eagle_plugin.parallel.disagg import (continue_generation, export_handoff, import_handoff, recv_handoff,
                                                 run_context_phase, send_handoff)

    timeout = datetime.timedelta(seconds=10)
    streams = [dist.new_group([0, 1], timeout=timeout) for _ in range(2)]  # streams[r]: what rank r sends
    agree = dist.new_group([0, 1], timeout=timeout)
    peer = 1 - rank
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    build = lambda: build_engine(target_dir, draft_dir, config, num_blocks=blocks,  # noqa: E731
                                 device=torch.device("cpu"))
    context = build()
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)]
    aggregated = build().generate(DISAGG_PROMPTS, DISAGG_NEW).outputs
    engine = build()
    state = lambda: (engine.scheduler.admitted_blocks, engine.cache.num_free_blocks,  # noqa: E731
                     sorted(engine.cache.allocator.request_ids, key=str))
    seen: dict = {}
    out = Path(out_dir) / f"agree_rank{rank}.json"

    def exchange(name, sent, **kwargs):
        sender: dict = {}
        thread = threading.Thread(target=lambda: sender.update(
            outcome=_outcome(lambda: send_handoff(sent, peer, streams[rank]))))
        thread.start()
        got: dict = {}
        seen[name] = _outcome(lambda: got.update(h=recv_handoff(peer, streams[peer], engine=engine, **kwargs)))
        thread.join(20)
        seen[f"{name} sent"] = sender.get("outcome", "still sending")
        out.write_text(json_.dumps(seen))
        return got.get("h")

    before = state()
    if rank == 1:  # short of pages: one block left free
        engine.cache.add_request("other")
        engine.cache.reserve("other", (engine.cache.num_blocks - 1) * engine.cache.block_size)
    exchange("short, alone", handoffs[0])  # the control: each rank decides on its own
    exchange("short", handoffs[0], agree=agree)
    if rank == 1:
        engine.cache.free("other")
    pool = len(handoffs[0].payload.pool_pages) - 1

    def flip(tensor):
        tensor[0, 0, 0] ^= 0x80

    def damaged():
        return exchange("damaged", handoffs[0], agree=agree)

    if rank == 0:  # rank 0 sends rank 1's pages through a faulty link
        _through_corrupting_link(t, f"pool {pool} of the handoff of request 0", flip, damaged)
    else:
        damaged()
    exchange("other request", handoffs[rank], agree=agree)  # rank 1 receives request 0, rank 0 request 1
    seen["untouched"] = state() == before
    good = exchange("good", handoffs[0], agree=agree)
    seen["outputs"] = continue_generation(engine, [import_handoff(engine, good)]).outputs
    seen["aggregated"] = aggregated[:1]
    out.write_text(json_.dumps(seen))
