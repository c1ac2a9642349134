"""M3Config from both checkpoint layouts, checked against transformers' own config parsing."""
from __future__ import annotations

import json
import re

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
        stored_heads = cfg.index_heads // cfg.index_head_repeat  # repeated up to one per KV head
        assert (stored_heads, cfg.index_dim, cfg.block_size, cfg.topk_blocks, cfg.local_blocks) == (
            hf.index_n_heads, hf.index_head_dim, hf.index_block_size, hf.index_topk_blocks, hf.index_local_blocks)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size)
    assert (cfg.dense_intermediate_size, cfg.shared_intermediate_size) == (
        hf.dense_intermediate_size, hf.shared_intermediate_size)
    assert cfg.max_position_embeddings == hf.max_position_embeddings


def test_text_layout_written_by_transformers(hf_text_checkpoint):
    cfg = M3Config.from_file(hf_text_checkpoint)
    assert cfg.layout == "text"
    _assert_same(cfg, tiny_text_config())


def test_production_layout_parses_like_transformers():
    raw = target_config()
    cfg = M3Config.from_dict(raw, "prod.json")
    assert cfg.layout == "production"
    _assert_same(cfg, _as_transformers_sees_it(raw))


@pytest.mark.parametrize("positions", [None, 16])
def test_max_position_embeddings_reads_as_transformers_reads_it(positions):
    """The reference host stops generation there; a config without the key has transformers' default."""
    raw = target_config()
    raw["text_config"].pop("max_position_embeddings")
    if positions is not None:
        raw["text_config"]["max_position_embeddings"] = positions
    assert M3Config.from_dict(raw).max_position_embeddings == _as_transformers_sees_it(raw).max_position_embeddings
    raw["text_config"]["max_position_embeddings"] = 0
    with pytest.raises(ConfigError, match="max_position_embeddings: must be >= 1, got 0"):
        M3Config.from_dict(raw)


def test_default_aux_layer_ids_follow_the_vllm_convention():
    cfg = M3Config.from_dict(target_config())
    assert cfg.default_aux_layer_ids == (2, 4, 5)  # (2, L//2, L-3) for 8 layers


def _published_production_config() -> dict:
    """The text backbone of minimax_m3_msa.md §1.2 (the published checkpoint's values) in the
    published layout (`MiniMaxM3SparseForConditionalGeneration`, legacy sparse section)."""
    raw = target_config()
    moe = [0] * 3 + [1] * 57
    raw["text_config"].update({
        "vocab_size": 200064, "hidden_size": 6144, "num_hidden_layers": 60, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072, "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072, "num_local_experts": 128, "num_experts_per_tok": 4,
        "routed_scaling_factor": 2.0, "moe_layer_freq": moe, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "partial_rotary_factor": 0.5, "rotary_dim": 64, "max_position_embeddings": 524288,
        "bos_token_id": 200034, "eos_token_id": 200020,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_score_type": "max",
            "sparse_init_block": 0, "sparse_local_block": 1, "sparse_disable_index_value": moe,
            "sparse_attention_freq": moe},
    })
    return raw


def test_published_production_config_reads_as_the_reference_tables():
    """minimax_m3_msa.md §1.2 / trtllm_host_api.md §4.1 field by field, transformers' reading of the same
    dict, and the Eagle3 aux capture ids (2, L//2, L-3) = (2, 30, 57) for L = 60 (§4.2)."""
    raw = _published_production_config()
    cfg = M3Config.from_dict(raw, "prod.json")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (200064, 6144, 60)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (64, 4, 128, 64)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (5e6, 1e-6, False)
    assert cfg.sparse_layer_ids == list(range(3, 60)) and cfg.moe_layers == cfg.sparse_layers
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 4, 3072)
    assert (cfg.shared_intermediate_size, cfg.dense_intermediate_size, cfg.routed_scaling_factor) == (3072, 12288, 2.0)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert (cfg.index_heads, cfg.index_dim, cfg.block_size, cfg.topk_blocks) == (4, 128, 128, 16)
    assert (cfg.local_blocks, cfg.init_blocks, cfg.index_head_repeat) == (1, 0, 1)
    assert cfg.default_aux_layer_ids == (2, 30, 57)
    _assert_same(cfg, _as_transformers_sees_it(raw))


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
    with pytest.raises(ConfigError, match="x.json: layer_types: required field is missing"):
        M3Config.from_dict(raw, "x.json")


def test_no_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        M3Config.from_file(tmp_path)


def test_a_directory_named_config_json_is_not_called_missing(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=r"config\.json is not a file"):
        M3Config.from_file(tmp_path)


def test_another_models_config_names_its_model_type():
    """A Llama config as transformers writes it: the missing M3 field alone would not say why."""
    transformers = pytest.importorskip("transformers")
    raw = transformers.LlamaConfig(num_hidden_layers=2).to_dict()
    with pytest.raises(ConfigError, match="model_type 'llama': is this a MiniMax-M3 checkpoint"):
        M3Config.from_dict(raw, "x.json")
    raw = target_config()
    del raw["text_config"]["vocab_size"]  # an M3 config missing a field gets no such hint
    with pytest.raises(ConfigError) as plain:
        M3Config.from_dict(raw, "x.json")
    assert "model_type" not in str(plain.value)


@pytest.mark.parametrize("patch,match", [
    ({"num_key_value_heads": 3}, "multiple"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    # values the model would otherwise ignore silently (transformers applies or ignores them too)
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling.rope_type: 'linear' is not supported"),
    ({"use_gemma_norm": False}, "use_gemma_norm: false is not supported"),
    ({"attention_output_gate": True}, "attention_output_gate: true is not supported"),
    ({"qk_norm_type": None}, None),  # null: the default, accepted
    ({"qk_norm_type": "per_layer"}, "qk_norm_type: 'per_layer' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
    ({"n_group": 2, "topk_group": 1}, "grouped expert routing"),
    ({"n_group": 2, "topk_group": 2}, None),  # every group kept: the same routing
])
def test_bad_values_are_rejected(patch, match):
    raw = target_config()
    raw["text_config"].update(patch)
    if match is None:
        M3Config.from_dict(raw)
        return
    with pytest.raises(ConfigError, match=match):
        M3Config.from_dict(raw)


@pytest.mark.parametrize("patch,match", [
    ({"swiglu_beta": 0.5}, r"text_config\.swiglu_beta: 0\.5 is not supported \(only 1\.0\)"),
    ({"use_qk_norm": False}, r"text_config\.use_qk_norm: false is not supported"),
    ({"use_routing_bias": False}, r"text_config\.use_routing_bias: false is not supported"),
])
def test_vllm_switches_that_change_the_model_are_refused_by_name(patch, match):
    """MiniMax-M3 configs carry these (vLLM, SGLang and TensorRT-LLM honour them: `(up + beta)`, no q/k
    norm, no selection bias); transformers and this model compute only the shipped values."""
    raw = target_config()
    raw["text_config"].update({"swiglu_beta": 1.0, "use_qk_norm": True, "use_routing_bias": True})
    M3Config.from_dict(raw)  # the released checkpoint's values load
    raw["text_config"].update(patch)
    with pytest.raises(ConfigError, match=match):
        M3Config.from_dict(raw)


def test_forced_blocks_past_the_top_k_are_refused_at_load():
    raw = target_config()
    sparse = raw["text_config"]["sparse_attention_config"]
    sparse["sparse_local_block"] = sparse["sparse_topk_blocks"] + 1
    with pytest.raises(ConfigError, match="local \\+ 0 init blocks exceed the top-"):
        M3Config.from_dict(raw)


def test_index_heads_that_divide_the_kv_heads_are_repeated_per_kv_head():
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["sparse_num_index_heads"] = 1
    cfg = M3Config.from_dict(raw)
    assert (cfg.index_heads, cfg.index_head_repeat) == (cfg.num_kv_heads, cfg.num_kv_heads)
    _assert_same(cfg, _as_transformers_sees_it(raw))


def test_more_index_heads_than_kv_heads_are_refused_naming_the_field():
    """transformers runs it (two selections inside one KV head's group); one selection per KV head cannot."""
    raw = target_config()
    text = raw["text_config"]
    text["sparse_attention_config"]["sparse_num_index_heads"] = text["num_attention_heads"]
    with pytest.raises(ConfigError) as info:
        M3Config.from_dict(raw, "x.json")
    assert str(info.value).startswith(
        f"x.json: text_config.sparse_attention_config.sparse_num_index_heads: {text['num_attention_heads']} index "
        f"heads do not divide num_key_value_heads ({text['num_key_value_heads']})")


@pytest.mark.parametrize("key,value", [("n_shared_experts", 2), ("num_shared_experts", 3),
                                       ("n_shared_experts", 0), ("n_shared_experts", None)])
def test_shared_expert_count_is_not_read_like_transformers(key, value):
    raw = target_config()
    raw["text_config"][key] = value
    cfg = M3Config.from_dict(raw)
    assert cfg.shared_intermediate_size == raw["text_config"]["shared_intermediate_size"]
    _assert_same(cfg, _as_transformers_sees_it(raw))


def test_use_sparse_attention_false_is_not_read_like_transformers():
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["use_sparse_attention"] = False
    cfg = M3Config.from_dict(raw)
    assert any(cfg.sparse_layers)
    _assert_same(cfg, _as_transformers_sees_it(raw))


@pytest.mark.parametrize("section,flat", [
    # the section's sparse_* index keys override index_*; layer_types / mlp_layer_types win over the patterns
    ({"sparse_block_size": 8, "sparse_topk_blocks": 2, "sparse_local_block": 2, "sparse_index_dim": 8,
      "sparse_attention_freq": [0, 0, 0, 0]}, {}),
    ({"sparse_block_size": 8}, {"index_topk_blocks": 5}),  # keys the section lacks come from index_*
    ({"sparse_attention_freq": [0, 1, 0, 1]}, {"layer_types": None}),  # no layer_types: the section's
    ({}, {"mlp_layer_types": None, "moe_layer_freq": [1, 0, 1, 0]}),  # no mlp_layer_types: moe_layer_freq
])
def test_text_config_with_a_legacy_section_resolves_like_transformers(section, flat):
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    raw = {k: v for k, v in tiny_text_config().to_dict().items() if k not in ("layer_types", "mlp_layer_types")}
    raw.update(layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3, mlp_layer_types=["dense"] + ["sparse"] * 3)
    raw.update(flat, sparse_attention_config=section)
    raw = {k: v for k, v in raw.items() if v is not None}
    cfg = M3Config.from_dict(raw)
    assert cfg.layout == "text"
    _assert_same(cfg, MiniMaxM3VLTextConfig(**json.loads(json.dumps(raw))))


def test_init_blocks_in_a_text_configs_legacy_section_are_refused_naming_the_field():
    """transformers reads no `sparse_init_block` (its indexer forces no init block), so a text config
    that asks for init blocks would run another model than transformers does: refused, not read."""
    raw = {k: v for k, v in tiny_text_config().to_dict().items()}
    raw["sparse_attention_config"] = {"sparse_init_block": 1}
    with pytest.raises(ConfigError) as info:
        M3Config.from_dict(raw, "x.json")
    assert str(info.value).startswith("x.json: sparse_attention_config.sparse_init_block: 1 init blocks")
    raw["sparse_attention_config"] = {"sparse_init_block": 0}
    assert M3Config.from_dict(raw).init_blocks == 0


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


# ---- bad files and bad values: one ConfigError "<file>: <field>: <what is wrong>" ----

@pytest.mark.parametrize("field,value,what", [
    ("hidden_size", "sixty-four", "expected an integer, got str 'sixty-four'"),
    ("num_hidden_layers", [8], "expected an integer, got list [8]"),
    ("hidden_size", 64.5, "expected an integer, got 64.5"),
    ("vocab_size", True, "expected an integer, got bool True"),
    ("num_attention_heads", -4, "must be >= 1, got -4"),
    ("num_key_value_heads", 0, "must be >= 1, got 0"),
    ("rms_norm_eps", "tiny", "expected a finite number, got str 'tiny'"),
    *((field, value, f"expected a finite number, got float {value!r}")
      for field in ("rms_norm_eps", "routed_scaling_factor") for value in (float("nan"), float("inf"))),
    ("tie_word_embeddings", "yes", "expected true or false, got str 'yes'"),
])
def test_wrong_type_or_range_names_file_and_field(field, value, what):
    raw = target_config()
    raw["text_config"][field] = value
    with pytest.raises(ConfigError) as info:
        M3Config.from_dict(raw, "x.json")
    assert str(info.value) == f"x.json: text_config.{field}: {what}"


def test_integral_float_is_accepted_as_an_int():
    raw = target_config()
    raw["text_config"]["vocab_size"] = float(raw["text_config"]["vocab_size"])
    assert M3Config.from_dict(raw).vocab_size == target_config()["text_config"]["vocab_size"]


@pytest.mark.parametrize("text,what", [
    ('{"text_config": {', "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 18)"),
    ("[1, 2]", "top level must be a JSON object, got list"),
    ('"config"', "top level must be a JSON object, got str"),
    ('{"text_config": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON (nested too deeply)"),  # RecursionError
])
def test_unparsable_config_file_names_the_file(tmp_path, text, what):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as info:
        M3Config.from_file(tmp_path)
    assert str(info.value) == f"{tmp_path / 'config.json'}: {what}"


def test_non_utf8_config_file_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON \(not UTF-8 text\)"):
        M3Config.from_file(tmp_path)


@pytest.mark.parametrize("path,value", [
    (("text_config",), [1]),
    (("text_config", "sparse_attention_config"), "yes"),
    (("text_config", "rope_parameters"), 5),
])
def test_section_that_is_not_an_object(path, value):
    raw = target_config()
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(ConfigError) as info:
        M3Config.from_dict(raw, "x.json")
    assert str(info.value) == f"x.json: {'.'.join(path)}: must be a JSON object, got {type(value).__name__}"


def test_unsupported_rope_type_names_file_and_field():
    raw = target_config()
    raw["text_config"]["rope_parameters"] = {"rope_type": "yarn"}
    with pytest.raises(ConfigError) as info:
        M3Config.from_dict(raw, "x.json")
    assert str(info.value) == "x.json: text_config.rope_parameters.rope_type: 'yarn' is not supported (only 'default')"


@pytest.mark.parametrize("section,key", [
    ("sparse_attention_config", "sparse_attention_freq"),
    ("sparse_attention_config", "sparse_disable_index_value"),
    ("", "moe_layer_freq"),
])
def test_short_production_pattern_names_the_list_and_the_length(section, key):
    raw = target_config()
    text = raw["text_config"]
    (text[section] if section else text)[key] = [0, 1]
    field = f"text_config.{section}.{key}" if section else f"text_config.{key}"
    with pytest.raises(ConfigError) as info:
        M3Config.from_dict(raw, "x.json")
    n = text["num_hidden_layers"]
    assert str(info.value) == f"x.json: {field}: has 2 entries, expected {n} (one per layer: num_hidden_layers)"


@pytest.mark.parametrize("key", ["layer_types", "mlp_layer_types"])
def test_short_text_pattern_names_the_list_and_the_length(hf_text_checkpoint, key):
    raw = json.loads((hf_text_checkpoint / "config.json").read_text())
    raw[key] = raw[key][:1]
    with pytest.raises(ConfigError, match=rf"^x\.json: {key}: has 1 entries, expected {raw['num_hidden_layers']} "):
        M3Config.from_dict(raw, "x.json")


@pytest.mark.parametrize("entry", [2, "1", [1], None])
def test_bad_pattern_entry_names_its_index(entry):
    raw = target_config()
    pattern = list(raw["text_config"]["moe_layer_freq"])  # target_config() may share this list with sparse_*
    pattern[3] = entry
    raw["text_config"]["moe_layer_freq"] = pattern
    with pytest.raises(ConfigError, match=r"^x\.json: text_config\.moe_layer_freq\[3\]: .* is not one of \[0, 1\]$"):
        M3Config.from_dict(raw, "x.json")


def test_index_value_branch_error_names_the_layers():
    raw = target_config()
    sp = raw["text_config"]["sparse_attention_config"]
    first_sparse = sp["sparse_attention_freq"].index(1)
    sp["sparse_disable_index_value"] = [int(i != first_sparse) for i in range(len(sp["sparse_attention_freq"]))]
    with pytest.raises(ConfigError, match=rf"sparse_disable_index_value: sparse layers \[{first_sparse}\] keep"):
        M3Config.from_dict(raw, "x.json")


_JSON_VALUES = st.one_of(
    st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=4),
    st.lists(st.integers(0, 9), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(field=st.sampled_from(["vocab_size", "intermediate_size", "dense_intermediate_size"]), value=_JSON_VALUES)
def test_any_json_value_for_a_size_parses_exactly_or_fails_naming_the_field(field, value):
    raw = target_config()
    raw["text_config"][field] = value
    positive_int = (not isinstance(value, bool) and isinstance(value, (int, float))
                    and float(value).is_integer() and value >= 1)
    attr = {"vocab_size": "vocab_size", "intermediate_size": "moe_intermediate_size",
            "dense_intermediate_size": "dense_intermediate_size"}[field]
    if positive_int:
        assert getattr(M3Config.from_dict(raw, "x.json"), attr) == value
    else:
        with pytest.raises(ConfigError, match=rf"^x\.json: text_config\.{field}: "):
            M3Config.from_dict(raw, "x.json")


# ---- fields read where transformers reads them (MiniMaxM3VLConfig is the oracle) ----

@pytest.mark.parametrize("top,text", [(True, False), (True, None), (False, True), (False, False), (None, None)])
def test_vl_top_level_tie_word_embeddings_ties_like_transformers(top, text):
    from transformers import MiniMaxM3VLConfig

    raw = target_config()
    for section, value in ((raw, top), (raw["text_config"], text)):
        section.pop("tie_word_embeddings")
        if value is not None:
            section["tie_word_embeddings"] = value
    want = MiniMaxM3VLConfig(**json.loads(json.dumps(raw))).tie_word_embeddings
    assert M3Config.from_dict(raw).tie_word_embeddings == want


def test_missing_head_dim_defaults_like_transformers():
    raw = target_config()
    del raw["text_config"]["head_dim"]
    raw["text_config"]["sparse_attention_config"]["sparse_index_dim"] = 128  # >= the rotary dim (64)
    hf = _as_transformers_sees_it(json.loads(json.dumps(raw)))
    cfg = M3Config.from_dict(raw)
    assert cfg.head_dim == hf.head_dim == 128  # not hidden_size // num_attention_heads (16 here)
    _assert_same(cfg, hf)


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"type": "default", "rope_theta": 500.0}},
    {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.25}},
    {"rope_scaling": {"type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 777.0}},
    {"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 777.0}},
    {"rope_parameters": {"type": "default", "rope_theta": 300.0, "partial_rotary_factor": 1.0}},
])
def test_rope_dict_is_the_one_transformers_reads(rope):
    raw = target_config()
    raw["text_config"].update(rope)
    hf = _as_transformers_sees_it(json.loads(json.dumps(raw)))
    assert hf.rope_parameters["rope_type"] == "default"
    _assert_same(M3Config.from_dict(raw), hf)


def test_legacy_type_key_in_rope_parameters_is_not_ignored():
    raw = target_config()
    raw["text_config"]["rope_parameters"] = {"type": "linear", "factor": 2.0}
    assert _as_transformers_sees_it(json.loads(json.dumps(raw))).rope_parameters["rope_type"] == "linear"
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_type: 'linear' is not supported"):
        M3Config.from_dict(raw)


@pytest.mark.parametrize("keys", [{"num_experts": 4}, {"num_experts": 4, "num_local_experts": 6},
                                  {"num_local_experts": 6, "num_experts": 4}, {"num_local_experts": 6}])
def test_expert_count_key_resolves_like_transformers(keys):
    """transformers sets `num_experts` (an attribute_map alias) after the fields, so it wins over
    `num_local_experts` whatever the order in the file."""
    raw = target_config()
    raw["text_config"].pop("num_local_experts", None)
    raw["text_config"].update(keys)
    hf = _as_transformers_sees_it(json.loads(json.dumps(raw)))
    cfg = M3Config.from_dict(raw)
    assert cfg.num_experts == hf.num_local_experts
    _assert_same(cfg, hf)


@pytest.mark.parametrize("layout", ["production", "text"])
def test_missing_optional_fields_default_like_transformers(layout):
    """Every field transformers' `MiniMaxM3VLTextConfig` defaults must take its default here too: the
    MoE and SwiGLU constants change the model's output, not just its shape."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    optional = ("shared_intermediate_size", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "rms_norm_eps",
                "num_experts_per_tok", "dense_intermediate_size")
    if layout == "production":
        raw = target_config()
        text = raw["text_config"]
        text["sparse_attention_config"].pop("sparse_local_block")
    else:
        raw = text = tiny_text_config().to_dict()
        text.pop("index_local_blocks")
    for key in optional:
        text.pop(key)
    hf = (_as_transformers_sees_it(json.loads(json.dumps(raw))) if layout == "production"
          else MiniMaxM3VLTextConfig(**json.loads(json.dumps(raw))))
    cfg = M3Config.from_dict(raw)
    assert cfg.layout == layout
    _assert_same(cfg, hf)
    assert (cfg.routed_scaling_factor, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.rms_norm_eps, cfg.num_experts_per_tok,
            cfg.local_blocks) == (hf.routed_scaling_factor, hf.swiglu_alpha, hf.swiglu_limit, hf.rms_norm_eps,
                                  hf.num_experts_per_tok, hf.index_local_blocks)


def test_booleans_accept_json_zero_and_one_and_positive_floats_refuse_zero():
    """`ConfigFields`' documented reads: a boolean is true/false or the integers 1/0 (some exporters
    write those), nothing else; a positive float such as rms_norm_eps refuses 0 (x / sqrt(0) is a NaN
    for an all-zero row)."""
    from m3_eagle_plugin.models.config_fields import ConfigFields

    fields = ConfigFields({"a": 1, "b": 0, "c": 2, "eps": 0, "small": 1e-12}, "x.json")
    assert fields.get_bool("a", False) is True and fields.get_bool("b", True) is False
    with pytest.raises(ConfigError, match="^x.json: c: expected true or false, got int 2$"):
        fields.get_bool("c", False)
    with pytest.raises(ConfigError, match="^x.json: eps: must be > 0, got 0$"):
        fields.get_float("eps", positive=True)
    assert fields.get_float("small", positive=True) == 1e-12
    raw = target_config()
    raw["text_config"]["rms_norm_eps"] = 0
    with pytest.raises(ConfigError, match=r"text_config\.rms_norm_eps: must be > 0, got 0$"):
        M3Config.from_dict(raw, "x.json")


# ---- gaps found by mutation testing ----

def test_null_rope_sections_read_as_absent_like_transformers():
    """HF configs often hold `"rope_scaling": null`: a null field is an absent one, not a bad section."""
    raw = target_config()
    raw["text_config"].update(rope_scaling=None, rope_parameters=None)
    _assert_same(M3Config.from_dict(raw), _as_transformers_sees_it(json.loads(json.dumps(raw))))


def test_int_list_refuses_a_boolean_entry_naming_it():
    from m3_eagle_plugin.models.config_fields import ConfigFields

    fields = ConfigFields({"ok": [2, 4, 5], "ids": [2, True]}, "x.json")
    assert fields.get_int_list("ok") == (2, 4, 5)
    with pytest.raises(ConfigError, match=r"^x\.json: ids\[1\]: expected an integer, got bool True$"):
        fields.get_int_list("ids")


def test_odd_rotary_dim_is_a_config_error():
    """16 * 0.3125 = 5 rotated channels: NeoX RoPE rotates channel pairs, so no model can be built."""
    raw = target_config()
    raw["text_config"]["partial_rotary_factor"] = 0.3125
    with pytest.raises(ConfigError, match=r"rotary dim 5 must be even"):
        M3Config.from_dict(raw)


@pytest.mark.parametrize("size", [3, 6, 12])
def test_sparse_block_size_that_is_not_a_power_of_two_is_refused(size):
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["sparse_block_size"] = size
    with pytest.raises(ConfigError, match=rf"sparse block size {size} must be a power of two"):
        M3Config.from_dict(raw)


def test_index_heads_other_than_the_kv_heads_are_refused_by_the_dataclass():
    """`M3Config` itself (not only the parser) holds one index head per KV head."""
    from dataclasses import replace

    cfg = M3Config.from_dict(target_config())
    with pytest.raises(ConfigError, match=r"index heads \(1\) must equal num_key_value_heads \(2\)"):
        replace(cfg, index_heads=1)


def test_every_expert_per_token_is_accepted_one_more_is_not():
    raw = target_config()
    text = raw["text_config"]
    text["num_experts_per_tok"] = text["num_local_experts"]
    cfg = M3Config.from_dict(raw)
    assert cfg.num_experts_per_tok == cfg.num_experts == 8
    _assert_same(cfg, _as_transformers_sees_it(json.loads(json.dumps(raw))))
    text["num_experts_per_tok"] += 1
    with pytest.raises(ConfigError, match=r"num_experts_per_tok 9 not in \[1, 8\]"):
        M3Config.from_dict(raw)


def test_text_layout_ignores_its_stale_rotary_dim_like_transformers():
    """transformers' text config carries a `rotary_dim` its rotary embedding never reads: without a
    partial_rotary_factor the whole head rotates."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding

    hf = tiny_text_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rotary_dim=4)
    cfg = M3Config.from_dict(hf.to_dict())
    assert cfg.layout == "text"
    assert cfg.rotary_dim == 2 * MiniMaxM3VLRotaryEmbedding(hf).inv_freq.shape[0] == 16


def test_production_init_blocks_are_read_from_the_legacy_section():
    """The production layout's `sparse_init_block` is read (vLLM / SGLang force those blocks)."""
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["sparse_init_block"] = 2
    assert M3Config.from_dict(raw).init_blocks == 2


# ---- adversarial review: values that escaped as other exceptions or were silently ignored ----

@pytest.mark.parametrize("field", ["rms_norm_eps", "routed_scaling_factor", "rope_theta", "partial_rotary_factor"])
def test_json_integer_too_large_for_a_float_names_the_field(field):
    """JSON has unbounded integers; one past the float range is not a finite number (not an OverflowError)."""
    raw = target_config()
    raw["text_config"][field] = 10 ** 400
    with pytest.raises(ConfigError, match=rf"^x\.json: text_config\.{field}: expected a finite number, got int 1000"):
        M3Config.from_dict(raw, "x.json")


@pytest.mark.parametrize("factor", [2.0, 1e308])
def test_partial_rotary_factor_above_one_names_the_field(factor):
    """A factor over 1 asks to rotate more channels than a head has (1e308 used to overflow int())."""
    raw = target_config()
    raw["text_config"]["partial_rotary_factor"] = factor
    with pytest.raises(ConfigError, match=rf"^x\.json: text_config\.partial_rotary_factor: must be in \(0, 1\], "
                                          rf"got {re.escape(repr(factor))}$"):
        M3Config.from_dict(raw, "x.json")


def test_per_layer_type_rope_parameters_are_refused_not_ignored():
    """transformers nests `rope_parameters` by layer type when its keys are layer types; its M3 rotary
    embedding then cannot find `rope_type`. Reading the nested dict as a flat one would silently run
    the default theta over the whole head instead of the config's values."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding

    per_type = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    nested = {"full_attention": dict(per_type), "minimax_m3_sparse": dict(per_type)}
    # transformers 5.24 keeps the dict nested and its rotary embedding misses `rope_type` (KeyError);
    # the H200's 5.17 already fails building the config (AttributeError on a float)
    with pytest.raises((KeyError, AttributeError)):
        MiniMaxM3VLRotaryEmbedding(tiny_text_config(rope_parameters=nested))
    raw = tiny_text_config().to_dict()
    raw["rope_parameters"] = nested
    with pytest.raises(ConfigError, match=r"^x\.json: rope_parameters\.full_attention: per-layer-type RoPE "):
        M3Config.from_dict(raw, "x.json")


# ---- refusals no test reached (each check was turned off in turn; these fail without it) ----

@pytest.mark.parametrize("values", [5, "245", {"2": 1}])
def test_int_list_that_is_not_a_list_is_refused_naming_the_field(values):
    """5 failed iterating an int (TypeError); a string or object was blamed on its first character or key."""
    from m3_eagle_plugin.models.config_fields import ConfigFields

    with pytest.raises(ConfigError, match=rf"^x\.json: ids: must be a list of integers, got {type(values).__name__}$"):
        ConfigFields({"ids": values}, "x.json").get_int_list("ids")


@pytest.mark.parametrize("value", [1, "00011111"])
def test_per_layer_pattern_that_is_not_a_list_is_refused_naming_the_field(value):
    """1 failed taking the length of an int (TypeError); a string of digits was blamed on its first character."""
    raw = target_config()
    raw["text_config"]["moe_layer_freq"] = value
    with pytest.raises(ConfigError, match=rf"^x\.json: text_config\.moe_layer_freq: must be a list, got "
                                          rf"{type(value).__name__}$"):
        M3Config.from_dict(raw, "x.json")


def test_an_index_head_narrower_than_the_rotary_dim_is_refused():
    """The index q and k take the same partial RoPE as the main heads (the first rotary_dim channels,
    shared/reference/minimax_m3_msa.md 2.1): a 4-wide index head cannot hold the 8 rotated channels."""
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["sparse_index_dim"] = 4
    with pytest.raises(ConfigError, match=r"^x\.json: index head dim 4 is smaller than the rotary dim 8$"):
        M3Config.from_dict(raw, "x.json")


def test_a_block_score_other_than_max_is_refused_naming_the_field():
    """MSA scores a block by the max over its tokens (minimax_m3_msa.md 2.2), the only rule implemented."""
    raw = target_config()
    raw["text_config"]["sparse_attention_config"]["sparse_score_type"] = "sum"
    with pytest.raises(ConfigError, match=r"^x\.json: text_config\.sparse_attention_config\.sparse_score_type: "
                                          r"'sum' is not supported \(only 'max'\)$"):
        M3Config.from_dict(raw, "x.json")


def test_a_block_score_type_of_a_model_without_sparse_layers_is_read_like_transformers():
    """No sparse layer, no index branch: the section's score type changes nothing and is not refused
    (as its init blocks and index sizes are not)."""
    raw = target_config()
    section = raw["text_config"]["sparse_attention_config"]
    section.update(sparse_score_type="sum", sparse_attention_freq=[0] * len(section["sparse_attention_freq"]))
    cfg = M3Config.from_dict(raw)
    assert not any(cfg.sparse_layers)
    _assert_same(cfg, _as_transformers_sees_it(raw))


@pytest.mark.parametrize("change, match", [
    (dict(vocab_size=0), r"vocab_size: must be >= 1, got 0"),
    (dict(num_layers=0, sparse_layers=(), moe_layers=()), r"num_layers: must be >= 1, got 0"),
    (dict(head_dim=0), r"head_dim: must be >= 1, got 0"),
    (dict(sparse_layers=(True,) * 7), r"per-layer patterns have 7 / 8 entries for 8 layers"),
    (dict(moe_layers=(True,) * 9), r"per-layer patterns have 8 / 9 entries for 8 layers"),
    (dict(topk_blocks=0, local_blocks=0), r"bad selection sizes topk=0 local=0 init=0"),
    (dict(local_blocks=-1), r"bad selection sizes topk=3 local=-1 init=0"),
    (dict(init_blocks=-1), r"bad selection sizes topk=3 local=1 init=-1"),
])
def test_sizes_the_parser_cannot_produce_are_refused_by_the_dataclass(change, match):
    """`M3Config` itself (not only the parser, whose field reads refuse these first) holds positive sizes,
    one pattern entry per layer and a selection of at least one block."""
    from dataclasses import replace

    cfg = M3Config.from_dict(target_config(), "x.json")
    with pytest.raises(ConfigError, match=rf"^x\.json: {match}$"):
        replace(cfg, **change)


@pytest.mark.parametrize("top,text,generation", [
    (7, None, None), (None, 9, None), (7, 9, None), (None, 9, {"eos_token_id": [3, 5]}), (None, None, None),
    (None, 9, {"do_sample": False}),
])
def test_eos_ids_are_read_as_transformers_generate_reads_them(tmp_path, top, text, generation):
    import transformers

    from m3_eagle_plugin.models.config import eos_token_ids

    raw = target_config()
    raw["eos_token_id"], raw["text_config"]["eos_token_id"] = top, text
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
        want = transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id
    else:
        want = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(tmp_path)).eos_token_id
    want = () if want is None else tuple(want) if isinstance(want, list) else (want,)
    assert eos_token_ids(tmp_path) == want


@pytest.mark.parametrize("top,text", [("absent", "absent"), (None, "absent"), ("absent", 9), (7, "absent"), (None, 9)],
                         ids=["both-absent", "top-null", "text-9", "top-7", "top-null-text-9"])
def test_an_eos_key_left_out_is_no_eos_as_from_pretrained_reads_it(tiny_dir, tmp_path, top, text):
    """A key left out is not the text config's class default (200020, what `from_model_config` of the
    parsed config gives): without generation_config.json, `from_pretrained` builds the generation config
    `generate` uses from the raw config.json, where a left-out key is no eos (a guard, not a fix)."""
    import shutil

    import transformers

    from m3_eagle_plugin.models.config import eos_token_ids

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_dir / "target", path)
    raw = json.loads((path / "config.json").read_text())
    for fields, value in ((raw, top), (raw["text_config"], text)):
        fields.pop("eos_token_id", None)
        if value != "absent":
            fields["eos_token_id"] = value
    (path / "config.json").write_text(json.dumps(raw))
    want = transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(path).generation_config.eos_token_id
    assert eos_token_ids(path) == (() if want is None else (want,))


@pytest.mark.parametrize("value", ["2", -1, 1.0, [3, "x"], True])
def test_an_eos_id_that_is_no_token_id_names_the_file(tmp_path, value):
    from m3_eagle_plugin.models.config import eos_token_ids

    raw = target_config()
    raw["text_config"]["eos_token_id"] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json: eos_token_id: must be an id or a list of ids >= 0"):
        eos_token_ids(tmp_path)


# ---- adversarial review: hostile files ----

def test_a_layer_count_past_memory_is_refused_naming_its_pattern_before_any_allocation():
    """A production config without the sparse section has no sparse layer; its (False,) * num_hidden_layers
    was built before moe_layer_freq, the list that must have one entry per layer, was read: 10**15 layers
    were a MemoryError (the run blamed its batch options), 10**9 filled 8 GB first."""
    raw = target_config()
    del raw["text_config"]["sparse_attention_config"]
    raw["text_config"]["num_hidden_layers"] = 10 ** 15
    with pytest.raises(ConfigError, match=r"^x\.json: text_config\.moe_layer_freq: has 8 entries, expected 10{15} "):
        M3Config.from_dict(raw, "x.json")


# ---- adversarial review: bounds no context can use ----

@pytest.mark.parametrize("layout", ["production", "text"])
def test_a_top_k_past_the_blocks_any_context_holds_is_refused_naming_its_key(layout):
    """transformers' indexer takes min(top-k, key blocks) columns; the selection here is top-k wide in
    every context, so 10**12 loaded and the first prefill asked for [H, T, 10**12] int32. No context of
    int32 positions (at most 2**31 - 1 tokens) sees more than 2**31 / 4 = 2**29 blocks of 4 tokens:
    that many loads (dense attention at any length), one more is refused by the key the file uses."""
    if layout == "production":
        raw, key = target_config(), r"text_config\.sparse_attention_config\.sparse_topk_blocks"
        section = raw["text_config"]["sparse_attention_config"]
        assert section["sparse_block_size"] == 4
        put = lambda value: section.update(sparse_topk_blocks=value)  # noqa: E731
    else:
        raw, key = tiny_text_config().to_dict(), "index_topk_blocks"
        assert raw["index_block_size"] == 4
        put = lambda value: raw.update(index_topk_blocks=value)  # noqa: E731
    put(2**29)
    assert M3Config.from_dict(raw, "x.json").topk_blocks == 2**29
    for value in (2**29 + 1, 10**12):
        put(value)
        with pytest.raises(ConfigError, match=rf"^x\.json: {key}: must be <= 536870912, the most blocks of 4 "
                                              rf"tokens .* got {value}$"):
            M3Config.from_dict(raw, "x.json")


def test_the_published_block_size_allows_a_top_k_of_every_block_of_an_int32_context():
    """Block 128: (2**31 - 1) tokens fill ceil(.../ 128) = 2**24 blocks, the bound by hand."""
    raw = _published_production_config()
    section = raw["text_config"]["sparse_attention_config"]
    section["sparse_topk_blocks"] = 2**24
    assert M3Config.from_dict(raw).topk_blocks == 2**24
    section["sparse_topk_blocks"] = 2**24 + 1
    with pytest.raises(ConfigError, match=r"sparse_topk_blocks: must be <= 16777216"):
        M3Config.from_dict(raw)


@pytest.mark.parametrize("size", [2**31, 2**40])
def test_a_block_size_past_int32_lengths_is_refused_naming_its_key(size):
    """A whole block's length is a KV length of the step metadata, int32 (MsaDecodeMetadata refuses a
    kv_len of 2**31): 2**30 is the largest power of two that fits. 2**40 loaded, and the run blamed
    --kv-blocks for a cache of one block."""
    raw = target_config()
    section = raw["text_config"]["sparse_attention_config"]
    section.update(sparse_block_size=2**30, sparse_topk_blocks=2)  # 2**31 / 2**30 = 2 blocks at most
    assert M3Config.from_dict(raw, "x.json").block_size == 2**30
    section["sparse_block_size"] = size
    key = r"text_config\.sparse_attention_config\.sparse_block_size"
    with pytest.raises(ConfigError, match=rf"^x\.json: {key}: must be <= 1073741824 \(2\*\*30: .*\), got {size}$"):
        M3Config.from_dict(raw, "x.json")


@pytest.mark.parametrize("change, match", [
    (dict(block_size=2**31), r"sparse block size 2147483648 is past 1073741824 \(a whole block's length must fit "
                             r"the int32 KV lengths\)"),
    (dict(topk_blocks=2**29 + 1), r"top-536870913 selection is past the 536870912 blocks any context holds"),
])
def test_bounds_the_parser_refuses_are_held_by_the_dataclass(change, match):
    from dataclasses import replace

    cfg = M3Config.from_dict(target_config(), "x.json")
    assert cfg.block_size == 4
    with pytest.raises(ConfigError, match=rf"^x\.json: {match}$"):
        replace(cfg, **change)


# ---- adversarial review: keys transformers reads off any config ----

def test_is_causal_false_which_transformers_masks_bidirectionally_is_refused_naming_it():
    """transformers' create_causal_mask reads `is_causal` off the text config and, false, lets a token
    see the ones after it (the first token's logits move); this model is causal only, so it loaded the
    file and ran another model (logits 2.6 off transformers') without a word."""
    import torch
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(tiny_text_config()).eval()
    ids = torch.arange(8)[None]
    with torch.no_grad():
        causal = model(input_ids=ids).logits[0, 0]
        model.config.is_causal = False
        assert not torch.allclose(model(input_ids=ids).logits[0, 0], causal)
    raw = target_config()
    raw["text_config"]["is_causal"] = False
    with pytest.raises(ConfigError, match=r"^x\.json: text_config\.is_causal: false is not supported \(only true\)$"):
        M3Config.from_dict(raw, "x.json")
    raw["text_config"]["is_causal"] = True
    assert M3Config.from_dict(raw) == M3Config.from_dict(target_config())


# ---- mutation-testing gaps ----

@pytest.mark.parametrize("layers,want", [(7, (2, 3, 4)), (9, (2, 4, 6)), (62, (2, 31, 59))])
def test_default_aux_layer_ids_floor_the_middle_layer_for_odd_layer_counts(layers, want):
    """vLLM's default `(2, num_layers // 2, num_layers - 3)`: the middle id rounds down, so an odd
    layer count captures the layer below the middle (7 layers: 3, not 4)."""
    raw = target_config()
    text = raw["text_config"]
    text["num_hidden_layers"] = layers
    text["sparse_attention_config"]["sparse_attention_freq"] = [0] * layers
    text["sparse_attention_config"]["sparse_disable_index_value"] = [1] * layers
    text["moe_layer_freq"] = [0] * layers
    assert M3Config.from_dict(raw).default_aux_layer_ids == want


def test_an_eos_id_of_zero_is_a_token_id_as_transformers_reads_it(tmp_path):
    """Token 0 may end generation: transformers' generation config keeps eos_token_id 0."""
    import transformers

    from m3_eagle_plugin.models.config import eos_token_ids

    raw = target_config()
    raw["eos_token_id"], raw["text_config"]["eos_token_id"] = None, 0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == 0
    assert eos_token_ids(tmp_path) == (0,)


def test_rotary_dim_truncates_head_dim_times_factor_as_transformers_does():
    """transformers rotates int(head_dim * partial_rotary_factor) dims: 16 * 0.47 = 7.52 is 7, odd, so
    refused (rounding to 8 would run 8 dims with frequencies transformers spaces for 7)."""
    raw = target_config()
    raw["text_config"]["partial_rotary_factor"] = 0.47
    assert int(raw["text_config"]["head_dim"] * 0.47) == 7
    with pytest.raises(ConfigError, match=r"rotary dim 7 must be even"):
        M3Config.from_dict(raw)
