"""Double of pyexecutor/_util.py: binds both dispatch names at import time."""
from ..attention.backends import get_sparse_attn_kv_cache_manager
from ..speculative import should_use_separate_draft_kv_cache
from .resource_manager import KVCacheManager


def get_kv_cache_manager_cls(model_config, kv_cache_config=None, is_disagg: bool = False,
                             cache_transceiver_config=None):
    sparse = getattr(model_config, "sparse_attention_config", None)
    if sparse is not None:
        return get_sparse_attn_kv_cache_manager(sparse)
    return KVCacheManager


class KvCacheCreator:
    def __init__(self, *, model_engine=None, draft_model_engine=None, mapping=None,
                 speculative_config=None, sparse_attention_config=None, **kwargs):
        self._mapping = mapping
        self._speculative_config = speculative_config
        self._sparse_attention_config = sparse_attention_config

    def _should_create_separate_draft_kv_cache(self) -> bool:
        if getattr(self._mapping, "enable_attention_dp", False):
            return False
        return should_use_separate_draft_kv_cache(self._speculative_config)
