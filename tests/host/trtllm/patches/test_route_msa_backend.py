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
