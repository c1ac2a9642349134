"""Patch `route-msa-backend`: MiniMax-M3 on MSA gets the plugin's attention backend and metadata.

Why: the host's MSA metadata (before NVIDIA/TensorRT-LLM#18872) assumes one query token per
generation row: no per-token slots / valid-block counts for 1 + draft_len verify rows, proxy
scratch sized by batch, and no device-side `on_update_kv_lens` re-derivation.
How: wrap `_resolve_minimax_m3_backend_cls` (the only resolver of the M3 backend; the vanilla,
trtllm and flashinfer pickers call it through the module global). When the host resolves its
`MiniMaxM3MsaSparseAttention` (implementation "msa", availability already checked by the host),
return the plugin subclass whose `Metadata` is the metadata class the plugin registry picks
(`m3_eagle_attention_metadata`; the built-in `M3EagleMsaMetadata` unless another plugin answers,
as the KV-manager route asks the registry for the manager). Any other result
(the Triton reference, other algorithms never reach here) is returned untouched, with one warning
a process: the plugin is active but serves none of that model's attention (a config without
`sparse_attention_config.implementation: msa` gets the host's default, triton).
Upstream: NVIDIA/TensorRT-LLM#18872.
Remove when: the supported host range starts at tensorrt_llm 1.4.0rc1.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from m3_eagle_plugin.host.trtllm.contract import ROUTE_MSA, resolve, symbol
from m3_eagle_plugin.host.trtllm.patching import Patch


#: Implementations already warned about in this process (the host resolves once per attention layer).
_warned: set[str] = set()


def _route_msa_backend(original: Callable[..., type]) -> Callable[..., type]:
    @functools.wraps(original)
    def _resolve_minimax_m3_backend_cls(sparse_params: Any, *args: Any, **kwargs: Any) -> type:
        backend = original(sparse_params, *args, **kwargs)
        if backend is not resolve("msa_attention"):
            implementation = str(getattr(sparse_params, "implementation", None))
            if implementation not in _warned:
                _warned.add(implementation)
                from m3_eagle_plugin.log import get_logger

                get_logger().warning(
                    f"MiniMax-M3 resolved the host's {getattr(backend, '__name__', backend)} (sparse_attention_config "
                    f"implementation {implementation!r}): the plugin serves implementation 'msa' only, so its "
                    "multi-token verify is not used for this model")
            return backend
        return plugin_msa_backend()

    return _resolve_minimax_m3_backend_cls


#: The backend class served for each plugin-picked metadata class (one class per metadata, so every
#: attention layer resolves the same backend).
_backends: dict[type, type] = {}


def plugin_msa_backend() -> type:
    """The plugin's MSA backend, whose `Metadata` is the class the plugin registry picks.

    A plugin's class must derive from the host's MSA metadata, which the host's MSA backend reads
    (as the built-in one does); anything else is refused naming it. A plugin's hook that fails fails
    the lookup, as for the KV manager."""
    from m3_eagle_plugin.host.trtllm import COMPONENTS
    from m3_eagle_plugin.host.trtllm.msa_backend import HostMsaMetadata, M3EagleMsaSparseAttention
    from m3_eagle_plugin.registry import get_plugin_manager, resolve

    reference = get_plugin_manager().attention_metadata("tensorrt_llm")
    if not reference or reference == COMPONENTS["attention_metadata"]:
        return M3EagleMsaSparseAttention
    metadata = resolve(reference)
    if not (isinstance(metadata, type) and issubclass(metadata, HostMsaMetadata)):
        raise TypeError(
            f"m3_eagle_attention_metadata picked {reference!r} for tensorrt_llm, which is not a subclass of "
            f"the host's {HostMsaMetadata.__module__}.{HostMsaMetadata.__qualname__}")
    backend = _backends.get(metadata)
    if backend is None:
        backend = _backends[metadata] = type(M3EagleMsaSparseAttention.__name__, (M3EagleMsaSparseAttention,),
                                             {"Metadata": metadata, "__module__": __name__})
    return backend


PATCHES = [Patch(ROUTE_MSA, symbol("m3_backend_resolver"), _route_msa_backend)]
