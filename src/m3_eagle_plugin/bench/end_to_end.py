"""Hook for the end-to-end section of `m3-eagle bench` (reference host, CUDA graphs, Eagle3).

Why: the kernel suite and the end-to-end run share the CLI, the table and the JSON; the lead
plugs the end-to-end run in here without touching the rest. `run_end_to_end` returns table rows
(dicts; keys become columns) and may return [] when it cannot run (e.g. no CUDA).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

EndToEnd = Callable[[argparse.Namespace], list[dict[str, Any]]]
_hook: EndToEnd | None = None


def register_end_to_end(fn: EndToEnd) -> EndToEnd:
    """Install the end-to-end runner (usable as a decorator)."""
    global _hook
    _hook = fn
    return fn


def run_end_to_end(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows of the end-to-end section; a single 'not available' row until a runner is registered. A
    runner that fails part-way may leave the rows it finished on the error (`e2e_rows`): they reach
    the caller as the error's `partial_rows`, in this section."""
    if _hook is None:
        return [{"section": "end_to_end", "kernel": "e2e", "note": "not implemented yet"}]
    try:
        rows = _hook(args)
    except BaseException as error:
        error.partial_rows = [{"section": "end_to_end", **row} for row in getattr(error, "e2e_rows", [])]
        raise
    return [{"section": "end_to_end", **row} for row in rows]
