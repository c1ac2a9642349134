"""MSA backend routing: only the host's MSA resolution is replaced; its availability gate stays."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.contract import import_first, symbol


def _resolve(implementation):
    dispatch = import_first(symbol("m3_backend_resolver").modules)
    return dispatch._resolve_minimax_m3_backend_cls(
        SimpleNamespace(algorithm="minimax_m3", implementation=implementation))


def test_msa_resolution_returns_the_plugin_subclass(host):
    host_msa, host_triton = _resolve("msa"), _resolve("triton")
    adapter.install()
    plugin = _resolve("msa")
    assert plugin is not host_msa and issubclass(plugin, host_msa)
    assert plugin.Metadata.__mro__[1] is host_msa.Metadata
    assert _resolve("triton") is host_triton


def test_msa_unavailability_still_raises(current_host):
    adapter.install()
    availability = import_first([m.rsplit(".", 1)[0] + ".minimax_m3.msa_availability"
                                 for m in symbol("m3_backend_resolver").modules])
    availability.AVAILABLE = False
    with pytest.raises(RuntimeError, match="SM100"):
        _resolve("msa")


def test_a_non_msa_resolution_warns_once_that_the_plugin_serves_none_of_it(host, capsys, monkeypatch):
    """A config without `implementation: msa` (the host's default is triton) gets the host's backend
    untouched; the plugin is active yet serves none of that model's attention, which one line says
    (the resolver runs once per attention layer: not once a layer)."""
    from m3_eagle_plugin.host.trtllm.patches import route_msa_backend

    monkeypatch.setattr(route_msa_backend, "_warned", set())
    adapter.install()
    capsys.readouterr()
    for _ in range(3):
        _resolve("triton")
    err = capsys.readouterr().err
    assert err.count("the plugin serves implementation 'msa' only") == 1 and "'triton'" in err
    _resolve("msa")
    assert "msa' only" not in capsys.readouterr().err


@pytest.fixture
def metadata_plugin(current_host, monkeypatch):
    """Registers a plugin whose m3_eagle_attention_metadata answers `plugin.reference` (a name in the
    module `m3_eagle_test_msa_metadata`, whose classes the test sets) for tensorrt_llm only."""
    import sys
    import types

    from m3_eagle_plugin.hooks import hookimpl
    from m3_eagle_plugin.registry import get_plugin_manager

    module = types.ModuleType("m3_eagle_test_msa_metadata")
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Plugin:
        reference = None

        @hookimpl
        def m3_eagle_attention_metadata(self, host):
            return self.reference if host == "tensorrt_llm" else None

    plugin = Plugin()
    plugin.module = module
    pm = get_plugin_manager()
    pm.register(plugin, name="test-msa-metadata")
    yield plugin
    pm.unregister(name="test-msa-metadata")


def test_a_plugin_can_pick_the_msa_metadata(metadata_plugin):
    """The registry's m3_eagle_attention_metadata answer is what the host builds its metadata from
    (`Metadata` of the backend it resolved), as status and doctor report it; every layer resolves
    the same backend class."""
    from m3_eagle_plugin.host.trtllm.msa_backend import M3EagleMsaMetadata, M3EagleMsaSparseAttention

    class MyMsaMetadata(M3EagleMsaMetadata):
        pass

    metadata_plugin.module.MyMsaMetadata = MyMsaMetadata
    metadata_plugin.reference = "m3_eagle_test_msa_metadata:MyMsaMetadata"
    adapter.install()
    backend = _resolve("msa")
    assert backend.Metadata is MyMsaMetadata
    assert issubclass(backend, M3EagleMsaSparseAttention)
    assert _resolve("msa") is backend
    metadata_plugin.reference = None  # no answer but the built-in one
    assert _resolve("msa") is M3EagleMsaSparseAttention


def test_a_plugin_metadata_that_is_not_the_hosts_is_refused(metadata_plugin):
    metadata_plugin.module.Unrelated = type("Unrelated", (), {})
    metadata_plugin.reference = "m3_eagle_test_msa_metadata:Unrelated"
    adapter.install()
    with pytest.raises(TypeError, match=r"'m3_eagle_test_msa_metadata:Unrelated'.*not a subclass of the host's "
                                        r".*MiniMaxM3MsaSparseAttentionMetadata"):
        _resolve("msa")
