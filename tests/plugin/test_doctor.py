"""`m3-eagle doctor`: table and JSON output, optional kernel report and host-source check."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from m3_eagle_plugin import cli, doctor
from m3_eagle_plugin.msa.kernels.backend import check_backend

from ._fake_host import write_plugin_distribution


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


@pytest.mark.parametrize("mode, version, ok, why", [
    ("require", "1.6.0", False, "outside"),           # unsupported: require raises, auto does nothing
    ("auto", "1.6.0", False, "outside"),
    ("require", "1.4.0rc1", False, "18872"),          # defer: require raises, auto steps aside (fine)
    ("auto", "1.4.0rc1", True, "18872"),
    ("require", "1.3.0", False, "M3_EAGLE_PLUGIN_FORCE"),  # untested: require needs the force switch
    ("auto", "1.3.0", True, None),
    ("require", "1.3.0rc24", True, None),             # tested
])
def test_doctor_ok_is_what_activating_would_decide(fake_host, hermetic_manager, capsys, monkeypatch,
                                                   mode, version, ok, why):
    fake_host(version)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", mode)
    assert cli.main(["doctor", "--json"]) == (0 if ok else 1)
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is ok and (why is None or why in data["reason"]), data["reason"]


@pytest.mark.parametrize("mode, ok", [("require", False), ("auto", True), ("off", True)])
def test_doctor_without_host_fails_only_where_activating_would_raise(clean_state, capsys, monkeypatch, mode, ok):
    """No tensorrt_llm: `activate("require")` raises, `auto` does nothing; the doctor says the same."""
    from m3_eagle_plugin import activate
    from m3_eagle_plugin.activation import ActivationError

    monkeypatch.setenv("M3_EAGLE_PLUGIN", mode)
    assert cli.main(["doctor", "--json"]) == (0 if ok else 1)
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is ok and "tensorrt_llm is not installed" in data["reason"], data["reason"]
    if mode == "require":
        with pytest.raises(ActivationError, match="not installed"):
            activate()


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_doctor_on_a_host_without_a_version_fails_as_activating_does(clean_state, hermetic_manager, fake_install,
                                                                    capsys, monkeypatch, tmp_path, mode):
    """A `tensorrt_llm` importable without dist-info (a source checkout on the path): activating
    refuses it in auto and require, so the doctor must not pass it."""
    from m3_eagle_plugin import activate
    from m3_eagle_plugin.activation import ActivationError

    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "__init__.py").write_text("__version__ = '1.3.0rc24'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("M3_EAGLE_PLUGIN", mode)
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    if mode == "require":
        with pytest.raises(ActivationError) as refused:
            activate()
        reason = str(refused.value)
    else:
        decided = activate()
        assert not decided.ok
        reason = decided.reason
    assert data["host_found"] is True and data["ok"] is False and data["reason"] == reason
    assert fake_install == []


def test_a_bad_kernel_setting_fails_the_doctor(clean_state, capsys, monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "bogus")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and "M3_EAGLE_KERNELS must be" in data["kernel_backend"]["unavailable"]


@pytest.mark.parametrize("mode", [
    pytest.param("triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs on this GPU")),
    pytest.param("flashinfer", marks=pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is not None, reason="FlashInfer is installed")),
])
def test_a_forced_kernel_backend_that_cannot_run_here_fails_the_doctor(clean_state, capsys, monkeypatch, mode):
    """`m3-eagle run` refuses it (`check_backend`), so the doctor must not say ok."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", mode)
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and f"M3_EAGLE_KERNELS={mode} but" in data["kernel_backend"]["error"]
    with pytest.raises(Exception, match=f"M3_EAGLE_KERNELS={mode} but"):
        check_backend("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["M3_EAGLE_HANDOFF", "M3_EAGLE_PDL", "M3_EAGLE_REPLAY"])
def test_a_bad_kernel_switch_fails_the_doctor(clean_state, capsys, monkeypatch, name):
    monkeypatch.setenv(name, "off")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and f"{name}='off'" in data["kernel_backend"]["unavailable"]


@pytest.mark.parametrize("name, value, problem", [
    ("M3_EAGLE_KERNELS", "trion", "M3_EAGLE_KERNELS must be auto, triton, torch or flashinfer, got 'trion'"),
    ("M3_EAGLE_PDL", "off", "M3_EAGLE_PDL='off': expected one of 0, 1, all"),
])
def test_a_bad_kernel_setting_is_named_among_the_setting_errors(clean_state, capsys, monkeypatch, name, value,
                                                                problem):
    """A bad mode is listed under "setting errors"; a bad kernel backend choice or kernel switch was
    only inside the kernel backend row's "backend_report failed" and the setting errors row read "-"."""
    monkeypatch.setenv(name, value)
    assert cli.main(["doctor", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["setting_errors"] == [problem]
    assert cli.main(["doctor"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("setting errors"))
    assert json.loads(row[len("setting errors"):]) == [problem]
    monkeypatch.setenv(name, "1" if name == "M3_EAGLE_PDL" else "torch")
    assert cli.main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setting_errors"] == []


def test_bad_mode_fails(clean_state, monkeypatch, capsys):
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "sometimes")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert "allowed values" in data["reason"]
    # named among the setting errors too, as a bad force switch is (the row read "-")
    assert data["setting_errors"] == [
        "M3_EAGLE_PLUGIN='sometimes' is not a valid mode; allowed values: off, auto, require"]


def test_a_bad_mode_still_reports_the_host_its_verdict_and_the_components(fake_host, hermetic_manager, capsys,
                                                                         monkeypatch):
    """A typo in the mode fails the doctor, as a bad force switch does, but the host's version, its verdict
    and the components do not depend on the mode (the table read `tensorrt_llm (version unknown)` for an
    installed 1.3.0rc24, and `verdict: null`)."""
    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "atuo")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["mode"] == "atuo" and "M3_EAGLE_PLUGIN='atuo'" in data["reason"]
    assert data["host_found"] is True and data["host_version"] == "1.3.0rc24" and data["verdict"] == "supported"
    assert data["components"]["kv_cache_manager"] == "fake.kv:Manager"
    assert data["components"]["reference"]["attention_metadata"] == "fake.msa:Metadata"
    assert cli.main(["doctor"]) == 1
    assert "tensorrt_llm 1.3.0rc24" in capsys.readouterr().out


def _finding(contract, key, status):
    return contract.Finding(key=key, attribute="attr", status=status, module="tensorrt_llm.mod", detail=status)


def test_host_source_check(clean_state, tmp_path, monkeypatch, capsys):
    """The doctor passes the directory to the contract check, reports every finding as plain
    data under the directory, and fails (exit 1) exactly when a finding is not ok."""
    from m3_eagle_plugin.host.trtllm import contract

    assert doctor.collect()["ok"] is True  # without a host-source check nothing fails
    calls = []
    findings = [_finding(contract, "a", "ok"), _finding(contract, "b", "skipped")]
    monkeypatch.setattr(contract, "check_source_tree", lambda d: calls.append(d) or findings)
    data = doctor.collect(host_source=str(tmp_path))
    assert calls == [str(tmp_path)]
    assert data["host_source"] == {"dir": str(tmp_path), "findings": [
        {"key": "a", "attribute": "attr", "status": "ok", "module": "tensorrt_llm.mod", "detail": "ok"},
        {"key": "b", "attribute": "attr", "status": "skipped", "module": "tensorrt_llm.mod", "detail": "skipped"},
    ]}
    assert data["ok"] is True  # "ok" and "skipped" findings pass
    assert cli.main(["doctor", "--host-source", str(tmp_path)]) == 0
    assert "host source check" in capsys.readouterr().out

    for status in ("missing", "missing-module", "signature", "unparsable"):
        findings = [_finding(contract, "a", "ok"), _finding(contract, "b", status)]
        data = doctor.collect(host_source=str(tmp_path))
        assert data["ok"] is False and data["host_source"]["findings"][1]["status"] == status, status
    assert cli.main(["doctor", "--json", "--host-source", str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr().out)["host_source"]["findings"][1]["key"] == "b"


def test_host_source_check_unavailable(clean_state, tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "_optional_call", lambda module, fn, *a: (None, f"{module} unavailable: test"))
    data = doctor.collect(host_source=str(tmp_path))
    assert data["host_source"]["error"].endswith("unavailable: test") and data["ok"] is False
    assert data["kernel_backend"] == {"unavailable": "m3_eagle_plugin.msa.kernels unavailable: test"}


def test_kernel_rows_show_flashinfer_the_table_and_verdicts(clean_state, capsys, monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.delenv("M3_EAGLE_KERNEL_TABLE", raising=False)
    assert cli.main(["doctor"]) == 0
    rows = {line.strip().split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "flashinfer" in rows and "SM90" in rows["flashinfer"]
    assert "peer_table_h200.json (NVIDIA H200, 2026-11-30" in rows["kernel table"]
    assert "B16/32K q4 -> flashinfer (ours 15.49 / FlashInfer 14.96 us)" in rows["sparse_attention"]
    assert "B64/32K q4 -> ours (ours 124.47 / FlashInfer 130.75 us)" in rows["select_blocks_paged"]
    assert "decision: ours" in rows["dense_attention"]
    data = doctor.collect()
    assert data["kernel_backend"]["kernel_table"]["device"] == "NVIDIA H200"


def test_malformed_kernel_table_fails_the_doctor(clean_state, capsys, monkeypatch, tmp_path):
    from m3_eagle_plugin.msa.kernels import kernel_table

    bad = tmp_path / "table.json"
    bad.write_text('{"device": "X", "date": "d", "command": "c", "rows": [{"kernel": "nope"}]}')
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(bad))
    kernel_table.clear_caches()
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert f"kernel table {bad}: rows[0].kernel must be one of" in out


@pytest.mark.parametrize("json_out", [True, False])
def test_a_bad_kernel_table_is_reported_beside_a_bad_switch(clean_state, capsys, monkeypatch, tmp_path, json_out):
    """A bad switch stops the backend report before it reads the table: the doctor still names
    both, so the operator does not fix one only to meet the other."""
    from m3_eagle_plugin.msa.kernels import kernel_table

    monkeypatch.setenv("M3_EAGLE_PDL", "off")
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(tmp_path / "nowhere.json"))
    kernel_table.clear_caches()
    assert cli.main(["doctor"] + (["--json"] if json_out else [])) == 1
    out = capsys.readouterr().out
    if json_out:
        backend = json.loads(out)["kernel_backend"]
        assert "M3_EAGLE_PDL='off'" in backend["unavailable"]
        assert backend["kernel_table"]["error"].startswith(f"kernel table {tmp_path / 'nowhere.json'}: cannot read")
    else:
        assert "M3_EAGLE_PDL='off'" in out and f"kernel table {tmp_path / 'nowhere.json'}: cannot read" in out


@pytest.mark.parametrize("version, verdict", [("1.3.0rc24", "supported"), ("1.4.0rc1", "defer")])
def test_a_bad_force_switch_fails_the_doctor(fake_host, hermetic_manager, capsys, monkeypatch, version, verdict):
    """The switch fails the doctor, and the rest of the report is still there: the verdict as with the switch
    unset (what activating would judge, had it not refused the value) and the components, which do not
    depend on it (they read `verdict: null` and nothing)."""
    fake_host(version)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "yes please")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and "M3_EAGLE_PLUGIN_FORCE='yes please'" in data["reason"]
    assert [e for e in data["setting_errors"] if "M3_EAGLE_PLUGIN_FORCE='yes please'" in e]
    assert data["verdict"] == verdict and data["host_version"] == version
    assert data["components"]["kv_cache_manager"] == "fake.kv:Manager"
    assert data["components"]["reference"]["attention_metadata"] == "fake.msa:Metadata"


@pytest.mark.parametrize("name, value", [("M3_EAGLE_PLUGIN_LOG_LEVEL", "LOUD"), ("M3_EAGLE_PLUGIN_LOG_LEVEL", "10"),
                                         ("M3_EAGLE_PLUGIN_TRACE", "2")])
def test_a_bad_log_level_or_trace_switch_fails_the_doctor(clean_state, capsys, monkeypatch, name, value):
    """README allows DEBUG, INFO, WARNING and the 1 switch; their readers fell back (INFO, no trace)
    without a word and the doctor said ok."""
    monkeypatch.setenv(name, value)
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and any(f"{name}={value!r}" in e and "allowed values" in e
                                       for e in data["setting_errors"])
    assert cli.main(["doctor"]) == 1
    assert f"{name}={value!r}" in capsys.readouterr().out


@pytest.mark.parametrize("name, value", [("M3_EAGLE_PLUGIN_LOG_LEVEL", "debug"),
                                         ("M3_EAGLE_PLUGIN_LOG_LEVEL", "WARNING"), ("M3_EAGLE_PLUGIN_LOG_LEVEL", ""),
                                         ("M3_EAGLE_PLUGIN_TRACE", "1"), ("M3_EAGLE_PLUGIN_TRACE", "0")])
def test_the_documented_log_levels_and_trace_switches_pass_the_doctor(clean_state, capsys, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert cli.main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setting_errors"] == []


def _plugin_distribution(site, entry_points: str) -> None:
    """A dist-info `extra-m3-plugin 1.0` on sys.path declaring `entry_points` in the plugin group."""
    write_plugin_distribution(site, "extra-m3-plugin", entry_points, {"extra_m3_plugin/__init__.py": ""})


@pytest.mark.parametrize("mode", ["require", "auto", "off"])
def test_an_allow_listed_plugin_that_is_not_installed_is_named_and_fatal_under_require(
        fake_host, capsys, monkeypatch, mode):
    """`M3_EAGLE_PLUGIN_LOAD=ghost` without a `ghost` plugin was ignored; activating under require now
    refuses naming it (as for a plugin that fails to load), and the doctor says so. The doctor exits
    1 in every mode: under auto the plugin would run without the plugin asked for (its docstring:
    "otherwise than asked"), and under off enabling it would."""
    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", mode)
    monkeypatch.setenv("M3_EAGLE_PLUGIN_LOAD", "ghost")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False
    assert [e for e in data["plugin_errors"] if "'ghost'" in e and "M3_EAGLE_PLUGIN_LOAD" in e], data["plugin_errors"]
    if mode == "require":
        assert "'ghost'" in data["reason"]


def test_a_third_party_builtin_entry_point_is_named_and_fatal_under_require(fake_host, tmp_path, capsys,
                                                                             monkeypatch):
    fake_host("1.3.0rc24")
    _plugin_distribution(tmp_path / "site", "builtin = extra_m3_plugin")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    [error] = data["plugin_errors"]
    assert "extra_m3_plugin" in error and "extra-m3-plugin" in error and "m3_eagle_plugin.builtin" in error, error
    assert error in data["reason"]


def test_json_is_the_only_stdout_when_a_plugin_imports_tensorrt_llm(fake_host, tmp_path, capsys, monkeypatch):
    """DESIGN: `--json` prints one JSON object on stdout. TensorRT-LLM prints its version line on stdout when
    imported; a third-party plugin whose module imports it (the registry expects such plugins) put that line
    before the JSON, which no JSON reader then parsed. It goes to stderr."""
    root = fake_host("1.3.0rc24")
    init = root / "tensorrt_llm" / "__init__.py"
    init.write_text(init.read_text() + 'print(f"[TensorRT-LLM] TensorRT-LLM version: {__version__}")\n')
    write_plugin_distribution(tmp_path / "site", "trt-m3-plugin", "trt = trt_m3_plugin",
                              {"trt_m3_plugin/__init__.py": "import tensorrt_llm\n"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert cli.main(["doctor", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "trt" in [plugin["name"] for plugin in json.loads(out)["plugins"]]
    assert "[TensorRT-LLM] TensorRT-LLM version: 1.3.0rc24" in err


@pytest.mark.parametrize("json_out", [True, False])
def test_plugins_left_out_by_the_allow_list_are_listed_with_the_reason(clean_state, tmp_path, capsys, monkeypatch,
                                                                        json_out):
    _plugin_distribution(tmp_path / "site", "extra = extra_m3_plugin")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("M3_EAGLE_PLUGIN_LOAD", "")
    assert cli.main(["doctor"] + (["--json"] if json_out else [])) == 0
    out = capsys.readouterr().out
    skipped = json.loads(out)["plugins_skipped"] if json_out else out
    assert "plugin 'extra' (extra_m3_plugin from extra-m3-plugin) not loaded: not in M3_EAGLE_PLUGIN_LOAD=''" in (
        skipped if json_out else out)


@pytest.mark.parametrize("json_out", [True, False])
def test_a_plugin_manager_that_cannot_be_built_is_reported_not_a_crash(clean_state, capsys, monkeypatch, json_out):
    """The manager failing to build is shown in the plugins row; the skipped list is then empty, not missing."""
    from m3_eagle_plugin import registry

    def broken():
        raise RuntimeError("manager exploded")

    monkeypatch.setattr(registry, "get_plugin_manager", broken)
    cli.main(["doctor"] + (["--json"] if json_out else []))
    out = capsys.readouterr().out
    if json_out:
        data = json.loads(out)
        assert data["plugins_skipped"] == []
        assert data["plugins"] == [{"error": "RuntimeError: manager exploded"}]
    else:
        assert "manager exploded" in out


def test_the_plugins_row_names_why_the_manager_could_not_be_built(clean_state, capsys, monkeypatch):
    """The table's plugins row read `["None (None)"]`, a plugin named None, instead of the failure."""
    from m3_eagle_plugin import registry

    def broken():
        raise RuntimeError("manager exploded")

    monkeypatch.setattr(registry, "get_plugin_manager", broken)
    assert cli.main(["doctor"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plugins "))
    assert row.split(None, 1)[1] == '["RuntimeError: manager exploded"]'


def test_an_empty_host_source_is_refused_not_checked_as_the_current_directory(capsys):
    """`--host-source "$UNSET"`: Path("") is ".", which was checked as the source tree without a word."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", "--host-source", ""])
    assert exit_.value.code == 2
    assert "argument --host-source: an empty path" in capsys.readouterr().err


def test_json_with_stdout_closed_writes_nothing_and_exits_as_the_table_does(clean_state, capsys, monkeypatch):
    """`m3-eagle doctor --json >&-`: Python's sys.stdout is None. The table (print) then writes nothing and
    exits 0, as `m3-eagle run` does; `--json` ended in an AttributeError traceback ('NoneType' object has
    no attribute 'write') and exit 1."""
    monkeypatch.setattr("sys.stdout", None)
    assert cli.main(["doctor"]) == 0
    assert cli.main(["doctor", "--json"]) == 0
