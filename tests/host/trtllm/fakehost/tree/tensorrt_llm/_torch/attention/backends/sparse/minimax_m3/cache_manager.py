"""Double of the pre-#18872 M3 manager: index-K coalesced into the K/V mega-slot, no draft pools."""
import torch

from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_manager_v2 import KVCacheManagerV2, Role


class MiniMaxM3KVCacheManagerV2(KVCacheManagerV2):
    def __init__(self, *args, sparse_layer_ids=None, disable_index_value_layer_ids=None,
                 sparse_index_dim=None, **kwargs):
        num_layers = kwargs["num_layers"]
        self.sparse_layer_ids = list(range(3, num_layers)) if sparse_layer_ids is None else list(sparse_layer_ids)
        super().__init__(*args, **kwargs)

    def _sub_pages(self, layer: int) -> int:
        return 3 if layer in self.sparse_layer_ids else 2  # K, V (+ index-K on sparse layers)

    def get_block_ids_per_seq(self, request_ids):
        """Raw slot ids, zero-padded to max_blocks_per_seq (int32)."""
        table = torch.zeros((len(request_ids), self.max_blocks_per_seq), dtype=torch.int32)
        for i, rid in enumerate(request_ids):
            slots = self._slots[rid]
            table[i, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        return table
