"""Triton cache write: a step's K, V and index-K rows scattered into their pages in one launch.

Why: the torch writers (`msa.write_kv`, `msa.write_index_k`) must redirect skipped slots (-1)
to a harmless duplicate write, since `index_put_` cannot mask, which costs about fifteen small
kernels per cache tensor; at batch 1 a verify + draft cycle spent more GPU time in them than in
its attention. Here a program per (token, KV head) loads its slot and stores its rows under a
mask, so a skipped token writes nothing at all. Values must already have the cache's dtype (the
callers cast, so fp8 rounding is torch's). Mirrors the torch writers exactly, except for a slot
past the cache: the torch writers refuse one in a host tensor, and here (device slots, no host
sync) it is skipped like a negative one rather than written out of bounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..blocks import is_integer_dtype
from ._common import check_cache_view, check_kv_caches, check_same_device, next_pow2, require
from .launch import launch


@triton.jit
def _write_step_kernel(
    slots_ptr,
    k_ptr, s_k_t, s_k_h, v_ptr, s_v_t, s_v_h,
    kc_ptr, s_kc_p, s_kc_h, s_kc_b, vc_ptr, s_vc_p, s_vc_h, s_vc_b,
    ik_ptr, s_ik_t, ikc_ptr, s_ikc_p, s_ikc_b, kv_slots, ik_slots,
    BLOCK: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, DI: tl.constexpr, DI_P: tl.constexpr,
    HAS_INDEX: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    keep = (slot >= 0) & (slot < kv_slots)
    page = tl.maximum(slot, 0) // BLOCK
    off = tl.maximum(slot, 0) % BLOCK
    d = tl.arange(0, D_P)
    dm = (d < D) & keep
    k = tl.load(k_ptr + t * s_k_t + h * s_k_h + d, mask=dm)
    v = tl.load(v_ptr + t * s_v_t + h * s_v_h + d, mask=dm)
    tl.store(kc_ptr + page * s_kc_p + h * s_kc_h + off * s_kc_b + d, k, mask=dm)
    tl.store(vc_ptr + page * s_vc_p + h * s_vc_h + off * s_vc_b + d, v, mask=dm)
    if HAS_INDEX:
        di = tl.arange(0, DI_P)
        im = (di < DI) & (slot >= 0) & (slot < ik_slots) & (h == 0)
        ik = tl.load(ik_ptr + t * s_ik_t + di, mask=im)
        tl.store(ikc_ptr + page * s_ikc_p + off * s_ikc_b + di, ik, mask=im)


def _check_rows(name: str, rows: torch.Tensor, cache: torch.Tensor, shape: tuple) -> None:
    require(tuple(rows.shape) == shape and rows.stride(-1) == 1,
            f"{name} must be {list(shape)} with unit last stride, got {tuple(rows.shape)}")
    require(rows.dtype == cache.dtype, f"{name} dtype {rows.dtype} differs from its cache's {cache.dtype}: cast first")
    require(rows.device == cache.device, f"{name} is on {rows.device}, its cache on {cache.device}")


def write_step_kv_fused(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, index_k_cache: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None) -> None:
    """Write `k`, `v` `[T, Hkv, D]` into `[P, Hkv, B, D]` caches (and `index_k` `[T, Di]` into
    `[P, B, Di]`) at `slots` `[T]` (page * B + offset; negative or past the cache = skip).
    Capture-safe, one launch."""
    check_kv_caches(k_cache, v_cache)
    check_same_device(k_cache.device, v_cache=v_cache, slots=slots, index_k_cache=index_k_cache)
    _, hkv, block, dim = k_cache.shape
    require(slots.dim() == 1 and is_integer_dtype(slots.dtype),
            f"slots must be a 1-d integer tensor, got {slots.dtype} {tuple(slots.shape)}")
    require(slots.stride(0) == 1 or slots.shape[0] <= 1,
            f"slots must be contiguous (the kernel reads it densely), got stride {slots.stride(0)}")
    num_tokens = slots.shape[0]
    _check_rows("k", k, k_cache, (num_tokens, hkv, dim))
    _check_rows("v", v, v_cache, (num_tokens, hkv, dim))
    has_index = index_k_cache is not None
    require(has_index == (index_k is not None), "pass index_k_cache and index_k together")
    if has_index:
        check_cache_view("index_k_cache", index_k_cache, 3)
        require(index_k_cache.shape[1] == block,
                f"index-K block size {index_k_cache.shape[1]} differs from the K/V block size {block}")
        _check_rows("index_k", index_k, index_k_cache, (num_tokens, index_k_cache.shape[2]))
    if num_tokens == 0:
        return
    ikc = index_k_cache if has_index else k_cache
    ik = index_k if has_index else k
    di = index_k_cache.shape[2] if has_index else 1
    launch(_write_step_kernel, (num_tokens, hkv),
        slots,
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ik, ik.stride(0), ikc, ikc.stride(0), ikc.stride(1), k_cache.shape[0] * block, ikc.shape[0] * block,
        BLOCK=block, D=dim, D_P=next_pow2(dim), DI=di, DI_P=next_pow2(di), HAS_INDEX=has_index,
        num_warps=1,
    )
