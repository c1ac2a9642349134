"""forward-env-to-mpi-pool: the driver's M3_EAGLE_* settings reach TensorRT-LLM's MPI pool workers."""
from __future__ import annotations

import importlib

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.patches.forward_env_to_mpi_pool import forwarding_executor


def _session_env(n_workers=2):
    mpi_session = importlib.import_module("tensorrt_llm.llmapi.mpi_session")
    pool = mpi_session.MpiPoolSession(n_workers).mpi_pool
    return pool, pool.worker_environ({"PATH": "/bin"})


def test_workers_receive_the_plugin_settings_the_driver_set_after_mpi_started(current_host, monkeypatch):
    # what the config key exports in the driver once the host (and MPI) is already up
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "require")
    monkeypatch.setenv("M3_EAGLE_PLUGIN_FORCE", "1")
    monkeypatch.setenv("TRTLLM_SOMETHING", "7")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    _, before = _session_env()
    assert "M3_EAGLE_PLUGIN" not in before  # the defect: the workers would run without the plugin
    mpi_session = importlib.import_module("tensorrt_llm.llmapi.mpi_session")
    original = mpi_session.MPIPoolExecutor
    adapter.install()
    pool, worker = _session_env()
    assert worker == {"PATH": "/bin", "TRTLLM_SOMETHING": "7", "M3_EAGLE_PLUGIN": "require",
                      "M3_EAGLE_PLUGIN_FORCE": "1"}
    assert isinstance(pool, original) and pool.max_workers == 2
    assert "forward_env_to_mpi_pool" in adapter.report()["steps"]
    adapter.uninstall()
    assert mpi_session.MPIPoolExecutor is original
    assert "M3_EAGLE_PLUGIN" not in _session_env()[1]


def test_a_single_device_build_binds_no_executor_and_installs_all_the_same(current_host, monkeypatch):
    mpi_session = importlib.import_module("tensorrt_llm.llmapi.mpi_session")
    monkeypatch.delattr(mpi_session, "MPIPoolExecutor")
    adapter.install()
    assert adapter.report()["installed"] and not hasattr(mpi_session, "MPIPoolExecutor")
    adapter.uninstall()


def test_the_hosts_own_env_wins_and_a_host_passing_none_gets_ours(monkeypatch):
    class Recorder:
        def __init__(self, max_workers=None, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setenv("M3_EAGLE_PLUGIN", "auto")
    executor = forwarding_executor(Recorder)
    assert executor(2, env={"M3_EAGLE_PLUGIN": "off", "TLLM_X": "1"}).kwargs["env"] == {
        "M3_EAGLE_PLUGIN": "off", "TLLM_X": "1"}
    assert executor(2, path=["p"]).kwargs == {"path": ["p"], "env": {"M3_EAGLE_PLUGIN": "auto"}}
    monkeypatch.delenv("M3_EAGLE_PLUGIN")
    assert executor(2).kwargs == {}  # nothing to forward: the call is the host's, unchanged


def test_only_the_plugins_own_variables_are_forwarded():
    """`M3_EAGLE_*` exactly: a name that merely starts with the same letters is not the plugin's."""
    from m3_eagle_plugin.host.trtllm.patches.forward_env_to_mpi_pool import plugin_environ

    environ = {"M3_EAGLE_PLUGIN": "on", "M3_EAGLE_X": "1", "M3_EAGLEX": "2", "M3_EAGLE": "3",
               "XM3_EAGLE_Y": "4", "m3_eagle_plugin": "5"}
    assert plugin_environ(environ) == {"M3_EAGLE_PLUGIN": "on", "M3_EAGLE_X": "1"}


def test_undo_leaves_an_executor_bound_since_in_place(current_host):
    """As the patch engine's revert (a name re-bound by someone else is left as is): a class bound
    at `MPIPoolExecutor` after the step ran is not replaced by the host's original on undo."""
    from m3_eagle_plugin.host.trtllm.patches.forward_env_to_mpi_pool import forward_env_to_mpi_pool

    mpi_session = importlib.import_module("tensorrt_llm.llmapi.mpi_session")
    original = mpi_session.MPIPoolExecutor
    undo = forward_env_to_mpi_pool()
    assert mpi_session.MPIPoolExecutor is not original
    theirs = type("TheirExecutor", (original,), {})
    mpi_session.MPIPoolExecutor = theirs
    try:
        undo()
        assert mpi_session.MPIPoolExecutor is theirs
    finally:
        mpi_session.MPIPoolExecutor = original
