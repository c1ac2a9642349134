"""Multi-GPU pieces: tensor-parallel sharding of the MiniMax-M3 target and its cache geometry,
and moving a request's KV between ranks for disaggregated serving.

`sharding` is pure arithmetic; `tp_model` cuts a loaded target into a rank's shard with an
all-reduce after attention and after the MLP / MoE; `transfer` sends a `kv.transfer` payload
over torch.distributed (`process_group` starts a local group); `disagg` hands a prefilled request
from one reference-host engine to another (it sits at host level, so it is not imported here).
Everything is device-agnostic: gloo on CPU processes, NCCL on GPUs (NVLS off by default).
"""
from m3_eagle_plugin.parallel.sharding import (
    RankShape,
    ShardingError,
    index_k_coalesced,
    rank_config,
    rank_pool_geometry,
    shard_heads,
    shard_width,
)

__all__ = ["RankShape", "ShardingError", "index_k_coalesced", "rank_config", "rank_pool_geometry",
           "shard_heads", "shard_width"]
