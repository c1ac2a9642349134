"""Strict int arguments, one rule for the whole package: sizes, layer ids, counts and drafted token
ids arrive from configs, host objects, drafters and callers; a float (layer 2.7, 1.5 heads), a bool
or a string ("2" bytes repeated into a page size) must be refused by name, never truncated, while
any integer (Python, numpy, a 0-d torch integer: anything with ``__index__``) is one; a torch bool
or a one-element torch tensor of more dimensions is not."""
from __future__ import annotations

import operator


def exact_index(value: object) -> int | None:
    """``value`` as an int if it is an integer (not bool), else None."""
    if type(value) is int:
        return value
    # a torch bool tensor and a one-element torch tensor of any shape have __index__ too
    if isinstance(value, bool) or getattr(value, "ndim", 0) != 0 or str(getattr(value, "dtype", "")) == "torch.bool":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_int(name: str, value: object, minimum: int | None = None, error: type[Exception] | None = None) -> int:
    """``value`` as an int, at least ``minimum`` when given; else ``error`` naming ``name``
    (by default TypeError for a non-integer, ValueError for one below ``minimum``)."""
    index = exact_index(value)
    if index is None:
        kind = "bool" if isinstance(value, bool) else f"{type(value).__name__} {value!r}"
        bound = "" if minimum is None else f" >= {minimum}"
        raise (error or TypeError)(f"{name} must be an int{bound}, got {kind}")
    if minimum is not None and index < minimum:
        raise (error or ValueError)(f"{name} must be an int >= {minimum}, got {index}")
    return index
