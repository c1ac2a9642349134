"""Patch `trtllm-gen-page-size-opt-in`: trtllm-gen may run at page sizes a KV manager opts into.

Why: MSA needs `tokens_per_block = 128`, and the Eagle3 draft layer shares that cache, but the
trtllm-gen allowlist (`SUPPORTED_TOKENS_PER_BLOCK`) stops at 64. Widening the class set would
change every other model; upstream instead lets a manager opt in per instance through
`trtllm_gen_extra_tokens_per_block`.
How: wrap `FlashInferTrtllmGenFmha._is_supported_with_reason`. Its answer is returned unchanged
unless it is a rejection, the page size is outside the class allowlist and inside the manager's
opt-in set. Only then is the check re-run against a read-only view of the instance whose
allowlist also holds the opted-in sizes: the allowlist is the last check, so the re-run accepts
only when every other check passed. Managers without the attribute (every non-M3 model) never
reach the re-run.
Upstream: NVIDIA/TensorRT-LLM#18872 ("8 lines" in flashinfer_trtllm_gen.py).
Remove when: the supported host range starts at tensorrt_llm 1.4.0rc1.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from m3_eagle_plugin.host.trtllm.contract import PAGE_SIZE, symbol
from m3_eagle_plugin.host.trtllm.patching import Patch

OPT_IN_ATTRIBUTE = "trtllm_gen_extra_tokens_per_block"


class _WidenedAllowlist:
    """Reads through to the FMHA instance, except for the page-size allowlist."""

    def __init__(self, fmha: Any, allowlist: frozenset) -> None:
        object.__setattr__(self, "_fmha", fmha)
        object.__setattr__(self, "SUPPORTED_TOKENS_PER_BLOCK", allowlist)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fmha, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the allowlist view is read-only (tried to set {name!r})")


def _page_size(meta: Any, manager: Any) -> int | None:
    """The page size the host's gate judges: the metadata's `tokens_per_block` (the host's property
    reads the manager's), the manager's only where the metadata has none."""
    for owner in (meta, manager):
        value = getattr(owner, "tokens_per_block", None)
        if isinstance(value, int):
            return value
    return None


def _opt_in_page_size(original: Callable[..., tuple]) -> Callable[..., tuple]:
    @functools.wraps(original)
    def _is_supported_with_reason(self, q, k, v, attn, meta, fwd, *args: Any, **kwargs: Any):
        supported, reason = original(self, q, k, v, attn, meta, fwd, *args, **kwargs)
        if supported:
            return supported, reason
        manager = getattr(meta, "kv_cache_manager", None)
        extra = frozenset(getattr(manager, OPT_IN_ATTRIBUTE, ()) or ())
        page = _page_size(meta, manager)
        allowlist = frozenset(self.SUPPORTED_TOKENS_PER_BLOCK)
        if not extra or page is None or page in allowlist or page not in extra:
            return supported, reason
        view = _WidenedAllowlist(self, allowlist | extra)
        return original(view, q, k, v, attn, meta, fwd, *args, **kwargs)

    return _is_supported_with_reason


PATCHES = [Patch(PAGE_SIZE, symbol("trtllm_gen_support_check"), _opt_in_page_size)]
