"""`m3-eagle doctor`: table and JSON output, optional kernel report and host-source check."""
from __future__ import annotations

import json

import pytest

from m3_eagle_plugin import cli, doctor


def test_json_without_host(clean_state, capsys):
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "off" and data["plugin_version"]
    assert data["host_found"] is False and data["verdict"] == "unsupported"
    assert "not activated" in data["patches_reason"]
    assert {"route-sparse-kv-cache-manager", "unified-draft-kv-policy"} <= set(data["manifest"]["patches"])
    assert data["components"]["reference"]["attention_metadata"] == "m3_eagle_plugin.msa:MsaDecodeMetadata"
    assert data["plugins"][0]["name"] == "builtin"
    assert "kernel_backend" in data


def test_table_with_fake_host(fake_host, hermetic_manager, capsys, monkeypatch):
    fake_host("1.4.0rc1")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "tensorrt_llm 1.4.0rc1" in out
    assert "defer" in out and "18872" in out
    assert "fake.kv:Manager" in out and "recording" in out


def test_bad_mode_fails(clean_state, monkeypatch, capsys):
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "sometimes")
    assert cli.main(["doctor", "--json"]) == 1
    assert "allowed values" in json.loads(capsys.readouterr().out)["reason"]


def test_host_source_check(clean_state, tmp_path, monkeypatch):
    calls = []
    import m3_eagle_plugin.host.trtllm as adapter

    contract = pytest.importorskip("m3_eagle_plugin.host.trtllm.contract")
    monkeypatch.setattr(contract, "check_source_tree", lambda d: calls.append(d) or {"missing": []}, raising=False)
    data = doctor.collect(host_source=str(tmp_path))
    assert calls == [str(tmp_path)] and data["host_source"]["findings"] == {"missing": []}
    assert adapter is not None


def test_host_source_check_unavailable(clean_state, tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "_optional_call", lambda module, fn, *a: (None, f"{module} unavailable: test"))
    data = doctor.collect(host_source=str(tmp_path))
    assert data["host_source"]["error"].endswith("unavailable: test") and data["ok"] is False
    assert data["kernel_backend"] == {"unavailable": "m3_eagle_plugin.msa.kernels unavailable: test"}
