"""The `m3_eagle_plugin:` YAML key: pure parsing, env export, and stripping before the host validates."""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.config_key import (
    CONFIG_KEY,
    ConfigKeyError,
    ConfigKeySettings,
    apply_settings,
    install_host_hook,
    parse_config_value,
    settings_env,
    split_config_key,
)

yaml = pytest.importorskip("yaml")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("m3_eagle_plugin: auto", ConfigKeySettings("auto")),
        ("m3_eagle_plugin: require", ConfigKeySettings("require")),
        ("m3_eagle_plugin: off", ConfigKeySettings("off")),  # YAML 1.1 reads `off` as false
        ("m3_eagle_plugin: on", ConfigKeySettings("auto")),
        ("m3_eagle_plugin: 'off'", ConfigKeySettings("off")),
        ("m3_eagle_plugin:", ConfigKeySettings("off")),
        ("m3_eagle_plugin: {mode: require, force: true}", ConfigKeySettings("require", force=True)),
        ("m3_eagle_plugin:\n  trace: false", ConfigKeySettings("auto", trace=False)),
    ],
)
def test_parse_yaml_values(text, expected):
    config = yaml.safe_load(text + "\nmax_batch_size: 8\n")
    remaining, parsed = split_config_key(config)
    assert parsed == expected
    assert remaining == {"max_batch_size": 8}
    assert CONFIG_KEY in config  # the input is not modified


@pytest.mark.parametrize(
    "value, message",
    [("maybe", "mode must be one of"), (3, "mode must be one of"), ({"mode": "auto", "speed": 1}, "unknown field"),
     ({"force": "yes"}, "force' must be true or false")],
)
def test_bad_values(value, message):
    with pytest.raises(ConfigKeyError, match=message):
        parse_config_value(value)


def test_configs_without_the_key_pass_through():
    config = {"max_batch_size": 8}
    assert split_config_key(config) == (config, None)
    assert split_config_key(None) == (None, None)


def test_settings_env_and_explicit_env_wins():
    settings = ConfigKeySettings("require", force=True, trace=False)
    assert settings_env(settings) == {"M3_EAGLE_PLUGIN": "require", "M3_EAGLE_PLUGIN_FORCE": "1",
                                      "M3_EAGLE_PLUGIN_TRACE": "0"}
    environ = {"M3_EAGLE_PLUGIN": "auto"}
    applied = apply_settings(settings, environ)
    assert environ["M3_EAGLE_PLUGIN"] == "auto" and "M3_EAGLE_PLUGIN" not in applied
    assert environ["M3_EAGLE_PLUGIN_FORCE"] == "1"


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k != CONFIG_KEY), st.integers(), max_size=4),
    st.sampled_from(["off", "auto", "require", True, False, None]),
    st.one_of(st.none(), st.booleans()),
)
def test_split_property(other, mode, force):
    value = {"mode": mode} if force is None else {"mode": mode, "force": force}
    remaining, parsed = split_config_key({**other, CONFIG_KEY: value})
    assert remaining == other
    expected_mode = {True: "auto", False: "off", None: "off"}.get(mode, mode) if not isinstance(mode, str) else mode
    assert parsed.mode == expected_mode and parsed.force == force
    env = settings_env(parsed)
    assert env["M3_EAGLE_PLUGIN"] == expected_mode
    assert ("M3_EAGLE_PLUGIN_FORCE" in env) == (force is not None)


def test_host_yaml_is_stripped_and_activates(fake_host, hermetic_manager, fake_install, tmp_path):
    fake_host("1.3.0rc24")
    import tensorrt_llm.commands.serve as serve  # binds the host function by `from ... import`
    import tensorrt_llm.llmapi.llm_args as llm_args

    config = tmp_path / "extra.yaml"
    config.write_text("max_batch_size: 8\nm3_eagle_plugin: auto\n")
    with pytest.raises(ValueError, match="unknown LlmArgs fields"):
        serve.load_args(config)  # the host alone rejects the key
    rebound = install_host_hook()
    assert {"tensorrt_llm.commands.serve", "tensorrt_llm.llmapi.llm_args", "tensorrt_llm.llmapi.llm_utils"} <= set(rebound)
    assert serve.load_args(config) == {"model": "m", "max_batch_size": 8}
    assert os.environ["M3_EAGLE_PLUGIN"] == "auto"
    assert fake_install == [1]
    plain = tmp_path / "plain.yaml"
    plain.write_text("max_batch_size: 4\n")
    assert llm_args.update_llm_args_with_extra_options({}, str(plain)) == {"max_batch_size": 4}
    assert install_host_hook() == []  # idempotent: nothing left to rebind
    assert sys.modules["tensorrt_llm.llmapi.llm_utils"].update_llm_args_with_extra_dict is serve.update_llm_args_with_extra_dict


def test_force_from_the_key_after_a_defer_decision_activates_the_driver_too(fake_host, hermetic_manager,
                                                                          fake_install, tmp_path, monkeypatch):
    """The driver decided "defer" at the first `tensorrt_llm` import; the key then exports
    M3_EAGLE_PLUGIN_FORCE=1, with which every process started afterwards activates (README: the
    force switch overrides defer). The driver must not keep its cached "defer"."""
    from m3_eagle_plugin import activation

    fake_host("1.4.0rc1")  # the manifest defers to the host's own one-model path
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    import tensorrt_llm.commands.serve as serve

    deferred = activation.activate()
    assert deferred.verdict == "defer" and not deferred.activated and fake_install == []
    install_host_hook()
    config = tmp_path / "extra.yaml"
    config.write_text("max_batch_size: 8\nm3_eagle_plugin: {mode: auto, force: true}\n")
    assert serve.load_args(config) == {"model": "m", "max_batch_size": 8}
    assert os.environ["M3_EAGLE_PLUGIN_FORCE"] == "1"
    driver = activation.status()
    assert driver.activated and "overridden" in driver.reason and fake_install == [1]


def test_unknown_fields_of_mixed_key_types_are_a_config_error():
    # YAML reads a bare `on:` / `1:` key as a bool / int: the message must still name the fields, not
    # fail with a TypeError from sorting str against bool.
    config = yaml.safe_load("m3_eagle_plugin: {mode: auto, on: 1, speed: 2}\n")
    with pytest.raises(ConfigKeyError, match="unknown field.*speed"):
        split_config_key(config)
    with pytest.raises(ConfigKeyError, match="unknown field"):
        parse_config_value({"mode": "auto", 1: "x", "foo": "y"})


def test_install_does_not_load_lazily_imported_modules(fake_host, hermetic_manager, fake_install, tmp_path,
                                                       monkeypatch):
    """`importlib.util.LazyLoader` modules execute on any attribute access, `__dict__` included: looking
    for the host function must neither load them nor fail when loading them fails."""
    import importlib.util

    fake_host("1.3.0rc24")
    import tensorrt_llm.commands.serve as serve

    source = tmp_path / "m3_lazy_probe.py"
    source.write_text("import os\nos.environ['M3_LAZY_PROBE_RAN'] = '1'\nraise RuntimeError('optional dep missing')\n")
    monkeypatch.setenv("M3_LAZY_PROBE_RAN", "")  # recorded, so a run of the probe is undone
    monkeypatch.delenv("M3_LAZY_PROBE_RAN")
    spec = importlib.util.spec_from_file_location("m3_lazy_probe", source)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "m3_lazy_probe", module)
    spec.loader.exec_module(module)  # lazy: nothing runs yet

    assert "tensorrt_llm.commands.serve" in install_host_hook()
    assert "M3_LAZY_PROBE_RAN" not in os.environ
    config = tmp_path / "extra.yaml"
    config.write_text("max_batch_size: 8\nm3_eagle_plugin: auto\n")
    assert serve.load_args(config) == {"model": "m", "max_batch_size": 8}
    from m3_eagle_plugin.config_key import uninstall_host_hook

    uninstall_host_hook()
    assert "M3_LAZY_PROBE_RAN" not in os.environ


def test_settings_env_writes_false_switches_as_zero():
    assert settings_env(ConfigKeySettings("auto", force=False, trace=True)) == {
        "M3_EAGLE_PLUGIN": "auto", "M3_EAGLE_PLUGIN_FORCE": "0", "M3_EAGLE_PLUGIN_TRACE": "1"}
    assert settings_env(ConfigKeySettings("off")) == {"M3_EAGLE_PLUGIN": "off"}


def test_a_blank_exported_variable_counts_as_unset():
    environ = {"M3_EAGLE_PLUGIN": "  ", "M3_EAGLE_PLUGIN_FORCE": ""}
    applied = apply_settings(ConfigKeySettings("require", force=True), environ)
    assert environ == applied == {"M3_EAGLE_PLUGIN": "require", "M3_EAGLE_PLUGIN_FORCE": "1"}


@pytest.mark.parametrize("value", ["yes", 1, None, "true"])
def test_trace_must_be_a_yaml_boolean(value):
    with pytest.raises(ConfigKeyError, match="trace' must be true or false"):
        parse_config_value({"trace": value})


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "WARNING config key m3_eagle_plugin:" in line]


@pytest.mark.parametrize(
    "name, exported, settings, keyed",
    [
        ("M3_EAGLE_PLUGIN", "off", ConfigKeySettings("require"), "require"),
        ("M3_EAGLE_PLUGIN", "require", ConfigKeySettings("off"), "off"),
        ("M3_EAGLE_PLUGIN_FORCE", "0", ConfigKeySettings("auto", force=True), "1"),
        ("M3_EAGLE_PLUGIN_FORCE", "yes", ConfigKeySettings("auto", force=False), "0"),
        ("M3_EAGLE_PLUGIN_TRACE", "1", ConfigKeySettings("auto", trace=False), "0"),
        ("M3_EAGLE_PLUGIN_TRACE", "off", ConfigKeySettings("auto", trace=True), "1"),
        ("M3_EAGLE_PLUGIN_TRACE", "maybe", ConfigKeySettings("auto", trace=True), "1"),  # not a switch: differs
    ],
)
def test_an_exported_variable_wins_over_the_key_and_says_so(name, exported, settings, keyed, capsys):
    """The environment wins for all three variables; the key's losing value is named, not dropped silently."""
    environ = {name: exported}
    applied = apply_settings(settings, environ)
    assert environ[name] == exported and name not in applied
    (line,) = _warnings(capsys.readouterr().err)
    assert f"{name} is exported as {exported!r} and wins over {keyed!r} from the key" in line


@pytest.mark.parametrize(
    "environ",
    [{}, {"M3_EAGLE_PLUGIN": " "}, {"M3_EAGLE_PLUGIN": "AUTO", "M3_EAGLE_PLUGIN_FORCE": "true",
                                    "M3_EAGLE_PLUGIN_TRACE": "no"}],
)
def test_the_key_applies_or_agrees_without_a_warning(environ, capsys):
    """Unset (or blank) variables take the key's values; exported ones that mean the same need no warning."""
    before = {name: value for name, value in environ.items() if value.strip()}
    apply_settings(ConfigKeySettings("auto", force=True, trace=False), environ)
    assert environ == {"M3_EAGLE_PLUGIN": "auto", "M3_EAGLE_PLUGIN_FORCE": "1", "M3_EAGLE_PLUGIN_TRACE": "0",
                       **before}
    assert _warnings(capsys.readouterr().err) == []


@pytest.mark.parametrize(
    "name, exported, settings",
    [
        ("M3_EAGLE_PLUGIN", "off", ConfigKeySettings("off")),  # a mode is a word, not the switch value 0
        ("M3_EAGLE_PLUGIN", " Off\n", ConfigKeySettings("off")),
        ("M3_EAGLE_PLUGIN", " require ", ConfigKeySettings("require")),
        ("M3_EAGLE_PLUGIN_FORCE", " yes ", ConfigKeySettings("auto", force=True)),
        ("M3_EAGLE_PLUGIN_TRACE", "\tOFF ", ConfigKeySettings("auto", trace=False)),
    ],
)
def test_an_exported_value_that_reads_as_the_keys_is_kept_without_a_warning(name, exported, settings, capsys):
    """Read the way the plugin reads it (stripped, case-folded), the exported value means what the key says."""
    environ = {name: exported}
    apply_settings(settings, environ)
    assert environ[name] == exported
    assert _warnings(capsys.readouterr().err) == []


def test_consume_config_key_exports_into_the_environ_it_is_given(clean_state, monkeypatch):
    from m3_eagle_plugin import activation
    from m3_eagle_plugin.config_key import consume_config_key

    activated = []
    monkeypatch.setattr(activation, "activate", lambda *args, **kwargs: activated.append(args))
    environ: dict[str, str] = {}
    config = {"max_batch_size": 8, CONFIG_KEY: {"mode": "require", "force": True}}
    assert consume_config_key(config, environ) == {"max_batch_size": 8}
    assert environ == {"M3_EAGLE_PLUGIN": "require", "M3_EAGLE_PLUGIN_FORCE": "1"}
    assert "M3_EAGLE_PLUGIN" not in os.environ and "M3_EAGLE_PLUGIN_FORCE" not in os.environ
    assert activated == [()]


def test_exported_force_and_trace_beat_the_hosts_yaml_with_one_warning_each(fake_host, hermetic_manager,
                                                                              fake_install, tmp_path, monkeypatch,
                                                                              capsys):
    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "0")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_TRACE", "1")
    import tensorrt_llm.commands.serve as serve

    install_host_hook()
    config = tmp_path / "extra.yaml"
    config.write_text("max_batch_size: 8\nm3_eagle_plugin: {mode: auto, force: true, trace: false}\n")
    assert serve.load_args(config) == {"model": "m", "max_batch_size": 8}
    assert os.environ["M3_EAGLE_PLUGIN"] == "auto"  # unset before: the key's value
    assert (os.environ["M3_EAGLE_PLUGIN_FORCE"], os.environ["M3_EAGLE_PLUGIN_TRACE"]) == ("0", "1")
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 2
    assert "M3_EAGLE_PLUGIN_FORCE is exported as '0' and wins over '1' from the key" in lines[0]
    assert "M3_EAGLE_PLUGIN_TRACE is exported as '1' and wins over '0' from the key" in lines[1]


@pytest.mark.parametrize("value, mode", [(" Require ", "require"), ("AUTO\n", "auto"), ({"mode": " off"}, "off")])
def test_a_mode_is_read_stripped_and_case_folded(value, mode):
    assert parse_config_value(value).mode == mode


def test_installing_the_hook_twice_is_undone_by_one_uninstall(fake_host, hermetic_manager, fake_install):
    from m3_eagle_plugin.config_key import uninstall_host_hook

    fake_host("1.3.0rc24")
    import tensorrt_llm.commands.serve as serve
    import tensorrt_llm.llmapi.llm_args as llm_args

    original = llm_args.update_llm_args_with_extra_dict
    install_host_hook()
    install_host_hook()
    assert serve.update_llm_args_with_extra_dict is not original
    uninstall_host_hook()
    assert serve.update_llm_args_with_extra_dict is original and llm_args.update_llm_args_with_extra_dict is original


def test_trace_from_the_key_traces_the_driver_the_environment_activated(fake_host, fake_install, tmp_path,
                                                                       monkeypatch, capsys):
    """M3_EAGLE_PLUGIN=auto exported: the driver activates (and builds its plugin manager) at the host
    import, before the YAML is read. The key's `trace: true` exported M3_EAGLE_PLUGIN_TRACE=1, so workers
    traced, but the driver's manager had read the switch already and traced nothing."""
    from m3_eagle_plugin import activation, registry

    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    import tensorrt_llm.commands.serve as serve

    assert activation.activate().activated
    install_host_hook()
    config = tmp_path / "extra.yaml"
    config.write_text("max_batch_size: 8\nm3_eagle_plugin: {mode: auto, trace: true}\n")
    assert serve.load_args(config) == {"model": "m", "max_batch_size": 8}
    assert os.environ["M3_EAGLE_PLUGIN_TRACE"] == "1"
    capsys.readouterr()
    registry.get_plugin_manager().attention_metadata("reference")
    traced = [line for line in capsys.readouterr().err.splitlines() if "hook m3_eagle_attention_metadata" in line]
    fresh = registry.make_plugin_manager()  # what a process started now (a worker) builds
    fresh.attention_metadata("reference")
    expected = [line for line in capsys.readouterr().err.splitlines() if "hook m3_eagle_attention_metadata" in line]
    assert len(traced) == len(expected) == 2, (traced, expected)


_LAUNCH = {"TLLM_SPAWN_PROXY_PROCESS": "1", "tllm_mpi_size": "8"}  # what trtllm-llmapi-launch exports


@pytest.mark.parametrize(
    "exported, value, outcome, unseen",
    [
        ({}, "require", "refused", ["M3_EAGLE_PLUGIN=require"]),
        ({}, {"mode": "auto", "force": True}, "warned", ["M3_EAGLE_PLUGIN=auto", "M3_EAGLE_PLUGIN_FORCE=1"]),
        ({}, {"mode": "auto", "force": False}, "warned", ["M3_EAGLE_PLUGIN=auto"]),
        ({"M3_EAGLE_PLUGIN": "require"}, {"force": True}, "refused", ["M3_EAGLE_PLUGIN_FORCE=1"]),
        ({"M3_EAGLE_PLUGIN": "require"}, {"trace": True}, "warned", ["M3_EAGLE_PLUGIN_TRACE=1"]),
        ({"M3_EAGLE_PLUGIN": "auto"}, "auto", "kept", []),  # exported before the launch: the ranks have it
        ({}, "off", "kept", []),
        ({"M3_EAGLE_PLUGIN": "off"}, {"mode": "auto", "force": True}, "kept", []),  # off in effect everywhere
        # switches the key turns off, under a mode the ranks have: nothing on here that is off there
        ({"M3_EAGLE_PLUGIN": "require"}, {"force": False, "trace": False}, "kept", []),
    ],
)
def test_under_trtllm_llmapi_launch_what_the_ranks_never_see_is_refused_or_named(exported, value, outcome, unseen,
                                                                                  clean_state, monkeypatch, capsys):
    """trtllm-llmapi-launch runs the command (the only reader of --config) on rank 0 with
    TLLM_SPAWN_PROXY_PROCESS=1; the model runs in MPI ranks it started from the launch's environment,
    which the key's exports never reach (the tasks they get carry no environment). The ranks read
    `exported` alone: a key that turns on more than that is a driver/worker split."""
    from m3_eagle_plugin import activation
    from m3_eagle_plugin.config_key import consume_config_key

    activated = []
    monkeypatch.setattr(activation, "activate", lambda *args, **kwargs: activated.append(args))
    ranks = {**_LAUNCH, **exported}
    environ = dict(ranks)
    config = {"max_batch_size": 8, CONFIG_KEY: value}
    if outcome == "refused":
        with pytest.raises(ConfigKeyError, match="TLLM_SPAWN_PROXY_PROCESS=1") as info:
            consume_config_key(config, environ)
        assert all(name in str(info.value) for name in unseen)
        assert environ == ranks and activated == []  # nothing exported, nothing activated
        return
    assert consume_config_key(config, environ) == {"max_batch_size": 8}
    lines = [line for line in _warnings(capsys.readouterr().err) if "TLLM_SPAWN_PROXY_PROCESS" in line]
    from m3_eagle_plugin.switches import read_switch

    def reads(env):  # each variable as the plugin reads it (unset: off / 0)
        return {"M3_EAGLE_PLUGIN": activation.resolve_mode(environ=env),
                **{name: "1" if read_switch(name, env)[0] else "0"
                   for name in ("M3_EAGLE_PLUGIN_FORCE", "M3_EAGLE_PLUGIN_TRACE")}}

    driver, workers = reads(environ), reads(ranks)
    differ = [f"{name}={driver[name]}" for name in driver if driver[name] != workers[name]]
    if outcome == "kept":  # the ranks decide as the driver does: same mode, and the switches matter only when on
        assert lines == [] and driver["M3_EAGLE_PLUGIN"] == workers["M3_EAGLE_PLUGIN"]
        assert driver["M3_EAGLE_PLUGIN"] == "off" or differ == []
        return
    (line,) = lines
    assert all(name in line for name in unseen) and "export before mpirun / srun" in line
    assert differ == unseen

def test_without_the_launcher_marker_the_key_is_exported_silently(clean_state, monkeypatch, capsys):
    """A bare mpirun (every rank reads --config) or TensorRT-LLM's pool (the driver forwards) needs no warning."""
    from m3_eagle_plugin import activation
    from m3_eagle_plugin.config_key import consume_config_key

    monkeypatch.setattr(activation, "activate", lambda *args, **kwargs: None)
    environ = {"TLLM_SPAWN_PROXY_PROCESS": "0"}
    assert consume_config_key({CONFIG_KEY: {"mode": "require", "force": True}}, environ) == {}
    assert environ == {"TLLM_SPAWN_PROXY_PROCESS": "0", "M3_EAGLE_PLUGIN": "require", "M3_EAGLE_PLUGIN_FORCE": "1"}
    assert _warnings(capsys.readouterr().err) == []


def test_a_host_function_replaced_after_the_install_is_wrapped_anew(fake_host, hermetic_manager, fake_install,
                                                                   monkeypatch):
    """`install_host_hook` wraps the host's YAML merge function wherever it is bound: installed again after
    the host rebound it (a reload, another tool's wrapper), the YAML must reach the function bound now,
    not the one the first install wrapped."""
    fake_host("1.3.0rc24")
    import tensorrt_llm.llmapi.llm_args as llm_args

    install_host_hook()
    seen = []

    def rebound(llm_args_obj, llm_args_dict, *args, **kwargs):
        seen.append(dict(llm_args_dict))
        return {**llm_args_obj, **llm_args_dict}

    monkeypatch.setattr(llm_args, "update_llm_args_with_extra_dict", rebound)
    assert "tensorrt_llm.llmapi.llm_args" in install_host_hook()
    merged = llm_args.update_llm_args_with_extra_dict({"model": "m"}, {"max_batch_size": 2, CONFIG_KEY: "off"})
    assert merged == {"model": "m", "max_batch_size": 2} and seen == [{"max_batch_size": 2}]
