"""M3Config from both checkpoint layouts, checked against transformers' own config parsing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.models.config import ConfigError, M3Config
from m3_eagle_plugin.models.tiny import target_config

from ._oracle import tiny_text_config


def _as_transformers_sees_it(raw: dict):
    from transformers import MiniMaxM3VLConfig

    return MiniMaxM3VLConfig(**raw).text_config


def _assert_same(cfg: M3Config, hf) -> None:
    assert cfg.num_layers == hf.num_hidden_layers and cfg.hidden_size == hf.hidden_size
    assert cfg.sparse_layers == tuple(t == "minimax_m3_sparse" for t in hf.layer_types)
    assert cfg.moe_layers == tuple(t == "sparse" for t in hf.mlp_layer_types)
    assert cfg.rotary_dim == int(hf.head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    if any(cfg.sparse_layers):  # index fields only matter (and are only required) with sparse layers
        assert (cfg.index_heads, cfg.index_dim, cfg.block_size, cfg.topk_blocks, cfg.local_blocks) == (
            hf.index_n_heads, hf.index_head_dim, hf.index_block_size, hf.index_topk_blocks, hf.index_local_blocks)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size)
    assert (cfg.dense_intermediate_size, cfg.shared_intermediate_size) == (
        hf.dense_intermediate_size, hf.shared_intermediate_size)


def test_text_layout_written_by_transformers(hf_text_checkpoint):
    cfg = M3Config.from_file(hf_text_checkpoint)
    assert cfg.layout == "text"
    _assert_same(cfg, tiny_text_config())


def test_production_layout_parses_like_transformers():
    raw = target_config()
    cfg = M3Config.from_dict(raw, "prod.json")
    assert cfg.layout == "production"
    _assert_same(cfg, _as_transformers_sees_it(raw))


def test_default_aux_layer_ids_follow_the_vllm_convention():
    cfg = M3Config.from_dict(target_config())
    assert cfg.default_aux_layer_ids == (2, 4, 5)  # (2, L//2, L-3) for 8 layers


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "moe_layer_freq", "vocab_size"])
def test_missing_production_field_names_file_and_field(tmp_path, field):
    raw = target_config()
    del raw["text_config"][field]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"config\.json.*text_config\.{field}"):
        M3Config.from_file(tmp_path)


def test_missing_sparse_key_names_the_section():
    raw = target_config()
    del raw["text_config"]["sparse_attention_config"]["sparse_block_size"]
    with pytest.raises(ConfigError, match="sparse_attention_config.sparse_block_size"):
        M3Config.from_dict(raw, "x.json")


def test_missing_text_layout_field(hf_text_checkpoint):
    raw = json.loads((hf_text_checkpoint / "config.json").read_text())
    del raw["layer_types"]
    with pytest.raises(ConfigError, match="x.json.*'layer_types'"):
        M3Config.from_dict(raw, "x.json")


def test_no_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        M3Config.from_file(tmp_path)


@pytest.mark.parametrize("patch,match", [
    ({"num_key_value_heads": 3}, "multiple"),
    ({"scoring_func": "softmax"}, "scoring_func"),
])
def test_bad_values_are_rejected(patch, match):
    raw = target_config()
    raw["text_config"].update(patch)
    with pytest.raises(ConfigError, match=match):
        M3Config.from_dict(raw)


def test_index_heads_must_equal_kv_heads():
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["sparse_num_index_heads"] = 1
    with pytest.raises(ConfigError, match="index heads"):
        M3Config.from_dict(raw)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(layers=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=8),
       factor=st.sampled_from([0.25, 0.5, 1.0]), theta=st.sampled_from([1e4, 5e6]))
def test_production_patterns_roundtrip_like_transformers(layers, factor, theta):
    raw = target_config()
    text = raw["text_config"]
    text["num_hidden_layers"] = len(layers)
    text["sparse_attention_config"]["sparse_attention_freq"] = [int(s) for s, _ in layers]
    text["sparse_attention_config"]["sparse_disable_index_value"] = [1] * len(layers)
    text["moe_layer_freq"] = [int(m) for _, m in layers]
    text["partial_rotary_factor"], text["rope_theta"] = factor, theta
    _assert_same(M3Config.from_dict(raw), _as_transformers_sees_it(raw))
