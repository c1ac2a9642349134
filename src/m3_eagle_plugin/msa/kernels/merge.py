"""Split-K merge: combine per-split partial attention outputs by their log-sum-exp.

Why: the sparse and dense verify kernels split a request's pages over several programs so small
batches still fill the GPU; this kernel folds the splits back into `[T, Hq, D]` in `q.dtype`.
Tokens past `cu_qo_lens[-1]` (graph padding) get zeros. The per-token sparse attention merges
up to four splits itself instead (its last split to finish; `split_arrivals` holds the counters).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import step_buffer
from .launch import launch
from .pdl import pdl_args, wait_for_prior_grid


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, s_o_t, s_o_h, cu_ptr, num_requests, num_heads, v_scale,
    SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    live = t < tl.load(cu_ptr + num_requests)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    row = t.to(tl.int64) * num_heads + h  # T x Hq x S x D can pass 2**31
    lse = tl.load(lse_ptr + row * SPLITS + s, mask=live & (s < SPLITS), other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    denom = tl.sum(w, axis=0)
    part = tl.load(part_ptr + (row * SPLITS + s)[:, None] * D + d[None, :],
                   mask=live & (s < SPLITS)[:, None], other=0.0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.where(denom > 0, denom, 1.0) * v_scale
    tl.store(out_ptr + t * s_o_t + h * s_o_h + d, o.to(out_ptr.dtype.element_ty))


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, cu_qo_lens: torch.Tensor,
                 v_scale: float = 1.0, num_warps: int | None = None) -> torch.Tensor:
    """`partial` `[T, Hq, S, D]` in fp32, fp16 or bf16 (normalised per split; `attention_io.partial_dtype`),
    `lse` fp32 `[T, Hq, S]` in log2 units."""
    num_tokens, num_heads, splits, dim = partial.shape
    if num_tokens and num_heads:
        grid = (num_tokens, num_heads)
        launch(_merge_splits_kernel, grid,
            partial, lse, out, out.stride(0), out.stride(1), cu_qo_lens, cu_qo_lens.shape[0] - 1,
            num_heads, v_scale, SPLITS=splits, SP=_split_lanes(splits), D=dim,
            num_warps=merge_warps(splits, dim) if num_warps is None else num_warps, **pdl_args(out.device, grid),
        )
    return out


def _split_lanes(splits: int) -> int:
    """The merge tile's split lanes: `splits` padded to a power of two, at least 2."""
    return max(2, triton.next_power_of_2(splits))


def merge_warps(splits: int, dim: int) -> int:
    """Warps of a merge program: one per 4096 elements of its `[split lanes, D]` tile, 1 to 4. A program
    per (token, head) is small; more warps only slow the launch of many programs (H200, 2026-11-30,
    `scripts/ab/merge16.py`, the merge alone, 4 warps -> this rule: T32 x H64 x 8 splits 7.56 ->
    2.85 us, T256 x H16 x 10 14.48 -> 7.06, T4 x H16 x 64 2.86 -> 2.01; 256 splits keep 4 warps,
    4.60 us, where 1 warp spills to 55.3)."""
    return int(min(4, max(1, _split_lanes(splits) * dim // 4096)))


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def split_arrivals(device: torch.device, num_slots: int) -> torch.Tensor | None:
    """int32 counters, one per (token, KV head), for an attention whose last split to finish
    merges the rest: zero between launches (that program resets its slot), so a launch needs no
    memset and replays in a CUDA graph. None while a graph is being captured and there are too
    few (a captured graph must not own them: the caller then launches `merge_splits`). Launches
    sharing them must not run concurrently on two streams of a device."""
    return step_buffer(_ARRIVALS, device, num_slots, fill=0, min_numel=1 << 16)
