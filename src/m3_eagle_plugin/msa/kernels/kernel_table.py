"""The measured ours-vs-FlashInfer table and the backend choice it backs.

Why: whether FlashInfer's MSA ops beat our Triton kernels depends on the GPU and the shape, and
the numbers get re-measured; so the choice reads data, not code. The shipped table
(`peer_table_h200.json`, one H200 run of `m3-eagle bench`) is replaced by the file named in
`M3_EAGLE_KERNEL_TABLE`, which `m3-eagle bench ... --write-table PATH` writes from its own rows.

Format (JSON object): `device` (the `torch.cuda.get_device_name` it was measured on), `date`,
`command`, optional `flashinfer` (version) and `notes`, and `rows`: objects with `kernel` (a bench
kernel name, TABLE_KERNELS), `batch`, `context`, `qo_len` (positive ints), `ours_us` (positive),
`flashinfer_us` (positive, or null / absent when not measured) and an optional `note`. Refused,
naming the file (and the row): an empty file, an unknown or repeated field (JSON
decoders silently keep the last of a repeated key), a non-finite or non-positive time, and a shape
measured twice (two rows of the same kernel, batch, context and qo_len: with different times the
choice would hang on their order; identical ones would be listed and counted twice by `doctor`).

Nearest row: among rows of the same kernel and the same q_len, the smallest |log2(batch ratio)|,
then the smallest |log2(context ratio)|, then the smaller measured batch and context. The chooser
answers "flashinfer" only when FlashInfer is eligible, the table was measured on a device of the
same name, such a row exists, and its FlashInfer time is lower; every other case is "triton" (ours)
with the reason. Decisions are cached per (table, kernel, device, batch, context, q_len); the table
is read once per path (restart to pick up an edited file); `check_override` reads the one
`M3_EAGLE_KERNEL_TABLE` names up front (`check_backend`, before `m3-eagle run` reads a weight).
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable

ENV_VAR = "M3_EAGLE_KERNEL_TABLE"
SHIPPED_NAME = "peer_table_h200.json"
SHIPPED_PATH = Path(__file__).with_name(SHIPPED_NAME)
TABLE_KERNELS = ("index_select", "sparse_attn", "sparse_step", "dense_attn", "dense_attn_peer")
#: Dispatcher -> the table kernels that measure it. `sparse_layer_attention` (a sparse layer's
#: selection + attention) is decided on the whole step: where both halves could run on FlashInfer,
#: the nearest `sparse_step` row picks the whole step (ours or FlashInfer's); without one, each half
#: follows its own row.
STEP = "sparse_layer_attention"
DISPATCH_ROWS = {"select_blocks_paged": ("index_select",), "sparse_attention": ("sparse_attn",),
                 "dense_attention": ("dense_attn", "dense_attn_peer"), STEP: ("sparse_step",)}


class KernelTableError(ValueError):
    """A kernel table file is missing, unreadable or malformed (the message names the file)."""


def _ratio(a: int, b: int) -> Fraction:
    return Fraction(max(a, b), min(a, b))


@dataclass(frozen=True)
class TableRow:
    kernel: str
    batch: int
    context: int
    qo_len: int
    ours_us: float
    flashinfer_us: float | None = None
    note: str | None = None

    def shape(self) -> str:
        ctx = f"{self.context // 1024}K" if self.context % 1024 == 0 else str(self.context)
        return f"B{self.batch}/{ctx} q{self.qo_len}"

    def distance(self, batch: int, context: int) -> tuple[Fraction, Fraction, int, int]:
        """How far this row's shape is from (batch, context): the batch ratio (larger over smaller,
        ordered as |log2| of it), then the context ratio, then the smaller measured batch and
        context (the module docstring's nearest row). Exact fractions: float log2 breaks ties such
        as B20 between B16 and B25 (20/16 = 25/20) by rounding, not by the smaller batch."""
        return _ratio(batch, self.batch), _ratio(context, self.context), self.batch, self.context

    def verdict(self) -> str:
        """Short: 'B16/32K q4 -> flashinfer (ours 18.9 / FlashInfer 15.3 us)'."""
        if self.flashinfer_us is None:
            return f"{self.shape()} -> ours (ours {self.ours_us:g} us / FlashInfer not measured)"
        who = "flashinfer" if self.flashinfer_us < self.ours_us else "ours"
        return f"{self.shape()} -> {who} (ours {self.ours_us:g} / FlashInfer {self.flashinfer_us:g} us)"


@dataclass(frozen=True, eq=False)  # hashed by identity: the decision cache keys on the loaded object
class KernelTable:
    source: str
    shipped: bool
    device: str
    date: str
    command: str
    rows: tuple[TableRow, ...]
    flashinfer: str | None = None
    notes: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"source": ("shipped " if self.shipped else f"{ENV_VAR}=") + self.source, "device": self.device,
                "date": self.date, "command": self.command, "flashinfer": self.flashinfer, "rows": len(self.rows)}

    def nearest(self, kernel: str, batch: int, context: int, q_len: int) -> TableRow | None:
        rows = [r for r in self.rows if r.kernel == kernel and r.qo_len == q_len]
        return min(rows, key=lambda r: r.distance(batch, context)) if rows else None

    def verdicts(self, kernel: str) -> list[str]:
        return [r.verdict() for r in self.rows if r.kernel == kernel]


# --- parsing ------------------------------------------------------------------------------------

def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    """A finite positive int or float that converts to a finite float (an int past float's range
    would raise OverflowError, not a named error)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:
        return False


TOP_FIELDS = ("device", "date", "command", "flashinfer", "notes", "rows")
ROW_FIELDS = ("kernel", "batch", "context", "qo_len", "ours_us", "flashinfer_us", "note")


class _Object(dict):
    """A decoded JSON object that keeps the keys given more than once (JSON decoders silently keep
    the last)."""
    repeated: tuple[str, ...] = ()


def _object(items: list[tuple[str, Any]]) -> _Object:
    obj = _Object(items)
    if len(obj) < len(items):
        seen: set[str] = set()
        obj.repeated = tuple(sorted({k for k, _ in items if k in seen or seen.add(k)}))
    return obj


def _kind(value: Any) -> str:
    return "dict" if isinstance(value, dict) else type(value).__name__  # a decoded `_Object` too


def parse_table(data: Any, source: str, *, shipped: bool = False) -> KernelTable:
    """A validated table from decoded JSON; any problem raises KernelTableError naming `source`."""
    def fail(problem: str):
        raise KernelTableError(f"kernel table {source}: {problem}")

    def check_fields(obj: dict, fields: tuple[str, ...], where: str = "") -> None:
        has = f"{where} has " if where else ""
        if getattr(obj, "repeated", ()):
            fail(f"{has}field(s) {list(obj.repeated)} given more than once")
        unknown = set(obj) - set(fields)
        if unknown:
            fail(f"{has}unknown field(s) {sorted(unknown)} (expected {', '.join(fields)})")

    if not isinstance(data, dict):
        fail(f"expected a JSON object, got {_kind(data)}")
    check_fields(data, TOP_FIELDS)
    for key in ("device", "date", "command"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            fail(f"'{key}' must be a non-empty string, got {data.get(key)!r}")
    for key in ("flashinfer", "notes"):
        if data.get(key) is not None and not isinstance(data[key], str):
            fail(f"'{key}' must be a string, got {data[key]!r}")
    rows_in = data.get("rows")
    if not isinstance(rows_in, list):
        fail(f"'rows' must be a list, got {_kind(rows_in)}")
    rows: list[TableRow] = []
    first: dict[tuple[str, int, int, int], int] = {}  # shape -> the index of the row measuring it
    for i, row in enumerate(rows_in):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            fail(f"{where} must be an object, got {_kind(row)}")
        check_fields(row, ROW_FIELDS, where)
        if row.get("kernel") not in TABLE_KERNELS:
            fail(f"{where}.kernel must be one of {list(TABLE_KERNELS)}, got {row.get('kernel')!r}")
        for key in ("batch", "context", "qo_len"):
            if not _positive_int(row.get(key)):
                fail(f"{where}.{key} must be a positive integer, got {row.get(key)!r}")
        if not _positive_number(row.get("ours_us")):
            fail(f"{where}.ours_us must be a positive number, got {row.get('ours_us')!r}")
        if row.get("flashinfer_us") is not None and not _positive_number(row["flashinfer_us"]):
            fail(f"{where}.flashinfer_us must be a positive number or null, got {row['flashinfer_us']!r}")
        if row.get("note") is not None and not isinstance(row["note"], str):
            fail(f"{where}.note must be a string, got {row['note']!r}")
        fi = row.get("flashinfer_us")
        parsed = TableRow(row["kernel"], row["batch"], row["context"], row["qo_len"], float(row["ours_us"]),
                          None if fi is None else float(fi), row.get("note"))
        key = (parsed.kernel, parsed.batch, parsed.context, parsed.qo_len)
        if key in first:
            j = first[key]
            same = (rows[j].ours_us, rows[j].flashinfer_us) == (parsed.ours_us, parsed.flashinfer_us)
            fail(f"{where} measures {parsed.kernel} {parsed.shape()} again (rows[{j}]): "
                 + ("identical times" if same else
                    f"different times ({rows[j].verdict()} there, {parsed.verdict()} here)")
                 + "; keep one row per kernel, batch, context and qo_len")
        first[key] = i
        rows.append(parsed)
    return KernelTable(source, shipped, data["device"].strip(), data["date"], data["command"], tuple(rows),
                       data.get("flashinfer"), data.get("notes"))


@functools.lru_cache(maxsize=8)
def _load(path: str, shipped: bool) -> KernelTable:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise KernelTableError(f"kernel table {path}: cannot read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise KernelTableError(f"kernel table {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise KernelTableError(f"kernel table {path}: the file is empty (expected a JSON object; module docstring)")
    try:
        data = json.loads(text, object_pairs_hook=_object)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
        raise KernelTableError(f"kernel table {path}: not valid JSON ({type(exc).__name__}: {exc})") from exc
    return parse_table(data, path, shipped=shipped)


def table_path() -> tuple[str, bool]:
    """(path, shipped?): `M3_EAGLE_KERNEL_TABLE` when set, else the table shipped in the package."""
    override = os.environ.get(ENV_VAR, "").strip()
    return (override, False) if override else (str(SHIPPED_PATH), True)


def load_table() -> KernelTable:
    """The table in force (read once per path); KernelTableError if it is unreadable or malformed."""
    return _load(*table_path())


def check_override() -> KernelTable | None:
    """The table `M3_EAGLE_KERNEL_TABLE` names, read and validated now (and cached: the choices to
    come use this very object), or None when the variable is unset (the shipped table, tested with
    the package); KernelTableError names the file and the problem."""
    path, shipped = table_path()
    return None if shipped else _load(path, shipped)


def clear_caches() -> None:
    _load.cache_clear()
    _decide.cache_clear()


# --- the choice -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    backend: str  # "flashinfer" | "triton" (ours)
    reason: str
    row: TableRow | None = None  # the measured row the choice read, if any


def names_match(a: str, b: str) -> bool:
    return a.strip().lower() == b.strip().lower()


@functools.lru_cache(maxsize=4096)
def _decide(table: KernelTable, kernel: str, device: str, batch: int, context: int, q_len: int) -> Choice:
    if not names_match(table.device, device):
        return Choice("triton", f"table measured on {table.device}, this device is {device}: no measurement, ours")
    measured = DISPATCH_ROWS.get(kernel, ())
    rows = [r for r in (table.nearest(name, batch, context, q_len) for name in measured) if r is not None]
    if not rows:
        return Choice("triton", f"no {'/'.join(measured) or kernel} row with q_len {q_len} in the table: ours")
    row = min(rows, key=lambda r: r.distance(batch, context))
    if row.flashinfer_us is None:
        return Choice("triton", f"nearest row {row.kernel} {row.shape()} has no FlashInfer time: ours", row)
    if row.flashinfer_us < row.ours_us:
        return Choice("flashinfer", f"nearest row {row.kernel} {row.shape()}: FlashInfer {row.flashinfer_us:g} us "
                                    f"< ours {row.ours_us:g} us", row)
    return Choice("triton", f"nearest row {row.kernel} {row.shape()}: ours {row.ours_us:g} us <= FlashInfer "
                            f"{row.flashinfer_us:g} us", row)


def choose(kernel: str, *, batch: int, context: int, q_len: int, device_name: str, eligible: tuple[bool, str],
           table: KernelTable | None = None) -> Choice:
    """The backend for one (kernel, shape, device): "flashinfer" only when `eligible` holds and the
    nearest measured row says FlashInfer is faster (module docstring); cached per shape."""
    ok, why = eligible
    if not ok:
        return Choice("triton", f"FlashInfer not eligible: {why}")
    table = load_table() if table is None else table
    return _decide(table, kernel, device_name, int(batch), max(1, int(context)), int(q_len))


# --- writing (from bench rows) --------------------------------------------------------------------

#: The attention FlashInfer's route calls (`flashinfer_msa.sparse_attention`); the bench times the
#: prefill form `msa_sparse_attention` in its place where this one refuses the shape.
ROUTED_ATTENTION = "msa_sparse_decode_attention"


def _bench_flashinfer_us(row: dict[str, Any], nvp_error: Any = None) -> tuple[float | None, str | None]:
    """FlashInfer's time for the form the dispatcher would run, else None (with why). For index
    selection that is the top-k with per-token num_valid_pages (timed alone in a child process):
    score + that top-k; for the attention and the whole step, the decode attention (`flashinfer_api`
    names what the bench called). Where that top-k failed (the index row's `flashinfer_nvp_error`,
    passed as `nvp_error` for the whole step of the same shape), neither routed form was measured."""
    fi = row.get("flashinfer_us")
    if fi is None:
        return None, None
    kernel, api = row.get("kernel"), row.get("flashinfer_api")
    attention = None if api is None else str(api).rsplit(" + ", 1)[-1]  # the step's api: score + top-k + attention
    if kernel in ("sparse_attn", "sparse_step") and attention not in (None, ROUTED_ATTENTION):
        return None, f"FlashInfer timed {api}, not {ROUTED_ATTENTION} (the form the router runs)"
    if kernel == "index_select":
        nvp_error = row.get("flashinfer_nvp_error")
    if kernel in ("index_select", "sparse_step") and nvp_error is not None:
        return None, f"FlashInfer's num_valid_pages top-k (the form the router runs) failed: {str(nvp_error)[:200]}"
    if kernel != "index_select":
        return fi, None
    if row.get("flashinfer_nvp_us") is not None and row.get("flashinfer_topk_us") is not None:
        return (fi - row["flashinfer_topk_us"] + row["flashinfer_nvp_us"],
                "flashinfer_us - flashinfer_topk_us + flashinfer_nvp_us (the num_valid_pages top-k the router runs)")
    return fi, "FlashInfer's default top-k form (the num_valid_pages form the router runs was not measured)"


def table_from_bench_rows(rows: Iterable[dict[str, Any]], *, device: str, date: str, command: str,
                          flashinfer: str | None = None) -> dict[str, Any]:
    """A table (JSON-ready dict, validated) from `m3-eagle bench` kernel rows: ours = `graph_us`."""
    rows = list(rows)
    nvp_failed = {(r.get("batch"), r.get("context"), r.get("qo_len")): r["flashinfer_nvp_error"] for r in rows
                  if r.get("kernel") == "index_select" and r.get("flashinfer_nvp_error") is not None}
    out = []
    for row in rows:
        if row.get("kernel") not in TABLE_KERNELS or not _positive_number(row.get("graph_us")):
            continue
        fi, note = _bench_flashinfer_us(row, nvp_failed.get((row.get("batch"), row.get("context"), row.get("qo_len"))))
        entry = {"kernel": row["kernel"], "batch": row["batch"], "context": row["context"], "qo_len": row["qo_len"],
                 "ours_us": round(float(row["graph_us"]), 2),
                 "flashinfer_us": round(float(fi), 2) if _positive_number(fi) else None}
        timing = row.get("flashinfer_timing")
        error = row.get("flashinfer_error")
        note = "; ".join(filter(None, [note, timing not in (None, "graph") and f"FlashInfer timed {timing}",
                                       error and f"FlashInfer error: {str(error)[:200]}"]))
        if note:
            entry["note"] = note
        out.append(entry)
    data = {"device": device, "date": date, "command": command, "flashinfer": flashinfer, "rows": out}
    parse_table(data, "(bench rows)")
    return data
