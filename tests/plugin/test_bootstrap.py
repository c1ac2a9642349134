"""Interpreter-start bootstrap: the env/argv gate, the post-import hook, and what it imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin import _bootstrap
from m3_eagle_plugin._bootstrap import installed_hook, wants_bootstrap

# The startup files sit beside the package under test: src/ here, site-packages once installed.
PACKAGE_ROOT = Path(_bootstrap.__file__).resolve().parents[1]
PTH_FILE = PACKAGE_ROOT / "m3_eagle_plugin.pth"
START_FILE = PACKAGE_ROOT / "m3_eagle_plugin.start"


def _pth_gate():
    """The inline gate of the .pth line, as a function of (environ, argv) - evaluated, not re-typed."""
    line = PTH_FILE.read_text().strip()
    assert line.startswith("import os, sys; ") and line.count(" and exec(") == 1
    expression = line[len("import os, sys; "):].split(" and exec(")[0]

    def gate(environ, argv):
        fake_os = type("os", (), {"environ": environ})
        fake_sys = type("sys", (), {"argv": argv})
        return bool(eval(expression, {"os": fake_os, "sys": fake_sys}))  # noqa: S307 - our own file

    return gate


def test_startup_files():
    assert START_FILE.read_text().strip() == "m3_eagle_plugin._bootstrap:main"
    assert len(PTH_FILE.read_text().strip().splitlines()) == 1


def _start_with_the_pth(site_dir: Path, code: str = "pass", **env: str) -> subprocess.CompletedProcess:
    """An interpreter start that processes `site_dir` as site does site-packages (with the .pth copied
    into it), then runs `code` and prints whether the bootstrap's finder went in."""
    (site_dir / PTH_FILE.name).write_text(PTH_FILE.read_text())
    script = (f"import site, sys; {code}; site.addsitedir({str(site_dir)!r}); "
              "print(any(getattr(f, '_m3_eagle_host_hook', False) for f in sys.meta_path))")
    environ = {k: v for k, v in os.environ.items() if k != "M3_EAGLE_PLUGIN" and k not in _bootstrap.MPI_MARKERS}
    return subprocess.run([sys.executable, "-I", "-S", "-B", "-c", script], env={**environ, **env}, cwd=site_dir,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("env", [{"PMI_SIZE": "2"}, {"M3_EAGLE_PLUGIN": "auto"}, {"M3_EAGLE_PLUGIN": "require"}])
@pytest.mark.parametrize("left", [{}, {"m3_eagle_plugin/__init__.py": ""}], ids=["package-gone", "bootstrap-gone"])
def test_a_pth_that_outlived_its_package_starts_the_interpreter_silently(tmp_path, left, env):
    """The package deleted or renamed (or an editable checkout removed) while the .pth stays: every
    start, of every MPI process too, must go on as if it were uninstalled (`pip uninstall` removes the
    .pth), not print site's traceback of the failed import."""
    for path, source in left.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    result = _start_with_the_pth(tmp_path, **env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\n", "")


def test_the_pth_runs_the_bootstrap_and_reports_its_other_import_failures(tmp_path):
    (tmp_path / "installed").mkdir()
    ok = _start_with_the_pth(tmp_path / "installed", f"sys.path.insert(0, {str(PACKAGE_ROOT)!r})",
                             M3_EAGLE_PLUGIN="auto")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "True\n", "")
    broken = tmp_path / "broken" / "m3_eagle_plugin"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "_bootstrap.py").write_text("import m3_not_a_module_anywhere\n")
    result = _start_with_the_pth(broken.parent, PMI_SIZE="2")
    assert result.returncode == 0 and result.stdout == "False\n"
    assert "No module named 'm3_not_a_module_anywhere'" in result.stderr  # a real failure, not an orphan


@pytest.mark.parametrize(
    "environ, argv, expected",
    [
        ({}, ["-c"], False),
        ({"M3_EAGLE_PLUGIN": "off"}, ["x.py"], False),
        ({"M3_EAGLE_PLUGIN": " OFF "}, [], False),
        ({"M3_EAGLE_PLUGIN": ""}, [], False),
        ({"M3_EAGLE_PLUGIN": "auto"}, [], True),
        ({"M3_EAGLE_PLUGIN": "Require"}, [], True),
        ({"M3_EAGLE_PLUGIN": "typo"}, [], True),  # activation reports the bad value when the host loads
        ({}, ["/usr/bin/trtllm-serve", "m", "--extra_llm_api_options", "x.yaml"], True),
        ({}, ["/usr/bin/trtllm-serve", "m", "--config=x.yaml"], True),
        ({"M3_EAGLE_PLUGIN": "off"}, ["serve", "--config", "x.yaml"], True),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, ["-m"], True),  # MPI workers: deferred to the host import
        ({"PMI_SIZE": "4", "M3_EAGLE_PLUGIN": "off"}, [], True),
        ({"PMIX_RANK": "0"}, [], True),
        ({"OMPI_MCA_foo": "1"}, [], False),
    ],
)
def test_gate_examples(environ, argv, expected):
    assert wants_bootstrap(environ, argv) is expected
    assert _pth_gate()(environ, argv) is expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["trtllm-serve", "m", "--config"], True),
        (["trtllm-serve", "m", "--config=a.yaml"], True),
        (["trtllm-serve", "m", "--config="], True),  # click's empty value: still the flag
        (["trtllm-serve", "m", "--extra_llm_api_options"], True),
        (["trtllm-serve", "m", "--extra_llm_api_options=a.yml"], True),
        (["pip", "install", "--config-settings=x", "."], False),
        (["pip", "install", "--config-settings", "x", "."], False),
        (["./configure.py", "--configure"], False),
        (["tool", "--config_file", "a.yaml"], False),
        (["tool", "--configs", "a.yaml"], False),
        (["tool", "--extra_llm_api_options_file=a.yml"], False),
        (["tool", "--conf", "a.yaml"], False),  # click takes no abbreviations
        (["tool", "-config", "a.yaml"], False),
        (["tool", "a.yaml", "--config"], True),
    ],
)
@pytest.mark.parametrize("environ", [{}, {"M3_EAGLE_PLUGIN": "off"}])
def test_only_the_exact_config_flags_ask_for_the_bootstrap(environ, argv, expected):
    """A flag that merely starts like `--config` (pip's `--config-settings`, `--configure`, ...) must
    not install the host-import finder; `--config` / `--extra_llm_api_options` alone or `=value` must."""
    assert _bootstrap.wants_activation(environ, argv) is expected
    assert wants_bootstrap(environ, argv) is expected
    assert _pth_gate()(environ, argv) is expected


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.one_of(st.none(), st.sampled_from(["", "off", "OFF", " off", "auto", "require", "x", "0"])),
    st.lists(st.sampled_from(["-c", "m", "--config", "--config=a", "--config=a.yaml", "--extra_llm_api_options",
                              "--extra_llm_api_options=a.yml", "--conf", "-x", "--config-settings=x",
                              "--configs", "--configure", "--config_file"]),
             max_size=4),
    st.sampled_from([{}, {"PMI_SIZE": "2"}]),
)
def test_pth_gate_matches_bootstrap(mode, argv, mpi):
    environ = dict(mpi) if mode is None else {**mpi, "M3_EAGLE_PLUGIN": mode}
    assert _pth_gate()(environ, argv) == wants_bootstrap(environ, argv)


def test_hook_activates_right_after_the_host_import(fake_host, hermetic_manager, fake_install, monkeypatch):
    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    _bootstrap.main()
    _bootstrap.main()  # .pth lines may run twice (lib and lib64 site dirs): one hook only
    assert sum(getattr(f, "_m3_eagle_host_hook", False) for f in sys.meta_path) == 1
    import json as _unrelated  # noqa: F401 - other imports pass through untouched

    assert fake_install == []
    import tensorrt_llm

    assert fake_install == [1]
    assert installed_hook() is None
    assert type(tensorrt_llm.__loader__).__name__ != "_PostImportLoader"
    assert tensorrt_llm.__spec__.loader is tensorrt_llm.__loader__
    from m3_eagle_plugin.activation import status

    assert status().activated and status().patches == ["fake-a", "fake-b"]


def _mpi_worker(monkeypatch):
    """This process as an MPI-spawned worker: a runtime marker set, no plugin settings yet."""
    for name in _bootstrap.MPI_MARKERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")


def test_mpi_worker_decides_at_the_host_import_from_settings_that_arrived_later(
        fake_host, hermetic_manager, fake_install, monkeypatch):
    """A TensorRT-LLM MPI pool worker starts without M3_EAGLE_PLUGIN; mpi4py applies the driver's
    forwarded settings before the first task imports the host. The bootstrap must still act then."""
    fake_host("1.3.0rc24")
    _mpi_worker(monkeypatch)
    _bootstrap.main()
    assert installed_hook() is not None and installed_hook().deferred
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")  # mpi4py's env=, applied after interpreter start
    import tensorrt_llm  # noqa: F401

    assert fake_install == [1] and installed_hook() is None
    from m3_eagle_plugin.activation import status

    assert status().activated


def test_mpi_worker_still_off_at_the_host_import_runs_nothing(fake_host, hermetic_manager, fake_install,
                                                              monkeypatch):
    import m3_eagle_plugin.activation as activation

    fake_host("1.3.0rc24")
    _mpi_worker(monkeypatch)
    called = []
    monkeypatch.setattr(activation, "on_host_imported", lambda module: called.append(module))
    _bootstrap.main()
    import tensorrt_llm  # noqa: F401

    assert called == [] and fake_install == [] and installed_hook() is None


def test_an_explicit_setting_upgrades_a_deferred_hook(fake_host, hermetic_manager, fake_install, monkeypatch):
    fake_host("1.3.0rc24")
    _mpi_worker(monkeypatch)
    _bootstrap.main()
    _bootstrap.install_hook()  # e.g. the .start file after the .pth, or a caller that wants it now
    assert not installed_hook().deferred


def test_require_failure_surfaces_at_host_import(fake_host, hermetic_manager, fake_install, monkeypatch):
    fake_host("1.2.0")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    _bootstrap.main()
    from m3_eagle_plugin.activation import ActivationError

    with pytest.raises(ActivationError, match="outside the supported range"):
        import tensorrt_llm  # noqa: F401
    assert fake_install == []


def test_a_host_import_refused_under_require_is_refused_again_when_retried(fake_host, hermetic_manager,
                                                                           fake_install, monkeypatch):
    """require: any mismatch raises. A caller that catches the failed import and imports the host
    again must meet the same refusal, not a host loaded without the plugin."""
    fake_host("1.2.0")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    _bootstrap.main()
    from m3_eagle_plugin.activation import ActivationError

    for _attempt in range(2):
        with pytest.raises(ActivationError, match="outside the supported range"):
            import tensorrt_llm  # noqa: F401
        assert "tensorrt_llm" not in sys.modules
    assert fake_install == []


def test_hook_runs_at_once_when_host_already_imported(fake_host, hermetic_manager, fake_install, monkeypatch):
    fake_host("1.3.0rc24")
    import tensorrt_llm  # noqa: F401

    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    _bootstrap.main()
    assert fake_install == [1] and installed_hook() is None


def test_bootstrap_imports_nothing_heavy():
    # Where the package is installed, the .pth already ran the bootstrap at interpreter start
    # (M3_EAGLE_PLUGIN=auto); elsewhere the explicit call does. Either way nothing heavy may load
    # beyond what the interpreter itself loads at start (some environments' own .pth files import
    # `typing`), which a plugin-off interpreter that never touches the bootstrap tells us.
    listing = ("print(','.join(sorted(m for m in sys.modules if m.startswith(('m3_eagle_plugin', 'torch', "
               "'tensorrt_llm', 'pluggy', 'packaging', 'typing')))))")

    def loaded(code: str, mode: str) -> set[str]:
        env = {**os.environ, "M3_EAGLE_PLUGIN": mode}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return set(filter(None, (out.stdout.strip().splitlines() or [""])[-1].split(",")))

    baseline = loaded("import sys; " + listing, "off")
    with_bootstrap = loaded("import sys; import m3_eagle_plugin._bootstrap as b; b.main(); " + listing, "auto")
    assert not {m for m in with_bootstrap if m.startswith(("torch", "tensorrt_llm", "pluggy", "packaging"))}
    extra = with_bootstrap - baseline
    assert extra <= {"m3_eagle_plugin", "m3_eagle_plugin._version", "m3_eagle_plugin._bootstrap"}, extra


def test_a_deferred_install_on_an_imported_host_follows_the_environment(fake_host, hermetic_manager, fake_install,
                                                                       monkeypatch):
    """install_hook(deferred=True): activate only if the environment asks for it, also when the host
    is already imported (then at once)."""
    fake_host("1.3.0rc24")
    import tensorrt_llm  # noqa: F401

    _bootstrap.install_hook(deferred=True)  # M3_EAGLE_PLUGIN unset: nothing
    assert fake_install == [] and installed_hook() is None
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    _bootstrap.install_hook(deferred=True)
    assert fake_install == [1]


def test_a_deferred_install_on_an_imported_host_that_stays_off_runs_nothing(fake_host, hermetic_manager,
                                                                            fake_install, monkeypatch):
    """Not even the config-key watch: an MPI worker still off when it installs the hook does nothing."""
    import m3_eagle_plugin.activation as activation

    fake_host("1.3.0rc24")
    import tensorrt_llm  # noqa: F401

    called = []
    monkeypatch.setattr(activation, "on_host_imported", lambda module: called.append(module))
    _bootstrap.install_hook(deferred=True)
    assert called == [] and installed_hook() is None


class _Loader:
    """A loader with its own module object (as extension-module loaders have)."""

    def __init__(self, module=None, exec_module=True):
        self.module = module
        if exec_module:
            self.exec_module = lambda module: None

    def create_module(self, spec):
        return self.module

    def load_module(self, fullname):  # the legacy protocol only
        return self.module


def test_the_wrapped_loader_creates_the_module_the_real_loader_creates():
    module = type(sys)("tensorrt_llm")
    wrapper = _bootstrap._PostImportLoader(_Loader(module), finder=None)
    assert wrapper.create_module(spec=None) is module


def test_a_loader_without_exec_module_is_left_unwrapped(monkeypatch):
    """Wrapping a legacy (load_module-only) loader would make the import call an exec_module it lacks."""
    import importlib.machinery

    legacy = _Loader(exec_module=False)

    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            return importlib.machinery.ModuleSpec(fullname, legacy) if fullname == "tensorrt_llm" else None

    hook = _bootstrap.HostImportHook()
    monkeypatch.setattr(sys, "meta_path", [hook, Finder()])
    assert hook.find_spec("tensorrt_llm").loader is legacy


def test_a_meta_path_entry_without_find_spec_is_skipped_as_the_import_system_skips_it(
        fake_host, hermetic_manager, fake_install, monkeypatch):
    """Python's import system passes over a `sys.meta_path` entry that has no `find_spec` (a legacy
    finder); the hook, which searches the finders after it itself, must too, not fail the host import."""
    fake_host("1.3.0rc24")
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")

    class Legacy:  # only the pre-3.4 protocol
        def find_module(self, fullname, path=None):
            return None

    monkeypatch.setattr(sys, "meta_path", [Legacy(), *sys.meta_path])
    _bootstrap.main()  # the hook goes first, the legacy entry is among the finders it searches
    import tensorrt_llm  # noqa: F401

    assert fake_install == [1] and installed_hook() is None


def _namespace_host(tmp_path, monkeypatch) -> Path:
    """A `tensorrt_llm` directory without __init__.py first on sys.path: Python imports it as a namespace package."""
    import importlib

    root = tmp_path / "namespace-root"
    (root / "tensorrt_llm").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return root / "tensorrt_llm"


def test_a_namespace_package_host_loads_as_python_loads_it_and_activation_runs(
        tmp_path, hermetic_manager, fake_install, monkeypatch):
    """A namespace `tensorrt_llm` has no loader when found (the import system adds one later): the hook
    returned it unwrapped, stayed installed, and the activation never ran, silently."""
    directory = _namespace_host(tmp_path, monkeypatch)
    import tensorrt_llm

    plain = (type(tensorrt_llm.__loader__), tensorrt_llm.__file__, list(tensorrt_llm.__path__))
    assert plain[2] == [str(directory)]
    del sys.modules["tensorrt_llm"]
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    _bootstrap.main()
    import tensorrt_llm

    assert installed_hook() is None  # it fired
    assert (type(tensorrt_llm.__loader__), tensorrt_llm.__file__, list(tensorrt_llm.__path__)) == plain
    assert tensorrt_llm.__spec__.loader is tensorrt_llm.__loader__
    from m3_eagle_plugin.activation import status

    report = status()
    assert fake_install == [] and not report.activated and not report.ok
    assert "namespace package" in report.reason and str(directory) in report.reason


def test_a_namespace_package_host_is_refused_under_require(tmp_path, hermetic_manager, fake_install, monkeypatch):
    """require: the host import fails naming the cause, not load an unpatched host."""
    directory = _namespace_host(tmp_path, monkeypatch)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    _bootstrap.main()
    from m3_eagle_plugin.activation import ActivationError

    with pytest.raises(ActivationError, match=f"namespace package.*{directory}"):
        import tensorrt_llm  # noqa: F401
    assert fake_install == []


def test_status_names_a_namespace_package_host_before_it_is_imported(tmp_path, hermetic_manager, monkeypatch):
    directory = _namespace_host(tmp_path, monkeypatch)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    from m3_eagle_plugin.activation import status

    report = status()
    assert "tensorrt_llm" not in sys.modules
    assert not report.ok and f"no __init__.py in {directory}" in report.reason
