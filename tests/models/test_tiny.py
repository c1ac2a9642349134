"""`m3-eagle make-tiny`: deterministic, loadable, free of transformers at runtime, draft training wired."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m3_eagle_plugin.cli import main as cli_main
from m3_eagle_plugin.models import tiny


def _read(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def test_cli_writes_target_and_draft_deterministically(tmp_path):
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert cli_main(["make-tiny", str(tmp_path / name), "--seed", seed, "--train-steps", "0"]) == 0
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
    assert dcfg["fc_norm"] is True  # vLLM and TensorRT-LLM build the fc_norm layers from the flag, not the tensors
    assert not any("embed_tokens" in k or "lm_head" in k for k in dtensors)


def test_make_tiny_does_not_import_transformers(tmp_path):
    code = ("import sys; from m3_eagle_plugin.models.tiny import make_tiny; "
            f"make_tiny({str(tmp_path)!r}, 1); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_trains_the_draft_by_default_and_zero_keeps_it_random(tmp_path, monkeypatch, capsys):
    """The CLI default distills the head (the real training is covered by tests/eagle3/test_train.py and
    tests/host/reference/test_trained_draft.py); here only the wiring of --train-steps is checked."""
    import m3_eagle_plugin.eagle3.train as train

    calls = []
    monkeypatch.setattr(train, "distill_checkpoint",
                        lambda target, draft, *, plan, seed: calls.append((target, draft, plan.steps, seed)) or [])
    assert cli_main(["make-tiny", str(tmp_path / "a"), "--seed", "3"]) == 0
    [(target, draft, steps, seed)] = calls  # trained where it was built, before it moved into place
    assert (target.name, draft.name, target.parent, steps, seed) == ("target", "draft", draft.parent,
                                                                     tiny.DEFAULT_TRAIN_STEPS, 3)
    assert target.parent.parent == tmp_path / "a" and not target.parent.exists()
    assert (tmp_path / "a" / "target" / "model.safetensors").is_file()
    assert "trained for" in capsys.readouterr().out
    assert cli_main(["make-tiny", str(tmp_path / "b"), "--seed", "3", "--train-steps", "0"]) == 0
    assert len(calls) == 1 and "random" in capsys.readouterr().out
    # the (stubbed) training left draft a as written: the same random head as --train-steps 0
    _, draft_a = _read(tmp_path / "a" / "draft")
    _, draft_b = _read(tmp_path / "b" / "draft")
    assert draft_a.keys() == draft_b.keys() and all((draft_a[k] == draft_b[k]).all() for k in draft_a)


def test_bad_train_steps_fail_with_the_cause(tmp_path, capsys):
    assert cli_main(["make-tiny", str(tmp_path), "--train-steps", "-1"]) == 2
    assert "--train-steps" in capsys.readouterr().err
    with pytest.raises(ValueError, match="train_steps"):
        tiny.make_tiny(tmp_path, train_steps=-2)


def test_bad_output_paths_and_seeds_are_one_line_errors_and_leave_nothing(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    part = tmp_path / "part"
    part.mkdir()
    (part / "draft").write_text("not a directory")
    for argv, match in (([str(afile)], "afile"), ([str(part)], "is not a directory"),
                        ([str(tmp_path / "s"), "--seed", str(2**64)], "--seed must be"),
                        ([str(tmp_path / "n"), "--seed", "-1"], "--seed must be")):
        assert cli_main(["make-tiny", *argv, "--train-steps", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("m3-eagle make-tiny: ") and match in err and "Traceback" not in err
    assert sorted(p.name for p in part.iterdir()) == ["draft"]  # no target written beside the bad draft


def test_an_interrupted_run_leaves_the_earlier_pair_and_no_scratch(tmp_path, monkeypatch):
    import m3_eagle_plugin.eagle3.train as train

    out = tmp_path / "out"
    tiny.make_tiny(out, seed=1)
    before = _read(out / "draft")[1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "distill_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.make_tiny(out, seed=2, train_steps=5)
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]
    after = _read(out / "draft")[1]
    assert all((before[k] == after[k]).all() for k in before)  # the seed-1 pair, untouched
    tiny.make_tiny(out, seed=2)  # a complete run replaces it
    assert any(not (before[k] == _read(out / "draft")[1][k]).all() for k in before)


def test_an_interrupt_while_swapping_the_pair_in_keeps_the_earlier_pair(tmp_path, monkeypatch):
    """Interrupted after the new target is in place but before the new draft is: the output must
    still be the earlier (seed 1) pair, not a lone target or a new target beside an old draft."""
    out = tmp_path / "out"
    tiny.make_tiny(out, seed=1)
    before = {name: _read(out / name)[1] for name in ("target", "draft")}
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == out / "draft" and Path(src).parent.name.startswith(".make-tiny-"):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(tiny.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        tiny.make_tiny(out, seed=2)
    monkeypatch.setattr(tiny.os, "replace", real_replace)
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]
    for name, tensors in before.items():
        after = _read(out / name)[1]
        assert after.keys() == tensors.keys() and all(torch.equal(tensors[k], after[k]) for k in tensors), name


def test_a_directory_that_is_not_make_tiny_output_is_never_replaced(tmp_path, capsys):
    """OUT_DIR/target holding someone's checkpoint (or any file) must survive, and nothing be written."""
    out = tmp_path / "out"
    (out / "target").mkdir(parents=True)
    (out / "target" / "config.json").write_text('{"model_type": "minimax_m3_vl"}')
    (out / "target" / "model.safetensors").write_bytes(b"precious")
    assert cli_main(["make-tiny", str(out), "--train-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "target exists and is not make-tiny output" in err and "Traceback" not in err
    assert (out / "target" / "model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in out.iterdir()) == ["target"]  # no draft, no scratch folder
    (out / "target" / "config.json").unlink()
    (out / "target" / "model.safetensors").unlink()
    tiny.make_tiny(out)  # an empty directory is taken
    tiny.make_tiny(out, seed=3)  # and so is an earlier make-tiny pair
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]
    for name in ("target", "draft"):  # a pair from a version whose config differs: known by its marker
        config = out / name / "config.json"
        config.write_text(config.read_text().replace('"vocab_size"', '"an_older_field": 1, "vocab_size"'))
    tiny.make_tiny(out, seed=4)
    (out / "draft" / tiny.MARKER).unlink()  # no marker and not today's config: someone's directory
    config = out / "draft" / "config.json"
    config.write_text(config.read_text().replace('"vocab_size"', '"an_older_field": 1, "vocab_size"'))
    with pytest.raises(ValueError, match="draft exists and is not make-tiny output"):
        tiny.make_tiny(out, seed=5)


def test_a_make_tiny_pair_holding_someone_elses_file_is_not_replaced(tmp_path):
    """README: "a target/ or draft/ it did not write is refused". A tokenizer added to an earlier pair's
    target/ was deleted with it (the marker alone decided)."""
    out = tmp_path / "out"
    tiny.make_tiny(out)
    (out / "target" / "tokenizer.json").write_text("{}")
    before = (out / "target" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="target exists and is not make-tiny output, or holds files make-tiny did "
                                         "not write"):
        tiny.make_tiny(out, seed=1)
    assert (out / "target" / "tokenizer.json").read_text() == "{}"
    assert (out / "target" / "model.safetensors").read_bytes() == before
    (out / "target" / "tokenizer.json").unlink()
    tiny.make_tiny(out, seed=1)  # the pair alone is replaced
    assert (out / "target" / "model.safetensors").read_bytes() != before


def test_an_empty_out_dir_is_refused_not_taken_as_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-tiny", "", "--train-steps", "0"]) == 2
    assert "OUT_DIR is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_largest_seed_is_refused(tmp_path):
    """Seeds are documented as [0, 2**63 - 1): the draft is seeded with seed + 1."""
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63 - 1\)"):
        tiny.make_tiny(tmp_path, seed=2**63 - 1)
    assert list(tmp_path.iterdir()) == []


def test_norm_weights_sit_near_each_norms_identity(tiny_dir):
    """The target's Gemma norms scale by 1 + w (w near 0), the draft's Llama norms by w (w near 1)."""
    for part, identity in (("target", 0.0), ("draft", 1.0)):
        _, tensors = _read(tiny_dir / part)
        norms = [t for name, t in tensors.items() if name.endswith("norm.weight")]
        assert norms and all(abs(t.mean().item() - identity) < 0.2 for t in norms), part


def test_a_non_directory_out_dir_target_or_draft_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """OUT_DIR a file, or target/ / draft/ a broken symlink: refused by name up front, not after the
    build and 15 s of training with the errno of the final rename (naming the scratch folder)."""
    def no_work(*args, **kwargs):
        raise AssertionError("refused only after building the pair")

    monkeypatch.setattr(tiny, "_random_tensors", no_work)
    afile = tmp_path / "afile"
    afile.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "draft").symlink_to(tmp_path / "nowhere")
    for out, bad, broken in ((afile, afile, False), (dangling, dangling / "draft", True)):
        assert cli_main(["make-tiny", str(out), "--train-steps", "0"]) == 2
        err = capsys.readouterr().err
        assert err == f"m3-eagle make-tiny: {bad} exists and is not a directory{' (a broken symlink)' * broken}\n"
    assert afile.read_text() == "x" and [p.name for p in dangling.iterdir()] == ["draft"]
    assert (dangling / "draft").is_symlink()


def test_a_failed_checkpoint_write_is_one_line_and_leaves_no_scratch(tmp_path, monkeypatch, capsys):
    """safetensors' save_file (distill_checkpoint writes the trained head with it) reports a full disk as
    SafetensorError, not an OSError: still the one-line error."""
    import m3_eagle_plugin.eagle3.train as train
    from safetensors import SafetensorError

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(train, "distill_checkpoint", disk_full)
    out = tmp_path / "new" / "deeper" / "out"
    assert cli_main(["make-tiny", str(out), "--train-steps", "1"]) == 2
    assert capsys.readouterr().err == ("m3-eagle make-tiny: Error while serializing: I/O error: No space left on "
                                       "device (os error 28)\n")
    assert list(tmp_path.iterdir()) == []  # the folders it made for OUT_DIR are gone again, not left empty
    existing = tmp_path / "mine"
    existing.mkdir()
    assert cli_main(["make-tiny", str(existing), "--train-steps", "1"]) == 2
    assert existing.is_dir() and list(existing.iterdir()) == []  # a folder that was there stays


def test_the_weights_are_as_readable_as_the_configs(tmp_path):
    """Other users (a server running as another uid) read the pair: every file gets 0666 less the
    umask, as open() gives config.json, not the 0600 safetensors' save_file creates files with."""
    mask = os.umask(0o022)
    try:
        target, draft = tiny.make_tiny(tmp_path / "out")
    finally:
        os.umask(mask)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "out").rglob("*")
             if p.is_file()}
    assert modes == {f"out/{d}/{f}": 0o644 for d in ("target", "draft")
                     for f in ("config.json", "model.safetensors", tiny.MARKER)}


def test_a_pair_from_a_version_before_the_marker_and_the_fc_norm_flag_is_replaced(tmp_path):
    """README: "an earlier make-tiny pair there is replaced". Versions before the marker wrote the pair with
    no marker and a draft config without `fc_norm` (added beside the fc_norm tensors later): that draft/ was
    refused as "not make-tiny output", as its config is not today's. A config with any other change still is."""
    out = tmp_path / "out"
    tiny.make_tiny(out, seed=1)
    for name in ("target", "draft"):
        (out / name / tiny.MARKER).unlink()
    config = tiny.draft_config()
    del config["fc_norm"]
    (out / "draft" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    before = _read(out / "draft")[1]
    tiny.make_tiny(out, seed=2)
    assert (out / "draft" / tiny.MARKER).is_file() and _read(out / "draft")[0] == tiny.draft_config()
    assert any(not torch.equal(before[k], _read(out / "draft")[1][k]) for k in before)
    (out / "draft" / tiny.MARKER).unlink()
    config["fc_norm"], config["hidden_act"] = True, "gelu"  # someone's edit: not a config make-tiny ever wrote
    (out / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="draft exists and is not make-tiny output"):
        tiny.make_tiny(out, seed=3)
