"""Triton kernels behind `m3_eagle_plugin.models.fused_ops` (imports `triton`; load it through that module).

Each kernel repeats the rounding of the torch code it replaces, step for step: the same fp32
intermediates, the same casts to the activation dtype in the same places, products and sums
rounded separately (launched with `enable_fp_fusion=False`, so no multiply-add is contracted into
an FMA the torch ops do not do). What can still differ is the order of the fp32 sum of squares in
a norm (a tree here, torch's own order there), i.e. the last bit of the fp32 norm factor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_eagle_plugin.msa.kernels.launch import launch

#: Launch option shared by every kernel here: no FMA contraction (see the module docstring).
_EXACT = {"enable_fp_fusion": False}


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


@triton.jit
def _rms_norm_kernel(
    x_ptr, s_x, r_ptr, s_r, w_ptr, y_ptr, s_y, sum_ptr, s_sum,
    n_cols, inv_n, eps,
    GEMMA: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # `residual + x` in the activation dtype (fp32 add, one rounding), kept for the caller.
        r = tl.load(r_ptr + row * s_r + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * s_sum + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:  # (x * rstd) * (1 + w) in fp32, one cast at the end
        y = (xf * rstd) * (1.0 + w)
    else:  # w * (x * rstd cast to x's dtype), in the promoted output dtype
        y = w * (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * s_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool, out_dtype: torch.dtype,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x [R, N]` (unit column stride) -> (normed `[R, N]` in `out_dtype`, `residual + x` or None)."""
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    total = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    block = _pow2(n)
    launch(_rms_norm_kernel, (rows,),
        x, x.stride(0), residual if residual is not None else x, (residual if residual is not None else x).stride(0),
        weight, y, y.stride(0), total if total is not None else y, (total if total is not None else y).stride(0),
        n, 1.0 / n, eps,
        GEMMA=gemma, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block), **_EXACT,
    )
    return y, total


@triton.jit
def _norm_rope_qk_kernel(
    q_ptr, s_q_t, s_q_h, k_ptr, s_k_t, s_k_h,
    qo_ptr, s_qo_t, s_qo_h, ko_ptr, s_ko_t, s_ko_h,
    qw_ptr, kw_ptr, q_eps, k_eps,
    pos_ptr, s_pos, freq_ptr,
    num_q_heads, half, head_dim, inv_d,
    HAS_NORM: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """One program per (token, head) row of q or of k: optional Gemma norm over the head, then
    rotate-half RoPE over its first `2 * half` channels; the rest pass through."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < num_q_heads:
        src = q_ptr + t * s_q_t + h * s_q_h
        dst = qo_ptr + t * s_qo_t + h * s_qo_h
        w_ptr = qw_ptr
        eps = q_eps
    else:
        src = k_ptr + t * s_k_t + (h - num_q_heads) * s_k_h
        dst = ko_ptr + t * s_ko_t + (h - num_q_heads) * s_ko_h
        w_ptr = kw_ptr
        eps = k_eps
    i = tl.arange(0, BLOCK_HALF)
    in_half = i < half
    x1 = tl.load(src + i, mask=in_half, other=0.0)
    x2 = tl.load(src + half + i, mask=in_half, other=0.0)
    if HAS_PASS:
        j = tl.arange(0, BLOCK_PASS)
        in_pass = j < head_dim - 2 * half
        x3 = tl.load(src + 2 * half + j, mask=in_pass, other=0.0)
    if HAS_NORM:  # GemmaRMSNorm over the whole head, cast back to the activation dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        sq = tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)
        if HAS_PASS:
            f3 = x3.to(tl.float32)
            sq += tl.sum(f3 * f3, axis=0)
        rstd = tl.rsqrt(sq * inv_d + eps)
        w1 = tl.load(w_ptr + i, mask=in_half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + i, mask=in_half, other=0.0).to(tl.float32)
        x1 = ((f1 * rstd) * (1.0 + w1)).to(x1.dtype)
        x2 = ((f2 * rstd) * (1.0 + w2)).to(x2.dtype)
        if HAS_PASS:
            w3 = tl.load(w_ptr + 2 * half + j, mask=in_pass, other=0.0).to(tl.float32)
            x3 = ((f3 * rstd) * (1.0 + w3)).to(x3.dtype)
    # angles = fp32(position) * inv_freq in fp32, as RotaryEmbedding.cos_sin builds them
    pos = tl.load(pos_ptr + t * s_pos).to(tl.float32)
    angle = pos * tl.load(freq_ptr + i, mask=in_half, other=0.0).to(tl.float32)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # apply_rope: rot * cos + cat(-rot[half:], rot[:half]) * sin, each product rounded on its own
    tl.store(dst + i, (a * cos + (-b) * sin).to(dst.dtype.element_ty), mask=in_half)
    tl.store(dst + half + i, (b * cos + a * sin).to(dst.dtype.element_ty), mask=in_half)
    if HAS_PASS:
        tl.store(dst + 2 * half + j, x3, mask=in_pass)


def norm_rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_out: torch.Tensor, k_out: torch.Tensor,
                 norm: tuple[torch.Tensor, float, torch.Tensor, float] | None) -> None:
    """q `[T, Hq, D]`, k `[T, Hk, D]` -> q_out, k_out (same shapes; may alias q, k)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    half = inv_freq.shape[0]
    rest = d - 2 * half
    qw, q_eps, kw, k_eps = norm if norm is not None else (q, 0.0, q, 0.0)
    launch(_norm_rope_qk_kernel, (t, hq + hk),
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1),
        q_out, q_out.stride(0), q_out.stride(1), k_out, k_out.stride(0), k_out.stride(1),
        qw, kw, q_eps, k_eps,
        positions, positions.stride(0), inv_freq,
        hq, half, d, 1.0 / d,
        HAS_NORM=norm is not None, HAS_PASS=rest > 0, BLOCK_HALF=_pow2(half), BLOCK_PASS=_pow2(max(rest, 1)),
        num_warps=1, **_EXACT,
    )


@triton.jit
def _gather_logits_kernel(src_ptr, s_src, index_ptr, out_ptr, s_out, n_out, BLOCK: tl.constexpr):
    """out[r, c] = float(src[r, index[c]]) where index[c] >= 0, else -inf."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_out
    idx = tl.load(index_ptr + cols, mask=ok, other=-1)
    v = tl.load(src_ptr + row * s_src + idx, mask=ok & (idx >= 0), other=float("-inf"))
    tl.store(out_ptr + row * s_out + cols, v.to(tl.float32), mask=ok)


GATHER_BLOCK = 2048


def gather_logits(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`src [R, Vd]` -> fp32 `[R, len(index)]` (see the kernel)."""
    rows, n_out = src.shape[0], index.shape[0]
    out = torch.empty((rows, n_out), dtype=torch.float32, device=src.device)
    launch(_gather_logits_kernel, (rows, triton.cdiv(n_out, GATHER_BLOCK)),
        src, src.stride(0), index, out, out.stride(0), n_out, BLOCK=GATHER_BLOCK, num_warps=4, **_EXACT)
    return out
