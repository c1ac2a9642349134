"""The plugin's logger: its level from `M3_EAGLE_PLUGIN_LOG_LEVEL`, a bad value said out loud."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = "from m3_eagle_plugin.log import get_logger; l = get_logger(); l.info('info-line'); l.debug('debug-line')"


def _stderr(level: str, script: str = SCRIPT) -> str:
    """A fresh interpreter's stderr (the logger is configured once a process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3_EAGLE")}
    env.update(M3_EAGLE_PLUGIN="off", M3_EAGLE_PLUGIN_LOG_LEVEL=level)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stderr


@pytest.mark.parametrize("level", ["LOUD", "10", "verbose"])
def test_a_bad_level_warns_naming_it_and_keeps_info(level):
    """It fell back to INFO without a word (README allows DEBUG, INFO, WARNING)."""
    err = _stderr(level)
    assert f"WARNING M3_EAGLE_PLUGIN_LOG_LEVEL={level!r} is not a log level; allowed values: DEBUG" in err
    assert "info-line" in err and "debug-line" not in err


@pytest.mark.parametrize("level, shown", [("debug", {"info-line", "debug-line"}), ("WARNING", set()),
                                          ("", {"info-line"})])
def test_documented_levels_apply_quietly(level, shown):
    err = _stderr(level)
    assert "is not a log level" not in err
    assert {line for line in ("info-line", "debug-line") if line in err} == shown


def test_a_host_that_configured_root_logging_sees_each_line_once():
    """The logger has its own handler, so nothing may reach the root logger's handler a second time."""
    err = _stderr("", "import logging; logging.basicConfig(level=logging.INFO); " + SCRIPT)
    assert err.count("info-line") == 1, err


RACE = """
import threading
from m3_eagle_plugin import log

meet = threading.Barrier(2)
real = log.level_from_env


def level_from_env():  # the first calls of two threads, both inside the set-up at once if nothing stops them
    try:
        meet.wait(timeout=0.5)
    except threading.BrokenBarrierError:
        pass
    return real()


log.level_from_env = level_from_env
threads = [threading.Thread(target=log.get_logger) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
log.get_logger().info('info-line')
"""


def test_two_threads_asking_first_set_up_one_handler():
    """Each thread's first call added its own handler, so every line of the process came out twice."""
    err = _stderr("", RACE)
    assert err.count("info-line") == 1, err
