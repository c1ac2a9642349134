"""Double of the sparse dispatch: hard-coded if/elif with function-local imports."""
from typing import Type


class RocketKVCacheManager:
    pass


class RocketTrtllmAttention:
    pass


def get_sparse_attn_kv_cache_manager(sparse_attention_config, use_kv_cache_manager_v2: bool = False) -> type:
    from .minimax_m3 import MiniMaxM3KVCacheManagerV2

    if sparse_attention_config.algorithm == "rocket":
        return RocketKVCacheManager
    elif sparse_attention_config.algorithm == "minimax_m3":
        return MiniMaxM3KVCacheManagerV2
    raise ValueError(f"Unsupported sparse attention algorithm: {sparse_attention_config.algorithm}")


def _resolve_minimax_m3_backend_cls(sparse_params) -> Type:
    from .minimax_m3 import MiniMaxM3SparseRuntimeBackend

    if getattr(sparse_params, "implementation", "triton") == "msa":
        from .minimax_m3 import MiniMaxM3MsaSparseAttention
        from .minimax_m3.msa_availability import ensure_msa_available

        ensure_msa_available()
        return MiniMaxM3MsaSparseAttention
    return MiniMaxM3SparseRuntimeBackend


def get_trtllm_sparse_attn_attention_backend(sparse_params) -> Type:
    if sparse_params.algorithm == "rocket":
        return RocketTrtllmAttention
    elif sparse_params.algorithm == "minimax_m3":
        return _resolve_minimax_m3_backend_cls(sparse_params)
    raise ValueError(f"Unsupported sparse attention algorithm: {sparse_params.algorithm}")
