"""Fixtures shared by the reliability tests and the end-of-run summary of what was exercised."""
from __future__ import annotations

from ._counts import COUNTS


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not COUNTS:
        return
    terminalreporter.write_sep("-", "reliability counts")
    line = ", ".join(f"{name}={COUNTS[name]}" for name in sorted(COUNTS))
    terminalreporter.write_line(line)
