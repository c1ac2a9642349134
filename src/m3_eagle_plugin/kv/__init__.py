"""KV cache layer: pool geometry, shared draft layout, virtual attention-op pools, paged manager.

Host-agnostic and pure torch: the reference host uses :class:`PagedKVCache` directly, the
TensorRT-LLM adapter reuses the table functions on the host's own pools.
"""
from m3_eagle_plugin.kv.allocator import BlockAllocator, OutOfBlocksError, UnknownRequestError
from m3_eagle_plugin.kv.draft_layout import (
    derive_shared_draft_layout,
    num_spec_layers,
    shared_draft_layer_count,
)
from m3_eagle_plugin.kv.geometry import (
    BufferSpec,
    DraftLayerPlacementError,
    PoolGeometry,
    PoolSpec,
    SubPage,
    UnknownBufferError,
    build_pool_geometry,
    minimax_m3_buffers,
    minimax_m3_geometry,
)
from m3_eagle_plugin.kv.manager import PagedKVCache
from m3_eagle_plugin.kv.transfer import (
    GeometryMismatchError,
    KVTransferPayload,
    cache_fingerprint,
    export_request,
    import_request,
)
from m3_eagle_plugin.kv.virtual_pools import (
    VirtualPools,
    copy_block_offsets,
    copy_pool_block_offsets,
    extend_attention_op_pools,
)

__all__ = [
    "BlockAllocator", "BufferSpec", "DraftLayerPlacementError", "GeometryMismatchError",
    "KVTransferPayload", "OutOfBlocksError", "PagedKVCache", "PoolGeometry", "PoolSpec",
    "SubPage", "UnknownBufferError", "UnknownRequestError", "VirtualPools",
    "build_pool_geometry", "cache_fingerprint", "copy_block_offsets", "copy_pool_block_offsets",
    "derive_shared_draft_layout", "export_request", "extend_attention_op_pools",
    "import_request", "minimax_m3_buffers", "minimax_m3_geometry", "num_spec_layers",
    "shared_draft_layer_count",
]
