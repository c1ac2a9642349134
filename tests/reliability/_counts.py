"""Run counters of the reliability suite (cases fuzzed, faults injected, requests soaked).

The numbers are what the suite's guarantees rest on, so they are reported at the end of every
run by the `pytest_terminal_summary` hook in this directory's conftest, whether or not `-s` is
given.
"""
from __future__ import annotations

import collections

COUNTS: "collections.Counter[str]" = collections.Counter()


def bump(name: str, amount: int = 1) -> None:
    """Add `amount` to the counter `name` (e.g. "fuzz.steps", "faults.injected")."""
    COUNTS[name] += int(amount)
