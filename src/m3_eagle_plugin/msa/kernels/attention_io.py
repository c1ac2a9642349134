"""What every verify attention wrapper does around its kernel: check the inputs, bound and
allocate the split partials, merge them.

Why: the sparse (`sparse_verify`) and dense (`dense_verify`) attentions take the same query, cache
and metadata layout and split a request's keys over programs the same way; one place decides
what they accept, how many split partials they may write and in which dtype.
"""
from __future__ import annotations

from typing import Any

import torch

from m3_eagle_plugin._ints import as_int

from ._common import (CACHE_DTYPES, FP8_DTYPES, KernelInputError, check_cache_block, check_kv_caches, check_meta,
                      check_same_device, check_step_rows, compute_dtype_of, require)
from .merge import merge_splits


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any) -> None:
    check_meta(meta, q.device)
    compute_dtype_of(q)
    require(q.dim() == 3 and q.stride(-1) == 1, f"q must be [T, Hq, D] with unit last stride, got {tuple(q.shape)}")
    check_kv_caches(k_cache, v_cache)
    check_same_device(q.device, k_cache=k_cache, v_cache=v_cache)
    _, hkv, block, dim = k_cache.shape
    require(q.shape[2] == dim, f"head dim of q ({q.shape[2]}) and cache ({dim}) differ")
    require(hkv >= 1, f"the K/V caches have no KV head: {tuple(k_cache.shape)}")
    require(q.shape[1] % hkv == 0, f"query heads {q.shape[1]} not a multiple of KV heads {hkv}")
    require(block >= 16 and dim >= 16 and block & (block - 1) == 0 and dim & (dim - 1) == 0,
            "block size and head dim must be powers of two >= 16")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(cache.dtype in CACHE_DTYPES, f"unsupported {name} dtype {cache.dtype}")
    check_step_rows("q", q, meta)
    check_cache_block("k_cache", block, meta)


#: Most elements the split partials `[T, Hq, splits, D]` may take (512 MB in fp32).
MAX_PARTIAL_ELEMENTS = 1 << 27


def max_partial_splits(partial_row: int) -> int:
    """Most splits whose partials (`partial_row` = T x Hq x D elements each) fit MAX_PARTIAL_ELEMENTS."""
    return MAX_PARTIAL_ELEMENTS // max(partial_row, 1)


def check_splits(splits: int, partial_row: int) -> int:
    """`splits` as an int within the partials' bound (2.5 failed in torch's allocation naming no option,
    True ran as one split)."""
    splits = as_int("splits", splits, 1, KernelInputError)
    require(splits == 1 or splits * partial_row <= MAX_PARTIAL_ELEMENTS,
            f"{splits} splits need {splits * partial_row} partial elements, more than {MAX_PARTIAL_ELEMENTS}")
    return splits


def partial_dtype(q: torch.Tensor, v_cache: torch.Tensor) -> torch.dtype:
    """The split partials' dtype: fp32 for fp32 queries; otherwise 16 bits, which halve what the
    attention writes and the merge reads. A partial is a mean of V rows weighted by their
    probabilities, before the V scale, so it never exceeds the largest |V|: fp16 where V's own
    range fits fp16 (fp16 and fp8 caches), bf16 otherwise (bf16 and fp32 caches).

    fp32 -> 16 bits (H200, 2026-11-30, `scripts/ab/dense_merge20.py`, graph-replayed, three
    alternating rounds, bf16 queries): the dense attention on bf16 K/V (bf16 partials) B1/32K q4
    17.44 -> 15.57 us, B1/128K q4 31.96 -> 29.10, B4/32K q4 30.42 -> 28.26, B16/8K q4 29.50 ->
    27.25, the peer case (B8/4K, 64/4 heads) 29.51 -> 27.66, level at B64 (0.995-1.006) and B1/8K
    q1 (7.65 -> 7.82; fp16 partials 7.67, the same speed as bf16 elsewhere), error against the
    torch reference 2.3e-3 -> 3.0e-3 (fp16: unchanged); the sparse step on fp8 K/V (fp16
    partials) 0.982-1.000x at nine shapes (B1/8K q4 8.78 -> 8.63, B16/32K q4 51.99 -> 51.38),
    error 8.2e-4 -> 1.0e-3."""
    if q.dtype == torch.float32:
        return torch.float32
    return torch.float16 if v_cache.dtype in (torch.float16,) + FP8_DTYPES else torch.bfloat16


def split_outputs(q: torch.Tensor, v_cache: torch.Tensor, splits: int):
    """(out, split partials, their LSE) for the attention kernels' `o_ptr` / `lse_ptr`. One split
    writes `out` directly (both pointers are `out`; the LSE is not written), graph-padding rows
    (past cu_qo_lens[-1]) zeroed by the kernel (`attention_tiles.zero_graph_padding`). Partials
    in `partial_dtype`, their LSE in fp32."""
    if splits == 1:
        out = torch.empty_like(q)
        return out, out, out
    num_tokens, num_heads, dim = q.shape
    return (torch.empty_like(q),
            torch.empty((num_tokens, num_heads, splits, dim), device=q.device, dtype=partial_dtype(q, v_cache)),
            torch.empty((num_tokens, num_heads, splits), device=q.device, dtype=torch.float32))


def merge_outputs(out, o_buf, lse, meta, splits: int, v_scale: float) -> torch.Tensor:
    """`out`, the split partials merged into it when there are several."""
    return out if splits == 1 else merge_splits(o_buf, lse, out, meta.cu_qo_lens, v_scale)
