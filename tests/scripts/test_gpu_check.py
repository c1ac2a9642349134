"""scripts/gpu-check.sh's arguments and exit status, with stand-ins for nvidia-smi and python on
PATH that record what they ran (the real parts need the H200)."""
from __future__ import annotations

import os
import subprocess

from tests.scripts._load import SCRIPTS

FAKE_PYTHON = '''#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$*" in -c*) exit "${FAKE_PREFLIGHT_RC:-0}" ;; esac
case "$*" in *pytest*tests/msa/kernels*) echo "1 failed"; exit "${FAKE_KERNELS_RC:-0}" ;; esac
exit 0
'''


def run(tmp_path, *parts, kernels_rc=0, smi_rc=0, preflight_rc=0):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", f"#!/usr/bin/env bash\necho H200\nexit {smi_rc}\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "ran.txt"
    log.write_text("")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), FAKE_LOG=str(log),
               FAKE_KERNELS_RC=str(kernels_rc), FAKE_PREFLIGHT_RC=str(preflight_rc))
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh"), *parts], env=env, capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, [line for line in log.read_text().splitlines() if "pytest" in line or "bench" in line]


def test_a_failing_pytest_fails_the_call_through_its_pipes(tmp_path):
    rc, ran = run(tmp_path, "kernels", kernels_rc=1)
    assert rc == 1 and len(ran) == 1 and "tests/msa/kernels" in ran[0]


def test_two_part_names_are_refused_not_one_run(tmp_path):
    rc, ran = run(tmp_path, "kernels", "rest")
    assert (rc, ran) == (2, [])
    rc, ran = run(tmp_path, "kernal")
    assert (rc, ran) == (2, [])


def test_no_gpu_or_no_cuda_torch_fails_the_call_before_any_test(tmp_path):
    # else every CUDA test skipped, the bench ran its CPU smoke table, and the GPU check passed
    rc, ran = run(tmp_path, "rest", smi_rc=9)
    assert rc != 0 and ran == []
    rc, ran = run(tmp_path, "bench", preflight_rc=1)
    assert rc != 0 and ran == []


def test_the_parts_run_every_test_directory_once(tmp_path):
    """kernels, host and rest together are the whole suite: a directory in none went untested on the GPU."""
    from pathlib import Path

    rc, ran = run(tmp_path, "all")
    assert rc == 0 and len(ran) == 4 and "bench" in ran[-1]
    tests = Path(__file__).resolve().parents[1]
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    kernels, host, rest = (line.split() for line in ran[:3])
    assert [a for a in kernels if a.startswith("tests")] == ["tests/msa/kernels"]
    assert [a for a in host if a.startswith("tests")] == ["tests/host", "tests/reliability"]
    ignored = {a.split("=", 1)[1] for a in rest if a.startswith("--ignore=")}
    assert ignored == {"tests/msa/kernels", "tests/host", "tests/reliability"} and rest[-1] == "tests"
    assert {"host", "reliability"} <= folders and (tests / "msa" / "kernels").is_dir()
