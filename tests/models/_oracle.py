"""Helpers for the model tests: tiny transformers configs, the oracle loader and a paged driver.

The oracle is transformers' own MiniMax-M3 (`MiniMaxM3VLForCausalLM`) on tiny random configs
with block size 4 and top-3 blocks, so MSA sparsity is active after 12 tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


import torch


from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig  # noqa: E402
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM  # noqa: E402

from m3_eagle_plugin.kv import PagedKVCache  # noqa: E402
from m3_eagle_plugin.models.config import M3Config  # noqa: E402
from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata  # noqa: E402


def tiny_text_config(**overrides) -> MiniMaxM3VLTextConfig:
    kwargs = dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, dense_intermediate_size=48, shared_intermediate_size=24,
        num_local_experts=6, num_experts_per_tok=2, routed_scaling_factor=2.0,
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3, mlp_layer_types=["dense"] + ["sparse"] * 3,
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=None, eos_token_id=None,
    )
    kwargs.update(overrides)
    return MiniMaxM3VLTextConfig(**kwargs)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give norms and routing biases non-trivial values (they initialise to zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else 0.08))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def load_oracle(path: Path, cls=MiniMaxM3VLForCausalLM) -> torch.nn.Module:
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


class PagedRunner:
    """Runs steps of several requests through PagedKVCache + MsaDecodeMetadata."""

    def __init__(self, config: M3Config, *, num_blocks: int = 64, max_tokens: int = 64, max_requests: int = 4,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, draft_num_kv_heads: int | None = None) -> None:
        """`draft_num_kv_heads`: also host one shared Eagle3 draft layer with that many KV heads."""
        self.cache = PagedKVCache.for_minimax_m3(
            config.num_layers, config.sparse_layer_ids, config.num_kv_heads, config.head_dim,
            config.index_dim or config.head_dim, config.block_size, num_blocks, dtype=dtype, device=device,
            num_draft_layers=0 if draft_num_kv_heads is None else 1, draft_num_kv_heads=draft_num_kv_heads)
        self.meta = MsaDecodeMetadata(max_requests, max_tokens, num_blocks, config.block_size, device,
                                      max_draft_len=7, num_index_heads=max(config.index_heads, 1))
        self.lengths: dict[str, int] = {}

    def prepare(self, chunks: Sequence[tuple[str, int]]) -> None:
        """`chunks`: (request id, number of new tokens) per request, in step order."""
        rids, qo, kv = [], [], []
        for rid, n in chunks:
            if rid not in self.lengths:
                self.cache.add_request(rid)
                self.lengths[rid] = 0
            self.lengths[rid] += n
            self.cache.reserve(rid, self.lengths[rid])
            rids.append(rid)
            qo.append(n)
            kv.append(self.lengths[rid])
        self.meta.prepare(qo, kv, self.cache.block_table(rids))
