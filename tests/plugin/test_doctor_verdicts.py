"""`m3-eagle doctor`: exit 1 when the manifest cannot be read, and the reason shown for no patches."""
from __future__ import annotations

import json

import pytest

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


def test_with_the_plugin_off_the_patches_reason_is_the_mode_not_the_verdict(fake_host, hermetic_manager, capsys):
    """README: the doctor shows "patches applied (or why not)". With M3_EAGLE_PLUGIN unset on a tested host
    the "why not" read "not activated: tensorrt_llm 1.3.0rc24 is a tested host", which is no reason."""
    fake_host("1.3.0rc24")
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["patches_applied"] == [] and data["verdict"] == "supported"
    assert data["patches_reason"] == "not activated: M3_EAGLE_PLUGIN is off", data["patches_reason"]


@pytest.mark.parametrize("version", ["1.4.0rc1", "1.5.0"])
def test_with_the_plugin_off_a_deferring_or_unsupported_host_is_not_why_nothing_is_patched(fake_host, hermetic_manager,
                                                                                          capsys, version):
    """With M3_EAGLE_PLUGIN unset on a deferring host the "why not" was the defer, ending "set
    M3_EAGLE_PLUGIN_FORCE=1 to override": doing so patches nothing while the plugin is off."""
    fake_host(version)
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["patches_applied"] == [] and data["verdict"] in ("defer", "unsupported")
    assert data["patches_reason"] == "not activated: M3_EAGLE_PLUGIN is off", data["patches_reason"]


@pytest.mark.parametrize("version", ["1.3.0rc24", "1.3.1"])
def test_a_host_that_would_activate_is_not_reported_as_the_reason_for_no_patches(fake_host, hermetic_manager,
                                                                                capsys, monkeypatch, version):
    """Under auto on an accepted host the doctor (which never imports tensorrt_llm, so never activates) gave
    the verdict ("is a tested host" / "is inside ... but not in the tested list") as why nothing is patched."""
    fake_host(version)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["patches_applied"] == [] and data["ok"] is True
    assert data["reason"] not in data["patches_reason"]
    assert "activates when tensorrt_llm is imported" in data["patches_reason"], data["patches_reason"]


def test_under_auto_a_deferring_host_gives_the_defer_as_the_reason_for_no_patches(fake_host, hermetic_manager,
                                                                                  capsys, monkeypatch):
    """plugin_manifest.toml: from 1.4.0rc1 the plugin defers to upstream unless forced, so importing the host
    would not patch it: "activates when tensorrt_llm is imported" is not why nothing is patched, the defer is."""
    fake_host("1.4.0rc1")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["patches_applied"] == [] and data["verdict"] == "defer" and data["ok"] is True
    assert "activates when" not in data["patches_reason"], data["patches_reason"]
    assert data["patches_reason"] == f"not activated: {data['reason']}" and "M3_EAGLE_PLUGIN_FORCE" in data["reason"]
