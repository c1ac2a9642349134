"""Decides whether a host call concerns MiniMax-M3, so patches can stay invisible to other models.

Every patched host function must return exactly what the unpatched one returns for any model
other than MiniMax-M3. The host identifies M3 by its sparse-attention algorithm
(`sparse_attention_config.algorithm == "minimax_m3"`, the lowered `SparseParams` carry the same
field). The draft-KV predicate only sees the speculative config, so the M3 paths mark that config
object here and the predicate consults the mark.
"""
from __future__ import annotations

import threading
from typing import Any

MINIMAX_M3_ALGORITHM = "minimax_m3"
MSA_IMPLEMENTATION = "msa"


def sparse_algorithm(config: Any) -> str | None:
    """The sparse algorithm name of a sparse-attention config / params object or dict."""
    if config is None:
        return None
    if isinstance(config, dict):
        value = config.get("algorithm")
    else:
        value = getattr(config, "algorithm", None)
    return value if isinstance(value, str) else None


def is_minimax_m3(config: Any) -> bool:
    return sparse_algorithm(config) == MINIMAX_M3_ALGORITHM


_marks_lock = threading.Lock()
_unified_spec_configs: dict[int, Any] = {}  # id -> object (kept alive so ids stay unique)


def mark_unified_draft_kv(spec_config: Any) -> None:
    """Record that `spec_config` drives a MiniMax-M3 target: its draft layer shares the target KV."""
    if spec_config is None:
        return
    with _marks_lock:
        _unified_spec_configs[id(spec_config)] = spec_config


def wants_unified_draft_kv(spec_config: Any) -> bool:
    if spec_config is None:
        return False
    with _marks_lock:
        return _unified_spec_configs.get(id(spec_config)) is spec_config


def clear_unified_marks() -> None:
    with _marks_lock:
        _unified_spec_configs.clear()
