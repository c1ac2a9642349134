"""Assemble a reference-host engine from checkpoint directories.

Loads the MiniMax-M3 target and (optionally) the Eagle3 head, sizes a paged cache with the draft
layer appended to the target's layers (shared pool, like the TensorRT-LLM unified manager), and
wires the aux capture the head reads. Both configs, the draft's tensor names and shapes, the
shared cache's geometry, and its size plus the step buffers' and the weights' (from the configs and
the safetensors headers) against free memory (on the CPU the host's or its memory cgroup's, the
smaller: a container's limit is the OOM killer's) are checked before any weight is read.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch

from m3_eagle_plugin.host.reference.engine import (
    Engine, EngineConfig, check_engine_settings, check_int, effective_draft_len, hook_drafts, runner_config,
)
from m3_eagle_plugin.host.reference.runner import step_metadata_bytes
from m3_eagle_plugin.host.reference.scheduler import kv_budget_tokens

__all__ = ["DTYPES", "blocks_for_prompts", "build_engine"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def blocks_for_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_len: int, block_size: int,
                       *, max_positions: int | None = None) -> int:
    """Enough KV blocks for every prompt's worst case at once (so no request ever waits). With the target's
    ``max_positions`` (max_position_embeddings) a request's new tokens stop there, as the engine stops them,
    and a prompt that fills them fails before it is admitted: it needs no blocks."""
    total = 0
    for prompt in prompts:
        new = max_new_tokens
        if max_positions is not None:
            if len(prompt) >= max_positions:
                continue
            new = min(new, max_positions - len(prompt))
        total += math.ceil(kv_budget_tokens(len(prompt), new, draft_len) / block_size)
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
    draft_embeddings: str = "target",
) -> Engine:
    from m3_eagle_plugin.eagle3.capture import AuxCapture
    from m3_eagle_plugin.eagle3.checkpoint import check_embeddings, inspect_draft, load_draft
    from m3_eagle_plugin.kv import DraftLayerPlacementError, PagedKVCache
    from m3_eagle_plugin.kv.manager import minimax_m3_cache_layout
    from m3_eagle_plugin.models.config import M3Config
    from m3_eagle_plugin.models.loader import load_target

    device = torch.device(device)
    # Everything a config and the tensor names can refuse is refused before any weight is read.
    num_blocks = check_int("num_blocks", num_blocks, 1)
    check_embeddings(draft_embeddings)
    tc = M3Config.from_file(model_dir)
    plan = inspect_draft(draft_dir, tc, embeddings=draft_embeddings) if draft_dir is not None else None
    draft_len = effective_draft_len(config, has_head=plan is not None,
                                    hook_drafts=hook_drafts(proposer, plugin_manager))
    check_engine_settings(config, vocab_size=tc.vocab_size, device=device, has_head=plan is not None,
                          draft_len=draft_len)
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
                       device, tc.block_size, weight_bytes=_weight_bytes(tc, plan, dtype))

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
        max_position_embeddings=tc.max_position_embeddings,
    )


def _weight_bytes(tc, plan, dtype: torch.dtype) -> int:
    """Bytes of the weights `load_target` and `load_draft` will hold, from the configs and the draft's
    tensor names alone: the target's parameters in ``dtype`` (the router bias in fp32; tied embeddings
    once), the head's tensors read from its checkpoint or gathered from the target's lm_head (what it
    shares with the target is counted once) and its d2t map as int64."""
    from m3_eagle_plugin.models.loader import _FP32_PARAMS
    from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM

    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(tc)
    params = dict(model.named_parameters(remove_duplicate=True))
    if tc.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    size = dtype.itemsize
    total = sum(p.numel() * (4 if name.endswith(_FP32_PARAMS) else size) for name, p in params.items())
    if plan is not None:
        for canon, shape in plan.expected.items():
            if canon in plan.read or (canon == "lm_head.weight" and plan.gathers_lm_head):
                total += math.prod(shape) * (8 if canon == "d2t" else size)
    return total


def _check_memory_fits(cache_bytes: int, step_bytes: int, num_blocks: int, config: EngineConfig,
                       device: torch.device, block_size: int | None = None, *, weight_bytes: int = 0) -> None:
    """Refuse a KV cache plus step buffers larger than the device's free memory up front, naming the
    options (a CPU allocation past it is not an error but the kernel's OOM killer). On the CPU the
    free memory is the smaller of the host's and what a memory cgroup (a container's limit) leaves.
    The weights (``weight_bytes``) are loaded first, so the cache gets what they leave."""
    free, where = _free_bytes(device), f"{device} has"
    if device.type == "cpu":
        limit = _cgroup_free_bytes()
        if limit is not None and (free is None or limit[0] < free):
            free, where = limit[0], f"{device} under {limit[1]} has"
    if free is None or weight_bytes + cache_bytes + step_bytes <= free:
        return
    if weight_bytes > free:
        raise ValueError(f"the checkpoints' weights need {weight_bytes / 2**30:.2f} GiB but {where} "
                         f"{free / 2**30:.2f} GiB free: no --kv-blocks fits (a smaller --dtype, or another device)")
    have = f"{where} {free / 2**30:.2f} GiB free"
    if weight_bytes:
        free -= weight_bytes
        have += f", {free / 2**30:.2f} GiB beside the weights ({weight_bytes / 2**30:.2f} GiB)"
    if block_size is not None and cache_bytes > free * num_blocks:  # not even one block fits
        raise ValueError(f"one KV block of {block_size} tokens needs {cache_bytes / num_blocks / 2**30:.2f} GiB "
                         f"({cache_bytes // num_blocks // block_size} bytes a token: the checkpoint's block size and "
                         f"attention geometry) but {have}: no --kv-blocks fits")
    if cache_bytes > free:
        raise ValueError(f"a KV cache of {num_blocks} blocks needs {cache_bytes / 2**30:.2f} GiB but {have}: "
                         f"lower --kv-blocks (or the prompts, --max-new-tokens)")
    raise ValueError(
        f"the step buffers for --max-batch-size {config.max_batch_size} and --max-tokens-per-step "
        f"{config.max_tokens_per_step} need {step_bytes / 2**30:.2f} GiB beside a KV cache of {num_blocks} blocks "
        f"({cache_bytes / 2**30:.2f} GiB) but {have}: lower --max-batch-size or --max-tokens-per-step (or "
        f"--kv-blocks)"
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


#: Where the memory cgroups are mounted (v2's unified hierarchy, v1's memory controller), each with
#: its limit, usage and reclaimable-cache files, and the file naming this process's cgroups.
CGROUP_MOUNTS = (
    (Path("/sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file"),
    (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)
PROC_CGROUP = Path("/proc/self/cgroup")


def _cgroup_free_bytes() -> tuple[int, str] | None:
    """The least memory a memory cgroup holding this process leaves it, and the limit file that says
    so: limit - usage + inactive file cache (reclaimable, as MemAvailable counts it), at each level
    from this process's cgroup up to the mount's root (inside a container the root is the container's
    own cgroup). A level with no limit ("max") or an unreadable limit or usage is skipped; None when
    no level limits."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    v2_path = v1_path = "/"
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "" and line.startswith("0:"):
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    best = None
    for (root, limit_name, usage_name, cache_key), own in zip(CGROUP_MOUNTS, (v2_path, v1_path)):
        parts = [part for part in own.split("/") if part]
        if ".." in parts:  # a cgroup outside this namespace's view: only the mount's root is ours
            parts = []
        for depth in range(len(parts), -1, -1):
            level = Path(root, *parts[:depth])
            free = _cgroup_level_free(level, limit_name, usage_name, cache_key)
            if free is not None and (best is None or free[0] < best[0]):
                best = free
    if best is None:
        return None
    free, limit_file, limit, usage, cache = best
    return free, (f"the cgroup memory limit {limit_file} ({limit / 2**30:.2f} GiB, {usage / 2**30:.2f} GiB in use, "
                  f"{cache / 2**30:.2f} GiB of it reclaimable cache)")


def _cgroup_level_free(level: Path, limit_name: str, usage_name: str, cache_key: str):
    """(free, limit file, limit, usage, reclaimable cache) of one cgroup level, None without a limit."""
    try:
        limit_text = (level / limit_name).read_text().strip()
        if limit_text == "max":
            return None
        limit, usage = int(limit_text), int((level / usage_name).read_text().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    cache = 0
    try:
        for line in (level / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = int(value)
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return max(min(limit - usage + cache, limit), 0), level / limit_name, limit, usage, cache
