"""Triton sparse verify attention: each request's union of selected pages read once.

Why: the 1 + draft_len verify tokens of a request select nearly the same pages. One program per
(request, KV head, split) deduplicates the tokens' selections, loads every page of the union
once and applies it to all of the request's query rows (tokens x GQA group in one MMA tile);
a row only sees a page its own token selected and keys up to its own position. Splits over the
union plus an LSE merge keep small batches busy. Mirrors `m3_eagle_plugin.msa.sparse_attention`.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ._common import (
    FP8_DTYPES,
    check_cache_view,
    check_meta,
    compute_dtype_of,
    device_sm_count,
    next_pow2,
    require,
    scale_value,
    tokens_per_tile,
)
from .merge import merge_splits

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_verify_kernel(
    q_ptr, s_q_t, s_q_h,
    k_ptr, s_k_p, s_k_h, s_k_b,
    v_ptr, s_v_p, s_v_h, s_v_b,
    sel_ptr, s_sel_h, s_sel_t,
    bt_ptr, s_bt_r, cu_ptr, pos_ptr,
    o_ptr, s_o_t, s_o_h, lse_ptr,
    qk_scale, v_scale,
    G: tl.constexpr, QP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
    BLOCK: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * G
    t0 = tl.load(cu_ptr + r)
    t1 = tl.load(cu_ptr + r + 1)

    rows = tl.arange(0, QP * G)
    head = g * G + rows % G
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
    n = tl.arange(0, QP * TOPK_P)
    kk = tl.arange(0, TOPK_P)
    sel_base = sel_ptr + g * s_sel_h
    for c0 in range(t0, t1, QP):
        tok = c0 + rows // G
        row_ok = tok < t1
        q = tl.load(q_ptr + tok[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
        # Union of this chunk's selections: entry n is kept if no earlier entry has its id.
        n_tok = c0 + n // TOPK_P
        n_ok = (n_tok < t1) & (n % TOPK_P < TOPK)
        cand = tl.load(sel_base + n_tok * s_sel_t + n % TOPK_P, mask=n_ok, other=-1)
        same = (cand[:, None] == cand[None, :]) & (n[None, :] < n[:, None])
        first = (cand >= 0) & (tl.max(same.to(tl.int32), axis=1) == 0)
        rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
        num_unique = tl.sum(first.to(tl.int32), axis=0)
        row_sel = tl.load(sel_base + tok[:, None] * s_sel_t + kk[None, :],
                          mask=row_ok[:, None] & (kk < TOPK)[None, :], other=-1)

        m_i = tl.full([QP * G], -1.0e30, tl.float32)
        l_i = tl.zeros([QP * G], tl.float32)
        acc = tl.zeros([QP * G, D], tl.float32)
        for u in range(split, num_unique, SPLITS):
            b = tl.sum(tl.where(first & (rank == u), cand, 0), axis=0)
            row_has = tl.max((row_sel == b).to(tl.int32), axis=1) > 0
            page = tl.load(bt_ptr + r * s_bt_r + b).to(tl.int64)
            k = tl.load(k_ptr + page * s_k_p + g * s_k_h + j[:, None] * s_k_b + d[None, :]).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            visible = row_has[:, None] & ((b * BLOCK + j)[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + page * s_v_p + g * s_v_h + j[:, None] * s_v_b + d[None, :]).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new

        safe_l = tl.where(l_i > 0, l_i, 1.0)
        if SPLITS == 1:
            o = acc / safe_l[:, None] * v_scale
            tl.store(o_ptr + tok[:, None] * s_o_t + head[:, None] * s_o_h + d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            prow = (tok * num_heads + head) * SPLITS + split
            tl.store(o_ptr + prow[:, None] * D + d[None, :], acc / safe_l[:, None], mask=row_ok[:, None])
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            tl.store(lse_ptr + prow, lse, mask=row_ok)


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any) -> None:
    check_meta(meta)
    compute_dtype_of(q)
    require(q.dim() == 3 and q.stride(-1) == 1, f"q must be [T, Hq, D] with unit last stride, got {tuple(q.shape)}")
    check_cache_view("k_cache", k_cache, 4)
    check_cache_view("v_cache", v_cache, 4)
    require(k_cache.shape == v_cache.shape, f"k/v cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    _, hkv, block, dim = k_cache.shape
    require(q.shape[2] == dim, f"head dim of q ({q.shape[2]}) and cache ({dim}) differ")
    require(q.shape[1] % hkv == 0, f"query heads {q.shape[1]} not a multiple of KV heads {hkv}")
    require(block >= 16 and dim >= 16 and block & (block - 1) == 0 and dim & (dim - 1) == 0,
            "block size and head dim must be powers of two >= 16")
    allowed = (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES
    require(k_cache.dtype in allowed and v_cache.dtype in allowed, f"unsupported KV dtype {k_cache.dtype}")


def choose_splits(num_requests: int, num_kv_heads: int, max_work: int, device: torch.device) -> int:
    """Splits per (request, KV head) so the grid has about two programs per SM."""
    target = 2 * device_sm_count(device)
    splits = -(-target // max(1, num_requests * num_kv_heads))
    return int(max(1, min(splits, max_work)))


def sparse_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    selection: torch.Tensor,
    *,
    scale: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_qo_len: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """`[T, Hq, D]` in `q.dtype`; `selection` int32 `[Hkv, T, topk]` of logical block ids."""
    check_attention_inputs(q, k_cache, v_cache, meta)
    require(selection.dim() == 3 and selection.dtype == torch.int32 and selection.stride(-1) == 1,
            f"selection must be int32 [Hkv, T, topk] with unit last stride, got {selection.dtype} {tuple(selection.shape)}")
    num_tokens, num_heads, dim = q.shape
    _, hkv, block, _ = k_cache.shape
    require(selection.shape[0] == hkv and selection.shape[1] == num_tokens,
            f"selection shape {tuple(selection.shape)} does not match [Hkv={hkv}, T={num_tokens}, topk]")
    group = num_heads // hkv
    topk = selection.shape[2]
    num_requests = meta.kv_lens.shape[0]
    qp = tokens_per_tile(num_tokens, num_requests, group, max_qo_len)
    if splits is None:
        splits = choose_splits(num_requests, hkv, topk + qp - 1, q.device)
    # Zeroed so graph-padding rows (past cu_qo_lens[-1]) read 0 on the single-split path too.
    out = torch.zeros_like(q) if splits == 1 else torch.empty_like(q)
    if num_tokens == 0 or num_requests == 0:
        return out.zero_()
    qk_scale = float(scale) * scale_value(k_scale) * LOG2E
    vs = scale_value(v_scale)
    if splits == 1:
        o_buf, lse = out, out  # lse unused when SPLITS == 1
    else:
        o_buf = torch.empty((num_tokens, num_heads, splits, dim), device=q.device, dtype=torch.float32)
        lse = torch.empty((num_tokens, num_heads, splits), device=q.device, dtype=torch.float32)
    _sparse_verify_kernel[(num_requests, hkv, splits)](
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        selection, selection.stride(0), selection.stride(1),
        meta.block_tables, meta.block_tables.stride(0), meta.cu_qo_lens, meta.positions,
        o_buf, out.stride(0), out.stride(1), lse,
        qk_scale, vs,
        G=group, QP=qp, TOPK=topk, TOPK_P=next_pow2(topk), BLOCK=block, D=dim, SPLITS=splits,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    if splits == 1:
        return out
    return merge_splits(o_buf, lse, out, meta.cu_qo_lens, vs)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
