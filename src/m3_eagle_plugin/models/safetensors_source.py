"""Read-only access to a safetensors checkpoint: one file or a sharded index.

Lists tensor names and shapes without reading data, so loaders can validate a whole checkpoint
(names, shapes) before touching any weight. A truncated or corrupt file, or a broken shard index,
is a `CheckpointError` naming the file (never safetensors' own exception), and so is a shard index
beside another `model.safetensors` (two checkpoints in one directory). A shard index names
files inside its directory: an absolute path or a `..` step is refused, not read (a symlinked shard
is followed, as in the Hugging Face cache, whose snapshot files link to `../../blobs`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

from m3_eagle_plugin.models.config_fields import json_refusal


class CheckpointError(ValueError):
    """A checkpoint's files or tensors do not match the model being loaded."""


class SafetensorsSource:
    INDEX = "model.safetensors.index.json"

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.root = path if path.is_dir() else path.parent
        self._weight_map: dict[str, str] | None = None  # the shard index's tensor -> file, when there is one
        self.files = self._find_files(path)
        self._file_of: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}  # safetensors' dtype names: "F32", "BF16", "I64", "F8_E4M3", ...
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    slices = {name: f.get_slice(name) for name in f.keys()}
                    shapes = {name: tuple(part.get_shape()) for name, part in slices.items()}
                    dtypes = {name: part.get_dtype() for name, part in slices.items()}
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{file}: not a readable safetensors file ({_one_line(error)})") from None
            for name, shape in shapes.items():
                if name in self._file_of:
                    raise CheckpointError(f"{file}: tensor {name!r} also appears in {self._file_of[name]}")
                self._file_of[name] = file
                self._shape[name] = shape
                self._dtype[name] = dtypes[name]
        if self._weight_map is not None:
            self._check_index_matches_shards()

    def _find_files(self, path: Path) -> list[Path]:
        if path.is_file():
            return [path]
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"checkpoint path {path} is not a file")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path {path} does not exist")
        index = path / self.INDEX
        if index.is_file():
            weight_map = self._weight_map = _read_weight_map(index)
            files = sorted({path / name for name in weight_map.values()})
            missing = [str(p) for p in files if not p.exists()]
            if missing:
                # save_pretrained sharded, then unsharded into one directory, leaves the old index beside
                # model.safetensors, which transformers reads first
                single = path / "model.safetensors"
                stale = (f"; the index is read before {single.name} beside it: if that file is the checkpoint, "
                         "remove the stale index") if single.is_file() else ""
                raise CheckpointError(f"{index}: shard files missing: {missing}{stale}")
            not_files = [str(p) for p in files if not p.is_file()]  # a FIFO would block safetensors' open
            if not_files:
                raise CheckpointError(f"{index}: shard paths that are not files: {not_files}")
            single = path / "model.safetensors"
            if single.is_file() and single.resolve() not in {file.resolve() for file in files}:
                # save_pretrained unsharded, then sharded into one directory, keeps the old file beside the
                # new shards; transformers reads model.safetensors, so either choice here may run other weights
                raise CheckpointError(f"{index}: its shards and {single.name} beside it are two checkpoints in one "
                                      f"directory (transformers reads {single.name}, not the index): remove the one "
                                      "that is not the checkpoint")
            return files
        single = path / "model.safetensors"
        if single.is_file():
            return [single]
        found = sorted(path.glob("*.safetensors"))
        if len(found) == 1:
            if found[0].exists() and not found[0].is_file():  # a FIFO would block safetensors' open for good
                raise CheckpointError(f"{found[0]} is not a file")
            return found
        pickled = [] if found else [p.name for ext in ("*.bin", "*.pt") for p in sorted(path.glob(ext))]
        unsupported = (f" ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}: PyTorch pickle weights are "
                       "not read; convert them to safetensors)") if pickled else ""
        raise CheckpointError(f"{path}: expected model.safetensors, {self.INDEX} or exactly one *.safetensors file, "
                              f"found {[p.name for p in found]}{unsupported}")

    def _check_index_matches_shards(self) -> None:
        """The index must list exactly the tensors its shards hold, each in its own shard: anything else
        is a stale index or a shard from another download, whose weights cannot be trusted."""
        index = self.root / self.INDEX
        listed = {name: self.root / shard for name, shard in self._weight_map.items()}
        absent = sorted(name for name, file in listed.items() if self._file_of.get(name) != file)
        unlisted = sorted(set(self._file_of) - set(listed))
        if not absent and not unlisted:
            return
        parts = []
        if absent:
            parts.append(f"{len(absent)} tensor(s) not in the shard the index names: "
                         + _preview([f"{n} ({listed[n].name})" for n in absent]))
        if unlisted:
            parts.append(f"{len(unlisted)} tensor(s) in a shard but not in the index: "
                         + _preview([f"{n} ({self._file_of[n].name})" for n in unlisted]))
        raise CheckpointError(f"{index}: index and shard files disagree: " + "; ".join(parts))

    @property
    def where(self) -> str:
        return str(self.files[0]) if len(self.files) == 1 else str(self.root / self.INDEX)

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("F32", "BF16", "I64", ...), read from the header."""
        return self._dtype[name]

    def get(self, name: str) -> torch.Tensor:
        return _read(self._file_of[name], {name: (self._shape[name], self._dtype[name])})[name]

    def get_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read several tensors, opening each shard once."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            out.update(_read(file, {name: (self._shape[name], self._dtype[name]) for name in group}))
        return out


def _read(file: Path, listed: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, torch.Tensor]:
    """The tensors as listed: a file replaced since (a download writing over it) whose tensor now has
    another shape or dtype is refused, not read as the weights its listing checked."""
    out: dict[str, torch.Tensor] = {}
    name = next(iter(listed), "<header>")
    try:
        with safe_open(str(file), framework="pt") as f:
            for name, (shape, dtype) in listed.items():
                part = f.get_slice(name)
                now = (tuple(part.get_shape()), part.get_dtype())
                if now != (shape, dtype):
                    raise CheckpointError(f"{file}: tensor {name!r} changed since the checkpoint was listed "
                                          f"({dtype} {shape}, now {now[1]} {now[0]})")
                out[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({_one_line(error)})") from None
    return out


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, OSError) as error:
        raise CheckpointError(f"{index}: cannot be read ({_one_line(error)})") from None
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{index}: {json_refusal(error)}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map: missing or not a JSON object")
    bad = sorted(name for name, shard in weight_map.items() if not isinstance(shard, str) or not shard)
    if bad:
        raise CheckpointError(f"{index}: weight_map: tensors without a shard file name: {_preview(bad)}")
    outside = sorted({shard for shard in weight_map.values() if Path(shard).is_absolute() or ".." in Path(shard).parts})
    if outside:
        raise CheckpointError(f"{index}: weight_map: shard paths not inside the checkpoint directory "
                              f"(absolute, or with a .. step): {_preview(outside)}")
    return weight_map


def _preview(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_names(where: str, missing: list[str], unknown: list[str]) -> None:
    """One error listing every missing and unknown tensor."""
    if not missing and not unknown:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing tensor(s): {_preview(sorted(missing))}")
    if unknown:
        parts.append(f"{len(unknown)} unknown tensor(s): {_preview(sorted(unknown))}")
    raise CheckpointError(f"{where}: checkpoint does not match the model: " + "; ".join(parts))


#: stored dtypes a weight can be read from as it is; anything else (integers, bool, float8 data whose
#: scales live in other tensors) would be cast to numbers that are not the weights
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


def check_weight_dtype(where: str, name: str, dtype: str) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise CheckpointError(f"{where}: tensor {name!r} is stored as {dtype}; weights must be one of "
                              f"{', '.join(WEIGHT_DTYPES)} (quantized checkpoints are not supported)")


def check_compute_dtype(dtype: object) -> None:
    """The dtype a model is loaded in (the caller's choice, not the file's): floating, 16 bits or more."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        raise ValueError(f"dtype must be a floating dtype of 16 bits or more for the weights, got {dtype}")


def check_sizes_stored(sizes: dict[str, int], shapes: Iterable[tuple[int, ...]], config_where: str,
                       stored_in: str, error: type[ValueError] = CheckpointError) -> None:
    """A config size past every dimension of the checkpoint's tensors (``shapes``) matches no tensor:
    refused by its field before a model is built from the config (2**62 overflowed torch's sizes even
    on the meta device, a bare TypeError or RuntimeError naming no field)."""
    largest = max((max(shape) for shape in shapes if shape), default=0)
    for field, size in sizes.items():
        if size > largest:
            raise error(f"{config_where}: {field}: {size}, larger than any dimension of a tensor in {stored_in} "
                        f"(the largest is {largest})")


def check_shape(where: str, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")
