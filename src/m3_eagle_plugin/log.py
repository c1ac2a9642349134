"""The plugin's logger: one named logger with its own stderr handler.

Activation must leave one visible line per process (driver, MPI workers, spawned servers) even when
the host has not configured Python logging, so the logger carries its own handler instead of relying
on the root logger. `M3_EAGLE_PLUGIN_LOG_LEVEL` (default INFO) sets its level.
"""
from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "m3_eagle_plugin"
LEVEL_ENV = "M3_EAGLE_PLUGIN_LOG_LEVEL"


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


def get_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not getattr(logger, "_m3_eagle_configured", False):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("[m3_eagle_plugin pid=%(process)d] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        try:
            logger.setLevel(os.environ.get(LEVEL_ENV, "INFO").strip().upper())
        except ValueError:
            logger.setLevel(logging.INFO)
        logger.propagate = False
        logger._m3_eagle_configured = True  # type: ignore[attr-defined]
    return logger
