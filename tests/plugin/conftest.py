"""Fixtures for the plugin machinery: a fake `tensorrt_llm` on sys.path and hermetic global state."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from m3_eagle_plugin import activation, config_key, registry
from m3_eagle_plugin._bootstrap import remove_hook
from m3_eagle_plugin.hooks import hookimpl

from ._fake_host import write_fake_host

PLUGIN_ENV = ("M3_EAGLE_PLUGIN", "M3_EAGLE_PLUGIN_FORCE", "M3_EAGLE_PLUGIN_TRACE", "M3_EAGLE_PLUGIN_LOAD")


def _forget_host_modules() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


class RecordingPlugin:
    """A hermetic stand-in for the built-in plugin with known answers."""

    @hookimpl
    def m3_eagle_model_classes(self, host):
        return {"MiniMaxM3SparseForCausalLM": "fake.model:M3"}

    @hookimpl
    def m3_eagle_kv_cache_manager(self, host, sparse_config):
        return "fake.kv:Manager"

    @hookimpl
    def m3_eagle_attention_metadata(self, host):
        return "fake.msa:Metadata"

    @hookimpl
    def m3_eagle_host_patches(self, host):
        return [SimpleNamespace(id="fake-a"), SimpleNamespace(id="fake-b"), SimpleNamespace(id="fake-a")]


@pytest.fixture
def clean_state(monkeypatch):
    """Plugin env vars unset, no activation decision, no singleton manager, no hooks installed."""
    for name in PLUGIN_ENV:
        monkeypatch.setenv(name, "")  # records the original value, so activation's writes are undone
        monkeypatch.delenv(name)
    activation._reset_for_tests()
    registry.reset_plugin_manager()
    yield
    config_key.uninstall_host_hook()
    remove_hook()
    activation._reset_for_tests()
    registry.reset_plugin_manager()
    _forget_host_modules()


@pytest.fixture
def hermetic_manager(clean_state, monkeypatch):
    """The process-wide manager replaced by one holding only `RecordingPlugin` (no entry points)."""
    manager = registry.make_plugin_manager(register_builtin=False)
    manager.register(RecordingPlugin(), name="recording")
    monkeypatch.setattr(registry, "_singleton", manager)
    return manager


@pytest.fixture
def fake_install(monkeypatch):
    """Replace the adapter's install() (1) and uninstall() (-1) with a recorder (the real ones need a real
    TensorRT-LLM)."""
    import m3_eagle_plugin.host.trtllm as adapter

    calls = []

    def install():
        calls.append(1)
        return {"patches": ["fake-a", "fake-b"]}

    def uninstall():
        calls.append(-1)
        return {}

    monkeypatch.setattr(adapter, "install", install, raising=False)
    monkeypatch.setattr(adapter, "uninstall", uninstall, raising=False)
    return calls


@pytest.fixture
def fake_host(tmp_path, monkeypatch, clean_state):
    """Returns make(version) that puts a fake `tensorrt_llm` of that version first on sys.path."""

    def make(version: str = "1.3.0rc24") -> Path:
        root = write_fake_host(tmp_path / f"host-{version}", version)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        _forget_host_modules()
        return root

    return make
