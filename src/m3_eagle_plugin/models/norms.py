"""RMSNorm in the two flavours this package needs.

MiniMax-M3 uses the Gemma form everywhere (scale by `1 + w`, weights start at 0); the Eagle3
draft head is a Llama layer and uses the plain form (scale by `w`). Both normalise in fp32.
"""
from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class LlamaRMSNorm(nn.Module):
    """y = w * (x * rsqrt(mean(x^2) + eps)); the normalised value is cast back before the scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight * y
