"""Plain-text table for bench rows (dicts), columns in a fixed order, missing cells blank."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

COLUMNS = ("section", "kernel", "batch", "context", "qo_len", "kv_dtype", "graph_us", "eager_us", "torch_us",
           "floor_us", "pct_of_floor", "vs_torch", "vs_q1", "union_blocks", "error", "flashinfer_us",
           "vs_flashinfer", "flashinfer_eager_us", "vs_flashinfer_eager", "flashinfer_check", "flashinfer_timing",
           "note", "flashinfer_error")
JSON_ONLY = {"bytes", "flashinfer_api", "flashinfer_note", "flashinfer_nvp_timing"}  # detail kept out of the table
CELL_LIMIT = {"flashinfer_error": 60, "flashinfer_nvp_error": 60}  # long messages cut in the table only
#: Columns whose None means "not measured" (JSON null), written "-"; a missing cell stays blank.
UNMEASURED = {"mean_acceptance_length"}


def _cell(value: Any, limit: int | None = None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):  # one line a row: a child's stderr tail (`flashinfer_nvp_error`) has several
        value = " ".join(value.splitlines())
    if limit is not None and isinstance(value, str) and len(value) > limit:
        return value[: limit - 3] + "..."
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == 0:
            return "0"
        return f"{value:.3g}" if abs(value) < 0.01 or abs(value) >= 1e5 else f"{value:.2f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One table per section (kernels and end to end have different columns), in first-seen order."""
    sections: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        sections.setdefault(row.get("section"), []).append(row)
    return "\n\n".join(_format_section(part) for part in sections.values())


def _format_section(rows: Sequence[dict[str, Any]]) -> str:
    present = [c for c in COLUMNS if any(c in r for r in rows)]
    extra = sorted({k for r in rows for k in r} - set(COLUMNS) - JSON_ONLY)
    cols = present + extra
    cells = [["-" if c in UNMEASURED and c in r and r[c] is None else _cell(r.get(c), CELL_LIMIT.get(c))
              for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def json_safe(value: Any, non_finite: Callable[[float], Any]) -> Any:
    """`value` with every non-finite float replaced by `non_finite(it)` (tuples become lists): `json.dump`
    writes `NaN` / `Infinity`, which is not JSON (jq and other strict readers refuse the whole file)."""
    if isinstance(value, float) and not math.isfinite(value):
        return non_finite(value)
    if isinstance(value, dict):
        return {k: json_safe(v, non_finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, non_finite) for v in value]
    return value
