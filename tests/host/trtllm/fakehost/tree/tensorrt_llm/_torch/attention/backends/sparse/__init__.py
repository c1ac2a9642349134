from .registry import get_sparse_attn_kv_cache_manager

__all__ = ["get_sparse_attn_kv_cache_manager"]
