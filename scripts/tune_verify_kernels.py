"""Launch-parameter sweep of the sparse-layer verify kernels on one GPU (a tuning aid, not a test).

Why: the defaults in `msa.kernels` (splits, key tile, warps, stages, pages per index program) were
chosen from a handful of H200 runs; this script times every variant side by side on the bench's
inputs and prints the best per shape, so a default changes only on a measured table.
    python scripts/tune_verify_kernels.py [--json out.json] [--quick]
        [--sparse-only | --dense-only | --merge | --token-grid | --topk | --union-grid | --pdl | --scoring
         | --paired-v | --handoff | --early]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path

import torch

from m3_eagle_plugin.bench.inputs import Geometry, union_blocks
from m3_eagle_plugin.bench.kernel_suite import DENSE_PEER, StepSet, dense_kv_bytes, index_k_bytes, kv_page_bytes
from m3_eagle_plugin.bench.table import json_safe
from m3_eagle_plugin.bench.timing import copy_ceiling_gbps, time_graph_us as graph_us
from m3_eagle_plugin.msa.kernels.dense_verify import default_splits, dense_verify_attention
from m3_eagle_plugin.msa.kernels import index_select
from m3_eagle_plugin.msa.kernels.index_select import index_block_scores, select_blocks_verify, topk_from_block_scores
from m3_eagle_plugin.msa import kernels
from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention, token_splits, union_splits
from m3_eagle_plugin.msa.kernels import launch as kernel_launch

kernel_launch.RETRY_FEWER_STAGES = False  # a variant is timed at the depth its row names, or skipped


def _fp8_step_set(geo, dev, batch: int, ctx: int, num_sets: int) -> StepSet:
    """The bench's inputs as every sweep uses them: fp8 K/V, bf16 index-K and queries."""
    return StepSet(batch, ctx, geo, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.bfloat16,
                   q_dtype=torch.bfloat16, device=dev, num_sets=num_sets)


def _fp8_step_sets(geo, dev, batch: int, ctx: int, qo: int, num_sets: int) -> tuple[StepSet, list]:
    """(`_fp8_step_set`, its `num_sets` steps of `qo` tokens a request)."""
    steps = _fp8_step_set(geo, dev, batch, ctx, num_sets)
    return steps, [steps.step(s, qo) for s in range(num_sets)]


def _shape(row: dict) -> str:
    """A row's shape for the summary: B x context x q_len, or tokens x heads x splits for the merge."""
    if "tokens" in row:
        return f"T{row['tokens']} H{row['heads']} S{row['splits']}"
    return f"B{row['batch']} {row['ctx']} q{row['qo']}"


#: Relative difference from the first variant's output past which a variant is wrong, not timed
#: (the variants differ in rounding order only; the fuzz's fp8 attention tolerance).
VARIANT_TOL = 2e-2


def time_variant(name: str, call, args_per_set: list, state: dict) -> tuple[float, float] | None:
    """(us, relative difference from the first variant timed) of `call(*args)` over the input
    sets, us NaN (listed last, never fastest) where the output differs past VARIANT_TOL or is not
    finite, or None when Triton cannot build the variant (reported, not fatal)."""
    try:
        out = call(*args_per_set[0]).float()
        state.setdefault("ref", out)
        err = float((out - state["ref"]).norm() / state["ref"].norm())
        if not err <= VARIANT_TOL:
            print(f"  wrong {name}: relative difference {err:.3e} from the first variant")
            return float("nan"), err
        return graph_us([lambda a=a: call(*a) for a in args_per_set]), err
    except Exception as exc:
        print(f"  skip {name}: {type(exc).__name__}: {exc}"[:200])
        return None


def best_round(rounds: list[float]) -> float:
    """The fastest of a variant's interleaved rounds, NaN where any round's output was wrong (marked
    NaN): `min` keeps a NaN only when it comes first."""
    return float("nan") if any(math.isnan(us) for us in rounds) else min(rounds)


#: (batch, context, FlashInfer peer geometry?) of `dense_sweep`.
DENSE_SHAPES = ((64, 32768, False), (16, 32768, False), (16, 131072, False), (64, 8192, False), (32, 8192, False),
                (8, 4096, True))


def dense_sweep(geo, dev, ceiling: float, scale: float) -> list[dict]:
    """Dense verify attention (bf16 K/V, q4 and q1): splits (the rule's choice, half and double it,
    and the counts the rule's docstring compares) x key tile x warps x stages, at B64 and B16 /
    32K, B16 / 128K, B64 and B32 / 8K and the FlashInfer peer shape (B8/4K, 64/4 heads)."""
    rows = []
    for batch, ctx, peer in DENSE_SHAPES:
        g = DENSE_PEER["geo"] if peer else geo
        steps = StepSet(batch, ctx, g, kv_dtype=torch.bfloat16, index_dtype=torch.bfloat16,
                        q_dtype=torch.bfloat16, device=dev, num_sets=3)
        for qo in (4, 1):
            sets = [steps.step(s, qo) for s in range(3)]
            nbytes = dense_kv_bytes(sets[0]["meta"], g, torch.bfloat16)
            width = sets[0]["meta"].block_tables.shape[1]
            chosen = default_splits(batch, g.kv_heads, width, sets[0]["q"].numel(), dev)
            counts = sorted({chosen // 2, chosen, 2 * chosen, 4, 8, 10, 16, 20, 32} & set(range(1, width + 1)))
            state: dict = {}
            for sp, kt, nw, ns in itertools.product(counts, (64, 128), (4, 8), (2, 3)):
                def call(st, sp=sp, kt=kt, nw=nw, ns=ns):
                    c = st["cache"]
                    return dense_verify_attention(st["q"], c.k, c.v, st["meta"], scale=scale, max_qo_len=qo,
                                                  splits=sp, key_tile=kt, num_warps=nw, num_stages=ns)
                variant = f"splits={sp} kt={kt} w={nw} s={ns}"
                timed = time_variant(f"dense {variant}", call, [(st,) for st in sets], state)
                if timed is not None:
                    rows.append({"kernel": "dense_attn", "batch": batch, "ctx": ctx, "qo": qo, "variant": variant,
                                 "us": timed[0], "pct": 100 * nbytes / (ceiling * 1e3) / timed[0],
                                 "err_vs_first": timed[1], "default": (sp, kt, nw, ns) == (chosen, 64, 4, 3)})
        del steps
        torch.cuda.empty_cache()
    return rows


MERGE_SHAPES = ((32, 64, 8), (256, 16, 16), (64, 16, 16), (4, 16, 64), (4, 16, 256))


def merge_sweep(dev) -> list[dict]:
    """The split-K merge alone: warps 1 / 2 / 4 against `merge.merge_warps` at the (tokens, query
    heads, splits) the verify kernels produce (B8/4K 64 heads, B64 q4, B16 q4, B1 q4 up to B1/128K)."""
    from m3_eagle_plugin.msa.kernels.merge import merge_splits, merge_warps

    rows = []
    for t, h, sp in MERGE_SHAPES:
        parts = [(torch.randn(t, h, sp, 128, device=dev), torch.randn(t, h, sp, device=dev)) for _ in range(3)]
        out = torch.empty(t, h, 128, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        state: dict = {}
        rule = merge_warps(sp, 128)
        for nw in (4, 2, 1):
            timed = time_variant(f"merge w={nw}", lambda p, l, nw=nw: merge_splits(p, l, out, cu, num_warps=nw),
                                 parts, state)
            if timed is not None:
                rows.append({"kernel": "merge", "tokens": t, "heads": h, "splits": sp, "variant": f"w={nw}",
                             "us": timed[0], "err_vs_first": timed[1], "default": nw == rule})
    return rows


def sparse_variants(quick: bool):
    """(variant name, sparse_verify_attention keywords) to time: the union layout at its default
    point (bf16 and fp16 MMAs), the per-token layout over key tile x splits (None = the default
    rule, 'x2' doubled, 'half' halved) x stages x warps, one knob at a time."""
    out = [(f"union f16={int(f16)} kt=64 sp=None s=3 w=4",
            dict(layout="union", compute_f16=f16, key_tile=64, splits=None, num_stages=3, num_warps=4))
           for f16 in (False, True)]
    for pf, kt, sp, ns, nw in itertools.product((True, False), (128, 64), (None, "x2", "half"), (3, 2, 4), (4, 8)):
        moved = (not pf) + (kt != 128) + (sp is not None) + (ns != 3) + (nw != 4)
        if moved > 1 or (quick and moved):
            continue
        out.append((f"token pf={int(pf)} kt={kt} sp={sp} s={ns} w={nw}",
                    dict(layout="token", compute_f16=True, prefetch=pf, key_tile=kt, splits=sp, num_stages=ns,
                         num_warps=nw)))
    return out


def _union_step(st: dict, geo, qo: int, scale: float):
    sel, union = select_blocks_verify(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk, max_qo_len=qo,
                                      union_group=geo.q_heads)
    return sparse_verify_attention(st["q"], st["cache"].k, st["cache"].v, st["meta"], sel, scale=scale,
                                   k_scale=st["cache"].k_scale, v_scale=st["cache"].v_scale, max_qo_len=qo,
                                   union=union, layout="union")


def _resolve_splits(kw: dict, default: int) -> dict:
    sp = kw["splits"]
    kw = dict(kw)
    kw["splits"] = default if sp is None else 2 * default if sp == "x2" else max(1, default // 2)
    return kw


def token_grid(geo, dev, scale: float) -> list[dict]:
    """The per-token sparse attention over its whole launch grid (keys a tile x warps x stages x
    splits at 1, 2 and 4 times the default rule), not one knob at a time: at 255 registers a
    thread (ncu, B64/32K q4) two programs share an SM, so the knobs interact."""
    rows = []
    for batch, ctx, qo in ((64, 32768, 4), (16, 32768, 4), (64, 32768, 1), (1, 8192, 4), (16, 32768, 1)):
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=3)
        base = token_splits(batch * qo, geo.topk, dev)
        state: dict = {}
        for kt, nw, ns, mult in itertools.product((128, 64, 32), (1, 2, 4, 8), (2, 3), (1, 2, 4)):
            sp = min(base * mult, geo.topk)
            if mult > 1 and sp == min(base * mult // 2, geo.topk):
                continue  # capped at top-k: the same launch as the smaller multiple

            def call(st, kt=kt, nw=nw, ns=ns, sp=sp):
                c = st["cache"]
                return sparse_verify_attention(st["q"], c.k, c.v, st["meta"], st["selection"], scale=scale,
                                               k_scale=c.k_scale, v_scale=c.v_scale, max_qo_len=qo,
                                               layout="token", splits=sp, key_tile=kt, num_warps=nw, num_stages=ns)
            variant = f"kt={kt} w={nw} s={ns} sp={sp}"
            timed = time_variant(f"token grid {variant}", call, [(st,) for st in sets], state)
            if timed is not None:
                rows.append({"kernel": "sparse_attn_grid", "batch": batch, "ctx": ctx, "qo": qo, "variant": variant,
                             "us": timed[0], "pct": float("nan"), "err_vs_first": timed[1],
                             "default": (kt, nw, ns, sp) == (128, 4, 3, base)})
        del steps, sets
        torch.cuda.empty_cache()
    return rows


def pdl_sweep(geo, dev, scale: float) -> list[dict]:
    """The sparse step (selection + attention, the model's dispatchers) with programmatic dependent
    launch off (`M3_EAGLE_PDL=0`), by the default rule (small grids only) and on every kernel
    (`all`), three interleaved rounds each, every output equal to the no-PDL one."""
    import os

    rows = []
    before = os.environ.get("M3_EAGLE_PDL")
    try:
        for batch, ctx, qo in ((1, 8192, 4), (1, 8192, 1), (16, 32768, 4), (16, 32768, 1), (64, 32768, 4),
                               (64, 32768, 1), (1, 131072, 4)):
            steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=2)

            def step(st):
                c = st["cache"]
                sel = kernels.select_blocks_paged(st["index_q"], c.index_k, st["meta"], topk=geo.topk, max_qo_len=qo)
                return kernels.sparse_attention(st["q"], c.k, c.v, st["meta"], sel, scale=scale, k_scale=c.k_scale,
                                                v_scale=c.v_scale, max_qo_len=qo)
            times: dict = {}
            os.environ["M3_EAGLE_PDL"] = "0"
            want = step(sets[0])
            for _ in range(3):
                for mode in ("0", "1", "all"):
                    os.environ["M3_EAGLE_PDL"] = mode
                    same = torch.equal(step(sets[0]), want)
                    us = graph_us([lambda st=st: step(st) for st in sets])
                    times.setdefault(mode, []).append(us if same else float("nan"))
            for mode, us in times.items():
                rows.append({"kernel": "sparse_step_pdl", "batch": batch, "ctx": ctx, "qo": qo,
                             "variant": f"M3_EAGLE_PDL={mode}", "us": best_round(us), "pct": float("nan"),
                             "default": mode == "1"})
            del steps, sets
            torch.cuda.empty_cache()
    finally:
        if before is None:
            os.environ.pop("M3_EAGLE_PDL", None)
        else:
            os.environ["M3_EAGLE_PDL"] = before
    return rows


def topk_sweep(geo, dev) -> list[dict]:
    """The top-k program alone (one token per program, and with union lists) over its warps, with
    every selection checked against the torch reference."""
    from m3_eagle_plugin.bench import torch_reference as ref

    rows = []
    for batch, ctx in ((1, 8192), (16, 32768), (64, 32768), (16, 131072)):
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, 4, num_sets=2)
        scores = [index_block_scores(st["index_q"], st["cache"].index_k, st["meta"], max_qo_len=4) for st in sets]
        want = [ref.select_blocks(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk) for st in sets]
        for tw, ug in itertools.product((None, 1, 2, 4, 8), (None, geo.q_heads)):
            def call(st, sc, tw=tw, ug=ug):
                return topk_from_block_scores(sc, st["meta"], topk=geo.topk, max_qo_len=4, union_group=ug,
                                              topk_warps=tw)[0]
            exact = all(torch.equal(call(st, sc), w) for st, sc, w in zip(sets, scores, want))
            rows.append({"kernel": "topk_union" if ug else "topk", "batch": batch, "ctx": ctx, "qo": 4,
                         "variant": f"warps={tw} exact={exact}", "pct": float("nan"), "default": tw is None,
                         "us": graph_us([lambda st=st, sc=sc, call=call: call(st, sc) for st, sc in zip(sets, scores)])
                         if exact else float("nan")})
        del steps, sets, scores
        torch.cuda.empty_cache()
    return rows


def _scoring_thunks(sets: list, qo: int, **launch) -> list:
    """One index-scoring call per input set with the launch parameters `launch` (the sweeps' timing unit)."""
    return [lambda st=st: index_block_scores(st["index_q"], st["cache"].index_k, st["meta"], max_qo_len=qo, **launch)
            for st in sets]


def scoring_sweep(geo, dev, ceiling: float) -> list[dict]:
    """Index scoring, TMA page loads vs per-thread copies, over pages per program x stages (and warps
    for TMA) on eight shapes (B1-B64, 8K-128K), every variant's scores checked equal to the default's."""
    rows = []
    for batch, ctx, qo in ((1, 8192, 4), (1, 131072, 4), (8, 32768, 4), (16, 32768, 4), (16, 32768, 1),
                           (32, 32768, 4), (64, 32768, 4), (16, 131072, 4)):
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=2)
        floor = index_k_bytes(sets[0]["meta"], geo, torch.bfloat16) / (ceiling * 1e3)
        nb = -(-ctx // geo.block)
        base = index_block_scores(sets[0]["index_q"], sets[0]["cache"].index_k, sets[0]["meta"], max_qo_len=qo)
        grid = [(False, bpp, ns, 4) for bpp, ns in itertools.product((None, 1, 2, 4, 8, 16), (2, 3))]
        grid += [(True, bpp, ns, nw) for bpp, ns, nw in itertools.product((1, 2, 4), (1, 2, 3), (2, 4, 8))]
        for tma, bpp, ns, nw in grid:
            th = _scoring_thunks(sets, qo, blocks_per_program=bpp, num_stages=ns, num_warps=nw, tma=tma)
            same = torch.equal(th[0]()[:, :, :nb], base[:, :, :nb])
            us = min(graph_us(th) for _ in range(2)) if same else float("nan")   # wrong: listed last
            rows.append({"kernel": "index_scores", "batch": batch, "ctx": ctx, "qo": qo,
                         "variant": f"tma={int(tma)} bpp={bpp} s={ns} w={nw} same={same}", "us": us,
                         "pct": 100 * floor / us, "default": (tma, bpp, ns, nw) == (True, 1, 1, 4)})
        del steps, sets
        torch.cuda.empty_cache()
    return rows


def union_grid(geo, dev, scale: float) -> list[dict]:
    """The union layout (on the top-k's own union lists) over key tile x stages x splits (the
    default rule halved, as is, doubled), against the per-token layout, and the whole sparse step
    with each layout forced (selection + attention, as the model's dispatchers run it)."""
    from m3_eagle_plugin.msa.kernels import sparse_verify as sv

    rows = []
    for batch, ctx, qo in ((64, 32768, 4), (32, 32768, 4), (16, 32768, 4), (8, 32768, 4), (1, 8192, 4),
                           (64, 32768, 1)):
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=3)
        fused = [select_blocks_verify(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk, max_qo_len=qo,
                                      union_group=geo.q_heads) for st in sets]
        u = fused[0][1]
        rule = union_splits(batch * u.num_chunks, u.chunk, geo.topk, dev, partial_row=sets[0]["q"].numel())
        state: dict = {}

        def attn(st, f, **kw):
            c = st["cache"]
            return sparse_verify_attention(st["q"], c.k, c.v, st["meta"], f[0], scale=scale, k_scale=c.k_scale,
                                           v_scale=c.v_scale, max_qo_len=qo, union=f[1], **kw)
        variants = [("token default", dict(layout="token"))]
        for kt, ns, sp in itertools.product((64, 128), (3, 2), sorted({max(1, rule // 2), rule, 2 * rule})):
            variants.append((f"union kt={kt} s={ns} sp={sp}",
                             dict(layout="union", key_tile=kt, num_stages=ns, splits=sp)))
        for variant, kw in variants:
            timed = time_variant(f"union grid {variant}", lambda st, f, kw=kw: attn(st, f, **kw),
                                 list(zip(sets, fused)), state)
            if timed is not None:
                rows.append({"kernel": "sparse_attn_union", "batch": batch, "ctx": ctx, "qo": qo,
                             "variant": variant, "us": timed[0], "pct": float("nan"), "err_vs_first": timed[1],
                             "default": variant == f"union kt=64 s=3 sp={rule}"})
        default_layout = sv.default_layout
        for forced in ("token", "union"):
            sv.default_layout = lambda *a, forced=forced, **k: forced
            try:
                us = graph_us([lambda st=st: kernels.sparse_attention(
                    st["q"], st["cache"].k, st["cache"].v, st["meta"],
                    kernels.select_blocks_paged(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk,
                                                max_qo_len=qo),
                    scale=scale, k_scale=st["cache"].k_scale, v_scale=st["cache"].v_scale, max_qo_len=qo)
                    for st in sets])
            finally:
                sv.default_layout = default_layout
            rows.append({"kernel": "sparse_step_layout", "batch": batch, "ctx": ctx, "qo": qo,
                         "variant": forced, "us": us, "pct": float("nan"),
                         "default": forced == default_layout(geo.q_heads)})
        del steps, sets, fused
        torch.cuda.empty_cache()
    return rows


def paired_v_sweep(geo, dev, scale: float) -> list[dict]:
    """The sparse attention with V read as bytes or as 16-bit pairs of head dims (`paired_v`), per
    layout, on the bench's shared selection and on the top-k's own selections; then the whole step
    (selection + attention) both ways. Errors are against the torch reference."""
    from m3_eagle_plugin.bench import torch_reference as ref

    rows = []
    for batch, ctx, qo in ((64, 32768, 4), (64, 32768, 1), (16, 32768, 4), (16, 32768, 1), (1, 8192, 4),
                           (1, 8192, 1), (1, 131072, 4)):
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=3)
        topk = [select_blocks_verify(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk, max_qo_len=qo)
                for st in sets]
        st0, c0 = sets[0], sets[0]["cache"]
        kw0 = dict(scale=scale, k_scale=c0.k_scale, v_scale=c0.v_scale)

        def attend(st, sel, **kw):
            c = st["cache"]
            return sparse_verify_attention(st["q"], c.k, c.v, st["meta"], sel, scale=scale, k_scale=c.k_scale,
                                           v_scale=c.v_scale, max_qo_len=qo, **kw)

        for kind, sels in (("shared", [st["selection"] for st in sets]), ("topk", topk)):
            expect = ref.sparse_attention(st0["q"], c0.k, c0.v, st0["meta"], sels[0], **kw0).float()
            for layout, paired in itertools.product(("token", "union"), (False, True)):
                err = float((attend(st0, sels[0], layout=layout, paired_v=paired).float() - expect).norm()
                            / expect.norm())
                us = min(graph_us([lambda st=st, sel=sel, layout=layout, paired=paired: attend(
                    st, sel, layout=layout, paired_v=paired) for st, sel in zip(sets, sels)]) for _ in range(2))
                rows.append({"kernel": f"sparse_attn_{kind}", "batch": batch, "ctx": ctx, "qo": qo,
                             "variant": f"{layout} paired_v={int(paired)}", "us": us, "pct": float("nan"),
                             "err_vs_ref": err, "default": layout == "token" and paired})
        ref_sel = ref.select_blocks(st0["index_q"], c0.index_k, st0["meta"], topk=geo.topk)
        expect = ref.sparse_attention(st0["q"], c0.k, c0.v, st0["meta"], ref_sel, **kw0).float()
        for paired in (False, True):
            def step(st, paired=paired):
                sel = select_blocks_verify(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk,
                                           max_qo_len=qo)
                return attend(st, sel, paired_v=paired)
            err = float((step(st0).float() - expect).norm() / expect.norm())
            us = min(graph_us([lambda st=st: step(st) for st in sets]) for _ in range(3))
            rows.append({"kernel": "sparse_step", "batch": batch, "ctx": ctx, "qo": qo,
                         "variant": f"paired_v={int(paired)}", "us": us, "pct": float("nan"), "err_vs_ref": err,
                         "default": paired})
        del steps, sets, topk
        torch.cuda.empty_cache()
    return rows


def handoff_sweep(geo, dev, scale: float) -> list[dict]:
    """The sparse step with the top-k waiting for the whole scoring grid or polling its request's
    scores (`handoff`), x the attention merging two splits with a merge launch or itself
    (`self_merge`): three interleaved rounds; every variant's selection must equal the torch
    reference's and the score board must be clean after it."""
    from m3_eagle_plugin.bench import torch_reference as ref
    from m3_eagle_plugin.msa.kernels import handoff as board

    rows = []
    for batch, ctx, qo in ((16, 32768, 4), (16, 32768, 1), (64, 32768, 4), (64, 32768, 1), (8, 32768, 4),
                           (1, 8192, 4), (1, 131072, 4)):
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=3)
        st0 = sets[0]
        want = ref.select_blocks(st0["index_q"], st0["cache"].index_k, st0["meta"], topk=geo.topk)

        def step(st, handoff, self_merge):
            c = st["cache"]
            sel = select_blocks_verify(st["index_q"], c.index_k, st["meta"], topk=geo.topk, max_qo_len=qo,
                                       handoff=handoff)
            out = sparse_verify_attention(st["q"], c.k, c.v, st["meta"], sel, scale=scale, k_scale=c.k_scale,
                                          v_scale=c.v_scale, max_qo_len=qo, self_merge=self_merge)
            return sel, out
        times: dict = {}
        for _ in range(3):
            for handoff, self_merge in itertools.product((False, True), (False, None)):
                same = torch.equal(step(st0, handoff, self_merge)[0], want)
                words = torch.empty(0, dtype=torch.int32, device=dev).set_(board.score_board(dev, 1).untyped_storage())
                clean = bool((words == board.SENTINEL).all())
                us = graph_us([lambda st=st: step(st, handoff, self_merge) for st in sets])
                times.setdefault((handoff, self_merge), []).append(us if same and clean else float("nan"))
        for (handoff, self_merge), us in times.items():
            rows.append({"kernel": "sparse_step_handoff", "batch": batch, "ctx": ctx, "qo": qo,
                         "variant": f"handoff={int(handoff)} self_merge={'rule' if self_merge is None else 0}",
                         "us": best_round(us), "pct": float("nan"), "default": handoff and self_merge is None})
        del steps, sets
        torch.cuda.empty_cache()
    return rows


def early_sweep(geo, dev, scale: float, quick: bool = False) -> list[dict]:
    """The sparse step (hand-off top-k + per-token attention on its selection) with the attention
    launched in stream order or early (`verify_step`), over splits x merge launch / self-merge, and
    early with two-page key tiles (2 stages) where a program gets two pages or more: three
    interleaved rounds; every variant's selection must equal two plain launches' and the
    ready flags must be zero after it."""
    from m3_eagle_plugin.msa.kernels import handoff as board
    from m3_eagle_plugin.msa.kernels.verify_step import early_rule, sparse_verify_step

    rows = []
    shapes = ((16, 32768, 4), (16, 32768, 1), (64, 32768, 4), (64, 32768, 1), (8, 32768, 4), (32, 32768, 4),
              (4, 32768, 4), (1, 8192, 4))
    for batch, ctx, qo in shapes[:2] if quick else shapes:
        steps, sets = _fp8_step_sets(geo, dev, batch, ctx, qo, num_sets=3)
        st0 = sets[0]
        want = select_blocks_verify(st0["index_q"], st0["cache"].index_k, st0["meta"], topk=geo.topk, max_qo_len=qo,
                                    handoff=False)
        base = token_splits(batch * qo, geo.topk, dev)
        rule = early_rule(batch * qo, geo.topk, dev)
        variants = [("rule", None, None)]
        for sp in sorted({min(base * m, geo.topk) for m in (1, 2, 4)} | {1}):
            variants += [(f"plain sp={sp} self_merge={int(sm)}", False, (sp, sm, {})) for sm in (False, True)
                         if sp > 1 or sm]
            variants += [(f"early sp={sp} self_merge={int(sm)}", True, (sp, sm, {})) for sm in (False, True)
                         if sp > 1 or sm]
        for sp in sorted({rule or 1, max(1, (rule or 1) // 2), min(2 * (rule or 1), geo.topk)}):
            if -(-geo.topk // sp) >= 2:
                variants.append((f"early sp={sp} two-page tiles", True, (sp, None, dict(pages_per_tile=2,
                                                                                          num_stages=2))))

        def step(st, early, launch):
            c = st["cache"]
            if launch is None:
                return sparse_verify_step(st["index_q"], c.index_k, st["q"], c.k, c.v, st["meta"], topk=geo.topk,
                                          scale=scale, k_scale=c.k_scale, v_scale=c.v_scale, max_qo_len=qo)
            sp, sm, tiling = launch
            if early:
                sel, _, ready = index_select.select_announcing(st["index_q"], c.index_k, st["meta"], topk=geo.topk,
                                                               max_qo_len=qo, consumers=sp)
            else:
                sel, ready = select_blocks_verify(st["index_q"], c.index_k, st["meta"], topk=geo.topk,
                                                  max_qo_len=qo), None
            return sel, sparse_verify_attention(st["q"], c.k, c.v, st["meta"], sel, scale=scale, k_scale=c.k_scale,
                                                v_scale=c.v_scale, max_qo_len=qo, splits=sp, self_merge=sm,
                                                ready=ready, **tiling)
        times: dict = {}
        for _ in range(3):
            for name, early, launch in variants:
                same = torch.equal(step(st0, early, launch)[0], want)
                clean = bool((board.ready_flags(dev, 1 << 16) == 0).all())
                us = graph_us([lambda st=st: step(st, early, launch) for st in sets])
                times.setdefault(name, []).append(us if same and clean else float("nan"))
        for name, us in times.items():
            rows.append({"kernel": "sparse_step_early", "batch": batch, "ctx": ctx, "qo": qo,
                         "variant": name + (f" (early rule: {rule})" if name == "rule" else ""),
                         "us": best_round(us), "pct": float("nan"), "default": name == "rule"})
        del steps, sets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dense-only", action="store_true", help="only the dense verify sweep (bf16 K/V)")
    ap.add_argument("--merge", action="store_true", help="only the split-K merge alone, by warps")
    ap.add_argument("--sparse-only", action="store_true", help="only the sparse attention sweep (both layouts)")
    ap.add_argument("--token-grid", action="store_true",
                    help="only the per-token sparse attention over its whole launch grid (five shapes)")
    ap.add_argument("--topk", action="store_true", help="only the top-k program over its warps (four shapes)")
    ap.add_argument("--pdl", action="store_true",
                    help="only the sparse step with programmatic dependent launch off / by rule / everywhere")
    ap.add_argument("--scoring", action="store_true",
                    help="only the index scoring over pages per program x stages (eight shapes)")
    ap.add_argument("--union-grid", action="store_true",
                    help="only the union layout over key tile x stages x splits, and the step per layout")
    ap.add_argument("--handoff", action="store_true",
                    help="only the sparse step with the top-k hand-off and the attention's self-merge on/off")
    ap.add_argument("--early", action="store_true",
                    help="only the sparse step with the attention launched in order / early, x splits x self-merge, "
                         "and early with two-page key tiles")
    ap.add_argument("--paired-v", action="store_true",
                    help="only the sparse attention and step with V read as bytes vs 16-bit pairs (seven shapes)")
    args = ap.parse_args()
    if args.json is not None:  # checked before the sweep (else a bad path lost the whole sweep's rows after it)
        target = Path(args.json)
        folder = target.resolve().parent
        if (not args.json or target.is_dir() or (target.exists() and not os.access(target, os.W_OK))
                or not (folder.is_dir() and os.access(folder, os.W_OK))):
            ap.error(f"--json {args.json!r}: not a writable file path")
    dev = torch.device("cuda")
    geo = Geometry()
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    rows = []
    scale = 1.0 / math.sqrt(geo.head_dim)
    if args.token_grid:
        rows += token_grid(geo, dev, scale)
    if args.topk:
        rows += topk_sweep(geo, dev)
    if args.union_grid:
        rows += union_grid(geo, dev, scale)
    if args.pdl:
        rows += pdl_sweep(geo, dev, scale)
    if args.scoring:
        rows += scoring_sweep(geo, dev, ceiling)
    if args.paired_v:
        rows += paired_v_sweep(geo, dev, scale)
    if args.handoff:
        rows += handoff_sweep(geo, dev, scale)
    if args.early:
        rows += early_sweep(geo, dev, scale, args.quick)
    if args.merge:
        rows += merge_sweep(dev)
    only = (args.dense_only or args.token_grid or args.topk or args.union_grid or args.pdl or args.scoring
            or args.paired_v or args.handoff or args.early or args.merge)
    if args.dense_only:
        rows += dense_sweep(geo, dev, ceiling, scale)
    for batch, ctx in () if only else ((64, 32768), (16, 32768), (1, 8192)):
        steps = _fp8_step_set(geo, dev, batch, ctx, num_sets=3)
        for qo in (4, 1):
            sets = [steps.step(s, qo) for s in range(3)]
            meta0 = sets[0]["meta"]
            ik_bytes = index_k_bytes(meta0, geo, torch.bfloat16)
            # index scoring: the default (TMA, a page a program), then per-thread copies over pages per
            # program x warps x stages
            for bpp, nw, ns in [("tma", 4, None)] + list(itertools.product((None, 4, 8, 16), (4, 8), (2, 3, 4))):
                if args.sparse_only or ((args.quick or qo == 1) and (nw, ns) not in ((4, 2), (4, None))):
                    continue
                launch = {} if bpp == "tma" else dict(blocks_per_program=bpp, num_warps=nw, num_stages=ns, tma=False)
                us = graph_us(_scoring_thunks(sets, qo, **launch))
                rows.append({"kernel": "index_scores", "batch": batch, "ctx": ctx, "qo": qo,
                             "variant": "tma default" if bpp == "tma" else f"bpp={bpp} w={nw} s={ns}", "us": us,
                             "pct": 100 * ik_bytes / (ceiling * 1e3) / us, "default": bpp == "tma"})
            # top-k (+ union) alone
            scores = [index_block_scores(st["index_q"], st["cache"].index_k, st["meta"], max_qo_len=qo) for st in sets]
            for tw, ug in itertools.product((None, 4, 8), (geo.q_heads, None)):
                if args.sparse_only and tw is not None:
                    continue
                th = [lambda st=st, sc=sc: topk_from_block_scores(sc, st["meta"], topk=geo.topk, max_qo_len=qo,
                                                                  union_group=ug, topk_warps=tw)
                      for st, sc in zip(sets, scores)]
                rows.append({"kernel": "topk_union" if ug else "topk", "batch": batch, "ctx": ctx, "qo": qo,
                             "variant": f"warps={tw}", "us": graph_us(th), "pct": float("nan")})
            # sparse attention on the fused top-k's own selection and union
            fused = [select_blocks_verify(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk,
                                          max_qo_len=qo, union_group=geo.q_heads) for st in sets]
            u = union_blocks(fused[0][0], meta0)
            att_bytes = u * kv_page_bytes(geo, torch.float8_e4m3fn)
            state = {}
            chunk = fused[0][1].chunk
            union_base = union_splits(batch * fused[0][1].num_chunks, chunk, geo.topk, dev,
                                      partial_row=sets[0]["q"].numel())
            token_base = token_splits(batch * qo, geo.topk, dev, partial_row=sets[0]["q"].numel())
            for variant, kw in sparse_variants(args.quick):
                kw = _resolve_splits(kw, union_base if kw["layout"] == "union" else token_base)

                def call(st, f, kw=kw):
                    return sparse_verify_attention(st["q"], st["cache"].k, st["cache"].v, st["meta"], f[0],
                                                   scale=scale, k_scale=st["cache"].k_scale,
                                                   v_scale=st["cache"].v_scale, max_qo_len=qo,
                                                   union=f[1] if kw["layout"] == "union" else None, **kw)
                timed = time_variant(f"sparse {variant}", call, list(zip(sets, fused)), state)
                if timed is not None:
                    rows.append({"kernel": "sparse_attn", "batch": batch, "ctx": ctx, "qo": qo,
                                 "variant": f"{variant} ({kw['splits']})", "us": timed[0],
                                 "pct": 100 * att_bytes / (ceiling * 1e3) / timed[0], "err_vs_first": timed[1],
                                 "default": variant.startswith("token pf=1 kt=128 sp=None s=3 w=4")})
            # the whole sparse-layer step as the model runs it (default layout), and the union layout
            # on the fused top-k's union lists
            step_bytes = ik_bytes + att_bytes
            for name, fn in (("default", lambda st: kernels.sparse_layer_attention(
                                 st["q"], st["cache"].k, st["cache"].v, st["index_q"], st["cache"].index_k,
                                 st["meta"], topk=geo.topk, scale=scale, k_scale=st["cache"].k_scale,
                                 v_scale=st["cache"].v_scale, max_qo_len=qo)),
                             ("union fused", lambda st: _union_step(st, geo, qo, scale))):
                us = graph_us([lambda st=st, fn=fn: fn(st) for st in sets])
                rows.append({"kernel": "sparse_step", "batch": batch, "ctx": ctx, "qo": qo, "variant": name,
                             "us": us, "pct": 100 * step_bytes / (ceiling * 1e3) / us, "default": name == "default"})
        del steps
        torch.cuda.empty_cache()
    summary(rows)
    if args.json:  # standard JSON: a wrong variant's NaN time as null (jq and other strict readers refuse NaN)
        with open(args.json, "w") as fh:
            json.dump(json_safe({"ceiling_gbps": ceiling, "rows": rows}, lambda _: None), fh, indent=1, allow_nan=False)


def summary(rows: list[dict]) -> None:
    """Per kernel and shape the six fastest rows and the default's, wrong ones (NaN us) last."""
    print(f"{'kernel':13} {'shape':>18}  {'us':>8} {'%floor':>7}  variant")
    groups: dict[tuple, list] = {}
    for r in rows:  # a shape's rows need not be adjacent (the rule's own row is timed last)
        groups.setdefault((r["kernel"], _shape(r)), []).append(r)
    for key, grp in groups.items():
        grp = sorted(grp, key=lambda r: (math.isnan(r["us"]), r["us"]))  # a NaN key would stop the sort ordering
        dflt = [r for r in grp if r.get("default") or r["variant"].startswith("warps=None")]
        for r in grp[:6] + [r for r in dflt[:1] if r not in grp[:6]]:
            tag = " (default)" if r in dflt else ""
            err = f"  err {r['err_vs_first']:.1e}" if "err_vs_first" in r else ""
            err += f"  err vs torch {r['err_vs_ref']:.1e}" if "err_vs_ref" in r else ""
            pct = r.get("pct", float("nan"))
            print(f"{key[0]:13} {key[1]:>18}  {r['us']:8.1f} {pct:7.1f}  {r['variant']}{tag}{err}")


if __name__ == "__main__":
    main()
