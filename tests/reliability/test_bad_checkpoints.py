"""Bad checkpoints: truncated or mismatched safetensors, broken configs, a draft that does not fit
its target, directly and through `m3-eagle run`. Each must give one clear error (a
ValueError/TypeError subclass) naming the file and the field or tensor, and load nothing.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import m3_eagle_plugin.cli as cli_api
import m3_eagle_plugin.host.reference.cli  # noqa: F401 - `m3-eagle run` goes through it
import m3_eagle_plugin.models.loader as loader_api
import m3_eagle_plugin.models.safetensors_source as source_api
import m3_eagle_plugin.models.tiny as tiny_api
from m3_eagle_plugin.eagle3 import checkpoint as checkpoint_api

from ._counts import bump

CLEAR_ERRORS = (ValueError, TypeError)


# ---- fixtures: one tiny checkpoint per session, copied per fault ----

@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    target, draft = tiny_api.make_tiny(out, seed=0)
    return Path(target), Path(draft)


@pytest.fixture
def target_copy(tiny_dirs, tmp_path):
    dst = tmp_path / "target"
    shutil.copytree(tiny_dirs[0], dst)
    return dst


@pytest.fixture
def draft_copy(tiny_dirs, tmp_path):
    dst = tmp_path / "draft"
    shutil.copytree(tiny_dirs[1], dst)
    return dst


def _loader():
    assert callable(loader_api.load_target)  # a missing loader fails, it is not skipped
    return loader_api


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Records every tensor read, so a test can show that a refused load read no weight."""
    src = source_api
    reads: list[str] = []
    get, get_many = src.SafetensorsSource.get, src.SafetensorsSource.get_many
    monkeypatch.setattr(src.SafetensorsSource, "get", lambda self, n: reads.append(n) or get(self, n))
    monkeypatch.setattr(src.SafetensorsSource, "get_many",
                        lambda self, ns: reads.extend(ns) or get_many(self, ns))
    return reads


def _expect_clear(call, *needles: str) -> BaseException:
    bump("faults.injected")
    with pytest.raises(Exception) as info:
        call()
    exc = info.value
    assert isinstance(exc, CLEAR_ERRORS), f"{type(exc).__module__}.{type(exc).__name__} is not a clear error: {exc}"
    for needle in needles:
        assert needle in str(exc), f"the error does not name {needle!r}: {exc}"
    return exc


def _rewrite_tensors(file: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


# ---- target checkpoint ----

@pytest.mark.parametrize("keep", [0.5, 0.0005], ids=["data-truncated", "header-truncated"])
def test_truncated_safetensors(target_copy, keep, no_weight_reads):
    loader = _loader()
    file = target_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: max(8, int(len(data) * keep))])
    _expect_clear(lambda: loader.load_target(target_copy), str(file))
    assert no_weight_reads == []


def test_tensor_with_wrong_shape(target_copy, no_weight_reads):
    loader = _loader()
    file = target_copy / "model.safetensors"
    victim = {}

    def edit(tensors):
        name = sorted(n for n in tensors if n.endswith("self_attn.o_proj.weight"))[0]
        victim["name"] = name
        tensors[name] = tensors[name][:, :-1].contiguous()

    _rewrite_tensors(file, edit)
    _expect_clear(lambda: loader.load_target(target_copy), str(file), victim["name"])
    assert no_weight_reads == [], "weights were read before the checkpoint was validated"


def test_missing_and_unknown_tensors(target_copy, no_weight_reads):
    loader = _loader()
    file = target_copy / "model.safetensors"
    names = {}

    def edit(tensors):
        gone = sorted(n for n in tensors if "index" in n)[0]
        names["gone"] = gone
        tensors["language_model.model.layers.0.surprise.weight"] = tensors.pop(gone)

    _rewrite_tensors(file, edit)
    _expect_clear(lambda: loader.load_target(target_copy), str(file), names["gone"], "surprise")
    assert no_weight_reads == []


def test_sharded_index_naming_a_missing_shard(target_copy):
    loader = _loader()
    from safetensors import safe_open

    with safe_open(str(target_copy / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = target_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}))
    _expect_clear(lambda: loader.load_target(target_copy), str(index), "model-00002-of-00002.safetensors")


# ---- target config.json ----

def _config_case(mutate):
    def apply(path: Path) -> None:
        raw = json.loads(path.read_text())
        out = mutate(raw)
        path.write_text(out if isinstance(out, str) else json.dumps(raw))
    return apply


CONFIG_CASES = [
    pytest.param(_config_case(lambda r: r["text_config"].pop("hidden_size")), "hidden_size", id="missing-field"),
    pytest.param(_config_case(lambda r: r["text_config"].__setitem__("hidden_size", "sixty-four")), "hidden_size",
                 id="string-for-int"),
    pytest.param(_config_case(lambda r: r["text_config"].__setitem__("num_hidden_layers", [8])), "num_hidden_layers",
                 id="list-for-int"),
    pytest.param(_config_case(lambda r: r["text_config"].__setitem__("hidden_size", 64.5)), "hidden_size",
                 id="fractional-int"),
    pytest.param(_config_case(lambda r: r["text_config"].__setitem__("num_attention_heads", -4)),
                 "num_attention_heads", id="negative-heads"),
    pytest.param(_config_case(lambda r: '{"text_config": {'), "config.json", id="malformed-json"),
    pytest.param(_config_case(lambda r: "[1, 2]"), "config.json", id="top-level-list"),
    pytest.param(_config_case(lambda r: r["text_config"].__setitem__("sparse_attention_config", "yes")),
                 "sparse_attention_config", id="section-not-object"),
    pytest.param(_config_case(lambda r: r["text_config"].__setitem__("rope_parameters", {"rope_type": "yarn"})),
                 "rope_type", id="unsupported-rope"),
    pytest.param(_config_case(lambda r: r["text_config"]["sparse_attention_config"].__setitem__(
                 "sparse_attention_freq", [0, 1])), "sparse_attention_freq", id="pattern-too-short"),
]


@pytest.mark.parametrize("mutate,field", CONFIG_CASES)
def test_broken_target_config(target_copy, mutate, field, no_weight_reads):
    loader = _loader()
    config = target_copy / "config.json"
    mutate(config)
    _expect_clear(lambda: loader.load_target(target_copy), str(config), field)
    assert no_weight_reads == []


# ---- Eagle3 draft checkpoint against its target ----

@pytest.fixture(scope="session")
def tiny_target(tiny_dirs):
    return _loader().load_target(tiny_dirs[0])


def _draft_loader():
    assert callable(checkpoint_api.load_draft)  # a missing draft loader fails, it is not skipped
    return checkpoint_api


def _edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


DRAFT_CONFIG_CASES = [
    pytest.param(lambda r: r.update(hidden_size=32, target_hidden_size=32), "hidden_size", id="draft-hidden-32"),
    pytest.param(lambda r: r.update(target_hidden_size=128), "target_hidden_size", id="declared-target-hidden"),
    pytest.param(lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 99]), "99",
                 id="aux-layer-out-of-range"),
    pytest.param(lambda r: r.pop("intermediate_size"), "intermediate_size", id="missing-field"),
    pytest.param(lambda r: r.update(vocab_size=1000), "vocab_size", id="vocab-mismatch"),
    pytest.param(lambda r: r.update(num_attention_heads="four"), "num_attention_heads", id="string-for-int"),
]


@pytest.mark.parametrize("edit,field", DRAFT_CONFIG_CASES)
def test_broken_draft_config(tiny_target, draft_copy, edit, field, no_weight_reads):
    ckpt = _draft_loader()
    config = draft_copy / "config.json"
    _edit_json(config, edit)
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(config), field)
    assert no_weight_reads == [], "draft weights were read before the config was validated"


def test_draft_config_that_is_not_json(tiny_target, draft_copy):
    ckpt = _draft_loader()
    config = draft_copy / "config.json"
    config.write_text("{\"hidden_size\": 64,")
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(config))


def test_draft_tensor_with_wrong_shape(tiny_target, draft_copy, no_weight_reads):
    ckpt = _draft_loader()
    file = draft_copy / "model.safetensors"
    _rewrite_tensors(file, lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :128].contiguous()))
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(file), "fc.weight")
    assert no_weight_reads == []


def test_draft_missing_tensor(tiny_target, draft_copy, no_weight_reads):
    ckpt = _draft_loader()
    file = draft_copy / "model.safetensors"
    _rewrite_tensors(file, lambda t: t.pop("midlayer.self_attn.k_proj.weight"))
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(file), "k_proj")
    assert no_weight_reads == []


def test_draft_vocab_without_d2t(tiny_target, draft_copy, no_weight_reads):
    ckpt = _draft_loader()
    _edit_json(draft_copy / "config.json", lambda r: r.update(draft_vocab_size=64))
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(draft_copy / "model.safetensors"), "d2t")
    assert no_weight_reads == []


def test_draft_d2t_outside_the_target_vocabulary(tiny_target, draft_copy):
    import torch

    ckpt = _draft_loader()
    _edit_json(draft_copy / "config.json", lambda r: r.update(draft_vocab_size=64))
    _rewrite_tensors(draft_copy / "model.safetensors",
                     lambda t: t.__setitem__("d2t", torch.full((64,), 250, dtype=torch.int64)))
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(draft_copy / "model.safetensors"), "d2t")


def test_truncated_draft_safetensors(tiny_target, draft_copy):
    ckpt = _draft_loader()
    file = draft_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000])
    _expect_clear(lambda: ckpt.load_draft(draft_copy, tiny_target), str(file))


# ---- the same files through `m3-eagle run`: exit status 2 and one line naming the file, no traceback ----

def _run_cli(capsys, *argv: str) -> tuple[int, str]:
    bump("faults.injected")
    code = cli_api.main(["run", *argv, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"])
    captured = capsys.readouterr()
    assert captured.out == "", f"a failed setup printed a result: {captured.out!r}"
    return code, captured.err


def test_run_cli_with_a_config_missing_a_field(target_copy, capsys):
    config = target_copy / "config.json"
    _edit_json(config, lambda r: r["text_config"].pop("num_key_value_heads"))
    code, err = _run_cli(capsys, "--model", str(target_copy))
    assert code == 2 and str(config) in err and "num_key_value_heads" in err, err
    assert len(err.strip().splitlines()) == 1, f"expected one line, got: {err!r}"


def test_run_cli_with_a_draft_that_does_not_fit(target_copy, draft_copy, capsys):
    config = draft_copy / "config.json"
    _edit_json(config, lambda r: r.update(hidden_size=32, target_hidden_size=32))
    code, err = _run_cli(capsys, "--model", str(target_copy), "--draft", str(draft_copy))
    assert code == 2 and str(config) in err and "hidden_size" in err, err


def test_run_cli_with_a_missing_checkpoint_directory(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    code, err = _run_cli(capsys, "--model", str(missing))
    assert code == 2 and str(missing) in err, err


def test_run_cli_with_a_truncated_checkpoint(target_copy, capsys):
    file = target_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[:4096])
    code, err = _run_cli(capsys, "--model", str(target_copy))
    assert code == 2 and str(file) in err, err


# ---- property: any one config field damaged -> loads, or one clear error naming file and field ----

_WRONG_VALUES = ["x", [1], {"a": 1}, -3, 0, 2.5, None, True, "__delete__"]


def _config_leaves(raw: dict, prefix: tuple = ()) -> list[tuple]:
    leaves = []
    for key, value in raw.items():
        if key in ("vision_config",):  # not read by the text backbone
            continue
        leaves.append(prefix + (key,))
        if isinstance(value, dict):
            leaves += _config_leaves(value, prefix + (key,))
    return leaves


def _section(raw: dict, path: tuple) -> list[str]:
    node = raw
    for key in path:
        node = node[key]
    return list(node) if isinstance(node, dict) else []


def _damage(raw: dict, path: tuple, value) -> None:
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value == "__delete__":
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _assert_clear_or_loaded(call, file: Path, key: str, inner: tuple = ()) -> None:
    """`inner`: a damaged section's own keys (a null or missing section may be reported through them)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the type is the assertion
        assert isinstance(exc, CLEAR_ERRORS), f"{type(exc).__name__} escaped for field {key!r}: {exc}"
        message = str(exc)
        # a damaged optional field may fall back to its default and surface as a weight mismatch:
        # then the error names the weights file and the tensor instead
        assert str(file.parent) in message, f"the error for field {key!r} does not name a checkpoint file: {exc}"
        assert any(k in message for k in (key, *inner)) or "tensor '" in message, \
            f"the error names neither field {key!r} nor a tensor: {exc}"
        bump("bad_files.refused")
    else:
        bump("bad_files.accepted")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_target_config_field_fuzz(tiny_dirs, data):
    import tempfile

    from m3_eagle_plugin.models.config import M3Config

    raw = json.loads((tiny_dirs[0] / "config.json").read_text())
    path = data.draw(st.sampled_from(_config_leaves(raw)), label="field")
    inner = tuple(_section(raw, path))
    _damage(raw, path, data.draw(st.sampled_from(_WRONG_VALUES), label="value"))
    bump("faults.injected")
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "config.json"
        file.write_text(json.dumps(raw))
        _assert_clear_or_loaded(lambda: M3Config.from_file(file), file, path[-1], inner)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_draft_config_field_fuzz(tiny_dirs, tiny_target, data):
    import tempfile

    ckpt = _draft_loader()
    raw = json.loads((tiny_dirs[1] / "config.json").read_text())
    path = data.draw(st.sampled_from(_config_leaves(raw)), label="field")
    inner = tuple(_section(raw, path))
    _damage(raw, path, data.draw(st.sampled_from(_WRONG_VALUES), label="value"))
    bump("faults.injected")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(tiny_dirs[1], Path(tmp) / "draft")
        file = Path(tmp) / "draft" / "config.json"
        file.write_text(json.dumps(raw))
        _assert_clear_or_loaded(lambda: ckpt.load_draft(file.parent, tiny_target), file, path[-1], inner)
