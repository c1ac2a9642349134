"""The kernel section of `m3-eagle bench`: each verify-step kernel timed, checked and costed.

Why: the goals are stated against the byte floor (bytes that must be read / copy ceiling), the
pure-torch reference and the single-token step; this module produces exactly those numbers per
(batch, context, q_len) so the table and the JSON say directly what meets its goal. Goals stated
against FlashInfer get its time on the same inputs in the same rows (flashinfer_peer.py).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import torch_reference as ref
from .inputs import (Geometry, make_cache, selected_tokens, shuffled_block_tables, shared_selection, union_blocks,
                     verify_queries)
from .step_meta import build_step_meta
from .timing import time_eager_us, time_graph_us

KERNELS = ("index_select", "sparse_attn", "sparse_step", "dense_attn", "kv_lens_update", "dense_peer")
# Rows that gain FlashInfer fields, in the order FlashInfer runs: the ops that call its top-k last
# (its num_valid_pages form crashed an SM90 run; the form used here is guarded, but last is safest).
FLASHINFER_KERNELS = ("dense_attn", "sparse_attn", "index_select", "sparse_step")
# What `on_update_kv_lens` writes, each checked after poisoning its buffer (`_` + name).
KV_UPDATE_FIELDS = ("kv_lens", "qo_offsets", "positions", "token_kv_lens", "valid_blocks", "cache_slots")
# The dense peer case: ours vs FlashInfer's paged prefill wrapper, goal ours >= 5x faster.
DENSE_PEER = {"batch": 8, "context": 4096, "qo_len": 4, "geo": Geometry(q_heads=64, kv_heads=4, head_dim=128,
                                                                         block=128), "goal": 5.0}


@dataclass(frozen=True)
class Case:
    batch: int
    context: int
    qo_len: int


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def index_k_bytes(meta, geo: Geometry, index_dtype: torch.dtype) -> int:
    """Index-K bytes of every valid token of every request (a partly filled last page: its share)."""
    return int(meta.kv_lens.sum()) * geo.index_dim * dtype_size(index_dtype)


def kv_token_bytes(geo: Geometry, kv_dtype: torch.dtype) -> int:
    """Bytes of one token's K plus V of one KV head."""
    return 2 * geo.head_dim * dtype_size(kv_dtype)


def kv_page_bytes(geo: Geometry, kv_dtype: torch.dtype) -> int:
    """Bytes of one K page plus one V page of one KV head."""
    return geo.block * kv_token_bytes(geo, kv_dtype)


def dense_kv_bytes(meta, geo: Geometry, kv_dtype: torch.dtype) -> int:
    """K/V bytes of every valid token of every request and KV head."""
    return int(meta.kv_lens.sum()) * geo.kv_heads * kv_token_bytes(geo, kv_dtype)


def _token_bytes(x: torch.Tensor, num_tokens: int) -> int:
    """Bytes of the first `num_tokens` rows of a `[T, ...]` tensor (graph padding rows excluded)."""
    return num_tokens * (x[0].numel() if x.shape[0] else 0) * x.element_size()


def byte_floor(name: str, meta, geo: Geometry, *, q: torch.Tensor, index_q: torch.Tensor, kv_dtype: torch.dtype,
               index_dtype: torch.dtype, selection: torch.Tensor | None = None) -> tuple[int, int]:
    """(bytes that must be moved, union blocks) of one verify step of kernel `name`: the floor of
    the "% floor" figures, for the GPU kernel rows and the CPU smoke table alike.

    Each kernel must read its inputs and write its outputs once:
    - `index_select`: the index queries, the index-K of every valid token, the selection written
      (int32 `[H_idx, T, topk]`);
    - `sparse_attn`: the queries, the selection given (`selection`, int32), the K and V of the
      valid tokens of each (request, KV head)'s union of selected blocks, the output (`q`'s shape
      and dtype);
    - `sparse_step` (selection + attention in one): the index queries, the index-K of every valid
      token, the queries, the selected K/V as above (`selection` is the step's own: it says which
      pages, but stays inside the step, so it is not counted), the output;
    - `dense_attn`: the queries, the K/V of every valid token of every KV head, the output;
    - anything else (`kv_lens_update`): 0.
    Union blocks: the number of distinct selected blocks summed over (request, KV head).

    Pages are counted by their valid tokens: a request's partly filled last page costs only its
    `kv_len % block` tokens. The kernels read such a page whole (tiles are pages), so this is the
    true floor, not what the kernels move; with contexts that are multiples of the block (every
    shape of the published tables) the two agree. Only live tokens count (`meta.cu_qo_lens[-1]`),
    not graph padding. The index queries and the selections, which the floor left out before,
    add under 0.1% at the published shapes.
    """
    tokens = int(meta.cu_qo_lens[-1])
    q_bytes = 2 * _token_bytes(q, tokens)  # read q, write the output (q's shape and dtype)
    index_bytes = _token_bytes(index_q, tokens) + index_k_bytes(meta, geo, index_dtype)
    if name == "index_select":
        return index_bytes + index_q.shape[1] * tokens * geo.topk * 4, 0
    if name in ("sparse_attn", "sparse_step"):
        if selection is None:
            raise ValueError(f"byte_floor({name!r}) needs the selection")
        union, union_tokens = union_blocks(selection, meta), selected_tokens(selection, meta)
        nbytes = union_tokens * kv_token_bytes(geo, kv_dtype) + q_bytes
        if name == "sparse_attn":
            return nbytes + selection.shape[0] * tokens * selection.shape[-1] * 4, union
        return nbytes + index_bytes, union
    if name == "dense_attn":
        return dense_kv_bytes(meta, geo, kv_dtype) + q_bytes, 0
    return 0, 0


def relative_error(out: torch.Tensor, expect: torch.Tensor) -> float:
    out, expect = out.double().cpu(), expect.double().cpu()
    if not (torch.isfinite(out).all() and torch.isfinite(expect).all()):  # NaN would pass every "error < tol"
        return math.inf
    return float((out - expect).norm() / expect.norm().clamp_min(1e-30))


def selection_mismatch(sel: torch.Tensor, expect: torch.Tensor) -> float:
    """Fraction of (head, token) rows whose selected sets differ."""
    a, b = sel.cpu(), expect.cpu()
    return float((a != b).any(dim=-1).float().mean())


class StepSet:
    """Input sets for one (batch, context): shared caches, per-q_len metas and queries."""

    def __init__(self, batch: int, context: int, geo: Geometry, *, kv_dtype, index_dtype, q_dtype,
                 device, num_sets: int, seed: int = 0):
        self.geo, self.kv_dtype, self.index_dtype, self.q_dtype = geo, kv_dtype, index_dtype, q_dtype
        self.batch, self.context, self.device = batch, context, device
        self.sets = []
        for s in range(num_sets):
            gen = torch.Generator().manual_seed(seed + s)
            dgen = torch.Generator(device=device).manual_seed(seed + s)
            kv_lens = [context] * batch
            num_pages = batch * -(-context // geo.block)
            tables = shuffled_block_tables(kv_lens, geo.block, num_pages, gen)
            cache = make_cache(num_pages, geo, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device,
                               generator=dgen)
            self.sets.append({"cache": cache, "tables": tables, "kv_lens": kv_lens, "gen": gen, "dgen": dgen})

    def step(self, s: int, qo_len: int) -> dict[str, Any]:
        st = self.sets[s]
        key = f"q{qo_len}"
        if key not in st:
            geo = self.geo
            meta = build_step_meta([qo_len] * self.batch, st["kv_lens"], st["tables"], geo.block, device=self.device)
            st[key] = {
                "meta": meta,
                "q": verify_queries(self.batch, qo_len, geo.q_heads, geo.head_dim, self.q_dtype, self.device,
                                    st["dgen"]),
                "index_q": verify_queries(self.batch, qo_len, geo.index_heads, geo.index_dim, self.index_dtype,
                                          self.device, st["dgen"], correlation=0.97),
                "selection": shared_selection(meta, geo, st["gen"]),
            }
        return {**st[key], "cache": st["cache"]}


def _kernel_thunks(name: str, step: dict[str, Any], geo: Geometry) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(kernel thunk, torch-reference thunk) for one input set."""
    from m3_eagle_plugin.msa.kernels.dense_verify import dense_verify_attention
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention
    from m3_eagle_plugin.msa.kernels.verify_step import sparse_verify_step

    meta, cache, q = step["meta"], step["cache"], step["q"]
    scale = 1.0 / math.sqrt(geo.head_dim)
    ks, vs = cache.k_scale, cache.v_scale
    qo = int(meta.qo_lens[0])
    if name == "index_select":
        return (lambda: select_blocks_verify(step["index_q"], cache.index_k, meta, topk=geo.topk, max_qo_len=qo),
                lambda: ref.select_blocks(step["index_q"], cache.index_k, meta, topk=geo.topk))
    if name == "sparse_attn":
        return (lambda: sparse_verify_attention(q, cache.k, cache.v, meta, step["selection"], scale=scale,
                                                k_scale=ks, v_scale=vs, max_qo_len=qo),
                lambda: ref.sparse_attention(q, cache.k, cache.v, meta, step["selection"], scale=scale,
                                             k_scale=ks, v_scale=vs))
    if name == "sparse_step":
        def kernel():  # our step as the layer dispatcher calls it (`verify_step`, defaults), never routed:
            # on a FlashInfer-eligible cache the dispatcher may pick its kernels, and the row would no
            # longer be ours (the bench's pooled K/V and index-K views are not eligible)
            return sparse_verify_step(step["index_q"], cache.index_k, q, cache.k, cache.v, meta, topk=geo.topk,
                                      scale=scale, k_scale=ks, v_scale=vs, max_qo_len=qo)[1]

        def reference():
            sel = ref.select_blocks(step["index_q"], cache.index_k, meta, topk=geo.topk)
            return ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale, k_scale=ks, v_scale=vs)
        return kernel, reference
    if name == "dense_attn":
        return (lambda: dense_verify_attention(q, cache.k, cache.v, meta, scale=scale, k_scale=ks, v_scale=vs,
                                               max_qo_len=qo),
                lambda: ref.dense_attention(q, cache.k, cache.v, meta, scale=scale, k_scale=ks, v_scale=vs))
    if name == "kv_lens_update":
        from m3_eagle_plugin.msa import MsaDecodeMetadata
        from m3_eagle_plugin.msa.kernels.kv_lens_update import on_update_kv_lens_fused

        qo_lens, kv_lens = meta.qo_lens.tolist(), meta.kv_lens.tolist()
        msa_meta = MsaDecodeMetadata(len(qo_lens), len(meta.positions), meta.block_tables.shape[1], geo.block,
                                     q.device, max_draft_len=max(qo_lens) - 1)
        msa_meta.prepare(qo_lens, kv_lens, meta.block_tables.cpu())
        new = (meta.kv_lens - 1).clamp_min(meta.qo_lens)
        step["msa_meta"] = msa_meta
        _update_on_torch_ops(msa_meta)
        return (lambda: on_update_kv_lens_fused(msa_meta, new), lambda: msa_meta.on_update_kv_lens(new))
    raise ValueError(f"unknown kernel {name!r}; choose from {KERNELS}")


def _update_on_torch_ops(msa_meta) -> None:
    """Keep `msa_meta.on_update_kv_lens` (the row's reference) on its torch ops: on CUDA with Triton
    it would dispatch to the fused kernel the row times, and compare that kernel with itself."""
    msa_meta._fused_kv_lens_update = lambda: None


def _time_ours(name: str, steps: StepSet, qo_len: int, *, eager: bool = False) -> float:
    """Our kernel's time on the row's input sets, as `run_case` takes it (graph-replayed, or eager)."""
    thunks = [_kernel_thunks(name, steps.step(s, qo_len), steps.geo)[0] for s in range(len(steps.sets))]
    return time_eager_us(thunks) if eager else time_graph_us(thunks)


def _kv_fields(meta) -> dict[str, torch.Tensor]:
    return {k: getattr(meta, k).clone() for k in KV_UPDATE_FIELDS}


def _error(name: str, got: Any, expect: Any, step: dict[str, Any], geo: Geometry) -> float:
    if name == "index_select":
        return selection_mismatch(got, expect)
    if name == "kv_lens_update":  # number of fields that differ from MsaDecodeMetadata's torch path
        return float(sum(not torch.equal(got[k], v) for k, v in expect.items()))
    return relative_error(got, expect)


def _bytes(name: str, step: dict[str, Any], geo: Geometry, kv_dtype, index_dtype) -> tuple[int, int]:
    """`byte_floor` for one input set: `sparse_attn` counts the selection it is given,
    `sparse_step` the one its own top-k makes."""
    selection = step["selection"] if name == "sparse_attn" else None
    if name == "sparse_step":
        from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

        selection = select_blocks_verify(step["index_q"], step["cache"].index_k, step["meta"], topk=geo.topk)
    return byte_floor(name, step["meta"], geo, q=step["q"], index_q=step["index_q"], kv_dtype=kv_dtype,
                      index_dtype=index_dtype, selection=selection)


def _mean(values) -> float | int:
    """The mean, an int where it is one (every input set alike)."""
    mean = statistics.fmean(values)
    return int(mean) if mean.is_integer() else mean


def run_case(name: str, steps: StepSet, qo_len: int, *, ceiling_gbps: float, check: bool = True,
             time_reference: bool = True, expects: dict | None = None) -> dict[str, Any]:
    """One row; with `expects`, the torch reference's output is kept there under (name, qo_len).
    `bytes` and `union_blocks` are the means over the input sets, as the times are over calls
    rotating through them (a step's own top-k selects unions of another size in each set)."""
    geo = steps.geo
    sets = [steps.step(s, qo_len) for s in range(len(steps.sets))]
    pairs = [_kernel_thunks(name, st, geo) for st in sets]
    kernels = [p[0] for p in pairs]
    row: dict[str, Any] = {"kernel": name, "batch": steps.batch, "context": steps.context, "qo_len": qo_len,
                           "kv_dtype": str(steps.kv_dtype).replace("torch.", "")}
    got = kernels[0]()
    if check:
        expect = pairs[0][1]()
        if expects is not None:
            expects[(name, qo_len)] = expect
        if name == "kv_lens_update":  # both write the metadata's buffers: snapshot, poison, rerun the kernel
            msa_meta = sets[0]["msa_meta"]
            expect = _kv_fields(msa_meta)
            for field in KV_UPDATE_FIELDS:
                getattr(msa_meta, "_" + field).fill_(-777)
            kernels[0]()
            got = _kv_fields(msa_meta)
        row["error"] = _error(name, got, expect, sets[0], geo)
    per_set = [_bytes(name, st, geo, steps.kv_dtype, steps.index_dtype) for st in sets]
    nbytes, union = _mean([b for b, _ in per_set]), _mean([u for _, u in per_set])
    row["eager_us"] = time_eager_us(kernels)
    row["graph_us"] = time_graph_us(kernels)
    if time_reference:
        row["torch_us"] = time_eager_us([pairs[0][1]], warmup=1, repeats=3, calls=1)
    row["bytes"] = nbytes
    row["union_blocks"] = union
    if nbytes:
        row["floor_us"] = nbytes / (ceiling_gbps * 1e3)
    _derive(row)
    return row


def _derive(row: dict[str, Any]) -> None:
    """The fields computed from `graph_us` (again after `--rounds` replaced it by a paired median)."""
    if "torch_us" in row:
        row["vs_torch"] = row["torch_us"] / row["graph_us"]
    if row.get("floor_us"):
        row["pct_of_floor"] = 100.0 * row["floor_us"] / row["graph_us"]


def _set_vs_q1(by_q: dict[int, dict[str, Any]]) -> None:
    """Each row's `graph_us` over the single-token row's, where a q_len 1 row was measured."""
    if 1 in by_q:
        for row in by_q.values():
            row["vs_q1"] = row["graph_us"] / by_q[1]["graph_us"]


def flashinfer_fields(name: str, steps: StepSet, qo_len: int, peer, *, graph_us: float,
                      eager_us: float | None = None, expects: dict | None = None, check: bool = True,
                      rounds: int = 1, ours: Callable[[], float] | None = None,
                      ours_eager: Callable[[], float] | None = None) -> dict[str, Any]:
    """FlashInfer's fields for one of our rows (same inputs, same input-set rotation): its time
    (graph-replayed when capturable), `vs_flashinfer` = its time / ours (> 1: we are faster), its
    check against the torch reference. Any failure becomes `flashinfer_error`; nothing raises.
    Ratios pair times of one mode: a FlashInfer call that is not graph-capturable (timed eagerly)
    is compared with our eager time (`eager_us`, or the eager pairs below), not with `graph_us`.
    With `ours_eager` (which times our kernel eagerly), both are also timed eagerly in
    max(1, `rounds`) alternating pairs right after the graph timings: `eager_us` (ours) and
    `flashinfer_eager_us` are the pairs' medians, `vs_flashinfer_eager` their ratio. An eager call
    is host-bound at small shapes, so whatever else the host runs then (a JIT build in the
    background) must fall on both sides.

    With `rounds` > 1 and `ours` (which times our kernel again), the two are timed alternately
    `rounds` times: `graph_us` and `flashinfer_us` become the medians of those rounds (each
    round's pair in `ours_rounds_us` / `flashinfer_rounds_us`), so drift during a run (clocks,
    heat) falls on both sides; `faster_every_round` says whether ours won every pair.

    The dense attention's peer is FlashInfer's paged prefill wrapper planned once for the row's
    lengths; `flashinfer_graph_wrapper_us` (and `vs_flashinfer_graph_wrapper`) time it in the form
    engines capture into CUDA graphs (`use_cuda_graph=True`) too."""
    from .flashinfer_peer import short_error, time_peer_us

    if peer.broken:
        return {"flashinfer_error": f"skipped: {peer.broken}"}
    fields: dict[str, Any] = {}
    errors, notes = [], []
    sets = [steps.step(s, qo_len) for s in range(len(steps.sets))]
    timed = [("flashinfer_us", name)]
    if name == "index_select":  # its two stages on their own too
        timed = [("flashinfer_score_us", "proxy_score"), ("flashinfer_topk_us", "topk_select")] + timed
    if name == "dense_attn":  # the wrapper as engines capture it, beside its plan-once form
        timed += [("flashinfer_graph_wrapper_us", "dense_attn_graph")]
    main = None
    modes: dict[str, str] = {}

    def failed(what: str, exc: Exception) -> bool:
        """Record a failed FlashInfer call; True (and the peer broken) when it left CUDA unusable."""
        errors.append(f"{what}: {short_error(exc)}")
        return peer.broken_by(what)

    for field, op_name in timed:
        try:
            ops = [peer.op(op_name, st) for st in sets]
            us, how, why = time_peer_us([op.run for op in ops], steps.device)
        except Exception as exc:
            if failed(op_name, exc):
                break
            continue
        modes[field] = how
        if field == "flashinfer_us" and rounds > 1 and ours is not None and how != "eager":
            try:
                mine, theirs = _paired_rounds(ours, lambda: time_peer_us([op.run for op in ops], steps.device)[0],
                                              rounds)
            except Exception as exc:
                errors.append(f"{op_name} rounds: {short_error(exc)}")
                continue
            us, graph_us = statistics.median(theirs), statistics.median(mine)
            fields.update(graph_us=graph_us, ours_rounds_us=mine, flashinfer_rounds_us=theirs,
                          faster_every_round=all(a < b for a, b in zip(mine, theirs)))
        fields[field] = us
        notes += [n for n in (ops[0].note, why) if n and n not in notes]
        if field == "flashinfer_us":
            main = ops[0]
            fields.update(flashinfer_timing=how, flashinfer_api=main.api)
            if ours_eager is not None:
                try:
                    mine, theirs = _paired_rounds(ours_eager, lambda: time_eager_us([op.run for op in ops]),
                                                  max(1, rounds))
                except Exception as exc:
                    failed(f"{op_name} eager", exc)
                else:
                    mine, theirs = statistics.median(mine), statistics.median(theirs)
                    fields.update(eager_us=mine, flashinfer_eager_us=theirs, vs_flashinfer_eager=theirs / mine)
                    if how == "eager":  # not capturable: the eager pair is the row's comparison
                        fields["flashinfer_us"] = theirs
    for field, ratio in (("flashinfer_us", "vs_flashinfer"),
                         ("flashinfer_graph_wrapper_us", "vs_flashinfer_graph_wrapper")):
        ours_us = fields.get("eager_us", eager_us) if modes.get(field) == "eager" else graph_us
        if field in fields and ours_us:
            fields[ratio] = fields[field] / ours_us
    if check and main is not None and not peer.broken:
        try:
            fields.update(_flashinfer_check(name, main, sets[0], steps.geo, expects or {}, qo_len))
        except Exception as exc:
            errors.append(f"check: {short_error(exc)}")
    if notes:
        fields["flashinfer_note"] = "; ".join(notes)
    if errors:
        fields["flashinfer_error"] = "; ".join(errors)
    return fields


def _paired_rounds(ours: Callable[[], float], theirs: Callable[[], float], rounds: int) -> tuple[list, list]:
    """(our times, their times): `rounds` pairs, each ours then theirs."""
    mine, other = [], []
    for _ in range(rounds):
        mine.append(ours())
        other.append(theirs())
    return mine, other


def _flashinfer_check(name: str, op, step: dict[str, Any], geo: Geometry, expects: dict,
                      qo_len: int) -> dict[str, float]:
    """Attention outputs: relative error vs the torch reference on the same selection (for the
    step: on FlashInfer's own selection). Selections: fraction of rows whose sets differ from ours
    (FlashInfer may select by another rule: reported, not failed)."""
    from .flashinfer_peer import q2k_indices

    meta, cache, q = step["meta"], step["cache"], step["q"]
    scale = 1.0 / math.sqrt(geo.head_dim)
    scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale}
    out = op.run()

    def ref_selection():
        got = expects.get(("index_select", qo_len))
        return got if got is not None else ref.select_blocks(step["index_q"], cache.index_k, meta, topk=geo.topk)

    if name == "index_select":
        return {"flashinfer_check": selection_mismatch(op.selection(), ref_selection())}
    if name == "sparse_step":
        sel = q2k_indices(op.selection(), cache.k.shape[1])
        expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale, **scales)
        return {"flashinfer_check": relative_error(out, expect),
                "flashinfer_sel_mismatch": selection_mismatch(op.selection(), ref_selection())}
    expect = expects.get((name, qo_len))
    if expect is None:
        expect = (ref.sparse_attention(q, cache.k, cache.v, meta, step["selection"], scale=scale, **scales)
                  if name == "sparse_attn" else ref.dense_attention(q, cache.k, cache.v, meta, scale=scale, **scales))
    return {"flashinfer_check": relative_error(out, expect)}


def run_dense_peer(*, device, ceiling_gbps: float, num_sets: int, check: bool, time_reference: bool, peer,
                   log: Callable[[str], None], rounds: int = 1) -> dict[str, Any]:
    """The issue's dense case: our dense verify vs FlashInfer's paged prefill wrapper (B8, q_len 4,
    64 q / 4 KV heads, head dim 128, page 128, 4K context, bf16 KV). Row kernel `dense_attn_peer`.
    `rounds` as for the grid's rows: the pair's medians, so `--rounds` holds for this row too."""
    p = DENSE_PEER
    steps = StepSet(p["batch"], p["context"], p["geo"], kv_dtype=torch.bfloat16, index_dtype=torch.bfloat16,
                    q_dtype=torch.bfloat16, device=device, num_sets=num_sets)
    expects: dict = {}
    row = run_case("dense_attn", steps, p["qo_len"], ceiling_gbps=ceiling_gbps, check=check,
                   time_reference=time_reference, expects=expects)
    row.update(kernel="dense_attn_peer", goal=f"vs_flashinfer >= {p['goal']:g}")
    if peer is None:
        row["note"] = "FlashInfer not timed (unavailable or --flashinfer off)"
    else:
        row.update(flashinfer_fields("dense_attn", steps, p["qo_len"], peer, graph_us=row["graph_us"],
                                     eager_us=row["eager_us"], expects=expects, check=check, rounds=rounds,
                                     ours_eager=lambda s=steps: _time_ours("dense_attn", s, p["qo_len"], eager=True),
                                     ours=lambda s=steps: _time_ours("dense_attn", s, p["qo_len"])))
        _derive(row)
        if "vs_flashinfer" in row:
            row["meets_goal"] = row["vs_flashinfer"] >= p["goal"]
        if "eager_us" in row and not peer.broken:
            row.update(_plan_run_fields(steps, p["qo_len"], peer, row["eager_us"]))
        peer.clear()
    log(f"  dense_attn_peer B{p['batch']} ctx{p['context']} q{p['qo_len']}: graph {row['graph_us']:.1f} us"
        f" flashinfer {row.get('flashinfer_us', float('nan')):.1f} us"
        f" (plan + run eager {row.get('flashinfer_plan_run_eager_us', float('nan')):.1f} us)")
    del steps
    torch.cuda.empty_cache()
    return row


def _plan_run_fields(steps: StepSet, qo_len: int, peer, eager_us: float) -> dict[str, Any]:
    """FlashInfer's wrapper with `plan()` before every `run()`, eager: what it costs a step whose
    lengths changed (`flashinfer_plan_run_eager_us`), against our eager call (`vs_flashinfer_plan_run`).
    The issue's 247 us for this case is of this form's order (H200, 2026-11-30: 174-328 us with the
    index tensors on the device, 134-140 with them on the host), not of `run()` alone (31.4 us
    graph-replayed, 40.6 in the CUDA-graph form)."""
    from .flashinfer_peer import short_error

    try:
        ops = [peer.op("dense_attn_plan_run", steps.step(s, qo_len)) for s in range(len(steps.sets))]
        us = time_eager_us([op.run for op in ops])
    except Exception as exc:
        peer.broken_by("plan + run")
        return {"flashinfer_plan_run_error": short_error(exc)}
    return {"flashinfer_plan_run_eager_us": us, "vs_flashinfer_plan_run": us / eager_us}


def run_kernel_suite(configs: list[tuple[int, int]], qo_lens: list[int], kernels: list[str], geo: Geometry, *,
                     kv_dtype, index_dtype, q_dtype, device, ceiling_gbps: float, num_sets: int = 3,
                     dense_kv_dtype=None, check: bool = True, time_reference: bool = True,
                     flashinfer: str = "off", rounds: int = 1,
                     log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Our rows per (config, kernel, q_len); with `flashinfer="auto"` and FlashInfer importable,
    its fields join the rows of FLASHINFER_KERNELS (timed after ours; an op FlashInfer lacks, e.g.
    msa_ops failing to import, becomes that row's `flashinfer_error`), with `rounds` > 1 as the
    medians of that many alternating (ours, FlashInfer) timings (`flashinfer_fields`).

    A run that fails part-way (out of memory at a large shape, most often) raises with the rows
    finished before it as the error's `kernel_rows`, so hours of measurement are not lost with it."""
    from .flashinfer_peer import FlashInferPeer, flashinfer_available, flashinfer_importable, nvp_probe

    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernel(s) {sorted(unknown)}; choose from {KERNELS}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    peer = FlashInferPeer() if flashinfer == "auto" and flashinfer_importable() else None
    grid = [k for k in kernels if k != "dense_peer"]  # the dense peer row has its own shape (DENSE_PEER)
    rows: list[dict[str, Any]] = []
    try:
        for batch, context in configs if grid else ():  # else every config's caches were built for no row
            steps = StepSet(batch, context, geo, kv_dtype=kv_dtype, index_dtype=index_dtype, q_dtype=q_dtype,
                            device=device, num_sets=num_sets)
            dense_steps = None
            expects: dict = {}
            ours: dict[tuple[str, int], tuple[dict[str, Any], StepSet]] = {}
            for name in grid:
                use = steps
                if name == "dense_attn" and dense_kv_dtype is not None and dense_kv_dtype != kv_dtype:
                    dense_steps = dense_steps or StepSet(batch, context, geo, kv_dtype=dense_kv_dtype,
                                                         index_dtype=index_dtype, q_dtype=q_dtype, device=device,
                                                         num_sets=num_sets)
                    use = dense_steps
                by_q = {}
                for qo_len in qo_lens:
                    row = run_case(name, use, qo_len, ceiling_gbps=ceiling_gbps, check=check,
                                   time_reference=time_reference, expects=expects if peer else None)
                    by_q[qo_len] = row
                    ours[(name, qo_len)] = (row, use)
                    rows.append(row)
                    log(f"  {name} B{batch} ctx{context} q{qo_len}: graph {row['graph_us']:.1f} us "
                        f"eager {row['eager_us']:.1f} us err {row.get('error', float('nan')):.2e}")
                _set_vs_q1(by_q)
            if peer is not None:
                for name in (k for k in FLASHINFER_KERNELS if k in kernels):
                    for qo_len in qo_lens:
                        row, use = ours[(name, qo_len)]
                        row.update(flashinfer_fields(name, use, qo_len, peer, graph_us=row["graph_us"],
                                                     eager_us=row["eager_us"], expects=expects,
                                                     check=check, rounds=rounds,
                                                     ours_eager=lambda n=name, u=use, q=qo_len: _time_ours(n, u, q,
                                                                                                           eager=True),
                                                     ours=lambda n=name, u=use, q=qo_len: _time_ours(n, u, q)))
                        _derive(row)
                        log(f"  flashinfer {name} B{batch} ctx{context} q{qo_len}: "
                            f"{row.get('flashinfer_us', float('nan')):.1f} us {row.get('flashinfer_error', '')}")
                    _set_vs_q1({qo_len: ours[(name, qo_len)][0] for qo_len in qo_lens})  # after --rounds' medians
                peer.clear()
            del steps, dense_steps, expects, ours
            torch.cuda.empty_cache()
        if "dense_peer" in kernels:
            rows.append(run_dense_peer(device=device, ceiling_gbps=ceiling_gbps, num_sets=num_sets, check=check,
                                       time_reference=time_reference, peer=peer, log=log, rounds=rounds))
        if peer is not None and flashinfer_available() and "index_select" in kernels and configs:
            log("  flashinfer top-k with num_valid_pages, in a child process")
            probe = nvp_probe(configs, qo_lens, device=device)
            for row in rows:
                if row["kernel"] == "index_select":
                    row.update(probe.get((row["batch"], row["context"], row["qo_len"]), {}))
    except BaseException as error:
        error.kernel_rows = list(rows)
        raise
    return rows
