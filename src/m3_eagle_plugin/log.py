"""The plugin's logger: one named logger with its own stderr handler.

Activation must leave one visible line per process (driver, MPI workers, spawned servers) even when
the host has not configured Python logging, so the logger carries its own handler instead of relying
on the root logger. `M3_EAGLE_PLUGIN_LOG_LEVEL` (default INFO) sets its level; any other value than a
level name leaves INFO and says so in one warning (the logger must not raise: it runs inside the
host's import), which `m3-eagle doctor` reports as a failure too (`level_from_env`).
"""
from __future__ import annotations

import logging
import os
import sys
import threading

LOGGER_NAME = "m3_eagle_plugin"
LEVEL_ENV = "M3_EAGLE_PLUGIN_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_configure_lock = threading.Lock()  # two threads' first calls would each add a handler: every line twice


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (so redirected or captured stderr sees it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401 - logging reads this attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def level_from_env(environ=None) -> tuple[int, str | None]:
    """(level, None) from `$M3_EAGLE_PLUGIN_LOG_LEVEL` (unset or empty: INFO), or (INFO, why the value
    is not a level)."""
    raw = (os.environ if environ is None else environ).get(LEVEL_ENV, "")
    name = raw.strip().upper() or "INFO"
    if name not in LEVELS:
        return logging.INFO, f"{LEVEL_ENV}={raw!r} is not a log level; allowed values: {', '.join(LEVELS)} (using INFO)"
    return logging.getLevelName(name), None


def get_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if getattr(logger, "_m3_eagle_configured", False):
        return logger
    with _configure_lock:
        if getattr(logger, "_m3_eagle_configured", False):
            return logger
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("[m3_eagle_plugin pid=%(process)d] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        level, problem = level_from_env()
        logger.setLevel(level)
        logger.propagate = False
        logger._m3_eagle_configured = True  # type: ignore[attr-defined]
    if problem is not None:
        logger.warning(problem)
    return logger
