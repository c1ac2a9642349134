"""KV-manager routing: M3 gets the plugin manager in every namespace, other algorithms do not."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.contract import import_first, symbol

KEYS = ("sparse_kv_manager_dispatch", "sparse_pkg_kv_manager_binding",
        "attention_pkg_kv_manager_binding", "util_kv_manager_binding")


def test_every_namespace_routes_m3_only(host):
    from tensorrt_llm.llmapi.llm_args import MiniMaxM3SparseAttentionConfig, RocketSparseAttentionConfig

    namespaces = [import_first(symbol(k).modules) for k in KEYS]
    rocket_before = namespaces[0].get_sparse_attn_kv_cache_manager(RocketSparseAttentionConfig())
    adapter.install()
    for namespace in namespaces:
        m3 = namespace.get_sparse_attn_kv_cache_manager(MiniMaxM3SparseAttentionConfig())
        assert m3.__name__ == "M3EagleKVCacheManagerV2" and m3.__mro__[1].__name__ == "MiniMaxM3KVCacheManagerV2"
        assert namespace.get_sparse_attn_kv_cache_manager(RocketSparseAttentionConfig()) is rocket_before
        assert namespace.get_sparse_attn_kv_cache_manager(
            MiniMaxM3SparseAttentionConfig(), True).__name__ == "M3EagleKVCacheManagerV2"
        # by keyword, as the host's get_kv_cache_manager_cls calls it (pyexecutor/_util.py @ 00043967)
        assert namespace.get_sparse_attn_kv_cache_manager(
            MiniMaxM3SparseAttentionConfig(), use_kv_cache_manager_v2=True).__name__ == "M3EagleKVCacheManagerV2"
        assert namespace.get_sparse_attn_kv_cache_manager(
            RocketSparseAttentionConfig(), use_kv_cache_manager_v2=False) is rocket_before
    from tensorrt_llm._torch.pyexecutor import _util

    model_config = SimpleNamespace(sparse_attention_config=MiniMaxM3SparseAttentionConfig())
    assert _util.get_kv_cache_manager_cls(model_config).__name__ == "M3EagleKVCacheManagerV2"


@contextlib.contextmanager
def _installed_with(plugin, name: str):
    """The adapter installed while `plugin` is registered; yields the host's `_util` namespace."""
    from m3_eagle_plugin.registry import get_plugin_manager

    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    try:
        adapter.install()
        from tensorrt_llm._torch.pyexecutor import _util

        yield _util
    finally:
        pm.unregister(name=name)


def test_a_plugin_can_pick_another_manager(current_host):
    from m3_eagle_plugin.hooks import hookimpl
    from tensorrt_llm.llmapi.llm_args import MiniMaxM3SparseAttentionConfig

    class Other:
        @hookimpl
        def m3_eagle_kv_cache_manager(self, host, sparse_config):
            return "collections:OrderedDict"

    import collections

    with _installed_with(Other(), "test-other-manager") as _util:
        assert _util.get_sparse_attn_kv_cache_manager(MiniMaxM3SparseAttentionConfig()) is collections.OrderedDict
    with pytest.raises(ValueError):
        _util.get_sparse_attn_kv_cache_manager(SimpleNamespace(algorithm="bogus"))


def test_a_plugin_hook_failing_on_import_is_not_replaced_by_the_builtin_manager(current_host):
    """A plugin answering for M3 whose hook cannot import its own dependency: the lookup fails naming
    the module, instead of handing the host the built-in manager as if no plugin had answered."""
    from m3_eagle_plugin.hooks import hookimpl
    from tensorrt_llm.llmapi.llm_args import MiniMaxM3SparseAttentionConfig

    class Broken:
        @hookimpl
        def m3_eagle_kv_cache_manager(self, host, sparse_config):
            import m3_eagle_test_absent_kv_backend  # noqa: F401

            return "m3_eagle_test_absent_kv_backend:Manager"

    with _installed_with(Broken(), "test-broken-manager") as _util:
        with pytest.raises(ImportError, match="m3_eagle_test_absent_kv_backend"):
            _util.get_sparse_attn_kv_cache_manager(MiniMaxM3SparseAttentionConfig())
