"""The Eagle3 draft side: the M3 head, aux-state capture, acceptance rules and the draft loop.

Names resolve lazily (PEP 562): `models` imports `eagle3.capture`, and `eagle3.checkpoint`
imports `models`, so an eager package import would be circular.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "AcceptResult": "accept",
    "forced_accept": "accept",
    "greedy_accept": "accept",
    "rejection_accept": "accept",
    "AuxCapture": "capture",
    "load_draft": "checkpoint",
    "Eagle3Head": "head",
    "run_draft_loop": "draft_loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
