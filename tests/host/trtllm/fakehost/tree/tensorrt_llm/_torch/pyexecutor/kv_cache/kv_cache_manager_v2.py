"""Double of KVCacheManagerV2: one pool whose slot holds every layer's pages (the mega-slot),
attention-op tables `kv_cache_pool_pointers` / `kv_cache_pool_mapping`, a host block-offset table
holding slot ids, and the native block-offset copy."""
import enum
from typing import List, Optional

import torch

from tensorrt_llm.bindings.internal.batch_manager.kv_cache_manager_v2_utils import (
    copy_batch_block_offsets_to_device,
)

from tensorrt_llm._torch.speculative.utils import get_num_spec_layers

POOL_BASE_ADDRESS = 1 << 32
PAGE_BYTES = 4096


class Role(enum.Enum):
    KEY = "key"
    VALUE = "value"
    INDEX_KEY = "index_key"


class _PageIndexConverter:
    def __init__(self, scale: int, layer_offset: int):
        self.scale, self.layer_offset = scale, layer_offset


class PageIndexMode(enum.Enum):
    SHARED = "shared"
    PER_LAYER = "per_layer"


class _Storage:
    """Layer-major sub-page placement inside one slot."""

    def __init__(self, sub_pages_per_layer: List[int]):
        self.offsets = [sum(sub_pages_per_layer[:i]) for i in range(len(sub_pages_per_layer))]
        self.scale = sum(sub_pages_per_layer)

    def get_mem_pool_base_address(self, layer: int, role, index_mode=None) -> int:
        """As the host's V2 storage: SHARED (and None, its default) is the layer's own page in
        slot 0; PER_LAYER is the pool-group base, for indices that add the layer offset."""
        if index_mode is PageIndexMode.PER_LAYER:
            return POOL_BASE_ADDRESS
        assert index_mode in (None, PageIndexMode.SHARED)
        return POOL_BASE_ADDRESS + (self.offsets[layer] + (role == Role.VALUE)) * PAGE_BYTES

    def get_page_index_converter(self, layer: int, role) -> _PageIndexConverter:
        return _PageIndexConverter(self.scale, self.offsets[layer])


class _IndexMapper:
    def __init__(self):
        self.rows = {}

    def add_new_sequence(self, request_id: int) -> int:
        return self.rows.setdefault(request_id, len(self.rows))

    def get_copy_index(self, request_ids, num_contexts, beam_width) -> torch.Tensor:
        return torch.tensor([self.rows[r] for r in request_ids], dtype=torch.int32)


class _Stream:
    cuda_stream = 0


class KVCacheManagerV2:
    def __init__(self, kv_cache_config=None, kv_cache_type=None, *, num_layers: int, num_kv_heads,
                 head_dim: int = 128, tokens_per_block: int = 128, max_seq_len: int = 4096,
                 max_batch_size: int = 8, spec_config=None, layer_mask=None, is_draft: bool = False,
                 sparse_attention_config=None, **kwargs):
        if spec_config is not None and layer_mask is None:
            num_layers += get_num_spec_layers(spec_config)
        self.num_local_layers = num_layers
        self.layer_offsets = {layer: layer for layer in range(num_layers)}
        self.tokens_per_block = tokens_per_block
        self.max_blocks_per_seq = -(-max_seq_len // tokens_per_block)
        self.is_draft = is_draft
        self.num_pools = 1
        self.impl = _Storage([self._sub_pages(layer) for layer in range(num_layers)])
        self.index_scales = torch.tensor([self.impl.scale], dtype=torch.int32)
        self.kv_offset = torch.tensor([1], dtype=torch.int32)
        self.index_mapper = _IndexMapper()
        self._stream = _Stream()
        self.host_kv_cache_block_offsets = torch.full(
            (self.num_pools, max_batch_size, 2, self.max_blocks_per_seq), -1, dtype=torch.int32)
        self._slots = {}
        self.update_calls = []
        self._prepare_page_table_tensor(max_batch_size)

    def _sub_pages(self, layer: int) -> int:
        return 2

    def _prepare_page_table_tensor(self, index_mapper_capacity: int) -> None:
        self.num_attention_op_pools = self.num_pools
        self.kv_cache_pool_pointers = torch.tensor([[POOL_BASE_ADDRESS, 0]], dtype=torch.int64)
        self.kv_cache_pool_mapping = torch.tensor(
            [[0, self.impl.offsets[layer]] for layer in range(self.num_local_layers)], dtype=torch.int32)

    def add_sequence(self, request_id: int, slots: List[int]) -> None:
        """Test helper: give a request its slots (the real manager allocates on resize)."""
        row = self.index_mapper.add_new_sequence(request_id)
        self._slots[request_id] = list(slots)
        self.host_kv_cache_block_offsets[:, row, 0, : len(slots)] = torch.tensor(slots, dtype=torch.int32)

    def get_batch_cache_indices(self, request_ids: List[int]) -> List[List[int]]:
        """Page indices already multiplied by the page-index scale (as the real accessor)."""
        return [[slot * self.impl.scale for slot in self._slots[r]] for r in request_ids]

    def copy_batch_block_offsets(self, dst_tensor: torch.Tensor, request_ids: List[int],
                                 beam_width: int, num_contexts: int, num_seqs: int):
        copy_idx = self.index_mapper.get_copy_index(request_ids, num_contexts, beam_width)
        copy_batch_block_offsets_to_device(self.host_kv_cache_block_offsets, dst_tensor, copy_idx,
                                           self.index_scales, self.kv_offset, self._stream.cuda_stream)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None):
        self.update_calls.append(scheduled_batch)
