"""Patch `unified-draft-kv-policy`: MiniMax-M3 keeps its Eagle3 draft layer in the target manager.

Why: a separate draft KV manager cannot be addressed by the dense drafter through the M3
mega-slot, and upstream settled on "M3 is always unified" (NVIDIA/TensorRT-LLM#17835, #18872).
The host decides with `should_use_separate_draft_kv_cache(spec_config)`, imported by name into
`speculative/__init__`, `models/modeling_speculative.py` and `pyexecutor/_util.py`, and with
`KvCacheCreator._should_create_separate_draft_kv_cache()`.
How: the M3 paths (the plugin's model class, and `KvCacheCreator` when its sparse config is
MiniMax-M3) mark the speculative config object; the wrapped predicate answers False for a marked
config and defers to the host for every other one. Activation runs in every process (driver,
MPI/Ray workers, disaggregated servers), so the policy holds in workers too; the private
`_allow_separate_draft_kv_cache` attribute is never relied on to survive pickling.
Upstream: NVIDIA/TensorRT-LLM#18872 (`py_executor_creator.py` sets the private attribute for M3).
Remove when: the supported host range starts at tensorrt_llm 1.4.0rc1.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from m3_eagle_plugin.host.trtllm.contract import UNIFIED_KV, symbol
from m3_eagle_plugin.host.trtllm.patching import Patch
from m3_eagle_plugin.host.trtllm.scope import is_minimax_m3, mark_unified_draft_kv, wants_unified_draft_kv


def _unified_predicate(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def should_use_separate_draft_kv_cache(spec_config: Any, *args: Any, **kwargs: Any) -> bool:
        if wants_unified_draft_kv(spec_config):
            return False
        return original(spec_config, *args, **kwargs)

    return should_use_separate_draft_kv_cache


def _mark_from_kv_creator(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def _should_create_separate_draft_kv_cache(self: Any, *args: Any, **kwargs: Any) -> bool:
        if is_minimax_m3(getattr(self, "_sparse_attention_config", None)):
            mark_unified_draft_kv(getattr(self, "_speculative_config", None))
        return original(self, *args, **kwargs)

    return _should_create_separate_draft_kv_cache


PATCHES = [
    Patch(
        UNIFIED_KV,
        symbol("separate_draft_kv_predicate"),
        _unified_predicate,
        rebinds=(
            symbol("speculative_pkg_predicate_binding"),
            symbol("modeling_speculative_predicate_binding"),
            symbol("util_predicate_binding"),
        ),
    ),
    Patch(UNIFIED_KV, symbol("kv_creator_separate_draft"), _mark_from_kv_creator),
]
