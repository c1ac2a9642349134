"""trtllm-gen page-size opt-in: consulted only after the allowlist rejects the page size."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.contract import import_first, symbol

from ..conftest import _activate, _deactivate
from ..fakehost import CURRENT


def _gate(num_heads=8, num_kv_heads=2):
    module = import_first(symbol("trtllm_gen_support_check").modules)
    attn = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, sparse_params=None)
    return module.FlashInferTrtllmGenFmha(attn), module.FlashInferTrtllmGenFmha


def _meta(page, extra=None):
    """Attention metadata as the host's: its `tokens_per_block` is the KV manager's."""
    manager = SimpleNamespace(tokens_per_block=page)
    if extra is not None:
        manager.trtllm_gen_extra_tokens_per_block = frozenset(extra)
    return SimpleNamespace(kv_cache_manager=manager, tokens_per_block=page)


CASES = {
    "plain-64": (dict(), _meta(64)),
    "plain-128": (dict(), _meta(128)),
    "opt-in-128": (dict(), _meta(128, {128})),
    "opt-in-128-heads-ratio": (dict(num_heads=128, num_kv_heads=2), _meta(128, {128})),
    "opt-in-96": (dict(), _meta(96, {96})),
    "opt-in-other-size": (dict(), _meta(128, {256})),
}


def test_reference_cases(host):
    before = {}
    for name, (heads, meta) in CASES.items():
        fmha, _ = _gate(**heads)
        before[name] = fmha._is_supported_with_reason(None, None, None, fmha.attn, meta, None)
    adapter.install()
    after = {}
    for name, (heads, meta) in CASES.items():
        fmha, cls = _gate(**heads)
        after[name] = fmha._is_supported_with_reason(None, None, None, fmha.attn, meta, None)
        assert fmha.is_supported(None, None, None, meta, None) == after[name][0]
    assert after["opt-in-128"] == (True, "")
    assert before["opt-in-128"][0] is False
    assert {k: v for k, v in after.items() if k != "opt-in-128"} == \
        {k: v for k, v in before.items() if k != "opt-in-128"}
    assert "heads ratio" in after["opt-in-128-heads-ratio"][1]
    assert cls.SUPPORTED_TOKENS_PER_BLOCK == {16, 32, 64}  # never widened globally


@settings(max_examples=25, deadline=None, derandomize=True)
@given(page=st.sampled_from([8, 16, 32, 48, 64, 96, 128, 256]),
       extra=st.one_of(st.none(), st.frozensets(st.sampled_from([32, 64, 96, 128, 256]), max_size=3)),
       ratio_ok=st.booleans())
def test_patched_answer_is_the_allowlist_union_rule(fake_host_dirs, page, extra, ratio_ok):
    root = fake_host_dirs[CURRENT]
    _activate(root)
    try:
        adapter.install()
        fmha, _ = _gate(num_heads=8 if ratio_ok else 128)
        ok, reason = fmha._is_supported_with_reason(None, None, None, fmha.attn, _meta(page, extra), None)
        power_of_two = page & (page - 1) == 0
        expected = ratio_ok and power_of_two and (page in {16, 32, 64} or page in (extra or ()))
        assert ok == expected
        assert (reason == "") == ok
    finally:
        _deactivate(root)


@pytest.mark.parametrize("meta_page, manager_page", [(128, 64), (128, None), (64, 128), (256, 128)])
def test_the_page_size_is_the_metadatas_as_the_host_reads_it(current_host, meta_page, manager_page):
    """The host's gate judges `meta.tokens_per_block` (flashinfer_trtllm_gen.py @ 05412d19 and
    5d7aadeb; a metadata property that reads the manager's): the opt-in must be judged for that page
    size too. Reading the manager's first, a metadata reporting 128 over a manager reporting 64 got the
    rejection of 128 back, where the #18872 rule (allowlist plus the manager's opt-in) accepts it."""
    adapter.install()
    fmha, _ = _gate()
    meta = _meta(manager_page, {128})
    meta.tokens_per_block = meta_page
    expected = meta_page in {16, 32, 64} | {128}
    assert fmha._is_supported_with_reason(None, None, None, fmha.attn, meta, None)[0] is expected


def test_the_gate_with_a_phase_keyword_gets_it_through_the_wrapper(current_host, monkeypatch):
    """The #18872 gate (flashinfer_trtllm_gen.py @ 5d7aadeb): `is_supported` and
    `_is_supported_with_reason` take a keyword-only `phase`, which `is_supported` passes on by keyword,
    and the allowlist is the class set plus the manager's opt-in. The patched gate hands `phase` to the
    host unchanged and answers as the host does."""
    module = import_first(symbol("trtllm_gen_support_check").modules)
    fmha_cls = module.FlashInferTrtllmGenFmha
    phases = []

    def is_supported(self, q, k, v, metadata, forward_args, *, phase=None):
        return self._is_supported_with_reason(q, k, v, self.attn, metadata, forward_args, phase=phase)[0]

    def _is_supported_with_reason(self, q, k, v, attn, meta, fwd, *, phase=None):
        phases.append(phase)
        page = meta.tokens_per_block
        allowed = self.SUPPORTED_TOKENS_PER_BLOCK | set(
            getattr(meta.kv_cache_manager, "trtllm_gen_extra_tokens_per_block", ()))
        return (True, "") if page in allowed else (False, f"tokens_per_block ({page})")

    monkeypatch.setattr(fmha_cls, "is_supported", is_supported)
    monkeypatch.setattr(fmha_cls, "_is_supported_with_reason", _is_supported_with_reason)
    adapter.install()
    fmha, _ = _gate()
    assert fmha.is_supported(None, None, None, _meta(128, {128}), None, phase="generation") is True
    assert fmha.is_supported(None, None, None, _meta(128), None, phase="context") is False
    assert fmha._is_supported_with_reason(None, None, None, fmha.attn, _meta(32), None) == (True, "")
    assert phases == ["generation", "context", None]
