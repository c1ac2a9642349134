"""Measure what `m3_eagle_plugin.pth` costs every Python start-up (not a test; run it by hand).

    python tests/plugin/measure_bootstrap_cost.py [--starts 200]

Builds a throwaway venv with `pip install .` (non-editable, no network: dependencies come from the
running interpreter), then times `python -c pass` with and without the .pth, interleaved so load
changes hit both sides alike, with the plugin off and with it on (`M3_EAGLE_PLUGIN=auto`). It also
times the .pth line itself in-process, which is the precise number when the plugin is off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

from _throwaway_venv import install_copy  # this script's own folder is first on sys.path


def time_starts(python: Path, pth: Path, starts: int, env: dict[str, str]) -> tuple[list[float], list[float]]:
    disabled = pth.with_suffix(".pth-disabled")
    with_pth, without_pth = [], []
    for i in range(2 * starts):
        enabled = i % 2 == 0
        if enabled and disabled.exists():
            disabled.rename(pth)
        elif not enabled and pth.exists():
            pth.rename(disabled)
        begin = time.perf_counter()
        subprocess.run([str(python), "-c", "pass"], env=env, check=True)
        (with_pth if enabled else without_pth).append(time.perf_counter() - begin)
    if disabled.exists():
        disabled.rename(pth)
    return with_pth, without_pth


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=200)
    args = parser.parse_args()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("M3_EAGLE_PLUGIN") and k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as tmp:
        python, site, _, result = install_copy(Path(tmp))
        result.check_returncode()
        pth = site / "m3_eagle_plugin.pth"
        line = pth.read_text().strip()
        for label, env in (("off", base_env), ("auto", {**base_env, "M3_EAGLE_PLUGIN": "auto"})):
            on, off = time_starts(python, pth, args.starts, env)
            print(f"M3_EAGLE_PLUGIN={label}: {args.starts} starts each; median with .pth {statistics.median(on)*1e3:.2f} ms, "
                  f"without {statistics.median(off)*1e3:.2f} ms, difference of medians "
                  f"{(statistics.median(on) - statistics.median(off))*1e3:+.3f} ms")
        per_line = min(timeit.repeat(lambda: exec(line), number=10_000, repeat=5)) / 10_000
        print(f".pth line in-process with the plugin off: {per_line*1e6:.2f} us per execution")
    return 0


if __name__ == "__main__":
    sys.exit(main())
