"""MSA (MiniMax Sparse Attention) core: block selection, paged sparse/dense attention, cache
writers and the multi-token step metadata, as pure-torch references that run on CPU and CUDA.

Triton kernels in ``m3_eagle_plugin.msa.kernels`` mirror these functions; the model, the Eagle3
draft head and both hosts build on them.
"""

from .attention import dense_attention, sparse_attention
from .blocks import MsaInputError, per_token_valid_blocks, valid_blocks_from_positions, validate_block_size
from .cache_write import write_index_k, write_kv
from .metadata import MsaDecodeMetadata
from .selection import select_blocks, select_blocks_paged, select_from_block_scores

__all__ = [
    "MsaDecodeMetadata",
    "MsaInputError",
    "dense_attention",
    "per_token_valid_blocks",
    "select_blocks",
    "select_blocks_paged",
    "select_from_block_scores",
    "sparse_attention",
    "valid_blocks_from_positions",
    "validate_block_size",
    "write_index_k",
    "write_kv",
]
