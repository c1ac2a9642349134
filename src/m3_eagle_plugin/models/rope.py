"""Rotary position embedding, NeoX (rotate-half) style, over the first `rotary_dim` channels.

MiniMax-M3 rotates half of each head (partial RoPE) for q, k, index-q and index-k alike; the
Eagle3 head rotates the full head. Positions are absolute token positions (`meta.positions`),
so one call serves any mix of prompt chunks, verify rows and single tokens.
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta = float(theta)
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (self.theta ** exponent), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin tables `[T, rotary_dim]` for the given positions `[T]`."""
        inv_freq = self.inv_freq.to(positions.device)
        # fp32 keeps this CPU-exact with transformers (positions * inv_freq in fp32, then cat).
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of `x` (`[T, ..., D]`); the rest pass through.

    `cos`/`sin` are `[T, rotary_dim]`; they broadcast over any head dimensions in between.
    """
    rd = cos.shape[-1]
    if rd > x.shape[-1]:
        raise ValueError(f"rotary dim {rd} exceeds the last dimension of x ({x.shape[-1]})")
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    cos = cos.reshape(shape)
    sin = sin.reshape(shape)
    rot = x[..., :rd].float()
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    if rd == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)
