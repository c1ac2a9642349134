"""Eagle3 draft loading: name variants, shared embeddings, d2t, and clear errors."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from m3_eagle_plugin.eagle3.checkpoint import (CheckpointError, canonical_name, inspect_draft, load_draft,
                                               parse_draft_config)
from m3_eagle_plugin.models.config import ConfigError
from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.tiny import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB, draft_config, make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target_dir, draft_dir = make_tiny(tmp_path_factory.mktemp("tiny"), seed=3)
    return load_target(target_dir), draft_dir


def _variant(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        tensors = edit_tensors(tensors) or tensors
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loads_public_layout_and_shares_target_embeddings(tiny):
    target, draft_dir = tiny
    head = load_draft(draft_dir, target)
    raw = load_file(str(draft_dir / "model.safetensors"))
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert torch.equal(head.layers[0].self_attn.k_proj.weight, raw["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(head.fc_norm[2].weight, raw["fc_norm.2.weight"])
    assert head.aux_layer_ids == (2, 4, 5)


def test_layers0_and_model_prefix_names_are_equivalent(tiny, tmp_path):
    target, draft_dir = tiny
    renamed = _variant(draft_dir, tmp_path / "d", lambda t: {
        ("model." + k.replace("midlayer.", "layers.0.")): v for k, v in t.items()})
    a, b = load_draft(draft_dir, target), load_draft(renamed, target)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert canonical_name("model.midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"


def test_own_embed_and_lm_head_are_used_when_present_and_asked_for(tiny, tmp_path):
    target, draft_dir = tiny
    own = torch.randn(256, 64)

    def add(t):
        t["embed_tokens.weight"], t["lm_head.weight"] = own, own * 2
    head = load_draft(_variant(draft_dir, tmp_path / "d", add), target, embeddings="own")
    assert head.embed_tokens is not target.embed_tokens
    assert torch.equal(head.embed_tokens.weight, own) and torch.equal(head.lm_head.weight, own * 2)


def test_by_default_the_targets_embed_and_lm_head_replace_the_shipped_ones_which_are_never_read(tiny, tmp_path,
                                                                                                 monkeypatch):
    """Reference §4.4: MiniMax-M3's head ships [200064, 6144] copies the model card says are replaced by
    the target's at serve time; the default serves it so, and reads neither copy (4.9 GB in bf16)."""
    from m3_eagle_plugin.models.safetensors_source import SafetensorsSource

    target, draft_dir = tiny

    def add(t):
        t["embed_tokens.weight"], t["lm_head.weight"] = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    path = _variant(draft_dir, tmp_path / "d", add)
    read = []
    get_many = SafetensorsSource.get_many
    monkeypatch.setattr(SafetensorsSource, "get_many", lambda self, names: read.extend(names) or get_many(self, names))
    head = load_draft(path, target)
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert head.from_target == ("embed_tokens", "lm_head")
    assert read and not {"embed_tokens.weight", "lm_head.weight"} & set(read)
    x = torch.randn(3, HIDDEN)  # logits are the target's: x @ W_target^T, by definition of its lm_head
    torch.testing.assert_close(head.lm_head(x), x @ target.lm_head.weight.T)


def test_a_reduced_vocabulary_keeps_its_shipped_lm_head_by_default_and_takes_the_targets_embedding(tiny, tmp_path):
    """A smaller draft vocabulary's own lm_head is trained for its ids: the target's rows are no substitute.
    The embedding is indexed by target ids whatever the draft vocabulary, so the target's serves."""
    target, draft_dir = tiny
    own_lm_head = torch.randn(16, HIDDEN)

    def add(t):
        t["d2t"], t["lm_head.weight"] = torch.arange(16), own_lm_head
        t["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    head = load_draft(_variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=16)), target)
    assert torch.equal(head.lm_head.weight, own_lm_head) and head.embed_tokens is target.embed_tokens
    assert head.from_target == ("embed_tokens",)


def test_a_full_vocabulary_in_another_order_keeps_its_shipped_lm_head_by_default(tiny, tmp_path):
    target, draft_dir = tiny
    own_lm_head = torch.randn(VOCAB, HIDDEN)

    def add(t):
        t["d2t"], t["lm_head.weight"] = torch.arange(VOCAB).flip(0) * 2 - (VOCAB - 1), own_lm_head  # d -> V-1-d
    head = load_draft(_variant(draft_dir, tmp_path / "d", add), target)
    assert torch.equal(head.lm_head.weight, own_lm_head) and head.from_target == ("embed_tokens",)


@pytest.mark.parametrize("embeddings", ["shared", "", None, 1, "TARGET"])
def test_an_unknown_embeddings_choice_is_refused_naming_the_choices(tiny, embeddings):
    target, draft_dir = tiny
    with pytest.raises(ValueError, match=r"^embeddings must be one of 'target', 'own', got "):
        inspect_draft(draft_dir, target.config, embeddings=embeddings)
    if embeddings is not None:  # None is load_draft's "the plan's, else target"
        with pytest.raises(ValueError, match=r"^embeddings must be one of 'target', 'own', got "):
            load_draft(draft_dir, target, embeddings=embeddings)


def test_a_plan_inspected_for_one_embeddings_choice_is_not_loaded_for_the_other(tiny):
    target, draft_dir = tiny
    plan = inspect_draft(draft_dir, target.config, embeddings="own")
    with pytest.raises(ValueError, match=r"embeddings='target', but the draft plan was inspected with "
                                         r"embeddings='own': pass it to inspect_draft"):
        load_draft(plan, target, embeddings="target")
    assert load_draft(plan, target, embeddings="own").embed_tokens is target.embed_tokens  # ships none


def test_sharing_shipped_embeddings_in_another_dtype_names_the_own_choice(tiny, tmp_path):
    target, draft_dir = tiny

    def add(t):
        t["embed_tokens.weight"], t["lm_head.weight"] = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    path = _variant(draft_dir, tmp_path / "d", add)
    with pytest.raises(ValueError, match=r"must be loaded in that dtype and device, got torch.float16 on cpu \(or "
                                         r"load with embeddings='own' to use the ones the checkpoint ships\)$"):
        load_draft(path, target, dtype=torch.float16)
    assert load_draft(path, target, dtype=torch.float16, embeddings="own").lm_head.weight.dtype == torch.float16


def test_sharing_in_another_dtype_names_the_own_choice_only_where_it_would_share_nothing(tiny, tmp_path):
    """The checkpoint ships an embedding but no lm_head: 'own' still shares the target's lm_head, so
    the dtype error must not send the user to it (it failed the same way)."""
    target, draft_dir = tiny

    def add(t):
        t["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    path = _variant(draft_dir, tmp_path / "d", add)
    for embeddings in ("target", "own"):
        with pytest.raises(ValueError, match=r"must be loaded in that dtype and device, got torch.float16 on cpu$"):
            load_draft(path, target, dtype=torch.float16, embeddings=embeddings)


@pytest.mark.parametrize(
    "ships, taken",
    [
        ((), ("embed_tokens", "lm_head")),
        (("embed_tokens",), ("lm_head",)),
        (("lm_head",), ("embed_tokens",)),
        (("embed_tokens", "lm_head"), ()),
    ],
)
@pytest.mark.parametrize("embeddings", ["own", "target"])
def test_from_target_names_each_module_the_checkpoint_does_not_ship(tiny, tmp_path, ships, taken, embeddings):
    target, draft_dir = tiny
    if embeddings == "target":  # full vocabulary, target order: both are the target's, shipped or not
        taken = ("embed_tokens", "lm_head")

    def add(t):
        for name in ships:
            t[f"{name}.weight"] = torch.randn(VOCAB, HIDDEN)
    head = load_draft(_variant(draft_dir, tmp_path / "d", add), target, embeddings=embeddings)
    assert head.from_target == taken
    for name in ("embed_tokens", "lm_head"):
        assert (getattr(head, name) is getattr(target, name)) == (name in taken), name


def test_d2t_places_draft_logits_at_target_ids(tiny, tmp_path):
    target, draft_dir = tiny
    vd = 32
    d2t = torch.arange(vd) * 7 % 200 - torch.arange(vd)  # draft id d -> target id (7d mod 200)

    def add(t):
        t["d2t"], t["t2d"] = d2t, torch.zeros(256, dtype=torch.bool)

    def cfg(c):
        c["draft_vocab_size"] = vd
    head = load_draft(_variant(draft_dir, tmp_path / "d", add, cfg), target)
    target_ids = torch.arange(vd) + d2t
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[target_ids])  # restricted target head
    hidden = torch.randn(3, 64)
    draft = head.draft_logits(hidden)
    full = head.to_target_logits(draft)
    assert full.shape == (3, 256)
    assert torch.equal(full[:, target_ids], draft)
    mask = torch.ones(256, dtype=torch.bool)
    mask[target_ids] = False
    assert torch.isinf(full[:, mask]).all()
    assert torch.equal(head.draft_to_target(draft.argmax(-1)), full.argmax(-1))


def test_reduced_vocab_without_d2t_is_an_error(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d", edit_config=lambda c: c.update(draft_vocab_size=32))
    with pytest.raises(CheckpointError, match="no 'd2t'"):
        load_draft(path, target)


def test_unknown_and_missing_tensors_in_one_error(tiny, tmp_path):
    target, draft_dir = tiny

    def edit(t):
        del t["midlayer.hidden_norm.weight"], t["fc_norm.1.weight"]
        t["midlayer.self_attn.q_norm.weight"] = torch.ones(16)
    path = _variant(draft_dir, tmp_path / "d", edit)
    with pytest.raises(CheckpointError) as err:
        load_draft(path, target)
    msg = str(err.value)
    assert "model.safetensors" in msg and "2 missing" in msg and "layers.0.hidden_norm.weight" in msg
    assert "fc_norm.1.weight" in msg and "1 unknown" in msg and "midlayer.self_attn.q_norm.weight" in msg


def test_shape_mismatch_names_tensor_and_shapes(tiny, tmp_path):
    target, draft_dir = tiny

    def edit(t):
        t["midlayer.self_attn.k_proj.weight"] = torch.zeros(64, 128)
    path = _variant(draft_dir, tmp_path / "d", edit)
    with pytest.raises(CheckpointError, match=r"midlayer\.self_attn\.k_proj\.weight.*\(64, 128\).*\(32, 128\)"):
        load_draft(path, target)


def test_hidden_size_mismatch_is_clear(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d", edit_config=lambda c: c.update(hidden_size=96))
    with pytest.raises(ConfigError, match="hidden_size 96.*target model's hidden size 64"):
        load_draft(path, target)


def test_aux_ids_out_of_range(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d",
                    edit_config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 4, 8]))
    with pytest.raises(ConfigError, match=r"\[8\]"):
        load_draft(path, target)


def test_nothing_is_assigned_when_validation_fails(tiny, tmp_path):
    """A failed load leaves the target untouched (shared modules are attached only at the end)."""
    target, draft_dir = tiny
    before = {k: v.clone() for k, v in target.state_dict().items()}
    path = _variant(draft_dir, tmp_path / "d", lambda t: {k: v for k, v in t.items() if k != "norm.weight"})
    with pytest.raises(CheckpointError):
        load_draft(path, target)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    shutil.rmtree(path)


# ---- bad draft configs and files: one error "<file>: <field>: <what is wrong>", nothing loaded ----

def _parse(raw, **overrides):
    kwargs = dict(target_hidden_size=HIDDEN, target_vocab_size=VOCAB, default_aux_layer_ids=(2, 4, 5),
                  has_fc_norm=True, target_num_layers=8)
    kwargs.update(overrides)
    return parse_draft_config(raw, "d.json", **kwargs)


def test_parse_draft_config_reads_the_tiny_draft():
    config = _parse(draft_config())
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.aux_layer_ids == (2, 4, 5) and config.norm_output is True


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(num_attention_heads="four"),
     "d.json: num_attention_heads: expected an integer, got str 'four'"),
    (lambda r: r.update(intermediate_size=[96]), "d.json: intermediate_size: expected an integer, got list [96]"),
    (lambda r: r.update(head_dim=16.5), "d.json: head_dim: expected an integer, got 16.5"),
    (lambda r: r.update(num_key_value_heads=-1), "d.json: num_key_value_heads: must be >= 1, got -1"),
    (lambda r: r.update(num_key_value_heads=3), "d.json: num_key_value_heads: 3 does not divide num_attention_heads 4"),
    (lambda r: r.update(rms_norm_eps="small"), "d.json: rms_norm_eps: expected a finite number, got str 'small'"),
    (lambda r: r.update(draft_vocab_size=10 ** 6), "d.json: draft_vocab_size: 1000000 exceeds vocab_size 256"),
    (lambda r: r.update(vocab_size=512), "d.json: vocab_size: draft vocab_size 512 != target vocab_size 256"),
    # no head_dim: hidden_size // heads, which more heads than hidden channels leave at 0
    (lambda r: (r.pop("head_dim"), r.update(num_attention_heads=128)),
     "d.json: num_attention_heads: 128 heads leave no room in hidden_size 64"),
    (lambda r: r.update(eagle_config="yes"), "d.json: eagle_config: must be a JSON object, got str"),
    # an odd head cannot be rotated in two halves: the head's RoPE refused it naming neither file nor field
    (lambda r: r.update(head_dim=15),
     "d.json: head_dim: head_dim 15 is odd; the draft's RoPE rotates the whole head in two halves and needs it even"),
    (lambda r: (r.pop("head_dim"), r.update(num_attention_heads=64, num_key_value_heads=64, hidden_size=64 * 3)),
     "d.json: num_attention_heads: head_dim 3 (hidden_size 192 // 64 heads) is odd; the draft's RoPE rotates the "
     "whole head in two halves and needs it even"),
    (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, "4", 5]),
     "d.json: eagle_config.eagle_aux_hidden_state_layer_ids[1]: expected an integer, got str '4'"),
    (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 99]),
     "d.json: eagle_config.eagle_aux_hidden_state_layer_ids: aux layer ids [99] out of range for a 8-layer target"),
    (lambda r: r.update(norm_output="yes"), "d.json: norm_output: expected true or false, got str 'yes'"),
    (lambda r: r.update(rope_scaling={"type": "yarn"}),
     "d.json: rope_scaling.type: unsupported draft rope type 'yarn' (only 'default')"),
    # transformers lets a non-empty legacy rope_scaling replace rope_parameters (so does the target's
    # parser); the draft read rope_parameters first and ran unscaled RoPE.
    (lambda r: r.update(rope_parameters={"rope_type": "default"}, rope_scaling={"rope_type": "linear", "factor": 4.0}),
     "d.json: rope_scaling.rope_type: unsupported draft rope type 'linear' (only 'default')"),
    (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[4]),
     "d.json: eagle_config.eagle_aux_hidden_state_layer_ids: 1 aux layer id(s); Eagle3 needs at least 2"),
    (lambda r: r.update(hidden_act="gelu"),
     "d.json: hidden_act: 'gelu' is not supported (the draft MLP is SiLU-gated)"),
    (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 5, 2]),
     "d.json: eagle_config.eagle_aux_hidden_state_layer_ids: aux layer ids [2, 5, 2] repeat a layer"),
    (lambda r: r.update(num_aux_hidden_states=4),
     "d.json: num_aux_hidden_states: 4 does not match the 3 aux layer ids [2, 4, 5]"),
    (lambda r: r.update(fc_norm="yes"), "d.json: fc_norm: expected true or false, got str 'yes'"),
    (lambda r: r["eagle_config"].update(norm_before_fc=2),
     "d.json: eagle_config.norm_before_fc: expected true or false, got int 2"),
])
def test_bad_draft_config_values(edit, message):
    raw = draft_config()
    edit(raw)
    with pytest.raises(ConfigError) as info:
        _parse(raw)
    assert str(info.value) == message


def test_draft_config_that_is_not_an_object():
    with pytest.raises(ConfigError, match="^d.json: top level: must be a JSON object, got list$"):
        _parse([1, 2])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(value=st.one_of(st.integers(-2, 9), st.floats(-2, 9), st.booleans(), st.text(max_size=3),
                       st.lists(st.integers(1, 4), max_size=2)))
@example(value=4.0)  # an integral JSON float: the bounded float draws never gave one
def test_any_json_value_for_draft_heads_parses_exactly_or_names_the_field(value):
    raw = draft_config()
    kv_heads = raw["num_key_value_heads"]
    raw["num_attention_heads"] = value
    raw.pop("head_dim")  # derived from the head count, so any divisor of hidden_size is a valid config
    exact = not isinstance(value, bool) and isinstance(value, (int, float)) and float(value).is_integer()
    if exact and value >= kv_heads and value % kv_heads == 0 and raw["hidden_size"] // value >= 1:
        heads = _parse(raw).num_heads
        assert heads == value and type(heads) is int
    else:
        with pytest.raises(ConfigError, match=r"^d\.json: (num_attention_heads|num_key_value_heads): "):
            _parse(raw)


def test_draft_config_that_is_not_json_names_the_file(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d")
    (path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match=rf"^{path / 'config.json'}: not valid JSON \("):
        load_draft(path, target)


def test_truncated_draft_safetensors_names_the_file(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=rf"^{file}: not a readable safetensors file \("):
        load_draft(path, target)


def test_full_size_d2t_in_another_order_scores_each_target_id_with_its_own_row(tiny, tmp_path):
    """d2t may permute a full-size draft vocabulary; the shared target lm_head must then follow it."""
    target, draft_dir = tiny
    target_ids = (torch.arange(VOCAB) * 3 + 1) % VOCAB  # a permutation (3 is odd, VOCAB a power of 2)
    path = _variant(draft_dir, tmp_path / "d", lambda t: t.update(d2t=target_ids - torch.arange(VOCAB)))
    head = load_draft(path, target)
    hidden = torch.randn(3, HIDDEN)
    want = hidden @ target.lm_head.weight.T  # by definition: target id t is scored by target row t
    assert torch.allclose(head.to_target_logits(head.draft_logits(hidden)), want, atol=1e-5)


def test_all_zero_d2t_keeps_sharing_the_target_lm_head(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d", lambda t: t.update(d2t=torch.zeros(VOCAB, dtype=torch.long)))
    assert load_draft(path, target).lm_head is target.lm_head


def test_non_integer_d2t_is_refused_by_inspect_draft_before_the_target_is_read(tiny, tmp_path):
    """The reference host inspects the draft before it reads the target's weights; the d2t dtype is in
    the safetensors header, so a float d2t is refused there (it was refused only by `load_draft`)."""
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d", lambda t: t.update(d2t=torch.full((VOCAB,), 0.5)))
    for load in (lambda: inspect_draft(path, target.config), lambda: load_draft(path, target)):
        with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'd2t' is stored as F32; d2t must hold "
                                                  r"integer id offsets$"):
            load()


@pytest.mark.parametrize("dtype, stored", [(torch.int32, "I32"), (torch.uint8, "U8")])
def test_an_integer_d2t_of_any_width_or_sign_is_taken(tiny, tmp_path, dtype, stored):
    """Id offsets stored as any integer type (I8..I64, U8..U64) pass the header check: a draft with a
    smaller vocabulary maps draft id i to target id i + d2t[i]."""
    from safetensors import safe_open

    target, draft_dir = tiny
    d2t = torch.tensor([0, 1, 1, 2, 2, 2, 2, 2], dtype=dtype)  # draft ids 0..7 -> target 0, 2, 3, 5, ..., 9

    def add(t):
        t["d2t"] = d2t
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=8))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_slice("d2t").get_dtype() == stored
    inspect_draft(path, target.config)
    head = load_draft(path, target)
    assert (torch.arange(8) + head.d2t.long()).tolist() == [0, 2, 3, 5, 6, 7, 8, 9]


def test_d2t_mapping_two_draft_ids_to_one_target_id_is_refused(tiny, tmp_path):
    """Both rows would land on one target logit (which one wins is unspecified); the other id is lost."""
    target, draft_dir = tiny
    d2t = torch.tensor([0, 1, 0, 10, 10, 10, 10, 10])  # draft 1 -> target 2, draft 2 -> target 2

    def add(t):
        t["d2t"] = d2t
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=8))
    with pytest.raises(CheckpointError, match=r"d2t maps draft ids \[1, 2\] to the same target id 2"):
        load_draft(path, target)


def test_draft_weight_stored_as_integers_is_refused_by_name(tiny, tmp_path):
    target, draft_dir = tiny

    def edit(t):
        t["fc.weight"] = (t["fc.weight"] * 100).to(torch.int16)
    path = _variant(draft_dir, tmp_path / "d", edit)
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' is stored as I16; weights must be one of"):
        load_draft(path, target)


def test_float8_draft_with_scale_tensors_is_refused_as_quantized(tiny, tmp_path):
    """An FP8 export stores each weight as float8 next to a `weight_scale_inv` tensor: the error names the
    stored dtype (the cause), not the scale tensor as an unknown name."""
    target, draft_dir = tiny

    def edit(t):
        t["fc.weight"] = t["fc.weight"].to(torch.float8_e4m3fn)
        t["fc.weight_scale_inv"] = torch.ones(1)
    path = _variant(draft_dir, tmp_path / "d", edit)
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' is stored as F8_E4M3; .*quantized checkpoints"):
        load_draft(path, target)


def test_missing_llama_fields_take_transformers_llama_defaults():
    """A draft config may leave out what `LlamaConfig` defaults (SafeAILab / SpecForge exports often
    do): rms_norm_eps, num_key_value_heads (= heads, MHA), head_dim (= hidden // heads) and the RoPE
    theta. The oracle is transformers' own `LlamaConfig` built from the same dict."""
    from transformers import LlamaConfig

    raw = draft_config()
    for key in ("rms_norm_eps", "num_key_value_heads", "head_dim", "rope_theta"):
        raw.pop(key)
    raw["num_attention_heads"] = 8  # head_dim then differs from the tiny draft's 16
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "eagle_config"})
    config = _parse(raw)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.num_kv_heads == hf.num_key_value_heads == 8
    assert config.head_dim == hf.head_dim == HIDDEN // 8
    assert config.rope_theta == hf.rope_parameters["rope_theta"]


def test_rope_theta_is_read_from_rope_parameters_as_transformers_does():
    from transformers import LlamaConfig

    raw = draft_config()
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "eagle_config"})
    assert _parse(raw).rope_theta == hf.rope_parameters["rope_theta"] == 123456.0


def test_a_flat_key_wins_over_the_same_key_in_eagle_config():
    """The module docstring: each flag may sit at the top level or in eagle_config, and the flat one
    wins; checked both ways round for each boolean flag and for the aux ids."""
    for key in ("norm_output", "norm_before_residual", "norm_before_fc"):
        for flat in (False, True):
            raw = draft_config()
            raw[key] = flat
            raw["eagle_config"][key] = not flat
            assert getattr(_parse(raw), key) is flat, (key, flat)
    raw = draft_config()
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    assert _parse(raw).aux_layer_ids == (1, 3, 6)


def test_d2t_pointing_one_past_the_target_vocabulary_is_refused(tiny, tmp_path):
    """Target ids run 0..V-1: a draft id mapped to V (an off-by-one at the top) is outside."""
    target, draft_dir = tiny
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[7] = VOCAB - 7  # draft 7 -> target id VOCAB

    def add(t):
        t["d2t"] = d2t
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=8))
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the target vocabulary"):
        load_draft(path, target)
    d2t[7] = VOCAB - 8  # draft 7 -> target id VOCAB - 1: the last valid id loads
    path = _variant(draft_dir, tmp_path / "ok", add, lambda c: c.update(draft_vocab_size=8))
    assert int(load_draft(path, target).draft_to_target(torch.tensor([7]))) == VOCAB - 1


def test_d2t_pointing_below_target_id_zero_is_refused(tiny, tmp_path):
    """Target ids start at 0: draft id 0 mapped to -1 would gather the target's LAST lm_head row
    (negative indexing) and score the wrong token."""
    target, draft_dir = tiny
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[0] = -1

    def add(t):
        t["d2t"] = d2t
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=8))
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the target vocabulary"):
        load_draft(path, target)


def test_an_lm_head_gathered_from_the_target_through_d2t_counts_as_taken_from_the_target(tiny, tmp_path):
    """A reduced draft vocabulary without its own lm_head gets the target's rows gathered into draft
    order: built from the target (rebuilt at every load), so `from_target` names it and training keeps it."""
    target, draft_dir = tiny

    def add(t):
        t["d2t"] = torch.arange(16)  # draft d -> target 2d

    head = load_draft(_variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=16)), target)
    assert head.lm_head is not target.lm_head
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[2 * torch.arange(16)])
    assert head.from_target == ("embed_tokens", "lm_head")


@pytest.mark.parametrize("tensor, stored", [("d2t", torch.arange(32)), ("lm_head.weight", torch.randn(32, HIDDEN))])
def test_a_short_draft_vocabulary_without_draft_vocab_size_names_the_field_to_set(tiny, tmp_path, tensor, stored):
    """Without draft_vocab_size the draft vocabulary is the target's (VOCAB rows); a 32-row d2t or lm_head read
    only "the model expects (256,)", naming no config field."""
    target, draft_dir = tiny

    def add(t):
        t[tensor] = stored
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.pop("draft_vocab_size"))
    want = (f"tensor '{tensor}' has shape {tuple(stored.shape)}, the model expects {(VOCAB,) + tuple(stored.shape[1:])}"
            f"; the draft vocabulary size {VOCAB} comes from {path / 'config.json'}'s draft_vocab_size (absent: the "
            "target's vocab_size)")
    with pytest.raises(CheckpointError, match=re.escape(want) + "$") as info:
        inspect_draft(path, target.config)
    assert "\n" not in str(info.value)


def test_a_wrong_hidden_width_of_a_shipped_lm_head_blames_no_vocabulary_field(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d", lambda t: t.update({"lm_head.weight": torch.randn(VOCAB, 2 * HIDDEN)}))
    with pytest.raises(CheckpointError, match=re.escape(f"the model expects {(VOCAB, HIDDEN)}") + "$"):
        inspect_draft(path, target.config)


_CUDA = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("target_device, head_device", [
    ("cpu", "cpu"), pytest.param("cpu", "cuda", marks=_CUDA), pytest.param("cuda", "cpu", marks=_CUDA)])
def test_an_lm_head_gathered_through_d2t_onto_another_device_holds_the_target_rows(tiny, tmp_path, target_device,
                                                                                   head_device):
    """The checkpoint ships its embedding, not its lm_head: nothing is shared, the target's rows are gathered
    and copied to the head's device. The gather indexed the target's lm_head with ids on the head's device
    ("indices should be either on cpu or on the same device as the indexed tensor")."""
    target_dir, draft_dir = make_tiny(tmp_path / "tiny", seed=3)
    own_embed = torch.randn(VOCAB, HIDDEN)

    def add(t):
        t["d2t"], t["embed_tokens.weight"] = torch.arange(16), own_embed  # draft d -> target 2d
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=16))
    head = load_draft(path, load_target(target_dir, device=target_device), device=head_device, embeddings="own")
    assert head.lm_head.weight.device.type == head_device and head.from_target == ("lm_head",)
    want = load_file(str(target_dir / "model.safetensors"))["language_model.lm_head.weight"][2 * torch.arange(16)]
    assert torch.equal(head.lm_head.weight.cpu(), want)
    assert torch.equal(head.embed_tokens.weight.cpu(), own_embed)


def test_two_stored_names_of_one_weight_are_refused(tiny, tmp_path):
    """`midlayer.x` and `model.layers.0.x` are the same weight: a checkpoint holding both is ambiguous."""
    target, draft_dir = tiny

    def add(t):
        t["model.layers.0.hidden_norm.weight"] = t["midlayer.hidden_norm.weight"] * 2
    path = _variant(draft_dir, tmp_path / "d", add)
    with pytest.raises(CheckpointError, match=r"tensors '.*hidden_norm.weight' and '.*hidden_norm.weight' name "
                                              r"the same weight$"):
        load_draft(path, target)


def test_rope_theta_in_rope_parameters_wins_over_a_top_level_one_as_in_transformers():
    from transformers import LlamaConfig

    raw = draft_config()
    raw["rope_theta"] = 111.0
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 222.0}
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "eagle_config"})
    assert _parse(raw).rope_theta == hf.rope_parameters["rope_theta"] == 222.0


# ---- review: inputs the tests above did not model ----


@pytest.mark.parametrize("layers, message", [
    (6, "repeat a layer"),  # (2, 3, 3)
    (2, "out of range for a 2-layer target"),  # (2, 1, -1)
])
def test_default_aux_ids_that_do_not_fit_a_small_target_name_the_default_not_the_config(layers, message):
    """A config that lists no aux ids takes vLLM's default (2, L//2, L-3); where that does not fit the
    target, the error says the ids were not given and are the default (it read as if the config had
    listed them, a key the file does not hold)."""
    raw = draft_config()
    del raw["eagle_config"]
    with pytest.raises(ConfigError) as info:
        _parse(raw, default_aux_layer_ids=(2, layers // 2, layers - 3), target_num_layers=layers)
    assert str(info.value).startswith("d.json: eagle_config.eagle_aux_hidden_state_layer_ids: not given, and the "
                                      "target's default (2, L//2, L-3) aux layer ids [")
    assert message in str(info.value)


def test_a_draft_directory_without_a_config_is_refused_as_missing(tiny, tmp_path):
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d")
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match=rf"^no config\.json at {re.escape(str(path / 'config.json'))}$"):
        inspect_draft(path, target.config)


def test_a_directory_named_config_json_in_the_draft_is_not_called_missing(tiny, tmp_path):
    """As for the target's config: the file is there, it is not a file."""
    target, draft_dir = tiny
    path = _variant(draft_dir, tmp_path / "d")
    (path / "config.json").unlink()
    (path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path / 'config.json'))} is not a file$"):
        inspect_draft(path, target.config)


@pytest.mark.parametrize("edit, field", [
    (dict(hidden_size=96), "hidden_size"),
    (dict(target_hidden_size=128), "target_hidden_size"),  # hidden_size is right: "64 ... does not match 64"
])
def test_a_hidden_size_mismatch_names_the_field_that_differs(edit, field):
    raw = draft_config()
    raw.update(edit)
    with pytest.raises(ConfigError, match=rf"^d\.json: {field}: draft hidden_size "):
        _parse(raw)


def test_a_plan_checked_against_another_target_is_refused(tiny, tmp_path):
    """A plan holds `inspect_draft`'s checks for the target it was given: loaded with another (a smaller
    vocabulary here) the head shared that target's 128-row embedding and lm_head under a config of 256,
    where the directory itself is refused."""
    target, draft_dir = tiny
    src = draft_dir.parent / "target"  # make_tiny writes the pair side by side

    def smaller_vocab(tensors):
        for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"):
            tensors[name] = tensors[name][:128].clone()

    other = load_target(_variant(src, tmp_path / "t", smaller_vocab,
                                 lambda c: c["text_config"].update(vocab_size=128)))
    with pytest.raises(ConfigError, match="vocab_size"):  # the oracle: the directory against this target
        load_draft(draft_dir, other)
    plan = inspect_draft(draft_dir, target.config)
    layers = target.config.num_layers
    with pytest.raises(ValueError, match=r"the draft plan was checked against a target of hidden size, vocabulary "
                                         rf"and layers \({HIDDEN}, {VOCAB}, {layers}\), not this one's "
                                         rf"\({HIDDEN}, 128, {layers}\)$"):
        load_draft(plan, other)
    assert load_draft(plan, target).lm_head is target.lm_head  # its own target still takes it


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_of_the_draft_checkpoint_is_refused_naming_the_directory_it_needs(tiny, name):
    """Given its config.json, the load said 'no config.json at .../config.json/config.json'; `load_target`
    refuses a file of its checkpoint the same way."""
    target, draft_dir = tiny
    path = draft_dir / name
    want = "^" + re.escape(str(path)) + r": the Eagle3 draft is read from its checkpoint directory"
    for load in (lambda: inspect_draft(path, target.config), lambda: load_draft(path, target)):
        with pytest.raises(CheckpointError, match=want):
            load()


@pytest.mark.parametrize("d2t, why", [
    ([0, 0, 0, 0, 0, 0, 0, VOCAB - 7], "d2t maps draft ids outside the target vocabulary"),  # draft 7 -> VOCAB
    ([0, 1, 0, 10, 10, 10, 10, 10], r"d2t maps draft ids \[1, 2\] to the same target id 2"),
])
def test_a_d2t_that_does_not_fit_the_target_is_refused_by_inspect_draft_before_the_target_is_read(
        tiny, tmp_path, d2t, why):
    """README: a draft that does not fit its target fails before any weight is read. The reference host
    inspects the draft, then reads the target's weights, then loads the head: a d2t naming target ids
    past the vocabulary, or one id twice, was refused only then, after the whole target was read."""
    target, draft_dir = tiny

    def add(t):
        t["d2t"] = torch.tensor(d2t)
    path = _variant(draft_dir, tmp_path / "d", add, lambda c: c.update(draft_vocab_size=8))
    for load in (lambda: inspect_draft(path, target.config), lambda: load_draft(path, target)):
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path / 'model.safetensors'))}: {why}"):
            load()


# ---- adversarial review: published config keys that change the head ----

def test_use_aux_hidden_state_false_in_eagle_config_is_refused_naming_it(tiny, tmp_path):
    """vLLM's llama_eagle3 (the reference's semantic oracle, §4.3) reads `eagle_config.use_aux_hidden_state`
    and, when false, builds no fc, skips the fc weights and feeds the target's last hidden state; the head
    loaded it anyway and ran fc on aux captures. vLLM reads the key in eagle_config only (a flat one is
    not its switch), and true is the published value (SpecForge, TorchSpec)."""
    target, draft_dir = tiny
    off = _variant(draft_dir, tmp_path / "off", edit_config=lambda c: c["eagle_config"].update(
        use_aux_hidden_state=False))
    want = rf"^{re.escape(str(off / 'config.json'))}: eagle_config\.use_aux_hidden_state: false is not supported"
    for load in (lambda: inspect_draft(off, target.config), lambda: load_draft(off, target)):
        with pytest.raises(ConfigError, match=want):
            load()
    flat = _variant(draft_dir, tmp_path / "flat", edit_config=lambda c: c.update(use_aux_hidden_state=False))
    assert load_draft(flat, target).fc.in_features == 3 * HIDDEN


def test_eh_proj_before_attn_in_eagle_config_is_refused_naming_it(tiny, tmp_path):
    """TensorRT-LLM's Eagle3 draft layer reads `eagle_config.eh_proj_before_attn` and, true, builds another
    head (an eh_proj before an attention over hidden_size inputs); the config loaded here as the usual head.
    False, the published value, loads."""
    target, draft_dir = tiny
    on = _variant(draft_dir, tmp_path / "on", edit_config=lambda c: c["eagle_config"].update(eh_proj_before_attn=True))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(on / 'config.json'))}: eagle_config\.eh_proj_before_attn: "
                                          r"true is not supported"):
        inspect_draft(on, target.config)
    off = _variant(draft_dir, tmp_path / "off", edit_config=lambda c: c["eagle_config"].update(
        eh_proj_before_attn=False))
    assert load_draft(off, target).fc.in_features == 3 * HIDDEN


def test_a_draft_config_of_more_decoder_layers_is_refused_naming_it(tiny, tmp_path):
    """vLLM and SGLang build `num_hidden_layers` decoder layers for an Eagle3 draft (vLLM refuses one whose
    weights are missing); a config saying 2 over a one-layer checkpoint loaded as a one-layer head."""
    target, draft_dir = tiny
    two = _variant(draft_dir, tmp_path / "two", edit_config=lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(two / 'config.json'))}: num_hidden_layers: 2 draft "
                                          r"decoder layers are not supported \(only 1\)$"):
        load_draft(two, target)
    absent = _variant(draft_dir, tmp_path / "absent", edit_config=lambda c: c.pop("num_hidden_layers"))
    assert len(load_draft(absent, target).layers) == 1


def test_a_speculators_format_config_is_refused_naming_its_format():
    """vLLM's speculators format (`Eagle3Speculator`: the Llama fields nested in transformer_layer_config,
    norm_before_residual defaulting to true) was refused as 'hidden_size: required field is missing'."""
    layer = {k: v for k, v in draft_config().items() if k not in ("eagle_config", "draft_vocab_size",
                                                                   "target_hidden_size", "norm_output", "fc_norm")}
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": VOCAB,
           "norm_before_residual": True, "transformer_layer_config": layer,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy"}}
    with pytest.raises(ConfigError, match=r"^d\.json: transformer_layer_config: a vLLM speculators-format config "
                                          r"is not supported"):
        _parse(raw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn, torch.complex64, "bfloat16"])
def test_a_weight_dtype_no_head_can_run_is_refused_naming_it_as_load_target_does(tiny, tmp_path, dtype):
    """A head shipping its own embedding and lm_head shares nothing with the target, so no shared-module
    check caught the dtype: ints and bool failed inside load_state_dict naming fc.weight's size, float8
    and complex loaded and failed at the first forward. load_target refuses the same dtypes by name."""
    target, draft_dir = tiny

    def own(t):
        t["embed_tokens.weight"], t["lm_head.weight"] = target.embed_tokens.weight, target.lm_head.weight
    path = _variant(draft_dir, tmp_path / "d", own)
    want = rf"^dtype must be a floating dtype of 16 bits or more for the weights, got {dtype}$"
    with pytest.raises(ValueError, match=want):
        load_target(path.parent / "none", dtype=dtype)  # the oracle: the target loader's own refusal
    with pytest.raises(ValueError, match=want):
        load_draft(path, target, dtype=dtype, embeddings="own")
    assert load_draft(path, target, dtype=torch.float16, embeddings="own").fc.weight.dtype == torch.float16


@pytest.mark.parametrize("key, value, field", [("intermediate_size", 2 ** 62, "intermediate_size"),
                                               ("num_attention_heads", 2 ** 62, "num_attention_heads x head_dim"),
                                               ("head_dim", 2 ** 63, "num_attention_heads x head_dim")])
def test_a_draft_size_past_every_stored_dimension_is_refused_by_its_field(tiny, tmp_path, key, value, field):
    """Building the head even on the meta device overflowed torch's sizes (a bare TypeError or
    RuntimeError naming no field); no tensor of the checkpoint can have such a size."""
    target, draft_dir = tiny
    big = _variant(draft_dir, tmp_path / "big", edit_config=lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(big / 'config.json'))}: {re.escape(field)}: \d+, "
                                          r"larger than any dimension of a tensor in .* \(the largest is \d+\)$"):
        inspect_draft(big, target.config)


# ---- HF layouts and a tied target, against the single-file load and the target's own rows ----

def _reduced_vocab_variant(draft_dir, dst, vd=40, seed=0):
    """A draft of `vd` ids scattered over the target vocabulary (d2t), the public way; returns (path, target ids)."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:vd].sort().values
    path = _variant(draft_dir, dst, lambda t: t.update(d2t=ids - torch.arange(vd)),
                    lambda c: c.update(draft_vocab_size=vd))
    return path, ids


def test_a_sharded_draft_with_model_prefixed_names_loads_as_its_single_file(tiny, tmp_path):
    """save_pretrained's sharded form: `model.`-prefixed names split over two shards by an index, d2t
    in the second shard; the head is the one its single file gives, weights, d2t and vocabulary maps."""
    target, draft_dir = tiny
    single, _ = _reduced_vocab_variant(draft_dir, tmp_path / "single")
    tensors = {("model." + k if k != "d2t" else k): v for k, v in load_file(str(single / "model.safetensors")).items()}
    names = sorted(tensors, key=lambda n: (n == "d2t", n))
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(single / "config.json", sharded / "config.json")
    want, got = load_draft(single, target), load_draft(sharded, target)
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name
    assert torch.equal(got.target_ids, want.target_ids) and torch.equal(got.draft_index, want.draft_index)


def test_a_reduced_vocab_draft_of_a_tied_target_scores_with_the_embedding_rows(tmp_path):
    """A target with tie_word_embeddings whose checkpoint holds only the embedding: a draft without an
    lm_head of its own scores draft id d with the embedding row of target id d + d2t[d], in fp32 and
    bf16, and gives every other target id -inf (reference: the hidden times those rows, in float64)."""
    from m3_eagle_plugin.models.tiny import make_tiny as make
    from tests.models._oracle import PagedRunner

    target_dir, draft_dir = make(tmp_path / "tiny", seed=4)
    config = json.loads((target_dir / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = True
    (target_dir / "config.json").write_text(json.dumps(config))
    stored = load_file(str(target_dir / "model.safetensors"))
    del stored["language_model.lm_head.weight"]
    save_file(stored, str(target_dir / "model.safetensors"))
    embedding = stored["language_model.model.embed_tokens.weight"].double()
    path, ids = _reduced_vocab_variant(draft_dir, tmp_path / "d", vd=40, seed=1)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[ids] = False
    gen = torch.Generator().manual_seed(2)
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        target = load_target(target_dir, dtype=dtype)
        head = load_draft(path, target)
        assert head.config.norm_output and head.from_target == ("embed_tokens", "lm_head")
        runner = PagedRunner(target.config, draft_num_kv_heads=head.config.num_kv_heads, dtype=dtype)
        runner.prepare([("a", 5)])
        with torch.no_grad():
            logits, normed = head(torch.randint(0, VOCAB, (5,), generator=gen),
                                  torch.randn(5, 3 * HIDDEN, generator=gen).to(dtype), runner.meta, runner.cache)
        want = normed.double() @ embedding[ids].T
        torch.testing.assert_close(logits[:, ids].double(), want, atol=atol, rtol=0)
        assert torch.isneginf(logits[:, others]).all()


@pytest.mark.parametrize("listed, fc_norm, shown", [
    ([2, 4], True, "aux layer ids [2, 4] feed fc 2 hidden states, but fc.weight in {fc_file} takes 3 (192 = 3 x"),
    ([1, 2, 4, 5], True, "aux layer ids [1, 2, 4, 5] feed fc 4 hidden states, but fc.weight in {fc_file} takes 3"),
    ([2, 4], False, "aux layer ids [2, 4] feed fc 2 hidden states, but fc.weight in {fc_file} takes 3"),
    (None, True, "not given, and the target's default (2, L//2, L-3) aux layer ids [2, 4, 5] feed fc 3 hidden "
                 "states, but fc.weight in {fc_file} takes 4 (256 = 4 x"),
])
def test_aux_ids_of_another_count_than_the_checkpoints_fc_takes_name_the_ids(tiny, tmp_path, listed, fc_norm, shown):
    """fc of the tiny head takes 3 x 64 = 192 inputs (4 x 64 in the last case, a head trained on 4 aux
    states whose config lists none). Another count of ids read as a stray or missing fc_norm tensor, or
    as an fc shape mismatch, naming no config field."""
    target, draft_dir = tiny

    def tensors(t):
        if not fc_norm:
            for i in range(3):
                del t[f"fc_norm.{i}.weight"]
        if listed is None:
            t["fc.weight"] = torch.zeros(HIDDEN, 4 * HIDDEN)
            t["fc_norm.3.weight"] = torch.ones(HIDDEN)

    def config(c):
        c["fc_norm"] = fc_norm
        if listed is None:
            del c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        else:
            c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = listed
    path = _variant(draft_dir, tmp_path / "d", tensors, config)
    with pytest.raises(ConfigError) as info:
        inspect_draft(path, target.config)
    assert str(info.value).startswith(f"{path / 'config.json'}: eagle_config.eagle_aux_hidden_state_layer_ids: ")
    assert shown.format(fc_file=path / "model.safetensors") in str(info.value)  # the file too: a truncated fc reads so
