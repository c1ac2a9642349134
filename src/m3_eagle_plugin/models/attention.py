"""MiniMax-M3 self-attention on the paged cache: dense causal layers and MSA sparse layers.

Both kinds project q/k/v, apply the per-head Gemma q/k norm, then partial NeoX RoPE, and write
the step's K/V into the layer's pages. A sparse layer also runs the index branch
(index_q -> `[Hi, Di]`, index_k -> `[Di]`, Gemma norm, RoPE), writes the index-K of every step
token before scoring, selects blocks per token and attends only inside them. Writing all the
step's tokens first is what makes a 1+K verify chunk equal K+1 single-token steps.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from m3_eagle_plugin.msa import kernels
from m3_eagle_plugin.models.config import M3Config
from m3_eagle_plugin.models.norms import GemmaRMSNorm
from m3_eagle_plugin.models.rope import RopeAt


class MsaIndexer(nn.Module):
    """The selection-only index branch of a sparse layer (no index value / output)."""

    def __init__(self, config: M3Config) -> None:
        super().__init__()
        self.num_heads = config.index_heads
        self.head_dim = config.index_dim
        self.q_proj = nn.Linear(config.hidden_size, config.index_heads * config.index_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.index_dim, bias=False)
        self.q_norm = GemmaRMSNorm(config.index_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.index_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (index_q `[T, Hi, Di]`, index_k `[T, Di]`), normed and rotated."""
        iq = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        ik = self.k_proj(x).view(x.shape[0], 1, self.head_dim)
        iq, ik = rope.qk(iq, ik, self.q_norm, self.k_norm)
        return iq, ik.view(x.shape[0], self.head_dim)


class M3Attention(nn.Module):
    def __init__(self, config: M3Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.topk_blocks = config.topk_blocks
        self.local_blocks = config.local_blocks
        self.init_blocks = config.init_blocks
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.indexer = MsaIndexer(config) if config.sparse_layers[layer_id] else None

    def forward(self, x: torch.Tensor, rope: RopeAt, meta: Any, cache: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k = rope.qk(self.q_proj(x).view(t, self.num_heads, self.head_dim),
                       self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), self.q_norm, self.k_norm)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = cache.k(self.layer_id), cache.v(self.layer_id)
        if self.indexer is None:
            kernels.write_step_kv(k_cache, v_cache, meta.cache_slots, k.to(k_cache.dtype), v.to(v_cache.dtype))
            out = kernels.dense_attention(q, k_cache, v_cache, meta, scale=self.scale)
        else:
            index_q, index_k = self.indexer(x, rope)
            index_k_cache = cache.index_k(self.layer_id)
            kernels.write_step_kv(k_cache, v_cache, meta.cache_slots, k.to(k_cache.dtype), v.to(v_cache.dtype),
                                  index_k_cache, index_k.to(index_k_cache.dtype))
            out = kernels.sparse_layer_attention(q, k_cache, v_cache, index_q, index_k_cache, meta,
                                                 topk=self.topk_blocks, scale=self.scale,
                                                 local_blocks=self.local_blocks, init_blocks=self.init_blocks)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim).to(x.dtype))
