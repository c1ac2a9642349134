"""The transformers MiniMax-M3 sparse attention layer as an independent oracle for MSA tests.

Builds one sparse attention layer of the tiny reference configuration (block 4, top-3 blocks,
2 index heads) and exposes, for a random sequence, the exact tensors the HF layer feeds its
indexer and attention (rotated q/k/v and index q/k), its block selection, and its attention
output before ``o_proj``. Only transformers' own modules compute these values.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

hf = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
MiniMaxM3VLTextConfig = hf.MiniMaxM3VLTextConfig

BLOCK_SIZE = 4
TOPK = 3
NUM_Q_HEADS = 8
NUM_KV_HEADS = 2
HEAD_DIM = 16
INDEX_HEADS = 2
INDEX_DIM = 16


def tiny_config() -> MiniMaxM3VLTextConfig:
    config = MiniMaxM3VLTextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        dense_intermediate_size=64,
        shared_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=NUM_Q_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM,
        index_block_size=BLOCK_SIZE,
        index_topk_blocks=TOPK,
        index_local_blocks=1,
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3,
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "eager"
    return config


@dataclass
class OracleRun:
    """HF tensors of one sequence, token-major: q [S, Hq, D], k/v [S, Hkv, D], iq [S, Hi, Di], ik [S, Di]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    index_q: torch.Tensor
    index_k: torch.Tensor
    selection: torch.Tensor  # [Hi, S, min(topk, blocks)], HF order (local first), -1 padded
    attention: torch.Tensor  # [S, Hq, D] the layer's attention output before o_proj
    scale: float


class SparseLayerOracle:
    """One HF attention layer (sparse layer 1, or dense layer 0) with randomised weights."""

    def __init__(self, seed: int = 0, *, dense: bool = False) -> None:
        torch.manual_seed(seed)
        self.config = tiny_config()
        self.attn = hf.MiniMaxM3VLAttention(self.config, layer_idx=0 if dense else 1).eval()
        self.rotary = hf.MiniMaxM3VLRotaryEmbedding(self.config)
        with torch.no_grad():
            for module in (self.attn.q_norm, self.attn.k_norm):
                module.weight.normal_(0.0, 0.3)
            if not dense:
                self.attn.indexer.q_norm.weight.normal_(0.0, 0.3)
                self.attn.indexer.k_norm.weight.normal_(0.0, 0.3)
                # Sharper index scores keep the top-k decisions far from ties.
                self.attn.indexer.q_proj.weight.mul_(3.0)

    @torch.no_grad()
    def run(self, seq_len: int, seed: int) -> OracleRun:
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(1, seq_len, self.config.hidden_size, generator=gen)
        position_ids = torch.arange(seq_len)[None]
        cos, sin = self.rotary(hidden, position_ids)
        attn, indexer = self.attn, self.attn.indexer
        shape = (1, seq_len, -1, HEAD_DIM)
        q = attn.q_norm(attn.q_proj(hidden).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
        v = attn.v_proj(hidden).view(shape).transpose(1, 2)
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        if indexer is None:  # dense layer: no index branch
            iq = torch.zeros(1, INDEX_HEADS, seq_len, INDEX_DIM)
            ik = torch.zeros(1, 1, seq_len, INDEX_DIM)
            selection = torch.empty(1, 0, seq_len, 0, dtype=torch.long)
        else:
            iq = indexer.q_norm(indexer.q_proj(hidden).view(1, seq_len, -1, INDEX_DIM)).transpose(1, 2)
            ik = indexer.k_norm(indexer.k_proj(hidden).view(1, seq_len, 1, INDEX_DIM)).transpose(1, 2)
            iq, ik = hf.apply_rotary_pos_emb(iq, ik, cos[..., :INDEX_DIM], sin[..., :INDEX_DIM])
            selection = indexer(hidden, (cos, sin), None, position_ids)

        captured = {}
        hook = attn.o_proj.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
        try:
            causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
            attn(hidden, (cos, sin), causal, cache=None, position_ids=position_ids)
        finally:
            hook.remove()
        return OracleRun(
            q=q[0].transpose(0, 1).contiguous(),
            k=k[0].transpose(0, 1).contiguous(),
            v=v[0].transpose(0, 1).contiguous(),
            index_q=iq[0].transpose(0, 1).contiguous(),
            index_k=ik[0, 0].contiguous(),
            selection=selection[0],
            attention=captured["x"][0].view(seq_len, NUM_Q_HEADS, HEAD_DIM),
            scale=attn.scaling,
        )


def selection_sets(selection: torch.Tensor) -> list[list[frozenset[int]]]:
    """A selection ``[H, T, k]`` (any order, ``-1`` padded) as per-(head, token) sets of block ids."""
    return [[frozenset(b for b in row if b >= 0) for row in head.tolist()] for head in selection]
