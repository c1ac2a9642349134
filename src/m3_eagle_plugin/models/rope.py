"""Rotary position embedding, NeoX (rotate-half) style, over the first `rotary_dim` channels.

MiniMax-M3 rotates half of each head (partial RoPE) for q, k, index-q and index-k alike; the
Eagle3 head rotates the full head. Positions are absolute token positions (`meta.positions`),
so one call serves any mix of prompt chunks, verify rows and single tokens.

Layers get a `RopeAt` (`rotary.at(positions)`) rather than cos/sin tables: on a GPU with Triton it
rotates q and k (after their per-head norm, if any) in one launch that computes the angles itself;
elsewhere it builds the fp32 tables once per forward and runs `apply_rope`, the reference.
"""
from __future__ import annotations

import torch
from torch import nn

from m3_eagle_plugin.models import fused_ops
from m3_eagle_plugin.models.norms import GemmaRMSNorm


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

    def at(self, positions: torch.Tensor) -> "RopeAt":
        return RopeAt(self, positions)


class RopeAt:
    """The rotation at one step's positions `[T]`, shared by every layer of a forward."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rotary = rotary
        self.positions = positions
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path's fp32 tables, built on first use."""
        if self._tables is None:
            self._tables = self.rotary.cos_sin(self.positions)
        return self._tables

    def qk(self, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
           k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`apply_rope(q_norm(q))`, `apply_rope(k_norm(k))` for q `[T, Hq, D]`, k `[T, Hk, D]` (norms optional)."""
        gemma_norms = isinstance(q_norm, GemmaRMSNorm) and isinstance(k_norm, GemmaRMSNorm)
        if gemma_norms or (q_norm is None and k_norm is None):  # the Gemma norm is the one fused in
            norm = (q_norm.weight, q_norm.eps, k_norm.weight, k_norm.eps) if gemma_norms else None
            fused = fused_ops.norm_rope_qk(q, k, self.positions, self.rotary.inv_freq, norm)
            if fused is not None:
                return fused
        cos, sin = self.cos_sin()
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


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
