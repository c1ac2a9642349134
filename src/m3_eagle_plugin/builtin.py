"""The built-in implementation of the hooks: this package's own components, registered as one plugin.

Hosts find the model, cache manager, MSA metadata and TensorRT-LLM patches through these hook
implementations exactly as they would find a third party's. Everything is named lazily
("module:qualname"); the TensorRT-LLM patch list is imported only when asked for.
"""
from __future__ import annotations

from typing import Any

from m3_eagle_plugin.hooks import hookimpl

REFERENCE_HOST = "reference"
TRTLLM_HOST = "tensorrt_llm"
TEXT_ARCHITECTURE, VL_ARCHITECTURE = ARCHITECTURES = ("MiniMaxM3SparseForCausalLM",
                                                       "MiniMaxM3SparseForConditionalGeneration")

_REFERENCE_COMPONENTS = {
    "model": "m3_eagle_plugin.models:MiniMaxM3ForCausalLM",
    "kv_cache_manager": "m3_eagle_plugin.kv:PagedKVCache",
    "attention_metadata": "m3_eagle_plugin.msa:MsaDecodeMetadata",
}


def _trtllm_components() -> dict[str, str]:
    """What the TensorRT-LLM adapter declares in `m3_eagle_plugin.host.trtllm.COMPONENTS` (if anything).

    Keys: "model", "vl_model" (the VL architecture's, else "model"), "kv_cache_manager",
    "attention_metadata" -> "module:qualname". The adapter package must stay importable without
    tensorrt_llm for this lookup; a missing adapter yields {}.
    """
    try:
        from m3_eagle_plugin.host import trtllm
    except ImportError:
        return {}
    components = getattr(trtllm, "COMPONENTS", None)
    return dict(components) if isinstance(components, dict) else {}


def _components(host: str) -> dict[str, str]:
    if host == REFERENCE_HOST:
        return _REFERENCE_COMPONENTS
    if host == TRTLLM_HOST:
        return _trtllm_components()
    return {}


def _is_minimax_m3(sparse_config: Any) -> bool:
    if sparse_config is None:
        return False
    algorithm = sparse_config.get("algorithm") if isinstance(sparse_config, dict) else getattr(
        sparse_config, "algorithm", None)
    return str(algorithm).lower() == "minimax_m3"


@hookimpl
def m3_eagle_model_classes(host: str) -> dict[str, str]:
    components = _components(host)
    model = components.get("model")
    return {TEXT_ARCHITECTURE: model, VL_ARCHITECTURE: components.get("vl_model", model)} if model else {}


@hookimpl(trylast=True)
def m3_eagle_kv_cache_manager(host: str, sparse_config: Any) -> str | None:
    if not _is_minimax_m3(sparse_config):
        return None
    return _components(host).get("kv_cache_manager")


@hookimpl(trylast=True)
def m3_eagle_attention_metadata(host: str) -> str | None:
    return _components(host).get("attention_metadata")


@hookimpl
def m3_eagle_host_patches(host: str) -> list[Any]:
    if host != TRTLLM_HOST:
        return []
    from m3_eagle_plugin.host.trtllm.patches import builtin_patches

    return list(builtin_patches())
