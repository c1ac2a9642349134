"""`m3-eagle make-tiny`: deterministic, loadable, and free of transformers at runtime."""
from __future__ import annotations

import json
import subprocess
import sys

from safetensors.torch import load_file

from m3_eagle_plugin.cli import main as cli_main


def _read(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def test_cli_writes_target_and_draft_deterministically(tmp_path):
    assert cli_main(["make-tiny", str(tmp_path / "a"), "--seed", "7"]) == 0
    assert cli_main(["make-tiny", str(tmp_path / "b"), "--seed", "7"]) == 0
    assert cli_main(["make-tiny", str(tmp_path / "c"), "--seed", "8"]) == 0
    for part in ("target", "draft"):
        (ca, ta), (cb, tb), (_, tc) = (_read(tmp_path / d / part) for d in "abc")
        assert ca == cb and ta.keys() == tb.keys() == tc.keys()
        assert all((ta[k] == tb[k]).all() for k in ta)
        assert any(not (ta[k] == tc[k]).all() for k in ta)


def test_layouts_are_the_public_ones(tiny_dir):
    cfg, tensors = _read(tiny_dir / "target")
    assert cfg["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]
    assert cfg["text_config"]["moe_layer_freq"] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert "language_model.model.layers.7.block_sparse_moe.experts.0.w2.weight" in tensors
    dcfg, dtensors = _read(tiny_dir / "draft")
    assert dcfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert dcfg["num_key_value_heads"] < dcfg["num_attention_heads"]  # GQA
    assert {"fc.weight", "fc_norm.0.weight", "midlayer.hidden_norm.weight"} <= set(dtensors)
    assert not any("embed_tokens" in k or "lm_head" in k for k in dtensors)


def test_make_tiny_does_not_import_transformers(tmp_path):
    code = ("import sys; from m3_eagle_plugin.models.tiny import make_tiny; "
            f"make_tiny({str(tmp_path)!r}, 1); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
