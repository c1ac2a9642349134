"""The adapter against host variants the double does not model by default, each re-created from the
host's real source: a one-engine Eagle3 base without size keywords, and the first MSA metadata
(no per-token decode scratch, multi-token decode refused in prepare)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.patching import HostPatchError


def _model_config(pretrained):
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, MiniMaxM3SparseAttentionConfig

    return SimpleNamespace(pretrained_config=pretrained, spec_config=Eagle3DecodingConfig(),
                           sparse_attention_config=MiniMaxM3SparseAttentionConfig())


@pytest.fixture
def two_argument_eagle3_base(host, monkeypatch):
    """`SpecDecOneEngineForCausalLM.__init__(self, model, model_config)` as in
    tensorrt_llm/_torch/models/modeling_speculative.py @ b35ac1b6 (1.2.0rc2) and in the later
    pre-refactor versions with DFlash/PARD (sizes read from model_config.pretrained_config; the
    `hidden_size=` / `vocab_size=` keywords arrived later, for VLM wrappers)."""
    from tensorrt_llm._torch.models.modeling_speculative import SpecDecOneEngineForCausalLM

    keyword_init = SpecDecOneEngineForCausalLM.__init__

    def __init__(self, model, model_config):
        keyword_init(self, model, model_config)

    monkeypatch.setattr(SpecDecOneEngineForCausalLM, "__init__", __init__)
    return host


def _registered(arch):
    adapter.install()
    from tensorrt_llm._torch.models.modeling_utils import get_registered_model_class

    return get_registered_model_class(arch)


def test_text_model_builds_on_an_eagle3_base_without_size_keywords(two_argument_eagle3_base):
    cls = _registered("MiniMaxM3SparseForCausalLM")
    model = cls(_model_config(SimpleNamespace(hidden_size=8, vocab_size=16, num_hidden_layers=3)))
    assert len(model.model.layers) == 3
    assert tuple(model.lm_head.weight.shape) == (16, 8)  # [vocab, hidden] of the text config


def test_vl_model_builds_on_an_eagle3_base_without_size_keywords(two_argument_eagle3_base):
    cls = _registered("MiniMaxM3SparseForConditionalGeneration")
    pretrained = SimpleNamespace(model_type="minimax_m3_vl",
                                 text_config={"hidden_size": 8, "vocab_size": 16, "num_hidden_layers": 2})
    model = cls(_model_config(pretrained))
    assert len(model.model.layers) == 2
    assert tuple(model.lm_head.weight.shape) == (16, 8)
    assert model.use_separate_draft_kv_cache is False


@pytest.fixture
def first_msa_metadata(host, monkeypatch):
    """The MSA metadata of msa_backend.py @ 01edceae: no `_msa_max_decode_tokens` (decode scratch
    `msa_n_valid_blocks` / `msa_max_score` sized by `max_num_sequences`), and `_build_msa_fields`,
    run by `prepare()`, raises NotImplementedError for a decode step whose rows carry more than one
    token. A plugin subclass cannot run a single verify step on it."""
    from m3_eagle_plugin.host.trtllm.contract import import_first, symbol

    module = import_first(symbol("msa_metadata_prepare").modules)
    meta_cls = module.MiniMaxM3MsaSparseAttentionMetadata
    monkeypatch.delattr(meta_cls, "_msa_max_decode_tokens")
    return host


def test_activation_refuses_an_msa_metadata_without_per_token_decode_scratch(first_msa_metadata):
    with pytest.raises(HostPatchError) as err:
        adapter.install()
    message = str(err.value)
    assert "nothing was patched" in message
    assert "_msa_max_decode_tokens" in message
    assert adapter.report()["installed"] is False
    assert adapter.report()["bindings"] == [] and adapter.report()["models"] == {}
