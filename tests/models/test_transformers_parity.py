"""Config fields transformers reads in its own way: each checkpoint loads in transformers and here,
and both compute the same logits (prefill, a verify chunk, single steps on the paged cache)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ._oracle import MiniMaxM3VLForCausalLM, PagedRunner, load_oracle, randomize_, tiny_text_config
from m3_eagle_plugin.models.loader import load_target

TOL = 1e-4


def _hf_checkpoint(path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    hf = MiniMaxM3VLForCausalLM(tiny_text_config(**overrides))
    randomize_(hf, seed=3)
    hf.save_pretrained(path)
    return path


def _with_config(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose config.json (the text config) is changed by `edit(dict)`."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw.get("text_config", raw))
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _assert_matches_transformers(path: Path, cls=MiniMaxM3VLForCausalLM, vocab: int = 96, length: int = 30) -> None:
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = load_oracle(path, cls)(input_ids=ids[None]).logits[0].float()
    model = load_target(path)
    runner = PagedRunner(model.config)
    start = 0
    with torch.no_grad():
        for n in (length - 9, 4, 1, 4):
            runner.prepare([("a", n)])
            got = model.compute_logits(model(ids[start:start + n], runner.meta, runner.cache))
            torch.testing.assert_close(got, want[start:start + n], atol=TOL, rtol=0)
            start += n


def test_shared_expert_count_does_not_widen_the_shared_expert(tmp_path):
    """transformers builds one shared expert of `shared_intermediate_size` whatever n_shared_experts says."""
    path = _hf_checkpoint(tmp_path / "ckpt", n_shared_experts=2)
    assert json.loads((path / "config.json").read_text())["n_shared_experts"] == 2
    _assert_matches_transformers(path)


def test_use_sparse_attention_false_still_runs_the_sparse_layers(tiny_dir, tmp_path):
    """transformers takes the sparse layers from `sparse_attention_freq` and never reads the switch."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    def edit(text):
        text["sparse_attention_config"]["use_sparse_attention"] = False
    path = _with_config(tiny_dir / "target", tmp_path / "ckpt", edit)
    _assert_matches_transformers(path, MiniMaxM3SparseForConditionalGeneration, vocab=256)


def test_fewer_index_heads_than_kv_heads_share_one_selection(tmp_path):
    """One index head for two KV heads: transformers applies its selection to every query head."""
    path = _hf_checkpoint(tmp_path / "ckpt", index_n_heads=1)
    assert load_target(path).config.index_head_repeat == 2
    _assert_matches_transformers(path)


def test_legacy_section_overrides_flat_index_fields_but_not_layer_types(hf_text_checkpoint, tmp_path):
    """A text config with a legacy `sparse_attention_config` too: its sparse_* index keys win over
    index_*, while `layer_types` wins over its `sparse_attention_freq` (transformers' __post_init__)."""
    def edit(text):
        text["sparse_attention_config"] = {"sparse_block_size": 8, "sparse_topk_blocks": 2,
                                           "sparse_attention_freq": [0] * text["num_hidden_layers"]}
    path = _with_config(hf_text_checkpoint, tmp_path / "ckpt", edit)
    hf_config = load_oracle(path).config
    assert (hf_config.index_block_size, hf_config.index_topk_blocks) == (8, 2)
    assert "minimax_m3_sparse" in hf_config.layer_types
    _assert_matches_transformers(path)  # 30 tokens: top-2 blocks of 8 drop keys after 16


def test_tied_checkpoint_holding_only_lm_head_loads_like_transformers(tmp_path):
    """safetensors' `save_model` keeps one tensor of a tied pair, `lm_head.weight` (first by name);
    transformers ties either way round, so the embedding comes from lm_head."""
    from safetensors.torch import load_file, save_model

    path = _hf_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    hf = MiniMaxM3VLForCausalLM.from_pretrained(path, dtype=torch.float32)
    save_model(hf, str(path / "model.safetensors"))
    names = set(load_file(str(path / "model.safetensors")))
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    _assert_matches_transformers(path)


@pytest.mark.parametrize("overrides", [
    dict(index_local_blocks=2, index_topk_blocks=4, index_block_size=2),  # two forced blocks, 2 free
    dict(index_local_blocks=0),  # nothing forced: the own block competes on its score
    dict(index_topk_blocks=10),  # more than the 8 blocks of 30 tokens: dense causal everywhere
    dict(index_block_size=64),  # every token inside one partial block
    dict(num_attention_heads=8, num_key_value_heads=4, index_n_heads=4),  # four selections, group 2
    dict(num_attention_heads=8, num_key_value_heads=4, index_n_heads=2),  # each index head for 2 KV heads
    dict(index_head_dim=32),  # index width twice the head width (RoPE still over the first 8)
], ids=["local2-top4-block2", "local0", "topk-past-visible", "block-past-context", "idx4-kv4", "idx2-kv4",
        "index-dim-32"])
def test_selection_geometry_edges_match_transformers(tmp_path, overrides):
    """Selection geometries the other checkpoints leave out, prefill (21 tokens over several
    blocks), a verify chunk and a single step against transformers' full forward."""
    _assert_matches_transformers(_hf_checkpoint(tmp_path / "ckpt", **overrides))
