"""Unified draft/target KV for MiniMax-M3: every namespace that bound the predicate agrees."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.contract import import_first, symbol

from ..conftest import _activate, _deactivate
from ..fakehost import CURRENT


def _namespaces():
    return [import_first(symbol(key).modules) for key in (
        "separate_draft_kv_predicate", "speculative_pkg_predicate_binding",
        "modeling_speculative_predicate_binding", "util_predicate_binding")]


def _configs():
    from tensorrt_llm.llmapi.llm_args import (
        Eagle3DecodingConfig,
        MiniMaxM3SparseAttentionConfig,
        RocketSparseAttentionConfig,
    )

    return Eagle3DecodingConfig, MiniMaxM3SparseAttentionConfig(), RocketSparseAttentionConfig()


def test_m3_creator_keeps_the_draft_in_the_target_manager(host):
    from tensorrt_llm._torch.pyexecutor import _util

    spec_cls, m3, rocket = _configs()
    m3_spec, rocket_spec = spec_cls(), spec_cls()
    creator = _util.KvCacheCreator(speculative_config=m3_spec, sparse_attention_config=m3)
    assert creator._should_create_separate_draft_kv_cache() is True  # unpatched host
    adapter.install()
    assert creator._should_create_separate_draft_kv_cache() is False
    for namespace in _namespaces():
        assert namespace.should_use_separate_draft_kv_cache(m3_spec) is False
        assert namespace.should_use_separate_draft_kv_cache(rocket_spec) is True
    other = _util.KvCacheCreator(speculative_config=rocket_spec, sparse_attention_config=rocket)
    assert other._should_create_separate_draft_kv_cache() is True
    dp = _util.KvCacheCreator(speculative_config=spec_cls(), sparse_attention_config=rocket,
                              mapping=SimpleNamespace(enable_attention_dp=True))
    assert dp._should_create_separate_draft_kv_cache() is False
    adapter.uninstall()
    assert _namespaces()[0].should_use_separate_draft_kv_cache(m3_spec) is True  # marks cleared


@settings(max_examples=20, deadline=None, derandomize=True)
@given(one_model=st.booleans(), allow=st.booleans(), algorithm=st.sampled_from(["rocket", "dsa", None]))
def test_non_m3_answers_are_unchanged(fake_host_dirs, one_model, allow, algorithm):
    root = fake_host_dirs[CURRENT]
    _activate(root)
    try:
        from tensorrt_llm._torch.pyexecutor import _util

        spec_cls, _, _ = _configs()
        spec = spec_cls(one_model=one_model)
        spec._allow_separate_draft_kv_cache = allow
        sparse = None if algorithm is None else SimpleNamespace(algorithm=algorithm)
        creator = _util.KvCacheCreator(speculative_config=spec, sparse_attention_config=sparse)
        before = [creator._should_create_separate_draft_kv_cache()] + [
            n.should_use_separate_draft_kv_cache(spec) for n in _namespaces()]
        adapter.install()
        after = [creator._should_create_separate_draft_kv_cache()] + [
            n.should_use_separate_draft_kv_cache(spec) for n in _namespaces()]
        assert after == before == [one_model and allow] * 5
    finally:
        _deactivate(root)
