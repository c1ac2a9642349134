"""Pool geometry: which (layer, role) page lives where inside a cache slot.

A paged KV cache keeps one *slot* per logical block of ``B`` tokens. Every per-layer buffer
(K, V, index-K) contributes one page to a slot. Buffers whose pages have the same size are
coalesced into one pool, so a single slot of that pool holds the pages of many layers side by
side (the MiniMax-M3 "mega-slot"): dense and draft layers add two sub-pages (K, V), sparse
layers three (K, V, index-K). Because the per-layer sub-page count differs, the offset of a
layer inside the slot is not a uniform stride, and every consumer must ask this table.

Within a pool the sub-pages are laid out in buffer-list order, and a layer's K and V pages are
always adjacent (V = K + 1), which is what the attention-op addressing ("kv offset 1") relies on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from m3_eagle_plugin._ints import as_int

ROLES: tuple[str, ...] = ("k", "v", "index_k")


class UnknownBufferError(KeyError, ValueError):
    """The geometry has no page for the requested (layer, role)."""


class DraftLayerPlacementError(ValueError):
    """A shared draft layer's K/V pages cannot live in the target's K/V pool."""


@dataclass(frozen=True)
class BufferSpec:
    """One paged per-layer buffer: its page (one block of tokens) is ``page_bytes`` long."""

    layer: int
    role: str
    page_bytes: int

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"buffer role must be one of {ROLES}, got {self.role!r}")
        if as_int("buffer layer", self.layer) < 0:
            raise ValueError(f"buffer layer id must be >= 0, got {self.layer}")
        if as_int("page_bytes", self.page_bytes) <= 0:
            raise ValueError(f"page size of layer {self.layer} role {self.role!r} must be > 0, "
                             f"got {self.page_bytes}")


@dataclass(frozen=True)
class PoolSpec:
    """A storage pool: each slot is ``sub_pages`` pages of ``page_bytes`` each."""

    pool_id: int
    page_bytes: int
    sub_pages: int

    @property
    def slot_bytes(self) -> int:
        return self.page_bytes * self.sub_pages


@dataclass(frozen=True)
class SubPage:
    """Where one (layer, role) page sits: pool and sub-page offset inside a slot."""

    pool_id: int
    offset: int


@dataclass(frozen=True)
class PoolGeometry:
    """The pools and the placement of every (layer, role) page inside a slot."""

    pools: tuple[PoolSpec, ...]
    placements: Mapping[tuple[int, str], SubPage]
    draft_layer_ids: tuple[int, ...] = ()

    def locate(self, layer: int, role: str) -> SubPage:
        try:
            return self.placements[(as_int("layer", layer), role)]
        except KeyError:
            raise UnknownBufferError(
                f"no {role!r} buffer for layer {layer} in this cache geometry") from None

    def has(self, layer: int, role: str) -> bool:
        return (as_int("layer", layer), role) in self.placements

    def pool(self, pool_id: int) -> PoolSpec:
        pool_id = as_int("pool_id", pool_id)
        if not 0 <= pool_id < len(self.pools):  # -1 silently named the last pool
            raise IndexError(f"pool {pool_id} is outside [0, {len(self.pools)})")
        return self.pools[pool_id]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.placements}))

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        drafts = set(self.draft_layer_ids)
        return tuple(layer for layer in self.layers if layer not in drafts)

    def fingerprint(self) -> str:
        """Canonical text that two caches with byte-compatible slots share."""
        return json.dumps(
            {
                "pools": [[p.page_bytes, p.sub_pages] for p in self.pools],
                "placements": sorted(
                    [layer, role, sp.pool_id, sp.offset]
                    for (layer, role), sp in self.placements.items()
                ),
                "draft_layers": list(self.draft_layer_ids),
            },
            sort_keys=True,
            separators=(",", ":"),
        )


def build_pool_geometry(
    buffers: Iterable[BufferSpec], *, draft_layer_ids: Sequence[int] = ()
) -> PoolGeometry:
    """Group ``buffers`` of equal page size into pools and place each (layer, role).

    Pools are numbered in order of first appearance. A layer's K and V must share a pool and
    V must directly follow K (callers list K then V); an index-K page needs its layer's K and V.
    ``draft_layer_ids`` name the shared draft layers: their K/V pages must land in a pool that
    also hosts the target's K/V, since the draft is addressed through a virtual pool fed from
    that pool's block offsets.
    """
    buffers = list(buffers)
    if not buffers:
        raise ValueError("cache geometry needs at least one buffer")
    pool_of_size: dict[int, int] = {}
    pool_sub_pages: list[int] = []
    pool_sizes: list[int] = []
    placements: dict[tuple[int, str], SubPage] = {}
    for buf in buffers:
        if not isinstance(buf, BufferSpec):
            raise TypeError(f"buffers must be BufferSpec, got {type(buf).__name__}")
        key = (int(buf.layer), buf.role)
        if key in placements:
            raise ValueError(f"duplicate buffer for layer {buf.layer} role {buf.role!r}")
        size = int(buf.page_bytes)
        if size not in pool_of_size:
            pool_of_size[size] = len(pool_sizes)
            pool_sizes.append(size)
            pool_sub_pages.append(0)
        pid = pool_of_size[size]
        placements[key] = SubPage(pid, pool_sub_pages[pid])
        pool_sub_pages[pid] += 1

    for (layer, role), sp in placements.items():
        if role == "k":
            v = placements.get((layer, "v"))
            if v is None:
                raise ValueError(f"layer {layer} has a K buffer but no V buffer")
            if v.pool_id != sp.pool_id or v.offset != sp.offset + 1:
                raise ValueError(
                    f"layer {layer}: V must directly follow K in the same pool "
                    f"(K at {sp}, V at {v}); give K and V pages the same size and list K before V"
                )
        elif role == "v" and (layer, "k") not in placements:
            raise ValueError(f"layer {layer} has a V buffer but no K buffer")

    drafts = tuple(as_int("draft layer id", d) for d in draft_layer_ids)
    _check_draft_hosting(placements, pool_sizes, drafts)
    for layer, role in placements:
        if role == "index_k" and (layer, "k") not in placements:
            # index-K is a sparse layer's third page; alone it counted as a target layer whose
            # attention-op mapping row (never set) aliased layer 0's K page
            raise ValueError(f"layer {layer} has an index-K buffer but no K/V buffers")
    pools = tuple(PoolSpec(i, pool_sizes[i], pool_sub_pages[i]) for i in range(len(pool_sizes)))
    return PoolGeometry(pools=pools, placements=dict(placements), draft_layer_ids=drafts)


def _check_draft_hosting(
    placements: Mapping[tuple[int, str], SubPage], pool_sizes: Sequence[int], drafts: Sequence[int]
) -> None:
    draft_set = set(drafts)
    if len(draft_set) != len(drafts):
        raise ValueError(f"duplicate draft layer ids {list(drafts)}")
    target_kv_pools = {
        sp.pool_id for (layer, role), sp in placements.items()
        if role in ("k", "v") and layer not in draft_set
    }
    for layer in drafts:
        if (layer, "k") not in placements:
            raise DraftLayerPlacementError(f"draft layer {layer} has no K/V buffers")
        if (layer, "index_k") in placements:
            raise DraftLayerPlacementError(f"draft layer {layer} is dense and must have no index-K")
        pid = placements[(layer, "k")].pool_id
        if pid not in target_kv_pools:
            target_sizes = sorted({pool_sizes[p] for p in target_kv_pools})
            raise DraftLayerPlacementError(
                f"shared draft layer {layer} cannot be hosted: its K/V page is "
                f"{pool_sizes[pid]} bytes, but the target's K/V pages are {target_sizes} bytes; "
                "the draft layer reads its block offsets from the target's K/V pool, so its page "
                "size (draft KV heads x block size x head dim x dtype size) must match it"
            )


def minimax_m3_buffers(
    num_layers: int,
    sparse_layer_ids: Iterable[int],
    num_kv_heads: int,
    head_dim: int,
    index_dim: int,
    block_size: int,
    *,
    num_draft_layers: int = 0,
    draft_num_kv_heads: int | None = None,
    kv_bytes_per_elem: int = 2,
    index_bytes_per_elem: int = 2,
) -> list[BufferSpec]:
    """The per-layer buffer list of a MiniMax-M3 rank (+ appended shared draft layers).

    K/V page: ``num_kv_heads * block_size * head_dim`` elements (HND); index-K page (sparse
    layers only): ``block_size * index_dim`` elements. Draft layers are ids
    ``num_layers .. num_layers + num_draft_layers - 1`` with ``draft_num_kv_heads`` heads.
    """
    sizes = (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
             ("head_dim", head_dim), ("index_dim", index_dim),
             ("block_size", block_size), ("kv_bytes_per_elem", kv_bytes_per_elem),
             ("index_bytes_per_elem", index_bytes_per_elem))
    for name, value in sizes:
        if as_int(name, value) <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    # Python ints from here: numpy or 0-d torch int32 sizes multiplied in int32, and a page of
    # 2**32 + 2**16 bytes wrapped to 2**16
    num_layers, num_kv_heads, head_dim, index_dim, block_size, kv_bytes_per_elem, index_bytes_per_elem = (
        as_int(name, value) for name, value in sizes)
    if as_int("num_draft_layers", num_draft_layers) < 0:
        raise ValueError(f"num_draft_layers must be >= 0, got {num_draft_layers}")
    if sparse_layer_ids is None or isinstance(sparse_layer_ids, (str, bytes)):
        raise TypeError(f"sparse_layer_ids must be an iterable of layer ids, got {sparse_layer_ids!r}")
    sparse = sorted({as_int("sparse layer id", i) for i in sparse_layer_ids})
    if sparse and (sparse[0] < 0 or sparse[-1] >= num_layers):
        raise ValueError(f"sparse_layer_ids must lie in [0, {num_layers}), got {sparse}")
    draft_heads = num_kv_heads if draft_num_kv_heads is None else as_int("draft_num_kv_heads", draft_num_kv_heads)
    if draft_heads <= 0:
        raise ValueError(f"draft_num_kv_heads must be > 0, got {draft_num_kv_heads}")
    kv_page = num_kv_heads * block_size * head_dim * kv_bytes_per_elem
    index_page = block_size * index_dim * index_bytes_per_elem
    draft_page = draft_heads * block_size * head_dim * kv_bytes_per_elem
    sparse_set = set(sparse)
    buffers: list[BufferSpec] = []
    for layer in range(num_layers):
        buffers.append(BufferSpec(layer, "k", kv_page))
        buffers.append(BufferSpec(layer, "v", kv_page))
        if layer in sparse_set:
            buffers.append(BufferSpec(layer, "index_k", index_page))
    for layer in range(num_layers, num_layers + num_draft_layers):
        buffers.append(BufferSpec(layer, "k", draft_page))
        buffers.append(BufferSpec(layer, "v", draft_page))
    return buffers


def minimax_m3_geometry(
    num_layers: int,
    sparse_layer_ids: Iterable[int],
    num_kv_heads: int,
    head_dim: int,
    index_dim: int,
    block_size: int,
    *,
    num_draft_layers: int = 0,
    draft_num_kv_heads: int | None = None,
    kv_bytes_per_elem: int = 2,
    index_bytes_per_elem: int = 2,
) -> PoolGeometry:
    """Pool geometry of a MiniMax-M3 rank; raises DraftLayerPlacementError if unhostable."""
    buffers = minimax_m3_buffers(
        num_layers, sparse_layer_ids, num_kv_heads, head_dim, index_dim, block_size,
        num_draft_layers=num_draft_layers, draft_num_kv_heads=draft_num_kv_heads,
        kv_bytes_per_elem=kv_bytes_per_elem, index_bytes_per_elem=index_bytes_per_elem,
    )
    drafts = range(num_layers, num_layers + num_draft_layers)
    return build_pool_geometry(buffers, draft_layer_ids=drafts)
