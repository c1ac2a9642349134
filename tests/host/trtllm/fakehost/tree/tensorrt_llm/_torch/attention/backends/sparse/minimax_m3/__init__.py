from .cache_manager import MiniMaxM3KVCacheManagerV2
from .msa_backend import MiniMaxM3MsaSparseAttention
from .triton_backend import MiniMaxM3SparseRuntimeBackend

__all__ = ["MiniMaxM3KVCacheManagerV2", "MiniMaxM3MsaSparseAttention", "MiniMaxM3SparseRuntimeBackend"]
