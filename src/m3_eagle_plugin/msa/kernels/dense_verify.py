"""Triton dense verify attention (causal ladder) over paged HND K/V, split-K with an LSE merge.

Why: the dense layers of M3 and the Eagle3 draft layer attend to a request's whole context. One
program per (request, KV head, split) streams a contiguous range of the request's pages once
for all verify tokens x the GQA group (16 query heads x 4 tokens = one 64-row MMA tile), each row
masked to keys up to its own position. Mirrors `m3_eagle_plugin.msa.dense_attention`.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._common import (attention_scales, check_grid, device_sm_count, fits_one_tile, is_pow2, qo_len_hint, require,
                      tokens_per_tile)
from .attention_io import check_attention_inputs, check_splits, max_partial_splits, merge_outputs, split_outputs
from .attention_tiles import LOG2E, online_softmax_step, store_rows, zero_graph_padding
from .launch import launch
from .replay import Replayer, call_signature
from .sparse_verify import check_key_tile


@triton.jit
def _dense_verify_kernel(
    q_ptr, s_q_t, s_q_h,
    k_ptr, s_k_p, s_k_h, s_k_b,
    v_ptr, s_v_p, s_v_h, s_v_b,
    bt_ptr, s_bt_r, cu_ptr, pos_ptr, kvl_ptr,
    o_ptr, s_o_t, s_o_h, lse_ptr, num_tokens,
    qk_scale, v_scale,
    G: tl.constexpr, QP: tl.constexpr, BLOCK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * G
    t0 = tl.load(cu_ptr + r)
    t1 = tl.load(cu_ptr + r + 1)
    num_blocks = tl.cdiv(tl.load(kvl_ptr + r), BLOCK)
    per_split = tl.cdiv(num_blocks, SPLITS)
    b_lo = split * per_split
    b_hi = tl.minimum(b_lo + per_split, num_blocks)

    rows = tl.arange(0, QP * G)
    head = g * G + rows % G
    d = tl.arange(0, D)
    jn = tl.arange(0, BN)
    for c0 in range(t0, t1, QP):
        tok = c0 + rows // G
        row_ok = tok < t1
        q = tl.load(q_ptr + tok[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
        pos_max = tl.max(pos, axis=0)
        m_i = tl.full([QP * G], -1.0e30, tl.float32)
        l_i = tl.zeros([QP * G], tl.float32)
        acc = tl.zeros([QP * G, D], tl.float32)
        # One flat loop over BN-key sub-tiles of this split's pages (see sparse_attention).
        for kt in range(b_lo * (BLOCK // BN), b_hi * (BLOCK // BN)):
            b = kt // (BLOCK // BN)
            key0 = (kt % (BLOCK // BN)) * BN
            page = tl.load(bt_ptr + r * s_bt_r + b).to(tl.int64)
            mapped = page >= 0  # an unmapped (-1) page is never dereferenced and never attended
            page = tl.maximum(page, 0)
            key = key0 + jn
            # Two plain loads rather than `attention_tiles.load_keys`: through it this kernel was 0.0-1.4%
            # slower at six shapes (H200, 2026-11-30, scripts/ab/dense_ab18.py; B64/32K q4 294.1 vs 290.0 us).
            k = tl.load(k_ptr + page * s_k_p + g * s_k_h + key[:, None] * s_k_b + d[None, :],
                        mask=mapped, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + page * s_v_p + g * s_v_h + key[:, None] * s_v_b + d[None, :],
                        mask=mapped, other=0.0).to(q.dtype)
            m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, row_ok & mapped,
                                                b * BLOCK + key, pos, pos_max, IEEE)

        store_rows(o_ptr, s_o_t, s_o_h, lse_ptr, acc, m_i, l_i, tok, head, d, row_ok, num_heads, split, v_scale,
                   D, SPLITS)
    if SPLITS == 1:
        zero_graph_padding(o_ptr, s_o_t, s_o_h, cu_ptr, num_tokens, g, G, D)


#: Query rows in one tile from which a one-page split is mostly its program's fixed cost.
WIDE_TILE_ROWS = 64


def default_splits(num_requests: int, num_kv_heads: int, width: int, partial_row: int, device: torch.device,
                   tile_rows: int = 0) -> int:
    """Splits of each (request, KV head)'s pages: of 1 .. the most (two programs per SM, or up to
    16 splits while each keeps 16 pages), the one with the fewest waves (of two programs per SM)
    x pages a split, ties to fewer splits; then as few splits as give the same pages per split,
    so none is left without pages. Small batches keep two programs per SM (one wave; more splits
    only shorten each program); past that a grid just over whole waves costs a wave: B16/128K
    with 17 splits took 357.4 us, 284.6 with 16.

    `tile_rows`: the query rows of a program's one tile when all of a request's tokens fit it (0
    otherwise). From WIDE_TILE_ROWS (a 4-token verify row at GQA group 16) one-page splits that
    would put more than 1.5 programs on every SM become two-page splits, one program per SM (H200,
    2026-11-30, `scripts/ab/dense_pages23.py`, q4, three alternating rounds, one page -> two pages a
    split: B1/32K 15.44 -> 14.68 us, B2/16K 14.93 -> 14.08, B4/8K 14.42 -> 13.66, B8/4K 14.14 ->
    13.43, B16/2K 14.18 -> 13.53; at 1.45 programs a SM B3/8K 12.30 -> 12.21, B6/4K 11.60 ->
    11.74, B12/2K 11.71 -> 11.86, so those keep one page; at q1, 16 rows, two pages took 0.98-1.07x).

    Waves x pages, not "up to 16 splits" (H200, 2026-11-30, `scripts/ab/dense_rule19.py`, former
    -> this rule, three alternating rounds; identical outputs elsewhere, e.g. B16/32K, B1/8K):
    B64/32K q4 16 -> 4 splits 293.2 -> 265.5 us, q1 257.0 -> 245.2; B64/128K q1 990.7 -> 940.8,
    q4 1100.1 -> 1080.3; B32/32K q4 16 -> 8 147.3 -> 137.2; B40/32K q4 16 -> 13 202.9 -> 176.7;
    B24/32K q4 16 -> 11 135.5 -> 107.4; B48/32K q4 16 -> 11 220.4 -> 213.7; B40/16K q4 8 -> 6
    123.0 -> 95.0; B64/16K q4 8 -> 4 145.7 -> 139.2; B128/8K q1 4 -> 2 132.6 -> 128.3; B256/8K q1
    4 -> 1 257.4 -> 241.7; B256/4K q4 2 -> 1 154.1 -> 129.2; every one of 24 differing shapes
    0.77-0.99x. By splits (`scripts/ab/dense_waves19.py`), B64/32K q4 4 / 5 / 8 / 10 / 16: 276.2 /
    378.2 / 280.1 / 312.0 / 294.0 (waves x pages 64 / 104 / 64 / 78 / 64); B48/32K q4 219.1 at 5,
    221.3 at 10, 223.8 at 16, 245.4 at 4, 253.1 at 8 (52 / 52 / 48 / 64 / 64).

    Earlier sweeps (`scripts/ab/dense16.py`, 2026-11-30, q4 (q1) us by splits):
    - 32K, splits 10 / 13 / 16 / 20 / 32: B16 104.5 (94.0) / 85.5 (75.8) / 76.3 (70.3) / 104.4
      (99.8) / 86.5 (75.3).
    - 128K, splits 10 / 16 / 32 / 64: B16 382.8 / 286.2 / 302.9 / 328.9.
    - B4/32K splits 16 / 32 / 64: 52.1 / 31.2 / 29.9. B8/4K with 64/4 heads (32 pages) splits 4 /
      8 / 9 / 16: 35.8 / 33.9 / 35.3 / 40.3 (with the former merge)."""
    width = max(1, width)
    units = max(1, num_requests * num_kv_heads)
    slots = 2 * device_sm_count(device)
    most = max(1, min(max(slots // units, min(16, width // 16)), width, max_partial_splits(partial_row)))

    def waves_x_pages(s: int) -> tuple[int, int]:
        return -(-units * s // slots) * -(-width // s), s
    # one wave at the most splits: nothing fewer does better (the common small-batch case, no search)
    splits = most if units * most <= slots else min(range(1, most + 1), key=waves_x_pages)
    splits = -(-width // -(-width // splits))
    if tile_rows >= WIDE_TILE_ROWS and splits == width > 1 and 4 * units * splits > 3 * slots:
        splits = -(-width // 2)
    return splits


def dense_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    *,
    scale: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_qo_len: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    key_tile: int | None = None,
) -> torch.Tensor:
    """`[T, Hq, D]` in `q.dtype`: every token attends to its request's keys up to its own position.
    Replayed (`replay`) after the first call of a signature."""
    inputs = (q, k_cache, v_cache)
    scalars = (scale, k_scale, v_scale, max_qo_len, splits, num_warps, num_stages, key_tile)
    return _REPLAYER.call(call_signature(inputs, meta, scalars), inputs, meta, lambda: _dense(
        q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len,
        splits=splits, num_warps=num_warps, num_stages=num_stages, key_tile=key_tile))


_REPLAYER = Replayer()


def _dense(q, k_cache, v_cache, meta, *, scale, k_scale, v_scale, max_qo_len, splits, num_warps, num_stages,
           key_tile) -> torch.Tensor:
    check_attention_inputs(q, k_cache, v_cache, meta)
    qk_scale, vs = attention_scales(scale, k_scale, v_scale)
    qk_scale *= LOG2E
    max_qo_len = qo_len_hint(meta, max_qo_len)
    num_tokens, num_heads, dim = q.shape
    _, hkv, block, _ = k_cache.shape
    group = num_heads // hkv
    require(is_pow2(group), f"dense attention tiles whole GQA groups: query heads per KV head must be a power of "
            f"two, got {group}")
    num_requests = meta.kv_lens.shape[0]
    width = meta.block_tables.shape[1]
    qp = tokens_per_tile(num_tokens, num_requests, group, max_qo_len)
    partial_row = num_tokens * num_heads * dim
    if splits is None:
        splits = default_splits(num_requests, hkv, width, partial_row, q.device,
                                tile_rows=qp * group if fits_one_tile(max_qo_len, qp) else 0)
    splits = check_splits(splits, partial_row)
    check_grid("dense verify attention", (num_requests, hkv, splits), "requests, KV heads, splits")
    out, o_buf, lse = split_outputs(q, v_cache, splits)
    if key_tile is None:  # H200 at B64/32K: 64 for 16-bit KV (2026-11-29 sweep: 311 vs 445 us with 128), 32 for fp8
        key_tile = 64 if k_cache.element_size() >= 2 else 32
    check_key_tile(key_tile)
    if num_tokens == 0 or num_requests == 0:
        return out.zero_()
    launch(_dense_verify_kernel, (num_requests, hkv, splits),
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables, meta.block_tables.stride(0), meta.cu_qo_lens, meta.positions, meta.kv_lens,
        o_buf, out.stride(0), out.stride(1), lse, num_tokens,
        qk_scale, vs,
        G=group, QP=qp, BLOCK=block, BN=min(block, key_tile), D=dim, SPLITS=splits,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return merge_outputs(out, o_buf, lse, meta, splits, vs)
