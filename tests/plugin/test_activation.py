"""Activation modes against a fake `tensorrt_llm` (version from its dist-info METADATA)."""
from __future__ import annotations

import importlib
import logging
import os
import threading

import pytest

import m3_eagle_plugin
from m3_eagle_plugin import activation
from m3_eagle_plugin.activation import ActivationError, InvalidModeError, resolve_mode
from m3_eagle_plugin.log import LOGGER_NAME


@pytest.fixture
def log_lines():
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


@pytest.fixture
def active_env(hermetic_manager, fake_install, fake_host):
    return fake_host, fake_install


def test_mode_resolution(monkeypatch, clean_state):
    assert resolve_mode() == "off"
    monkeypatch.setenv("M3_EAGLE_PLUGIN", " Require ")
    assert resolve_mode() == "require"
    assert resolve_mode("AUTO") == "auto"
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "yes")
    with pytest.raises(InvalidModeError, match=r"M3_EAGLE_PLUGIN='yes'.*off, auto, require"):
        resolve_mode()
    with pytest.raises(InvalidModeError, match="activate"):
        resolve_mode("on")
    for not_a_string in (1, True):  # named the type only, not what the argument may be
        with pytest.raises(InvalidModeError, match=rf"activate\(mode={not_a_string}\).*allowed values: off, auto, "
                                                   rf"require \(strings\), got {type(not_a_string).__name__}"):
            resolve_mode(not_a_string)


def test_off_touches_nothing(active_env, log_lines):
    make_host, installs = active_env
    make_host("1.3.0rc24")
    report = m3_eagle_plugin.activate()
    assert (report.mode, report.ok, report.activated) == ("off", True, False)
    assert installs == [] and log_lines == []


def test_an_explicit_off_is_exported_like_any_other_mode(active_env, monkeypatch):
    """README: `activate(mode)` exports the mode for the workers. An inherited M3_EAGLE_PLUGIN=auto must
    not make workers (or this process's later host import) activate after the caller chose off."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    assert m3_eagle_plugin.activate("off").mode == "off"
    assert os.environ["M3_EAGLE_PLUGIN"] == "off"
    assert resolve_mode() == "off" and installs == []


def test_auto_on_tested_host_activates_once(active_env, log_lines, monkeypatch):
    make_host, installs = active_env
    make_host("1.3.0rc24")
    report = m3_eagle_plugin.activate("auto")
    assert report.ok and report.activated
    assert report["verdict"] == "supported" and report["host_version"] == "1.3.0rc24"
    assert report.patches == ["fake-a", "fake-b"]
    assert report.components["model_classes"] == {"MiniMaxM3SparseForCausalLM": "fake.model:M3"}
    assert report.components["kv_cache_manager"] == "fake.kv:Manager"
    assert dict(report)["mode"] == "auto" and set(report) >= {"mode", "host", "verdict", "components", "patches"}
    assert m3_eagle_plugin.activate("auto") is report and m3_eagle_plugin.activate("require") is report
    assert m3_eagle_plugin.status() is report
    assert installs == [1]
    assert len(log_lines) == 1 and "activated" in log_lines[0] and "fake-a" in log_lines[0]
    assert report.fingerprint == activation.fingerprint(["fake-b", "fake-a"]) and report.fingerprint in log_lines[0]
    assert activation.fingerprint(["fake-a"]) != report.fingerprint
    assert activation.os.environ["M3_EAGLE_PLUGIN"] == "auto"  # spawned workers agree


def test_activation_is_thread_safe(active_env):
    make_host, installs = active_env
    make_host("1.3.0rc24")
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(m3_eagle_plugin.activate("auto"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert installs == [1] and all(r is reports[0] for r in reports)


def test_auto_on_untested_host_activates_with_verdict_and_a_warning(active_env):
    make_host, installs = active_env
    make_host("1.3.0")
    levels = []

    class Collect(logging.Handler):
        def emit(self, record):
            levels.append((record.levelno, record.getMessage()))

    handler = Collect()
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    try:
        report = m3_eagle_plugin.activate("auto")
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(handler)
    assert report.activated and report.verdict == "untested" and installs == [1]
    assert [level for level, message in levels if "activated" in message] == [logging.WARNING]


def _host_ready_listener(seen: list):
    """A plugin registered late that notes every host it hears is ready."""
    from m3_eagle_plugin.hooks import hookimpl

    class Late:
        @hookimpl
        def m3_eagle_host_ready(self, host, report):
            seen.append(host)

    return Late()


def _broken_host_ready_plugin():
    """A third-party plugin whose host_ready hook raises."""
    from m3_eagle_plugin.hooks import hookimpl

    class Broken:
        @hookimpl
        def m3_eagle_host_ready(self, host, report):
            raise RuntimeError("third-party hook failed")

    return Broken()


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_a_failure_after_install_takes_the_patches_out(active_env, hermetic_manager, log_lines, mode):
    """Another plugin's host_ready hook raising: the patches come out again, and the report (and the
    log line saying the host was left untouched) is then true."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    hermetic_manager.register(_broken_host_ready_plugin(), name="broken")
    if mode == "require":
        with pytest.raises(ActivationError, match="third-party hook failed"):
            m3_eagle_plugin.activate(mode)
    else:
        report = m3_eagle_plugin.activate(mode)
        assert not report.activated and not report.ok and "third-party hook failed" in report.reason
        assert "left untouched" in log_lines[0]
    assert installs == [1, -1]
    assert not m3_eagle_plugin.status().activated


def test_a_rolled_back_report_lists_nothing_of_the_undone_install(active_env, hermetic_manager, monkeypatch):
    """After the rollback the adapter has nothing installed: the report must not list the patches,
    fingerprint, adapter report or registered models of the install that was undone."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter

    def install():
        installs.append(1)
        return {"patches": ["fake-a"], "models": {"MiniMaxM3SparseForCausalLM": "fake.model:M3"}}

    monkeypatch.setattr(adapter, "install", install)
    hermetic_manager.register(_broken_host_ready_plugin(), name="broken")
    report = m3_eagle_plugin.activate("auto")
    assert installs == [1, -1]  # installed, then uninstalled
    assert (report.patches, report.fingerprint, report.host_report) == ([], "", {})
    assert "registered_models" not in report.components


def test_a_failed_host_ready_is_not_replayed_to_later_plugins(active_env, hermetic_manager):
    """pluggy records a historic call before running it and replays it to every plugin registered
    later; after the failure above the host is left untouched, so no late plugin may hear it is ready."""
    make_host, installs = active_env
    make_host("1.3.0rc24")

    seen = []
    hermetic_manager.register(_broken_host_ready_plugin(), name="broken")
    assert not m3_eagle_plugin.activate("auto").activated
    hermetic_manager.register(_host_ready_listener(seen), name="late")
    assert installs == [1, -1] and seen == []


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_a_rollback_that_fails_still_tells_no_later_plugin_the_host_is_ready(active_env, hermetic_manager,
                                                                            monkeypatch, log_lines, mode):
    """A host_ready hook raises after the install, and undoing the install raises too. Activation has
    failed: no plugin registered later may hear the host is ready, the report lists nothing of the
    install, and the error names both failures (the host is not "left untouched")."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter
    from m3_eagle_plugin.host.trtllm.patching import HostPatchError

    def uninstall():
        raise HostPatchError("reverting the patches was incomplete: fake-a is still patched")

    monkeypatch.setattr(adapter, "uninstall", uninstall)
    seen = []
    hermetic_manager.register(_broken_host_ready_plugin(), name="broken")
    if mode == "require":
        with pytest.raises(ActivationError, match="third-party hook failed.*fake-a is still patched"):
            m3_eagle_plugin.activate(mode)
    else:
        report = m3_eagle_plugin.activate(mode)
        assert not report.activated and (report.patches, report.fingerprint) == ([], "")
        assert "third-party hook failed" in report.reason and "fake-a is still patched" in report.reason
        assert "left untouched" not in log_lines[0]
    hermetic_manager.register(_host_ready_listener(seen), name="late")
    assert seen == []


def test_require_on_untested_host_raises_unless_forced(active_env, monkeypatch):
    make_host, installs = active_env
    make_host("1.3.0")
    with pytest.raises(ActivationError, match="M3_EAGLE_PLUGIN_FORCE"):
        m3_eagle_plugin.activate("require")
    assert installs == []
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "1")
    assert m3_eagle_plugin.activate("require").activated


@pytest.mark.parametrize("cause", ["untested host", "plugin error"])
def test_require_after_an_auto_activation_refuses_what_require_refuses(active_env, monkeypatch, cause):
    """The bootstrap activated under an exported auto; the script then asks `activate("require")` (README,
    before building LLM(...)). It returned the auto report, ok, on an untested host without the force switch
    or beside a plugin that failed to load: require passed them silently. Where require takes the host too,
    it returns the same report (auto stays exported: the workers decide as the driver did)."""
    make_host, installs = active_env
    make_host("1.3.0" if cause == "untested host" else "1.3.0rc24")
    if cause == "plugin error":
        from m3_eagle_plugin.registry import PluginLoadError, get_plugin_manager

        get_plugin_manager().load_errors.append(PluginLoadError("broken", "x:y", None, "ImportError: boom"))
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    report = m3_eagle_plugin.activate()
    assert report.activated and installs == [1]
    with pytest.raises(ActivationError, match="M3_EAGLE_PLUGIN_FORCE" if cause == "untested host" else "broken"):
        m3_eagle_plugin.activate("require")
    assert os.environ["M3_EAGLE_PLUGIN"] == "auto" and m3_eagle_plugin.activate() is report and installs == [1]
    if cause == "untested host":
        monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "1")
        assert m3_eagle_plugin.activate("require") is report and os.environ["M3_EAGLE_PLUGIN"] == "auto"


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_defer_on_upstream_host(active_env, monkeypatch, log_lines, mode):
    make_host, installs = active_env
    make_host("1.4.0rc1")
    if mode == "require":
        with pytest.raises(ActivationError, match="18872"):
            m3_eagle_plugin.activate(mode)
    else:
        report = m3_eagle_plugin.activate(mode)
        assert report.verdict == "defer" and report.ok and not report.activated
        assert len(log_lines) == 1 and "defer" in log_lines[0]
    assert installs == []


def test_force_overrides_defer(active_env, monkeypatch):
    make_host, installs = active_env
    make_host("1.4.0rc1")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "1")
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and "overridden" in report.reason and installs == [1]


def test_force_set_after_a_defer_decision_activates(active_env, monkeypatch, log_lines):
    """The config key may export the force switch after this process deferred; processes started
    afterwards activate with it, so this one must too, and say so in a line of its own."""
    make_host, installs = active_env
    make_host("1.4.0rc1")
    assert m3_eagle_plugin.activate("auto").verdict == "defer" and installs == []
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "1")
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and "overridden" in report.reason and installs == [1]
    assert len(log_lines) == 2 and "defer" in log_lines[0] and log_lines[1].startswith("activated")


def test_unsupported_host_auto_logs_one_line_require_raises(active_env, log_lines):
    make_host, installs = active_env
    make_host("1.2.0")
    report = m3_eagle_plugin.activate("auto")
    assert not report.ok and report.verdict == "unsupported" and "outside" in report.reason
    assert m3_eagle_plugin.activate("auto") is report
    assert len(log_lines) == 1 and "left untouched" in log_lines[0]
    with pytest.raises(ActivationError, match="outside the supported range"):
        m3_eagle_plugin.activate("require")
    assert installs == []


def test_missing_host(hermetic_manager, fake_install, monkeypatch):
    monkeypatch.setattr(activation, "host_version", lambda package="tensorrt_llm": (False, None))
    assert not m3_eagle_plugin.activate("auto").ok
    with pytest.raises(ActivationError, match="tensorrt_llm"):
        m3_eagle_plugin.activate("require")


def _supported_host_whose_install_fails(active_env, monkeypatch) -> None:
    make_host, _ = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter

    def broken():
        raise RuntimeError("host symbol tensorrt_llm.x:y missing")

    monkeypatch.setattr(adapter, "install", broken, raising=False)


def test_install_failure(active_env, monkeypatch):
    _supported_host_whose_install_fails(active_env, monkeypatch)
    report = m3_eagle_plugin.activate("auto")
    assert not report.ok and not report.activated and "symbol" in report.reason
    with pytest.raises(ActivationError, match="symbol"):
        m3_eagle_plugin.activate("require")


def test_broken_third_party_plugin(active_env):
    make_host, _ = active_env
    make_host("1.3.0rc24")
    from m3_eagle_plugin.registry import PluginLoadError, get_plugin_manager

    get_plugin_manager().load_errors.append(PluginLoadError("broken", "x:y", None, "ImportError: boom"))
    with pytest.raises(ActivationError, match="broken"):
        m3_eagle_plugin.activate("require")
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and report.plugin_errors


def test_require_refuses_an_allow_listed_plugin_that_is_not_installed(fake_install, fake_host, monkeypatch):
    """`M3_EAGLE_PLUGIN_LOAD=ghost` without a `ghost` entry point: `require` must not run without the plugin
    asked for (the real manager, entry points loaded); `auto` activates and reports it."""
    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_LOAD", "ghost")
    with pytest.raises(ActivationError, match="'ghost'.*M3_EAGLE_PLUGIN_LOAD"):
        m3_eagle_plugin.activate("require")
    assert fake_install == []
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and any("'ghost'" in error for error in report.plugin_errors)


def test_host_ready_hook_sees_the_report(active_env, hermetic_manager):
    make_host, _ = active_env
    make_host("1.3.0rc24")
    from m3_eagle_plugin.hooks import hookimpl

    seen = []

    class Ready:
        @hookimpl
        def m3_eagle_host_ready(self, host, report):
            seen.append((host, report["patches"]))

    report = m3_eagle_plugin.activate("auto")
    hermetic_manager.register(Ready(), name="ready")  # historic: late registrants are called too
    assert seen == [("tensorrt_llm", report.patches)]


def test_status_without_activation(active_env, monkeypatch):
    make_host, installs = active_env
    make_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    report = m3_eagle_plugin.status()
    assert report.verdict == "supported" and not report.activated and installs == []
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "bad")
    bad = m3_eagle_plugin.status()
    assert not bad.ok and "allowed values" in bad.reason


def test_reentrant_activation_from_install(active_env, monkeypatch):
    """install() may import tensorrt_llm, which fires the bootstrap hook: no second evaluation."""
    make_host, _ = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter

    inner = []

    def install():
        inner.append(m3_eagle_plugin.activate())
        return {"patches": ["p"]}

    monkeypatch.setattr(adapter, "install", install, raising=False)
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and len(inner) == 1 and inner[0] is report


@pytest.mark.parametrize("value", ["maybe", "2", "force"])
def test_a_bad_force_value_is_an_error_naming_it_not_quietly_unforced(active_env, monkeypatch, log_lines, value):
    """README: `M3_EAGLE_PLUGIN_FORCE=1` forces; any other value read as "not forced" without a word,
    so `require` on a deferring host refused for the wrong reason and `auto` stepped aside silently."""
    make_host, installs = active_env
    make_host("1.4.0rc1")  # defer: only the force switch activates here
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", value)
    with pytest.raises(ActivationError, match=rf"M3_EAGLE_PLUGIN_FORCE='{value}'.*allowed values: 1 or 0"):
        m3_eagle_plugin.activate("require")
    report = m3_eagle_plugin.activate("auto")
    assert not report.ok and not report.activated and f"M3_EAGLE_PLUGIN_FORCE='{value}'" in report.reason
    assert len(log_lines) == 1 and f"M3_EAGLE_PLUGIN_FORCE='{value}'" in log_lines[0]  # one line a process
    assert installs == []


@pytest.mark.parametrize("value, forced", [("1", True), ("TRUE", True), ("0", False), ("no", False), (" ", False)])
def test_force_values_the_readme_and_the_config_key_write_are_read(monkeypatch, value, forced):
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", value)  # the config key exports 1 / 0
    assert activation.force_requested() is forced


def test_status_reports_a_failed_activation_that_the_verdict_does_not_explain(active_env, monkeypatch):
    """A supported host whose install() failed under auto: status() must not read "ok" afterwards."""
    _supported_host_whose_install_fails(active_env, monkeypatch)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    assert not m3_eagle_plugin.activate().ok
    report = m3_eagle_plugin.status()
    assert report.verdict == "supported" and not report.ok and "symbol" in report.reason


def test_an_imported_host_is_judged_by_its_own_version(monkeypatch):
    """A source checkout on PYTHONPATH shadowing an installed wheel: the imported module runs, so its
    `__version__` decides; the installed metadata only where the module is absent or has none."""
    import importlib.metadata
    import sys
    import types

    monkeypatch.setattr(importlib.metadata, "version", lambda package: "1.2.0")
    host = types.ModuleType("fake_host_pkg")
    monkeypatch.setitem(sys.modules, "fake_host_pkg", host)
    assert activation.host_version("fake_host_pkg") == (True, "1.2.0")  # no __version__: the metadata
    host.__version__ = "1.3.0rc24"
    assert activation.host_version("fake_host_pkg") == (True, "1.3.0rc24")
    monkeypatch.delitem(sys.modules, "fake_host_pkg")
    assert activation.host_version("fake_host_pkg") == (True, "1.2.0")  # not imported: the metadata


def test_an_imported_host_version_that_is_not_a_version_string_is_not_taken(monkeypatch):
    """host_version gives a version string or None: a `__version__` that is no string, or blank, is
    not one, so the installed metadata decides; without metadata the imported host is installed,
    version unknown. A padded version string is taken without its whitespace."""
    import importlib.metadata
    import sys
    import types

    installed = {"fake_host_pkg": "1.2.0"}

    def version(package):
        if package not in installed:
            raise importlib.metadata.PackageNotFoundError(package)
        return installed[package]

    monkeypatch.setattr(importlib.metadata, "version", version)
    host = types.ModuleType("fake_host_pkg")
    monkeypatch.setitem(sys.modules, "fake_host_pkg", host)
    host.__version__ = " 1.3.0rc24\n"
    assert activation.host_version("fake_host_pkg") == (True, "1.3.0rc24")
    for unusable in [(1, 3, 0), 13, "  "]:
        host.__version__ = unusable
        assert activation.host_version("fake_host_pkg") == (True, "1.2.0"), unusable
    installed.clear()
    for unusable in [(1, 3, 0), "  ", None]:
        host.__version__ = unusable
        assert activation.host_version("fake_host_pkg") == (True, None), unusable


def test_status_with_a_bad_force_value_is_not_ok_but_still_judges_the_host(active_env, monkeypatch):
    """status() names the malformed switch and is not ok (activating refuses it), yet still reports
    the verdict as judged with the switch unset; nothing is installed."""
    make_host, installs = active_env
    make_host("1.3.0rc24")  # supported: only the switch makes the report not ok
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "maybe")
    report = m3_eagle_plugin.status()
    assert report.ok is False and report.verdict == "supported" and not report.activated
    assert report.reason.startswith("M3_EAGLE_PLUGIN_FORCE='maybe'"), report.reason
    assert installs == []


def test_status_judges_the_host_with_a_valid_force_switch(active_env, monkeypatch):
    """A deferring host with `M3_EAGLE_PLUGIN_FORCE=1`: status() reports what activating would do (the
    defer overridden), not the verdict with the switch unset."""
    make_host, installs = active_env
    make_host("1.4.0rc1")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "1")
    report = m3_eagle_plugin.status()
    assert report.verdict != "defer" and "overridden" in report.reason and installs == []


def test_without_a_patch_list_from_install_the_report_lists_the_plugins_patches_once(active_env, hermetic_manager,
                                                                                     monkeypatch):
    """install() answering no "patches": the report names what the plugins asked for, each id once, a
    patch's `id` before its `name`."""
    from types import SimpleNamespace

    from m3_eagle_plugin.hooks import hookimpl

    make_host, _ = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter

    class Named:
        @hookimpl
        def m3_eagle_host_patches(self, host):
            return [SimpleNamespace(id="fake-c", name="display name")]

    hermetic_manager.register(Named(), name="named")
    monkeypatch.setattr(adapter, "install", lambda: {})
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and sorted(report.patches) == ["fake-a", "fake-b", "fake-c"]


def test_the_report_lists_the_patches_and_models_install_answered(active_env, monkeypatch):
    make_host, _ = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter

    models = {"MiniMaxM3SparseForCausalLM": "host.models:M3"}
    monkeypatch.setattr(adapter, "install", lambda: {"patches": ["installed-x"], "models": models})
    report = m3_eagle_plugin.activate("auto")
    assert report.patches == ["installed-x"] and report.fingerprint == activation.fingerprint(["installed-x"])
    assert report.components["registered_models"] == models
    assert report.host_report == {"patches": ["installed-x"], "models": models}


@pytest.mark.parametrize("exported", [None, " AUTO "])
def test_activating_with_the_mode_from_the_environment_leaves_the_environment_as_it_was(active_env, monkeypatch,
                                                                                       exported):
    """Only an explicit `activate(mode)` is exported (module doc of `_export_mode`)."""
    make_host, _ = active_env
    make_host("1.3.0rc24")
    if exported is not None:
        monkeypatch.setenv("M3_EAGLE_PLUGIN", exported)
    m3_eagle_plugin.activate()
    assert os.environ.get("M3_EAGLE_PLUGIN") == exported


def test_status_off_on_a_host_without_a_version_is_ok(clean_state, hermetic_manager, tmp_path, monkeypatch):
    """Off activates nothing, so a host of unknown version is no failure there (auto and require refuse it)."""
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = m3_eagle_plugin.status()
    assert report.mode == "off" and report.ok and report.host_version is None


def test_status_off_on_a_host_without_a_version_does_not_call_it_not_installed(clean_state, hermetic_manager,
                                                                              tmp_path, monkeypatch):
    """An importable `tensorrt_llm` without dist-info (a source checkout on the path): with the plugin off
    the reason read "tensorrt_llm is not installed" beside the doctor's "host found, version unknown"."""
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = m3_eagle_plugin.status()
    assert report.ok and "not installed" not in report.reason, report.reason
    assert report.reason == activation._unknown_version("tensorrt_llm")


def test_status_after_an_off_decision_still_gives_the_verdicts_reason(active_env):
    make_host, _ = active_env
    make_host("1.3.0rc24")
    assert m3_eagle_plugin.activate().reason == "M3_EAGLE_PLUGIN is off"
    report = m3_eagle_plugin.status()
    assert report.ok and report.reason == "tensorrt_llm 1.3.0rc24 is a tested host"


def test_a_report_reads_like_a_dict_of_its_fields_only(clean_state):
    report = activation.ActivationReport(mode="off")
    assert "mode" in report and "to_dict" not in report and report.get("nope") is None
    with pytest.raises(KeyError):
        report["to_dict"]


def test_the_host_import_also_watches_the_hosts_yaml_for_the_config_key(fake_host, hermetic_manager, fake_install,
                                                                       monkeypatch):
    from m3_eagle_plugin import _bootstrap

    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    _bootstrap.main()
    import tensorrt_llm.llmapi.llm_args as llm_args

    assert getattr(llm_args.update_llm_args_with_extra_dict, "_m3_eagle_config_key", False)
    assert fake_install == [1]


def test_an_explicit_auto_that_is_refused_is_exported_too(active_env, monkeypatch):
    """README: `activate(mode)` exports the mode for the workers, and this process's later host import
    must decide the same (`_export_mode`). A refused `activate("auto")` was not exported: with
    M3_EAGLE_PLUGIN=require inherited, the bootstrap then raised at `import tensorrt_llm` (and workers
    would), against the caller's auto."""
    from m3_eagle_plugin import _bootstrap

    make_host, installs = active_env
    make_host("1.6.0")  # outside the supported range: auto refuses, require raises
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    _bootstrap.main()
    report = m3_eagle_plugin.activate("auto")
    assert not report.ok and "outside" in report.reason
    assert os.environ["M3_EAGLE_PLUGIN"] == "auto"
    importlib.import_module("tensorrt_llm")  # the bootstrap decides too: the same refusal, not a raise

    assert m3_eagle_plugin.activate() is report and installs == []


def test_an_interrupt_as_install_returns_takes_the_patches_out(active_env, monkeypatch):
    """A Ctrl-C raised as the adapter's install() returns (CPython raises a pending signal there): the
    host was patched, but nothing recorded or undid it: status() said not activated over a patched
    host. The patches come out again before the interrupt goes on, and a later activation starts
    clean."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    import m3_eagle_plugin.host.trtllm as adapter

    def install_then_interrupted():
        installs.append(1)
        raise KeyboardInterrupt

    installed = adapter.install
    monkeypatch.setattr(adapter, "install", install_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        m3_eagle_plugin.activate("auto")
    assert installs == [1, -1] and not m3_eagle_plugin.status().activated
    monkeypatch.setattr(adapter, "install", installed)
    assert m3_eagle_plugin.activate("auto").activated and installs == [1, -1, 1]


def test_an_interrupt_after_the_install_completed_keeps_the_activation_recorded(active_env, hermetic_manager,
                                                                               monkeypatch):
    """A Ctrl-C after every plugin heard the host is ready (while the mode is exported): the host stays
    patched, so the activation must stay recorded. It was not: status() said not activated over a
    patched host, and the next activate() installed again and told every host_ready plugin twice."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    seen = []
    hermetic_manager.register(_host_ready_listener(seen), name="listener")
    exported = activation._export_mode

    def interrupted(mode, resolved):
        monkeypatch.setattr(activation, "_export_mode", exported)
        raise KeyboardInterrupt

    monkeypatch.setattr(activation, "_export_mode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m3_eagle_plugin.activate("auto")
    report = m3_eagle_plugin.status()
    assert report.activated and installs == [1] and len(seen) == 1
    assert m3_eagle_plugin.activate("auto") is report and installs == [1] and len(seen) == 1


def test_the_reported_cache_manager_is_the_one_a_plugin_written_as_documented_gives_the_host(
        clean_state, fake_install, fake_host, monkeypatch):
    """hooks.M3EagleSpecs.m3_eagle_kv_cache_manager's example reads `sparse_config.algorithm`, as the host's
    config object (TensorRT-LLM's MiniMaxM3SparseAttentionConfig) has it. Activation and status asked with a
    plain dict probe, on which that example answers None: the report named another manager (or none) than the
    one the host then builds from the same plugin."""
    from types import SimpleNamespace

    from m3_eagle_plugin import registry
    from m3_eagle_plugin.hooks import hookimpl

    class AsDocumented:
        @hookimpl
        def m3_eagle_kv_cache_manager(self, host, sparse_config):
            if getattr(sparse_config, "algorithm", None) != "minimax_m3":
                return None
            return "my_pkg.kv:MyManager"

    manager = registry.make_plugin_manager(register_builtin=False)
    manager.register(AsDocumented(), name="as-documented")
    monkeypatch.setattr(registry, "_singleton", manager)
    fake_host("1.3.0rc24")
    host_config = SimpleNamespace(algorithm="minimax_m3")  # what the host passes (route_sparse_kv_cache_manager)
    assert manager.kv_cache_manager("tensorrt_llm", host_config) == "my_pkg.kv:MyManager"
    status = m3_eagle_plugin.status()
    assert status.components.get("kv_cache_manager") == "my_pkg.kv:MyManager", status.reason
    report = m3_eagle_plugin.activate("auto")
    assert report.activated and report.components["kv_cache_manager"] == "my_pkg.kv:MyManager"


def test_auto_on_an_untested_host_is_refused_where_the_manifest_says_refuse(active_env, monkeypatch, log_lines):
    """plugin_manifest.toml: `on_untested_host = "refuse"` makes `auto` leave an in-range but untested host
    alone (one line saying why); only the shipped "warn" policy was exercised."""
    import dataclasses

    from m3_eagle_plugin import manifest as manifest_module

    make_host, installs = active_env
    make_host("1.3.0")  # inside >=1.3.0rc1,<1.5, not in the tested list
    shipped = manifest_module.load_manifest()
    refusing = dataclasses.replace(shipped, activation=dataclasses.replace(shipped.activation,
                                                                          on_untested_host="refuse"))
    monkeypatch.setattr(manifest_module, "load_manifest", lambda path=None: refusing)
    report = m3_eagle_plugin.activate("auto")
    assert (report.ok, report.activated, report.verdict) == (False, False, "untested") and installs == []
    assert "refuses untested hosts" in report.reason and len(log_lines) == 1
    assert not m3_eagle_plugin.status().ok  # status says what activating decided


def test_status_under_auto_beside_a_broken_plugin_is_ok_as_activating_is(active_env, monkeypatch):
    """status() is "what activation would see now": `auto` activates beside a plugin that failed to load
    (only `require` refuses it), so status under auto must not say the activation would fail."""
    make_host, installs = active_env
    make_host("1.3.0rc24")
    from m3_eagle_plugin.registry import PluginLoadError, get_plugin_manager

    get_plugin_manager().load_errors.append(PluginLoadError("broken", "x:y", None, "ImportError: boom"))
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    predicted = m3_eagle_plugin.status()
    assert predicted.ok and predicted.plugin_errors and "boom" not in predicted.reason and installs == []
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    refused = m3_eagle_plugin.status()
    assert not refused.ok and "boom" in refused.reason
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    assert m3_eagle_plugin.activate().ok is predicted.ok is True
