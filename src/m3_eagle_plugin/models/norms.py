"""RMSNorm in the two flavours this package needs.

MiniMax-M3 uses the Gemma form everywhere (scale by `1 + w`, weights start at 0); the Eagle3
draft head is a Llama layer and uses the plain form (scale by `w`). Both normalise in fp32.
`reference` is the torch formula (and the CPU path); on a GPU with Triton, `forward` and
`add_then_norm` run it as one fused kernel with the same rounding (`models.fused_ops`).
"""
from __future__ import annotations

import torch
from torch import nn

from m3_eagle_plugin.models import fused_ops


class _RMSNorm(nn.Module):
    gemma: bool  # which formula; read by the fused kernels

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops.rms_norm(x, self.weight, self.eps, gemma=self.gemma)
        return self.reference(x) if fused is None else fused

    def add_then_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(residual + x, self(residual + x))`: a pre-norm block's residual step and the next norm."""
        fused = fused_ops.rms_norm(x, self.weight, self.eps, gemma=self.gemma, residual=residual)
        if fused is not None:
            return fused
        total = residual + x
        return total, self(total)


class GemmaRMSNorm(_RMSNorm):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32, returned in x's dtype."""

    gemma = True

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class LlamaRMSNorm(_RMSNorm):
    """y = w * (x * rsqrt(mean(x^2) + eps)); the normalised value is cast back before the scale."""

    gemma = False

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight * y
