"""Target checkpoint loading: layouts, shards, ignored tensors and clear errors."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from m3_eagle_plugin.models.loader import CheckpointError, detect_layout, load_target


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint with its tensors edited by `edit(dict)`."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_production_tensors_are_fused_as_documented(tiny_dir):
    """w1 = gate (first rows of gate_up), w3 = up, w2 = down; index_* go to the indexer."""
    path = tiny_dir / "target"
    raw = load_file(str(path / "model.safetensors"))
    model = load_target(path)
    p = "language_model.model.layers.4."
    experts = model.layers[4].mlp.experts
    i = raw[p + "block_sparse_moe.experts.3.w1.weight"].shape[0]
    assert torch.equal(experts.gate_up_proj[3, :i], raw[p + "block_sparse_moe.experts.3.w1.weight"])
    assert torch.equal(experts.gate_up_proj[3, i:], raw[p + "block_sparse_moe.experts.3.w3.weight"])
    assert torch.equal(experts.down_proj[3], raw[p + "block_sparse_moe.experts.3.w2.weight"])
    assert torch.equal(model.layers[4].mlp.gate.e_score_correction_bias,
                       raw[p + "block_sparse_moe.e_score_correction_bias"])
    assert torch.equal(model.layers[4].self_attn.indexer.k_proj.weight, raw[p + "self_attn.index_k_proj.weight"])
    dense = model.layers[0].mlp.gate_up_proj.weight
    gate = raw["language_model.model.layers.0.mlp.gate_proj.weight"]
    assert torch.equal(dense[:gate.shape[0]], gate)
    assert torch.equal(model.lm_head.weight, raw["language_model.lm_head.weight"])


def test_sharded_checkpoint_loads_like_the_single_file(tiny_dir, tmp_path):
    src = tiny_dir / "target"
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    _same_weights(load_target(tmp_path), load_target(src))


def test_mtp_and_vision_tensors_are_ignored(tiny_dir, tmp_path):
    def add(t):
        t["mtp.0.enorm.weight"] = torch.ones(4)
        t["vision_tower.vision_model.pre_layrnorm.weight"] = torch.ones(4)
        t["multi_modal_projector.linear_1.weight"] = torch.ones(2, 2)
    path = _rewrite(tiny_dir / "target", tmp_path / "x", add)
    _same_weights(load_target(path), load_target(tiny_dir / "target"))


def test_transformers_resave_of_the_vl_model_loads(tiny_dir, tmp_path):
    """transformers writes the VL model back in production names, vision weights under model.*."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_dir / "target", dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    _same_weights(load_target(tmp_path), load_target(tiny_dir / "target"))


def test_text_layout_detection(hf_text_checkpoint, tiny_dir):
    assert detect_layout(set(load_file(str(hf_text_checkpoint / "model.safetensors")))) == "text"
    assert detect_layout(set(load_file(str(tiny_dir / "target" / "model.safetensors")))) == "production"


def test_unknown_and_missing_tensors_are_listed_in_one_error(tiny_dir, tmp_path):
    def edit(t):
        del t["language_model.model.layers.5.block_sparse_moe.experts.2.w3.weight"]
        del t["language_model.model.norm.weight"]
        t["language_model.model.layers.1.self_attn.surprise.weight"] = torch.zeros(2)
    path = _rewrite(tiny_dir / "target", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_target(path)
    msg = str(err.value)
    assert str(path / "model.safetensors") in msg
    assert "2 missing" in msg and "experts.2.w3.weight" in msg and "language_model.model.norm.weight" in msg
    assert "1 unknown" in msg and "surprise" in msg


def test_shape_mismatch_names_tensor_and_both_shapes(hf_text_checkpoint, tmp_path):
    def edit(t):
        t["model.layers.2.mlp.experts.down_proj"] = torch.zeros(6, 64, 31)
    path = _rewrite(hf_text_checkpoint, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.down_proj.*\(6, 64, 31\).*\(6, 64, 32\)"):
        load_target(path)


def test_missing_checkpoint_files(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "target" / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_target(tmp_path)


def test_bf16_load_keeps_router_bias_fp32(tiny_dir):
    """The bias is kept in fp32 for its precision (it shifts the scores the top-k experts are chosen by):
    its values must be the stored fp32 ones, not ones rounded through the bf16 model dtype on the way."""
    raw = load_file(str(tiny_dir / "target" / "model.safetensors"))
    stored = raw["language_model.model.layers.3.block_sparse_moe.e_score_correction_bias"]
    assert stored.dtype == torch.float32 and not torch.equal(stored.to(torch.bfloat16).float(), stored)
    model = load_target(tiny_dir / "target", dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.weight, raw["language_model.model.embed_tokens.weight"].to(torch.bfloat16))
    bias = model.layers[3].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, stored)


@pytest.mark.parametrize("dtype,stored", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.bool, "BOOL")])
def test_weight_stored_as_a_non_float_dtype_is_refused_by_name(tiny_dir, tmp_path, dtype, stored):
    """Casting integer or float8 data to the model dtype gives numbers that are not the weights."""
    name = "language_model.model.layers.4.block_sparse_moe.experts.1.w2.weight"

    def edit(t):
        t[name] = t[name].to(dtype)
    path = _rewrite(tiny_dir / "target", tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored as {stored}; weights must be one of"):
        load_target(path)


def test_bf16_fp16_and_fp64_weights_still_load(tiny_dir, tmp_path):
    """Mixed storage dtypes (the fused expert and gate/up tensors combine parts of different dtypes)
    load as their stored values in the model dtype: the same model as the fp32 checkpoint holding
    each stored value upcast (exact for bf16/fp16; fp64 rounds to fp32 once, either way)."""
    dtypes = (torch.bfloat16, torch.float16, torch.float64)

    def edit(t):
        for i, name in enumerate(sorted(t)):
            t[name] = t[name].to(dtypes[i % 3])

    def upcast(t):
        edit(t)
        for name in t:
            t[name] = t[name].float()
    model = load_target(_rewrite(tiny_dir / "target", tmp_path / "ckpt", edit))
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == set(dtypes)
    assert model.embed_tokens.weight.dtype == torch.float32
    _same_weights(model, load_target(_rewrite(tiny_dir / "target", tmp_path / "fp32", upcast)))
    p = "language_model.model.layers.4.block_sparse_moe.experts.3."
    i = stored[p + "w1.weight"].shape[0]
    gate_up = model.layers[4].mlp.experts.gate_up_proj[3]
    assert torch.equal(gate_up[:i], stored[p + "w1.weight"].float())
    assert torch.equal(gate_up[i:], stored[p + "w3.weight"].float())


def test_rotary_inv_freq_buffers_of_older_exports_are_ignored(tiny_dir, tmp_path):
    def add(t):
        t["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        t["language_model.model.rotary_emb.inv_freq"] = torch.ones(4)
    path = _rewrite(tiny_dir / "target", tmp_path / "x", add)
    _same_weights(load_target(path), load_target(tiny_dir / "target"))


def test_a_lone_unknown_tensor_is_refused(tiny_dir, tmp_path):
    def add(t):
        t["language_model.model.layers.1.self_attn.surprise.weight"] = torch.zeros(2)
    path = _rewrite(tiny_dir / "target", tmp_path / "bad", add)
    with pytest.raises(CheckpointError, match=r"does not match the model: 1 unknown tensor\(s\): .*surprise"):
        load_target(path)


def test_dense_mlp_under_block_sparse_moe_names_loads(tiny_dir, tmp_path):
    """transformers 5.17 re-saves a dense layer's MLP as `block_sparse_moe.{gate,up,down}_proj`."""
    def rename(t):
        for name in [n for n in t if ".mlp." in n]:
            t[name.replace(".mlp.", ".block_sparse_moe.")] = t.pop(name)
    path = _rewrite(tiny_dir / "target", tmp_path / "x", rename)
    assert not any(".mlp." in n for n in load_file(str(path / "model.safetensors")))
    _same_weights(load_target(path), load_target(tiny_dir / "target"))


def test_float8_checkpoint_with_scale_tensors_is_refused_as_quantized(tiny_dir, tmp_path):
    """An FP8 export stores each weight as float8 next to a `weight_scale_inv` tensor: the error names the
    stored dtype (the cause), not the scale tensors as unknown names."""
    name = "language_model.model.layers.4.block_sparse_moe.experts.1.w2.weight"

    def edit(t):
        t[name] = t[name].to(torch.float8_e4m3fn)
        t[name[:-len("weight")] + "weight_scale_inv"] = torch.ones(1)
    path = _rewrite(tiny_dir / "target", tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored as F8_E4M3; .*quantized checkpoints are not"):
        load_target(path)


# ---- adversarial review: inputs refused naming another cause ----

@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_of_the_checkpoint_is_refused_naming_the_directory_it_needs(tiny_dir, name):
    """`load_target` reads config.json and the weights from one directory: given one of its files, it
    used to read the weights as JSON ("not valid JSON") or config.json as safetensors."""
    path = tiny_dir / "target" / name
    want = "^" + re.escape(str(path)) + r": load_target takes the checkpoint directory"
    with pytest.raises(CheckpointError, match=want):
        load_target(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn, torch.complex64])
def test_a_weight_dtype_that_cannot_run_the_model_is_refused_naming_it(tiny_dir, dtype):
    """Integer and bool weights failed deep in load_state_dict; float8 and complex ones loaded and failed in
    the forward ("add_stub" / "clamp" not implemented)."""
    with pytest.raises(ValueError, match=rf"^dtype must be a floating dtype of 16 bits or more .*got {dtype}$"):
        load_target(tiny_dir / "target", dtype=dtype)


# ---- adversarial review: hostile config sizes ----

def _with_config(tiny_dir: Path, dst: Path, edit) -> Path:
    shutil.copytree(tiny_dir / "target", dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw["text_config"])
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_more_experts_than_the_checkpoint_stores_are_refused_before_their_names_are_built(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """Every expert's w1/w2/w3 names were built before any was compared: num_local_experts 10**8 held
    3.5 GB and ended in a MemoryError; the checkpoint stores 8."""
    import m3_eagle_plugin.models.loader as loader_api

    def no_names(*args):
        raise AssertionError("the per-expert tensor names were built")

    monkeypatch.setattr(loader_api, "_production_recipes", no_names)
    ckpt = _with_config(tiny_dir, tmp_path / "t", lambda t: t.update(num_local_experts=10 ** 9))
    want = (f"^{re.escape(str(ckpt / 'config.json'))}: num_local_experts: 1000000000 experts per MoE layer, "
            f"but {re.escape(str(ckpt / 'model.safetensors'))} stores 8$")
    with pytest.raises(CheckpointError, match=want):
        load_target(ckpt)


def test_more_layers_than_the_checkpoint_stores_are_refused_before_the_model_is_built(tiny_dir, tmp_path,
                                                                                     monkeypatch):
    """The model was built (on meta, about 120 KB and 2 ms a layer) before its names were compared: a 1 MB
    config.json of 10**5 layers would hold about 12 GB first. 9 layers here, the checkpoint stores 8."""
    import m3_eagle_plugin.models.loader as loader_api

    def no_model(config):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loader_api, "MiniMaxM3ForCausalLM", no_model)

    def nine_layers(t):
        t["num_hidden_layers"] = 9
        for pattern in (t, t["sparse_attention_config"]):
            for key in ("moe_layer_freq", "sparse_attention_freq", "sparse_disable_index_value"):
                if key in pattern:
                    pattern[key] = pattern[key] + [1]

    ckpt = _with_config(tiny_dir, tmp_path / "t", nine_layers)
    want = (f"^{re.escape(str(ckpt / 'config.json'))}: num_hidden_layers: 9 layers, "
            f"but {re.escape(str(ckpt / 'model.safetensors'))} stores 8$")
    with pytest.raises(CheckpointError, match=want):
        load_target(ckpt)


@pytest.mark.parametrize("key,shown", [("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                                       ("intermediate_size", "intermediate_size"),
                                       ("dense_intermediate_size", "dense_intermediate_size"),
                                       ("shared_intermediate_size", "shared_intermediate_size"),
                                       ("num_attention_heads", "num_attention_heads x head_dim")])
@pytest.mark.parametrize("size", [2 ** 62, 2 ** 63])
def test_a_size_past_every_stored_dimension_is_refused_by_its_field_before_the_model_is_built(
        tiny_dir, tmp_path, monkeypatch, key, shown, size):
    """hidden_size 2**62 (or any size past int64) overflowed torch's sizes as the model was built on
    meta: a bare TypeError with a C++ stack, or 'Storage size calculation overflowed', naming no file
    or field. No tensor of the checkpoint can match it (oracle: its largest dimension, read by safetensors)."""
    import m3_eagle_plugin.models.loader as loader_api

    def no_model(config):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loader_api, "MiniMaxM3ForCausalLM", no_model)
    ckpt = _with_config(tiny_dir, tmp_path / "t", lambda t: t.update({key: size}))
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        largest = max(max(f.get_slice(name).get_shape()) for name in f.keys())
    head_dim = json.loads((ckpt / "config.json").read_text())["text_config"]["head_dim"]
    want = (f"^{re.escape(str(ckpt / 'config.json'))}: {shown}: {size * (head_dim if 'x' in shown else 1)}, "
            f"larger than any dimension of a tensor in {re.escape(str(ckpt / 'model.safetensors'))} "
            f"\\(the largest is {largest}\\)$")
    with pytest.raises(CheckpointError, match=want):
        load_target(ckpt)


def test_tied_embeddings_loaded_in_another_dtype_stay_one_tensor(tiny_dir, tmp_path):
    """A tied checkpoint stores one matrix for the embedding and the lm_head; read in its own dtype they
    shared it, but converted to another they became two copies of the vocabulary-sized matrix. transformers
    ties them into one parameter whatever the dtype."""
    src = tiny_dir / "target"
    raw = json.loads((src / "config.json").read_text())
    raw["text_config"]["tie_word_embeddings"] = True
    _rewrite(src, tmp_path, lambda t: t.pop("language_model.lm_head.weight"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    stored = load_file(str(tmp_path / "model.safetensors"))["language_model.model.embed_tokens.weight"]
    assert stored.dtype == torch.float32
    model = load_target(tmp_path, dtype=torch.bfloat16)
    assert model.lm_head.weight.untyped_storage().data_ptr() == model.embed_tokens.weight.untyped_storage().data_ptr()
    assert torch.equal(model.lm_head.weight, stored.to(torch.bfloat16))
