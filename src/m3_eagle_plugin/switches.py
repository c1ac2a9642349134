"""The plugin's environment setting names (its mode, `M3_EAGLE_PLUGIN`, read by `activation` and the
config key) and its on/off switches (`M3_EAGLE_PLUGIN_FORCE`, `M3_EAGLE_PLUGIN_TRACE`), read one
way: 1, true, yes, on / 0, false, no, off, or unset (off). Any other value is reported by name
rather than quietly meaning "off"; each caller decides whether that raises or warns.
"""
from __future__ import annotations

import os
from typing import Mapping

MODE_ENV = "M3_EAGLE_PLUGIN"
MODES = ("off", "auto", "require")
FORCE_ENV = "M3_EAGLE_PLUGIN_FORCE"
TRACE_ENV = "M3_EAGLE_PLUGIN_TRACE"
TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")


def read_switch(name: str, environ: Mapping[str, str] | None = None) -> tuple[bool, str | None]:
    """(on?, None) from ``$name``, or (False, why its value is not a switch)."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE, None
    return False, (f"{name}={raw!r} is not a valid switch; allowed values: 1 or 0 (also "
                   f"{', '.join(TRUE[1:])} / {', '.join(FALSE[2:])}; unset means 0)")
