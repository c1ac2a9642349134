"""Assemble a reference-host engine from checkpoint directories.

Loads the MiniMax-M3 target and (optionally) the Eagle3 head, sizes a paged cache with the draft
layer appended to the target's layers (shared pool, like the TensorRT-LLM unified manager), and
wires the aux capture the head reads.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch

from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.scheduler import kv_budget_tokens

__all__ = ["DTYPES", "blocks_for_prompts", "build_engine"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def blocks_for_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_len: int, block_size: int) -> int:
    """Enough KV blocks for every prompt's worst case at once (so no request ever waits)."""
    total = sum(math.ceil(kv_budget_tokens(len(p), max_new_tokens, draft_len) / block_size) for p in prompts)
    return max(total, 1)


def build_engine(
    model_dir: str | Path,
    draft_dir: str | Path | None,
    config: EngineConfig,
    *,
    num_blocks: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    plugin_manager=None,
    proposer=None,
) -> Engine:
    from m3_eagle_plugin.eagle3.capture import AuxCapture
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.models.loader import load_target

    device = torch.device(device)
    target = load_target(model_dir, dtype=dtype, device=device)
    if config.cuda_graphs:
        target.set_graph_safe_moe(True)
    head = capture = None
    if draft_dir is not None:
        head = load_draft(draft_dir, target, dtype=dtype, device=device)
        capture = AuxCapture(head.aux_layer_ids)
    tc = target.config
    if head is not None and head.config.head_dim != tc.head_dim:
        raise ValueError(
            f"the draft head's head_dim {head.config.head_dim} differs from the target's {tc.head_dim}: "
            "the shared cache needs equal page geometry"
        )
    cache = PagedKVCache.for_minimax_m3(
        tc.num_layers, list(tc.sparse_layer_ids), tc.num_kv_heads, tc.head_dim, tc.index_dim or tc.head_dim,
        tc.block_size, num_blocks, num_draft_layers=1 if head is not None else 0,
        draft_num_kv_heads=head.config.num_kv_heads if head is not None else None, dtype=dtype, device=device,
    )
    return Engine(
        target, cache, config, vocab_size=tc.vocab_size, head=head, capture=capture, proposer=proposer,
        plugin_manager=plugin_manager, device=device, num_index_heads=max(tc.index_heads, 1),
    )
