"""`pip install .` (non-editable) into a throwaway venv: startup files, manifest copy, real interpreter starts.

The venv sees /tmp/venv-style dependencies through a .pth pointing at the running interpreter's
site-packages (so nothing is downloaded); the package itself comes from the fresh wheel install.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from ._fake_host import write_fake_host
from ._throwaway_venv import REPO, install_copy
PLUGIN_ENV = ("M3_EAGLE_PLUGIN", "M3_EAGLE_PLUGIN_FORCE", "M3_EAGLE_PLUGIN_TRACE", "M3_EAGLE_PLUGIN_LOAD")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV and k != "PYTHONPATH"}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def venv(tmp_path_factory):
    if shutil.which("git") is None and not (REPO / "src").exists():  # pragma: no cover
        pytest.skip("no source tree")
    python, site, env_dir, result = install_copy(tmp_path_factory.mktemp("install"),
                                                 env=_clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return python, site, env_dir


def test_install_places_startup_files_and_manifest(venv):
    python, site, _ = venv
    assert (site / "m3_eagle_plugin.pth").read_text() == (REPO / "src" / "m3_eagle_plugin.pth").read_text()
    assert (site / "m3_eagle_plugin.start").read_text().strip() == "m3_eagle_plugin._bootstrap:main"
    record = next(site.glob("m3_eagle_plugin-*.dist-info")) / "RECORD"
    assert {"m3_eagle_plugin.pth", "m3_eagle_plugin.start"} <= {
        line.split(",")[0] for line in record.read_text().splitlines()}  # pip uninstall removes them
    installed = site / "m3_eagle_plugin" / "plugin_manifest.toml"
    assert installed.is_file() and not installed.is_symlink()
    assert installed.read_bytes() == (REPO / "plugin_manifest.toml").read_bytes()
    table = Path("m3_eagle_plugin", "msa", "kernels", "peer_table_h200.json")  # the measured kernel table
    assert (site / table).is_file() and (site / table).read_bytes() == (REPO / "src" / table).read_bytes()
    where = subprocess.run([str(python), "-c", "import m3_eagle_plugin; print(m3_eagle_plugin.__file__)"],
                           check=True, capture_output=True, text=True, env=_clean_env()).stdout.strip()
    assert Path(where).parent == site / "m3_eagle_plugin"


def _importtime(python: Path, **env: str) -> str:
    result = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                            env=_clean_env(**env), check=True)
    return result.stderr


def test_importtime_auto_runs_bootstrap_without_torch(venv):
    python, _, _ = venv
    on = _importtime(python, M3_EAGLE_PLUGIN="auto")
    assert "m3_eagle_plugin._bootstrap" in on
    for heavy in ("torch", "tensorrt_llm", "pluggy", "packaging"):
        assert f"| {heavy}\n" not in on and f"| {heavy}." not in on
    off = _importtime(python)
    assert "m3_eagle_plugin" not in off


SPAWN_SCRIPT = textwrap.dedent('''
    import json, multiprocessing as mp, sys

    def summary():
        from m3_eagle_plugin.activation import status
        import os
        r = status()
        return {"mode": r.mode, "activated": r.activated, "verdict": r.verdict, "patches": r.patches,
                "fingerprint": r.fingerprint, "env": os.environ.get("M3_EAGLE_PLUGIN")}

    def child(queue):
        import tensorrt_llm  # the bootstrap activates right after this import
        queue.put(summary())

    if __name__ == "__main__":
        from tensorrt_llm.commands.serve import load_args
        args = load_args(sys.argv[sys.argv.index("--config") + 1])
        parent = summary()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        result = queue.get(timeout=120)
        proc.join(60)
        print(json.dumps({"args": args, "parent": parent, "child": result}))
''')


def test_config_key_and_spawned_child_activate_alike(venv, tmp_path):
    python, _, _ = venv
    host = write_fake_host(tmp_path / "host", "1.3.0rc24", install_double=True)
    script = tmp_path / "serve_like.py"
    script.write_text(SPAWN_SCRIPT)
    config = tmp_path / "extra.yaml"
    config.write_text("max_batch_size: 8\nm3_eagle_plugin: auto\n")
    out = subprocess.run([str(python), str(script), "--config", str(config)], capture_output=True, text=True,
                         env=_clean_env(PYTHONPATH=str(host)), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["args"] == {"model": "m", "max_batch_size": 8}  # key stripped before the host validated
    assert data["parent"]["activated"] and data["parent"]["patches"] == ["fake-patch"]
    assert data["child"] == data["parent"]  # same mode, verdict, patches and fingerprint
    assert data["child"]["env"] == "auto"
    assert out.stderr.count("activated m3-eagle-plugin") == 2  # one line per process
