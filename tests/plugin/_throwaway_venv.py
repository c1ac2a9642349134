"""`pip install .` of a copy of this repository into a fresh venv, with no network.

Shared by `test_install.py` and the by-hand `measure_bootstrap_cost.py` (which imports it from its
own folder). Dependencies (and pip/setuptools) come from the running interpreter through a .pth
appended after the venv's own site dir; the package itself comes from the fresh wheel install.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def install_copy(root: Path, env: dict[str, str] | None = None
                 ) -> tuple[Path, Path, Path, subprocess.CompletedProcess]:
    """(venv python, its site-packages, the venv dir, pip's result) under `root`."""
    source = root / "src-copy"
    shutil.copytree(REPO, source, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                                  ".pytest_cache", ".hypothesis", "tests", "out"))
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_parent_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(source)],
        capture_output=True, text=True, env=env)
    return python, site, env_dir, result
