"""Assemble a reference-host engine from checkpoint directories.

Loads the MiniMax-M3 target and (optionally) the Eagle3 head, sizes a paged cache with the draft
layer appended to the target's layers (shared pool, like the TensorRT-LLM unified manager), and
wires the aux capture the head reads. Both configs, the draft's tensor names and shapes, the
shared cache's geometry, and its size plus the step buffers' against free memory are checked
before any weight is read.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch

from m3_eagle_plugin.host.reference.engine import (
    Engine, EngineConfig, check_engine_settings, check_int, effective_draft_len, has_drafter_hook, runner_config,
)
from m3_eagle_plugin.host.reference.runner import step_metadata_bytes
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
    from m3_eagle_plugin.eagle3.checkpoint import inspect_draft, load_draft
    from m3_eagle_plugin.kv import DraftLayerPlacementError, PagedKVCache
    from m3_eagle_plugin.kv.manager import minimax_m3_cache_layout
    from m3_eagle_plugin.models.config import M3Config
    from m3_eagle_plugin.models.loader import load_target

    device = torch.device(device)
    # Everything a config and the tensor names can refuse is refused before any weight is read.
    num_blocks = check_int("num_blocks", num_blocks, 1)
    tc = M3Config.from_file(model_dir)
    plan = inspect_draft(draft_dir, tc) if draft_dir is not None else None
    hook_drafts = proposer is not None or has_drafter_hook(plugin_manager)
    check_engine_settings(config, vocab_size=tc.vocab_size, device=device, has_head=plan is not None,
                          draft_len=effective_draft_len(config, has_head=plan is not None, hook_drafts=hook_drafts))
    if plan is not None and plan.config.head_dim != tc.head_dim:
        raise ValueError(
            f"{Path(draft_dir) / 'config.json'}: head_dim: the draft head's {plan.config.head_dim} differs from "
            f"the target's {tc.head_dim}: the shared cache needs equal page geometry"
        )
    layout = (tc.num_layers, list(tc.sparse_layer_ids), tc.num_kv_heads, tc.head_dim, tc.index_dim or tc.head_dim,
              tc.block_size)
    shared = dict(num_draft_layers=1 if plan is not None else 0,
                  draft_num_kv_heads=plan.config.num_kv_heads if plan is not None else None, dtype=dtype)
    try:
        geometry, _ = minimax_m3_cache_layout(*layout, **shared)
    except DraftLayerPlacementError as error:
        if plan is None or plan.config.num_kv_heads == tc.num_kv_heads:
            raise
        raise DraftLayerPlacementError(
            f"{Path(draft_dir) / 'config.json'}: num_key_value_heads: the draft head's {plan.config.num_kv_heads} "
            f"differs from the target's {tc.num_kv_heads}; the draft layer lives in the target's K/V pages, so "
            f"use a head exported with the target's KV heads (for MiniMax-M3: the GQA export, not the MHA one) "
            f"({error})") from None
    # The step metadata too: sized by --max-batch-size / --max-tokens-per-step, not by the cache
    # (at the configured draft length: the engine drops it to 0 only where nothing drafts).
    run = runner_config(config, draft_len=config.draft_len, block_size=tc.block_size, total_blocks=num_blocks,
                        device=device, num_index_heads=max(tc.index_heads, 1))
    step_bytes = step_metadata_bytes(run, has_head=plan is not None)
    _check_memory_fits(num_blocks * sum(pool.slot_bytes for pool in geometry.pools), step_bytes, num_blocks, config,
                       device)

    target = load_target(model_dir, dtype=dtype, device=device)
    if config.cuda_graphs:
        target.set_graph_safe_moe(True)
    head = capture = None
    if plan is not None:
        head = load_draft(plan, target, dtype=dtype, device=device)
        capture = AuxCapture(head.aux_layer_ids)
    cache = PagedKVCache.for_minimax_m3(*layout, num_blocks, **shared, device=device)
    return Engine(
        target, cache, config, vocab_size=tc.vocab_size, head=head, capture=capture, proposer=proposer,
        plugin_manager=plugin_manager, device=device, num_index_heads=max(tc.index_heads, 1),
    )


def _check_memory_fits(cache_bytes: int, step_bytes: int, num_blocks: int, config: EngineConfig,
                       device: torch.device) -> None:
    """Refuse a KV cache plus step buffers larger than the device's free memory up front, naming the
    options (a CPU allocation past it is not an error but the kernel's OOM killer)."""
    free = _free_bytes(device)
    if free is None or cache_bytes + step_bytes <= free:
        return
    if cache_bytes > free:
        raise ValueError(f"a KV cache of {num_blocks} blocks needs {cache_bytes / 2**30:.2f} GiB but {device} has "
                         f"{free / 2**30:.2f} GiB free: lower --kv-blocks (or the prompts, --max-new-tokens)")
    raise ValueError(
        f"the step buffers for --max-batch-size {config.max_batch_size} and --max-tokens-per-step "
        f"{config.max_tokens_per_step} need {step_bytes / 2**30:.2f} GiB beside a KV cache of {num_blocks} blocks "
        f"({cache_bytes / 2**30:.2f} GiB) but {device} has {free / 2**30:.2f} GiB free: lower --max-batch-size or "
        f"--max-tokens-per-step (or --kv-blocks)"
    )


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
