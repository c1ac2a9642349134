"""Per-rank geometry of tensor-parallel MiniMax-M3: heads, widths and the cache pools they give.

Production runs the target TP4: the 64 query heads, the 4 KV heads and the 4 index heads are
split evenly over the ranks (16 / 1 / 1 per rank), the single shared index-K head is replicated,
and the MLP / MoE intermediate widths are split. A rank's KV page then holds ``Hkv / tp`` heads,
which, with the element sizes, decides whether its K/V pages and its index-K pages have one byte
size and coalesce into the one-pool "mega-slot" (TP4 with one element size: ``1 x 128 x 128`` =
``128 x 128``) or stay in separate pools (TP1: K/V pages are four times bigger; TP4 with fp8 K/V
beside a bf16 index-K: half the size). Everything here is arithmetic; no process group is needed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.kv.geometry import PoolGeometry, minimax_m3_geometry
from m3_eagle_plugin.models.config import M3Config

__all__ = [
    "ShardingError", "RankShape", "shard_heads", "shard_width", "rank_config", "rank_pool_geometry",
    "index_k_coalesced",
]


class ShardingError(ValueError):
    """A head count or width does not split evenly over the tensor-parallel ranks."""


@dataclass(frozen=True)
class RankShape:
    """What one tensor-parallel rank holds of the attention: heads per rank, and which slice."""

    tp_size: int
    q_heads: int
    kv_heads: int
    index_heads: int

    def q_head_range(self, rank: int) -> range:
        return _slice(rank, self.tp_size, self.q_heads)

    def kv_head_range(self, rank: int) -> range:
        return _slice(rank, self.tp_size, self.kv_heads)

    def index_head_range(self, rank: int) -> range:
        return _slice(rank, self.tp_size, self.index_heads)


def _slice(rank: int, tp_size: int, per_rank: int) -> range:
    rank = as_int("rank", rank)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside [0, {tp_size})")
    return range(rank * per_rank, (rank + 1) * per_rank)


def _check_tp(tp_size: int) -> int:
    tp_size = as_int("tp_size", tp_size)
    if tp_size < 1:
        raise ShardingError(f"tp_size must be >= 1, got {tp_size}")
    return tp_size


def shard_width(name: str, total: int, tp_size: int) -> int:
    """``total / tp_size``, or ShardingError naming ``name`` when it does not divide."""
    tp_size, total = _check_tp(tp_size), as_int(name, total)
    if total < 0:
        raise ShardingError(f"{name} must be >= 0, got {total}")
    if total % tp_size:
        raise ShardingError(f"{name} = {total} does not split over {tp_size} tensor-parallel ranks")
    return total // tp_size


def shard_heads(num_heads: int, num_kv_heads: int, index_heads: int, tp_size: int) -> RankShape:
    """Heads per rank. KV heads are never replicated here, so ``tp_size`` must divide them; the
    index heads follow the KV heads (index head ``i`` selects blocks for KV head ``i``)."""
    tp_size = _check_tp(tp_size)
    num_heads, num_kv_heads, index_heads = (as_int(name, value) for name, value in (
        ("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("index_heads", index_heads)))
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ShardingError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    if index_heads and index_heads != num_kv_heads:
        raise ShardingError(f"{index_heads} index heads must equal the {num_kv_heads} KV heads")
    kv = shard_width("num_key_value_heads", num_kv_heads, tp_size)
    return RankShape(
        tp_size=tp_size,
        q_heads=shard_width("num_attention_heads", num_heads, tp_size),
        kv_heads=kv,
        index_heads=shard_width("index heads", index_heads, tp_size) if index_heads else 0,
    )


def rank_config(config: M3Config, tp_size: int) -> M3Config:
    """The config one rank's shard is built from: heads and intermediate widths divided by TP."""
    if not isinstance(config, M3Config):
        raise TypeError(f"config must be an M3Config, got {type(config).__name__}")
    shape = shard_heads(config.num_heads, config.num_kv_heads,
                        config.index_heads if any(config.sparse_layers) else 0, tp_size)
    widths = {}
    if not all(config.moe_layers):
        widths["dense_intermediate_size"] = shard_width("dense_intermediate_size",
                                                        config.dense_intermediate_size, tp_size)
    if any(config.moe_layers):
        widths["moe_intermediate_size"] = shard_width("moe_intermediate_size", config.moe_intermediate_size, tp_size)
        widths["shared_intermediate_size"] = shard_width("shared_intermediate_size",
                                                         config.shared_intermediate_size, tp_size)
    return dataclasses.replace(
        config, num_heads=shape.q_heads, num_kv_heads=shape.kv_heads,
        index_heads=shape.index_heads if any(config.sparse_layers) else config.index_heads,
        source=f"{config.source} [tp{tp_size} rank shard]", **widths,
    )


def rank_pool_geometry(
    config: M3Config,
    tp_size: int,
    *,
    num_draft_layers: int = 0,
    draft_num_kv_heads: int | None = None,
    bytes_per_elem: int = 2,
    index_bytes_per_elem: int | None = None,
) -> PoolGeometry:
    """The cache pools of one rank (every rank has the same geometry).

    ``draft_num_kv_heads`` is the draft head's total KV head count; it is split like the target's.
    ``bytes_per_elem`` is the K/V element size, ``index_bytes_per_elem`` the index-K's (default: the
    same; production pairs fp8 K/V, 1 byte, with a bf16 index-K, 2).
    """
    shape = shard_heads(config.num_heads, config.num_kv_heads,
                        config.index_heads if any(config.sparse_layers) else 0, tp_size)
    draft_heads = None
    if draft_num_kv_heads is not None:
        draft_heads = shard_width("draft num_key_value_heads", draft_num_kv_heads, tp_size)
    return minimax_m3_geometry(
        config.num_layers, config.sparse_layer_ids, shape.kv_heads, config.head_dim,
        config.index_dim or config.head_dim, config.block_size,
        num_draft_layers=num_draft_layers, draft_num_kv_heads=draft_heads,
        kv_bytes_per_elem=bytes_per_elem,
        index_bytes_per_elem=bytes_per_elem if index_bytes_per_elem is None else index_bytes_per_elem,
    )


def index_k_coalesced(geometry: PoolGeometry) -> bool:
    """True when every index-K page shares its slot with the K/V pages (the mega-slot)."""
    kv_pools = {sp.pool_id for (_, role), sp in geometry.placements.items() if role in ("k", "v")}
    index_pools = {sp.pool_id for (_, role), sp in geometry.placements.items() if role == "index_k"}
    return bool(index_pools) and index_pools <= kv_pools
