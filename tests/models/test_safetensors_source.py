"""SafetensorsSource: broken files and shard indexes fail as one CheckpointError naming the file."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import m3_eagle_plugin.models.safetensors_source as source_module
from m3_eagle_plugin.models.safetensors_source import CheckpointError, SafetensorsSource


@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file({"a.weight": torch.arange(12.0).view(3, 4), "b.bias": torch.ones(5)}, str(out))
    return out


def _truncated(src: Path, dst_dir: Path, keep: int) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / "model.safetensors"
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


def test_intact_file_lists_names_and_shapes_and_reads(good_file):
    source = SafetensorsSource(good_file.parent)
    assert source.names() == {"a.weight", "b.bias"}
    assert source.shape("a.weight") == (3, 4)
    assert torch.equal(source.get("a.weight"), torch.arange(12.0).view(3, 4))


@pytest.mark.parametrize("keep", [0, 7, 20, -8], ids=["empty", "no-header-length", "header-cut", "data-cut"])
def test_truncated_file_is_a_checkpoint_error_naming_it(good_file, tmp_path, keep):
    size = good_file.stat().st_size
    bad = _truncated(good_file, tmp_path, keep % size if keep < 0 else keep)
    with pytest.raises(CheckpointError) as info:
        SafetensorsSource(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{bad}: not a readable safetensors file (") and "\n" not in message


def test_garbage_file_is_a_checkpoint_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a json header")
    with pytest.raises(CheckpointError, match=rf"^{bad}: not a readable safetensors file"):
        SafetensorsSource(tmp_path)


@pytest.mark.parametrize("break_file, read", [
    (lambda path: path.write_bytes(b""), lambda source: source.get_many(["a.weight"])),
    (lambda path: path.unlink(), lambda source: source.get("a.weight")),
], ids=["emptied", "removed"])
def test_file_that_breaks_after_listing_names_file_and_tensor(good_file, tmp_path, break_file, read):
    path = tmp_path / "model.safetensors"
    path.write_bytes(good_file.read_bytes())
    source = SafetensorsSource(tmp_path)
    break_file(path)
    with pytest.raises(CheckpointError, match=rf"^{path}: tensor 'a.weight' cannot be read"):
        read(source)
    with pytest.raises(CheckpointError, match=rf"^{path}: tensor 'b.bias' cannot be read"):
        source.get("b.bias")


@pytest.mark.parametrize("index_text,what", [
    ('{"weight_map": ', "not valid JSON"),
    ("[]", "weight_map: missing or not a JSON object"),
    ('{"weight_map": ["model.safetensors"]}', "weight_map: missing or not a JSON object"),
    ('{"weight_map": {"a.weight": 3}}', "weight_map: tensors without a shard file name: a.weight"),
    ('{"weight_map": {"a.weight": ""}}', "weight_map: tensors without a shard file name: a.weight"),
    ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON (nested too deeply)"),  # RecursionError
    ('{"metadata": {"total_size": ' + "7" * 5000 + "}}", "cannot be read as JSON (Exceeds the limit"),  # int digits
])
def test_broken_shard_index_names_the_index(good_file, tmp_path, index_text, what):
    (tmp_path / "model.safetensors").write_bytes(good_file.read_bytes())
    index = tmp_path / SafetensorsSource.INDEX
    index.write_text(index_text)
    with pytest.raises(CheckpointError) as info:
        SafetensorsSource(tmp_path)
    assert str(info.value).startswith(f"{index}: {what}")


def test_index_naming_a_missing_shard(good_file, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(good_file.read_bytes())
    index = tmp_path / SafetensorsSource.INDEX
    index.write_text(json.dumps({"weight_map": {"a.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=rf"^{index}: shard files missing: .*model-00002-of-00002"):
        SafetensorsSource(tmp_path)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(fraction=st.floats(0.0, 1.0, exclude_max=True))
def test_any_truncation_is_refused_naming_the_file(good_file, tmp_path_factory, fraction):
    size = good_file.stat().st_size
    folder = tmp_path_factory.mktemp("cut")
    bad = _truncated(good_file, folder, int(size * fraction))
    with pytest.raises(CheckpointError, match=rf"^{bad}: not a readable safetensors file"):
        SafetensorsSource(folder)


def _two_shards(directory: Path, weight_map: dict[str, str]) -> Path:
    save_file({"a.weight": torch.zeros(2)}, str(directory / "s1.safetensors"))
    save_file({"b.weight": torch.zeros(3)}, str(directory / "s2.safetensors"))
    index = directory / SafetensorsSource.INDEX
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


@pytest.mark.parametrize("weight_map,what", [
    ({"a.weight": "s1.safetensors", "b.weight": "s1.safetensors"},
     r"1 tensor\(s\) not in the shard the index names: b.weight \(s1.safetensors\)"),
    ({"a.weight": "s1.safetensors", "b.weight": "s2.safetensors", "c.weight": "s2.safetensors"},
     r"1 tensor\(s\) not in the shard the index names: c.weight \(s2.safetensors\)"),
    ({"a.weight": "s2.safetensors", "b.weight": "s1.safetensors"},
     r"2 tensor\(s\) not in the shard the index names: a.weight \(s2.safetensors\), b.weight \(s1.safetensors\)$"),
    ({"a.weight": "s1.safetensors", "x.weight": "s2.safetensors"},
     r"x.weight \(s2.safetensors\); 1 tensor\(s\) in a shard but not in the index: b.weight \(s2.safetensors\)"),
])
def test_index_that_disagrees_with_its_shards_names_the_tensors(tmp_path, weight_map, what):
    """A stale index or a shard from another download: the tensors it moved or lost are named."""
    index = _two_shards(tmp_path, weight_map)
    with pytest.raises(CheckpointError, match=rf"^{index}: index and shard files disagree: .*{what}"):
        SafetensorsSource(tmp_path)


def test_index_that_matches_its_shards_loads(tmp_path):
    _two_shards(tmp_path, {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"})
    source = SafetensorsSource(tmp_path)
    assert source.names() == {"a.weight", "b.weight"} and source.dtype("b.weight") == "F32"


def test_a_tensor_stored_in_two_shards_is_refused_whichever_the_index_names(tmp_path):
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.zeros(3)}, str(tmp_path / "s1.safetensors"))
    save_file({"b.weight": torch.ones(3), "c.weight": torch.ones(1)}, str(tmp_path / "s2.safetensors"))
    for shard in ("s1.safetensors", "s2.safetensors"):
        weight_map = {"a.weight": "s1.safetensors", "b.weight": shard, "c.weight": "s2.safetensors"}
        (tmp_path / SafetensorsSource.INDEX).write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=r"s2\.safetensors: tensor 'b\.weight' also appears in .*s1"):
            SafetensorsSource(tmp_path)


def test_model_safetensors_is_taken_beside_other_safetensors_files(good_file, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(good_file.read_bytes())
    save_file({"other": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    source = SafetensorsSource(tmp_path)
    assert source.files == [tmp_path / "model.safetensors"] and source.names() == {"a.weight", "b.bias"}


def test_several_safetensors_files_without_an_index_are_refused(tmp_path):
    for name in ("a.safetensors", "b.safetensors"):
        save_file({name: torch.zeros(1)}, str(tmp_path / name))
    with pytest.raises(CheckpointError, match=r"one \*\.safetensors file, found \['a.safetensors', 'b.safetensors'\]"):
        SafetensorsSource(tmp_path)


def test_pickle_weights_alone_are_refused_saying_they_are_not_read(tmp_path):
    """A `.bin` checkpoint (torch.save pickles) was "found []", as if the directory were empty."""
    for name in ("pytorch_model-00002-of-00002.bin", "pytorch_model-00001-of-00002.bin", "a.pt", "b.pt"):
        torch.save({"w": torch.zeros(1)}, tmp_path / name)
    with pytest.raises(CheckpointError) as error:
        SafetensorsSource(tmp_path)
    assert str(error.value) == (f"{tmp_path}: expected model.safetensors, model.safetensors.index.json or exactly one "
                                "*.safetensors file, found [] (pytorch_model-00001-of-00002.bin, "
                                "pytorch_model-00002-of-00002.bin, a.pt, ...: PyTorch pickle weights are not read; "
                                "convert them to safetensors)")
    for name in ("a.pt", "b.pt", "pytorch_model-00002-of-00002.bin"):
        (tmp_path / name).unlink()
    with pytest.raises(CheckpointError, match=r"found \[\] \(pytorch_model-00001-of-00002.bin: PyTorch pickle weights"):
        SafetensorsSource(tmp_path)


def test_a_path_that_does_not_exist_is_refused_as_missing(tmp_path):
    """A mistyped checkpoint path read as a directory with no safetensors file in it ("found []")."""
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(CheckpointError, match=rf"^checkpoint path {re.escape(str(missing))} does not exist$"):
        SafetensorsSource(missing)


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_a_lone_safetensors_entry_that_is_not_a_file_is_refused_by_name(tmp_path, make):
    """A FIFO blocked safetensors' open until some process wrote to it (the load hung); a directory
    was 'No such device (os error 19)'."""
    entry = tmp_path / "weights.safetensors"
    make(entry)
    # held open for writing, a regression opens the FIFO and fails instead of blocking the test
    holder = os.open(entry, os.O_RDWR) if entry.is_fifo() else None
    try:
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(entry))} is not a file$"):
            SafetensorsSource(tmp_path)
        if holder is not None:  # given itself (a directory is read as a checkpoint directory)
            with pytest.raises(CheckpointError, match=rf"^checkpoint path {re.escape(str(entry))} is not a file$"):
                SafetensorsSource(entry)
    finally:
        if holder is not None:
            os.close(holder)


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_an_index_naming_a_shard_that_is_not_a_file_says_so(good_file, tmp_path, make):
    """The shard is there, only not a file: it was reported as missing, sending the user to look for a
    download that had not failed."""
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(good_file.read_bytes())
    shard = tmp_path / "model-00002-of-00002.safetensors"
    make(shard)
    index = tmp_path / SafetensorsSource.INDEX
    index.write_text(json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                "b.bias": shard.name}}))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(index))}: shard paths that are not files: "
                                              rf"\['{re.escape(str(shard))}'\]$"):
        SafetensorsSource(tmp_path)


def test_a_stale_index_beside_model_safetensors_names_both(tmp_path):
    """transformers' own save_pretrained, sharded and then unsharded into one directory, removes the old
    shards but keeps their index beside the new model.safetensors, which its from_pretrained reads (the
    oracle: the directory transformers wrote and loads). The refusal said only 'shard files missing'."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="10KB")
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.glob("*.safetensors*")} == {"model.safetensors", SafetensorsSource.INDEX}
    assert transformers.LlamaForCausalLM.from_pretrained(tmp_path) is not None
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / SafetensorsSource.INDEX))}: shard files "
                                              r"missing: .*; the index is read before model\.safetensors beside it: "
                                              r"if that file is the checkpoint, remove the stale index$"):
        SafetensorsSource(tmp_path)


def test_a_complete_index_beside_another_model_safetensors_is_refused_naming_both(tmp_path):
    """transformers' save_pretrained, unsharded and then sharded into one directory, keeps the old
    model.safetensors beside the new index and shards, and its from_pretrained reads model.safetensors
    (the oracle); the shards were read here, silently other weights than transformers runs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="10KB")
    assert (tmp_path / "model.safetensors").is_file() and len(list(tmp_path.glob("model-0000*.safetensors"))) > 1
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / SafetensorsSource.INDEX))}: its shards and "
                                              r"model\.safetensors beside it are two checkpoints .*transformers reads "
                                              r"model\.safetensors.*remove the one that is not the checkpoint$"):
        SafetensorsSource(tmp_path)


def test_an_index_whose_one_shard_is_model_safetensors_loads(good_file, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(good_file.read_bytes())
    weight_map = {"a.weight": "model.safetensors", "b.bias": "model.safetensors"}
    (tmp_path / SafetensorsSource.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert SafetensorsSource(tmp_path).names() == {"a.weight", "b.bias"}


@pytest.mark.parametrize("shard", ["ABSOLUTE", "../outside/model.safetensors", "sub/../../outside/model.safetensors",
                                   "sub/../model.safetensors"], ids=["absolute", "parent", "climbing", "sub-dotdot"])
def test_an_index_naming_a_shard_outside_its_directory_is_refused_unread(good_file, tmp_path, monkeypatch, shard):
    """A downloaded index is data, not a path to follow: its weight_map named /abs/file or ../file and
    another file on the machine was opened and its tensors loaded as the checkpoint's (`sub/..` leaves
    too when sub is a symlink). The oracle: the module's contract, and no open outside the directory."""
    outside = tmp_path / "outside" / "model.safetensors"
    outside.parent.mkdir()
    outside.write_bytes(good_file.read_bytes())
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(good_file.read_bytes())
    shard = str(outside) if shard == "ABSOLUTE" else shard
    index = folder / SafetensorsSource.INDEX
    index.write_text(json.dumps({"weight_map": {"a.weight": shard, "b.bias": shard}}))
    opened, safe_open = [], source_module.safe_open

    def recording_open(path, *args, **kwargs):
        opened.append(path)
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(source_module, "safe_open", recording_open)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(index))}: weight_map: shard paths not inside the "
                                              rf"checkpoint directory \(absolute, or with a \.\. step\): "
                                              rf"{re.escape(shard)}$"):
        SafetensorsSource(folder)
    assert opened == []


def test_an_index_naming_shards_in_a_subdirectory_or_symlinked_out_loads(good_file, tmp_path):
    """What stays allowed: a shard in a subdirectory, and the Hugging Face cache's layout, where each
    snapshot file is a symlink to ../../blobs/<hash> (the index names the link, inside the directory)."""
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    blob.write_bytes(good_file.read_bytes())
    snapshot = tmp_path / "snapshots" / "rev"
    (snapshot / "sub").mkdir(parents=True)
    (snapshot / "sub" / "model-00001-of-00001.safetensors").symlink_to(os.path.relpath(blob, snapshot / "sub"))
    (snapshot / SafetensorsSource.INDEX).write_text(json.dumps(
        {"weight_map": {"a.weight": "sub/model-00001-of-00001.safetensors",
                        "b.bias": "./sub/model-00001-of-00001.safetensors"}}))
    source = SafetensorsSource(snapshot)
    assert torch.equal(source.get("a.weight"), torch.arange(12.0).view(3, 4))
    assert source.files == [snapshot / "sub" / "model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("stored", [torch.full((3, 4), 7, dtype=torch.int64), torch.ones(4, 3)], ids=["dtype", "shape"])
@pytest.mark.parametrize("read", [lambda source: source.get("a.weight"), lambda source: source.get_many(["a.weight"])],
                         ids=["get", "get_many"])
def test_a_file_replaced_after_listing_with_other_tensors_is_refused_naming_both(good_file, tmp_path, stored, read):
    """A download writing over the file between the listing and the read: the new int64 tensor was
    returned as the F32 weight the listing checked (a loader casts it to float, a wrong model without a
    word), and a [4, 3] as the listed [3, 4]. The oracle: shape() and dtype(), what the checks read."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(good_file.read_bytes())
    source = SafetensorsSource(tmp_path)
    listed = (source.dtype("a.weight"), source.shape("a.weight"))
    save_file({"a.weight": stored, "b.bias": torch.ones(5)}, str(path))
    now = ({torch.int64: "I64", torch.float32: "F32"}[stored.dtype], tuple(stored.shape))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: tensor 'a.weight' changed since the "
                                              rf"checkpoint was listed \({listed[0]} {re.escape(str(listed[1]))}, "
                                              rf"now {now[0]} {re.escape(str(now[1]))}\)$"):
        read(source)
    assert torch.equal(source.get("b.bias"), torch.ones(5))
