"""One-launch Triton versions of the per-token glue between the GEMMs: RMSNorm (optionally fused with
the residual add before it), q/k RoPE (optionally after a per-head Gemma norm), and the draft head's
placement of its logits into the target vocabulary.

Why: at batch 1 a decode step is overhead-bound, not bandwidth-bound. Written as torch ops, an fp32
RMSNorm is ~8-10 kernels (cast, pow, mean, add, rsqrt, mul, cast, weight mul, ...), a partial RoPE ~8
(cast, neg, cat, mul, mul, add, cast, cat) plus the cos/sin tables, and each of those kernels moves a
few KB; the Eagle3 draft step in particular is almost nothing but this glue. Here each is one launch.

Every function returns None when it does not apply (no usable Triton on the tensors' device, the
`M3_EAGLE_KERNELS=torch` override, autograd needing a backward, or a shape/dtype/layout the kernel
does not take); the caller then runs its torch code, which stays the reference and the CPU path.
Importing this module never imports `triton`: `fused_kernels` is loaded on the first fused call,
after `use_triton()` said yes (as in `m3_eagle_plugin.msa.kernels`).
"""
from __future__ import annotations

import torch

from m3_eagle_plugin.msa.kernels import use_triton
from m3_eagle_plugin.msa.kernels.backend import run_on_device_of

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

#: Widest row one norm program holds in registers; wider rows take the torch path.
MAX_NORM_WIDTH = 16384


def _kernels():
    from m3_eagle_plugin.models import fused_kernels

    return fused_kernels


def active(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the fused kernels serve `x` (and the tensors it is combined with) here."""
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)):
        return False  # the kernels have no backward
    return use_triton(x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm over the last dim in one launch, rounded as `models.norms` rounds it.

    Gemma: `(x * rsqrt(mean(x^2) + eps) * (1 + w))` in fp32, cast to x's dtype. Llama: the normalised
    value is cast to x's dtype, then multiplied by `w` (result in the promoted dtype). With `residual`
    the input is `residual + x` (rounded to x's dtype) and the result is `(residual + x, normed)`.
    """
    n = x.shape[-1] if x.dim() else 0
    if (x.dtype not in _FLOATS or weight.dtype not in _FLOATS or weight.dim() != 1 or weight.shape[0] != n
            or x.numel() == 0 or n > MAX_NORM_WIDTH or x.stride(-1) != 1 or weight.stride(0) != 1
            or weight.device != x.device):
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(-1) != 1):
        return None
    rows_x, rows_r = _rows(x), (_rows(residual) if residual is not None else None)
    if rows_x is None or (residual is not None and rows_r is None):
        return None
    if not (active(x, weight) if residual is None else active(x, weight, residual)):
        return None
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    y, total = run_on_device_of(x, _kernels().rms_norm_rows, rows_x, weight, float(eps), gemma=gemma,
                                out_dtype=out_dtype, residual=rows_r)
    if total is None:
        return y.view(x.shape)
    return total.view(x.shape), y.view(x.shape)


def norm_rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 norm: tuple[torch.Tensor, float, torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """NeoX RoPE of q `[T, Hq, D]` and k `[T, Hk, D]` over their first `2 * len(inv_freq)` channels,
    in one launch, new tensors out. Angles are `fp32(positions[t]) * inv_freq` (computed in-kernel,
    no cos/sin tables); `positions` is `[T]`, one per token (other lengths take the torch path,
    which refuses them). `norm = (q_weight, q_eps, k_weight, k_eps)` first applies a Gemma RMSNorm per
    head (cast back to the activation dtype, as `GemmaRMSNorm` then `apply_rope` do)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        return None
    t, _, d = q.shape
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else -1
    if (q.dtype not in _FLOATS or k.dtype != q.dtype or q.stride(-1) != 1 or k.stride(-1) != 1 or t == 0
            or half < 1 or 2 * half > d or inv_freq.dtype not in _FLOATS or positions.dim() != 1
            or positions.shape[0] != t or positions.dtype.is_floating_point or positions.device != q.device
            or k.device != q.device):
        return None
    tensors = [q, k]
    if norm is not None:
        qw, _, kw, _ = norm
        if (qw.dtype not in _FLOATS or kw.dtype != qw.dtype or qw.shape != (d,) or kw.shape != (d,)
                or qw.stride(0) != 1 or kw.stride(0) != 1 or qw.device != q.device or kw.device != q.device):
            return None
        tensors += [qw, kw]
    if not active(*tensors):
        return None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    norm_args = None if norm is None else (norm[0], float(norm[1]), norm[2], float(norm[3]))
    run_on_device_of(q, _kernels().norm_rope_qk, q, k, positions, inv_freq.to(q.device).contiguous(), q_out,
                     k_out, norm_args)
    return q_out, k_out


def gather_logits(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
    """fp32 `out [R, len(index)]` with `out[:, c] = logits[:, index[c]]`, `-inf` where `index[c] < 0`,
    in one launch (the draft head's logits placed in the target vocabulary via the inverse of d2t)."""
    if (logits.dim() != 2 or logits.dtype not in _FLOATS or logits.stride(-1) != 1 or logits.shape[0] == 0
            or index.dim() != 1 or index.dtype not in (torch.int32, torch.int64) or index.stride(0) != 1
            or index.device != logits.device):
        return None
    if not active(logits):
        return None
    return run_on_device_of(logits, _kernels().gather_logits, logits, index)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x` as `[R, N]` rows with one row stride (a view), or None."""
    if x.dim() == 2:
        return x
    if x.dim() == 1:
        return x.view(1, -1)
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None
