"""Patch `route-sparse-kv-cache-manager`: MiniMax-M3 gets the plugin's KV-cache manager.

Why: the host picks the sparse KV manager with a hard-coded if/elif
(`get_sparse_attn_kv_cache_manager`); there is no registry. The plugin's manager adds the shared
draft layer's virtual attention-op pools, the block-offset copy that feeds them, the trtllm-gen
P128 opt-in and the refusal of tree acceptance.
How: wrap the dispatch function; for `algorithm == "minimax_m3"` return
`M3EagleKVCacheManagerV2` (a subclass of the host's M3 manager), for anything else return the
host's answer untouched. The definer (`sparse/utils.py` or `sparse/registry.py`) and every
namespace that re-bound the name at import time (`sparse/__init__`, the attention package,
`pyexecutor/_util.py`) are rebound; a `sparse/__init__` that serves the name lazily through a
module `__getattr__` (some hosts) binds nothing and reads the wrapped definer.
Not rebound on purpose: the post-move compatibility shim `tensorrt_llm._torch.attention_backend`
(`from ...attention.backends import get_sparse_attn_kv_cache_manager`, re-exported only). No
host runtime code calls the dispatch through it; the one caller, `pyexecutor/_util.py`
(`get_kv_cache_manager_cls`), reads its own module binding, which is rebound whichever package
it imported from (the shim re-exports the very same function object). The shim is slated for
removal upstream, so a required rebind there would fail activation once it goes. (Before the
move `attention_backend` is the real package, and the package rebind above resolves to it.)
Upstream: NVIDIA/TensorRT-LLM#18872 (the in-tree M3 manager gains the same features).
Remove when: the supported host range starts at tensorrt_llm 1.4.0rc1.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from m3_eagle_plugin.host.trtllm.contract import ROUTE_KV, symbol
from m3_eagle_plugin.host.trtllm.patching import Patch
from m3_eagle_plugin.host.trtllm.scope import is_minimax_m3


def _route_kv_manager(original: Callable[..., type]) -> Callable[..., type]:
    @functools.wraps(original)
    def get_sparse_attn_kv_cache_manager(sparse_attention_config: Any, *args: Any, **kwargs: Any) -> type:
        manager_cls = original(sparse_attention_config, *args, **kwargs)
        if not is_minimax_m3(sparse_attention_config):
            return manager_cls
        return plugin_kv_manager(sparse_attention_config)

    return get_sparse_attn_kv_cache_manager


def plugin_kv_manager(sparse_attention_config: Any) -> type:
    """The manager class the plugin registry picks for an M3 config (the built-in one by default).

    A plugin's hook that fails (an ImportError of its own dependency included) fails the lookup: the
    built-in manager is for configs no plugin answers, not a silent stand-in for a broken one."""
    from m3_eagle_plugin.registry import get_plugin_manager, resolve

    reference = get_plugin_manager().kv_cache_manager("tensorrt_llm", sparse_attention_config)
    if reference:
        return resolve(reference)
    from m3_eagle_plugin.host.trtllm.cache_manager import M3EagleKVCacheManagerV2

    return M3EagleKVCacheManagerV2


PATCHES = [
    Patch(
        ROUTE_KV,
        symbol("sparse_kv_manager_dispatch"),
        _route_kv_manager,
        rebinds=(
            symbol("sparse_pkg_kv_manager_binding"),
            symbol("attention_pkg_kv_manager_binding"),
            symbol("util_kv_manager_binding"),
        ),
    )
]
