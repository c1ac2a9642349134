from .interface import AttentionMetadata
from .sparse import get_sparse_attn_kv_cache_manager
from .trtllm import TrtllmAttention, TrtllmAttentionMetadata

__all__ = ["AttentionMetadata", "TrtllmAttention", "TrtllmAttentionMetadata",
           "get_sparse_attn_kv_cache_manager"]
