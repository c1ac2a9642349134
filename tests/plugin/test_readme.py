"""README and CI agree: `.ci/run` runs the README's two newcomer commands verbatim."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_commands():
    readme = (REPO / "README.md").read_text()
    main_job, tests = _bash_blocks(readme)[:2]
    assert main_job.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e \".[test]\"")
    assert tests == ".venv/bin/python -m pytest -q"
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert main_job in ci_lines and tests in ci_lines


def test_readme_documents_every_setting():
    readme = (REPO / "README.md").read_text()
    for name in ("M3_EAGLE_PLUGIN", "M3_EAGLE_PLUGIN_FORCE", "M3_EAGLE_PLUGIN_TRACE", "M3_EAGLE_PLUGIN_LOAD",
                 "M3_EAGLE_PLUGIN_LOG_LEVEL", "M3_EAGLE_KERNELS", "M3_EAGLE_KERNEL_TABLE", "m3_eagle_plugin:",
                 "## Guarantees", "## Compatibility"):
        assert name in readme, name
