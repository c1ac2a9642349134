"""`m3-eagle doctor`: exit 1 when the manifest cannot be read, and the reason shown for no patches."""
from __future__ import annotations

import json

from m3_eagle_plugin import cli


def test_an_unreadable_manifest_fails_the_doctor(clean_state, capsys, monkeypatch):
    """The module docstring: it exits 1 when anything would fail."""
    from m3_eagle_plugin import manifest

    def broken():
        raise ValueError("plugin_manifest.toml: bad TOML")

    monkeypatch.setattr(manifest, "load_manifest", broken)
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and "plugin_manifest.toml: bad TOML" in data["manifest"]["error"]


def test_without_a_host_the_patches_reason_is_the_missing_host(clean_state, capsys):
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["patches_applied"] == [] and data["patches_reason"] == "not activated: tensorrt_llm is not installed"
