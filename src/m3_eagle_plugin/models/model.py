"""`MiniMaxM3ForCausalLM`: the MiniMax-M3 text backbone running on the paged KV cache.

One forward serves a whole mixed step (prompt chunks, 1+K verify rows, single tokens): the
tokens are concatenated `[T]`, positions and cache slots come from the step metadata
(`MsaDecodeMetadata`), target layer i uses cache layer i. Layers are plain pre-norm residual
blocks: h = x + o_proj(attn(input_layernorm(x))); y = h + ffn(post_attention_layernorm(h)).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from m3_eagle_plugin.eagle3.capture import AuxCapture
from m3_eagle_plugin.models.attention import M3Attention
from m3_eagle_plugin.models.config import M3Config
from m3_eagle_plugin.models.mlp import M3SparseMoE, SwigluOaiMLP
from m3_eagle_plugin.models.norms import GemmaRMSNorm
from m3_eagle_plugin.models.rope import RopeAt, RotaryEmbedding
from m3_eagle_plugin.msa.blocks import check_page_size


class M3DecoderLayer(nn.Module):
    def __init__(self, config: M3Config, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = M3Attention(config, layer_id)
        if config.moe_layers[layer_id]:
            self.mlp: nn.Module = M3SparseMoE(
                config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                config.shared_intermediate_size, config.routed_scaling_factor, config.swiglu_alpha, config.swiglu_limit)
        else:
            self.mlp = SwigluOaiMLP(config.hidden_size, config.dense_intermediate_size, config.swiglu_alpha,
                                    config.swiglu_limit)

    def forward(self, x: torch.Tensor, rope: RopeAt, meta: Any, cache: Any) -> torch.Tensor:
        h, normed = self.post_attention_layernorm.add_then_norm(
            x, self.self_attn(self.input_layernorm(x), rope, meta, cache))
        return h + self.mlp(normed)


class MiniMaxM3ForCausalLM(nn.Module):
    def __init__(self, config: M3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(M3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def set_graph_safe_moe(self, enabled: bool = True) -> None:
        """Route every token through every expert (no host sync, CUDA-graph capturable)."""
        for layer in self.layers:
            if isinstance(layer.mlp, M3SparseMoE):
                layer.mlp.graph_safe = enabled

    def forward(self, input_ids: torch.Tensor, meta: Any, cache: Any, *,
                capture: AuxCapture | None = None) -> torch.Tensor:
        """Final-normed hidden states `[T, H]` for the step's tokens `input_ids [T]`."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
        positions = meta.positions
        if positions.shape[0] != input_ids.shape[0]:  # more ids failed in the RoPE reshape, fewer in the KV write
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens, the step metadata {positions.shape[0]}: "
                             "prepare the metadata for this step's tokens")
        check_page_size(cache.k(0), meta)
        if any(self.config.sparse_layers) and meta.block_size != self.config.block_size:
            # the selection's block is the page: another page size selects other blocks, silently
            raise ValueError(f"the step metadata's block size {meta.block_size} (the cache's page size) differs from "
                             f"the checkpoint's MSA block size {self.config.block_size}: build the cache and the "
                             "metadata with the checkpoint's block size")
        if capture is not None:
            bad = [i for i in capture.layer_ids if i >= self.config.num_layers]
            if bad:
                raise ValueError(f"aux layer ids {bad} out of range for {self.config.num_layers} layers")
            capture.reset()
        rope = self.rotary.at(positions)
        x = self.embed_tokens(input_ids)
        if capture is not None:
            capture.check_step(x)  # a step its buffer cannot take fails before layer 0 writes KV
        for i, layer in enumerate(self.layers):
            if capture is not None and capture.wants(i):
                capture.record(i, x)
            x = layer(x, rope, meta, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[T, V]`."""
        return self.lm_head(hidden).float()
