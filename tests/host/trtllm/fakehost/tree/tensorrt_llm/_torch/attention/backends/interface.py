from dataclasses import dataclass
from typing import Any, List, Optional

import torch


@dataclass
class KVCacheParams:
    use_cache: bool = True
    num_cached_tokens_per_seq: Optional[List[int]] = None
    num_extra_kv_tokens: int = 0


@dataclass(kw_only=True)
class AttentionMetadata:
    max_num_requests: int
    max_num_tokens: int
    kv_cache_manager: Any = None
    max_num_sequences: Optional[int] = None
    request_ids: Optional[List[int]] = None
    seq_lens: Optional[torch.Tensor] = None
    num_contexts: int = 0
    kv_cache_params: Optional[KVCacheParams] = None
    sparse_metadata_params: Any = None
    is_cuda_graph: bool = False

    def __post_init__(self) -> None:
        if self.max_num_sequences is None:
            self.max_num_sequences = self.max_num_requests

    @property
    def tokens_per_block(self) -> Optional[int]:
        """As in the host: the KV manager's page size, None without a manager."""
        return None if self.kv_cache_manager is None else self.kv_cache_manager.tokens_per_block

    @property
    def num_seqs(self) -> int:
        return 0 if self.seq_lens is None else int(self.seq_lens.shape[0])

    def prepare(self):
        pass

    def on_update_kv_lens(self):
        pass

    def update_for_spec_dec(self) -> None:
        pass
