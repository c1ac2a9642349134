"""Strict int arguments for the KV layer: sizes, layer ids, addresses and scales arrive from
configs, host objects and callers; a float (layer 2.7, 1.5 heads), a bool or a string ("2" bytes
repeated into a page size) must be refused by name, never truncated."""
from __future__ import annotations

import operator


def as_int(name: str, value: object) -> int:
    """``value`` as an int (anything with ``__index__``: int, numpy and torch integers); else TypeError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
