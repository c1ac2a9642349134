"""The reference host's paged KV cache: real pool storage, page tables, zero-copy views.

Each pool of the geometry owns one tensor ``[num_blocks, sub_pages, page_elems]``; block ``b``
of a request is slot ``b`` of every pool. Target layers are viewed directly through the
geometry. Shared draft layers are viewed the way an attention op addresses them: through the
virtual attention-op pool tables (base pointer, index scale, kv offset) turned back into a
strided view of the real storage, so a wrong table shows up as wrong data.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Optional, Sequence

import torch

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.kv.allocator import BlockAllocator
from m3_eagle_plugin.kv.draft_layout import derive_shared_draft_layout
from m3_eagle_plugin.kv.geometry import PoolGeometry, minimax_m3_geometry
from m3_eagle_plugin.kv.virtual_pools import (
    VirtualPools,
    copy_block_offsets,
    extend_attention_op_pools,
)


_KV_FACTOR = 2  # K and V: an attention-op layer offset steps over both pages of a layer


class PagedKVCache:
    """Paged K/V/index-K storage with a block allocator and per-layer strided views."""

    def __init__(
        self,
        geometry: PoolGeometry,
        *,
        block_size: int,
        num_blocks: int,
        kv_heads: Mapping[int, int],
        head_dim: int,
        index_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        shard: tuple[int, int] | None = None,
    ) -> None:
        """``shard``: (tensor-parallel rank, TP size) of the KV heads this cache holds, where it holds
        one rank's slice; it joins the transfer fingerprint, so rank r's pages are refused on rank s."""
        if not isinstance(geometry, PoolGeometry):
            raise TypeError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.geometry = geometry
        # sizes as ints: a float is refused, not truncated (block_size=4.5 would build a 4-token cache)
        self.block_size = as_int("block_size", block_size)
        self.num_blocks = as_int("num_blocks", num_blocks)
        self.head_dim = as_int("head_dim", head_dim)
        self.index_dim = as_int("index_dim", index_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.shard = None if shard is None else _checked_shard(shard)
        if not isinstance(kv_heads, Mapping):  # the list minimax_m3_cache_layout returns failed on .items()
            raise TypeError(f"kv_heads must be a mapping {{layer: KV heads}}, got {type(kv_heads).__name__}; "
                            "for a per-layer list pass dict(enumerate(heads))")
        self.kv_heads = {as_int("kv_heads layer", k): as_int(f"kv_heads[{k}]", v) for k, v in kv_heads.items()}
        # each on its own: the page-size check sees products, and -2 heads x -128 dims passed it
        for name, value in (("block_size", self.block_size), ("head_dim", self.head_dim),
                            ("index_dim", self.index_dim), *((f"kv_heads[{k}]", v) for k, v in self.kv_heads.items())):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.draft_layer_ids: list[int] = list(geometry.draft_layer_ids)
        self.num_target_layers = len(geometry.target_layer_ids)
        self.sparse_layer_ids: list[int] = sorted(
            layer for layer, role in geometry.placements if role == "index_k"
        )
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        self._check_page_sizes()
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)
        self._storage = [
            torch.zeros(self.num_blocks, pool.sub_pages, pool.page_bytes // self._itemsize,
                        dtype=dtype, device=self.device)
            for pool in geometry.pools
        ]
        self.op_tables: VirtualPools = self._build_op_tables()

    @classmethod
    def for_minimax_m3(
        cls,
        num_layers: int,
        sparse_layer_ids: Iterable[int],
        num_kv_heads: int,
        head_dim: int,
        index_dim: int,
        block_size: int,
        num_blocks: int,
        *,
        num_draft_layers: int = 0,
        draft_num_kv_heads: Optional[int] = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        shard: tuple[int, int] | None = None,
    ) -> "PagedKVCache":
        """A MiniMax-M3 rank's cache, with ``num_draft_layers`` shared draft layers appended
        (``shard``: this rank's (rank, TP size), as in ``__init__``)."""
        geometry, heads = minimax_m3_cache_layout(
            num_layers, sparse_layer_ids, num_kv_heads, head_dim, index_dim, block_size,
            num_draft_layers=num_draft_layers, draft_num_kv_heads=draft_num_kv_heads, dtype=dtype)
        return cls(geometry, block_size=block_size, num_blocks=num_blocks,
                   kv_heads=dict(enumerate(heads)), head_dim=head_dim, index_dim=index_dim,
                   dtype=dtype, device=device, shard=shard)

    # ---- construction helpers -------------------------------------------------------------
    def _check_page_sizes(self) -> None:
        for pool in self.geometry.pools:
            if pool.page_bytes % self._itemsize:
                raise ValueError(f"pool {pool.pool_id}: page of {pool.page_bytes} bytes is not a "
                                 f"whole number of {self.dtype} elements")
        for (layer, role), sp in self.geometry.placements.items():
            if role == "index_k":
                expected = self.block_size * self.index_dim * self._itemsize
            else:
                if layer not in self.kv_heads:
                    raise ValueError(f"kv_heads has no entry for layer {layer}")
                expected = self.kv_heads[layer] * self.block_size * self.head_dim * self._itemsize
            actual = self.geometry.pool(sp.pool_id).page_bytes
            if actual != expected:
                raise ValueError(f"layer {layer} role {role!r}: geometry page is {actual} bytes, "
                                 f"the shapes and {self.dtype} give {expected}")

    def _build_op_tables(self) -> VirtualPools:
        layers = self.geometry.layers
        pointers = torch.tensor([[t.data_ptr(), 0] for t in self._storage], dtype=torch.int64)
        # -1: a layer id this cache has no K/V pages for (a gap in its ids); a row of zeros named pool 0
        # at offset 0, the first layer's K page, so the gap aliased another layer's memory
        mapping = torch.full((max(layers) + 1, 2), -1, dtype=torch.int32)
        for layer in layers:
            if self.geometry.has(layer, "k"):
                sp = self.geometry.locate(layer, "k")
                mapping[layer] = torch.tensor([sp.pool_id, sp.offset], dtype=torch.int32)
        drafts = []
        for layer in self.draft_layer_ids:
            sp = self.geometry.locate(layer, "k")
            pool = self.geometry.pool(sp.pool_id)
            address = self._storage[sp.pool_id].data_ptr() + sp.offset * pool.page_bytes
            drafts.append((layer, address, pool.sub_pages))
        return extend_attention_op_pools(pointers, mapping, drafts)

    @property
    def num_layers(self) -> int:
        """Target plus draft layers."""
        return self.num_target_layers + len(self.draft_layer_ids)

    # ---- allocator ------------------------------------------------------------------------
    def add_request(self, rid: Hashable) -> None:
        self.allocator.add_request(rid)

    def reserve(self, rid: Hashable, num_tokens: int) -> list[int]:
        return self.allocator.reserve(rid, num_tokens)

    def rewind(self, rid: Hashable, num_tokens: int) -> list[int]:
        return self.allocator.rewind(rid, num_tokens)

    def free(self, rid: Hashable) -> None:
        self.allocator.free(rid)

    def num_tokens(self, rid: Hashable) -> int:
        return self.allocator.num_tokens(rid)

    def pages(self, rid: Hashable) -> list[int]:
        return self.allocator.pages(rid)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def block_table(self, rids: Sequence[Hashable], width: Optional[int] = None) -> torch.Tensor:
        return self.allocator.block_table(rids, width)

    # ---- views ----------------------------------------------------------------------------
    def storage(self, pool_id: int) -> torch.Tensor:
        """The real storage ``[num_blocks, sub_pages, page_elems]`` of one pool."""
        return self._storage[self.geometry.pool(pool_id).pool_id]  # refuses -1 (the last pool) by name

    def k(self, layer: int) -> torch.Tensor:
        """``[P, Hkv, B, D]`` view of layer ``layer``'s K pages."""
        return self._kv_view(layer, "k")

    def v(self, layer: int) -> torch.Tensor:
        """``[P, Hkv, B, D]`` view of layer ``layer``'s V pages."""
        return self._kv_view(layer, "v")

    def index_k(self, layer: int) -> torch.Tensor:
        """``[P, B, Di]`` view of a sparse layer's index-K pages."""
        sp = self.geometry.locate(layer, "index_k")
        return self._storage[sp.pool_id][:, sp.offset, :].view(
            self.num_blocks, self.block_size, self.index_dim)

    def _kv_view(self, layer: int, role: str) -> torch.Tensor:
        layer = as_int("layer", layer)  # int(2.7) read layer 2
        if layer in self.draft_layer_ids:
            return self._op_pool_view(layer, role)
        sp = self.geometry.locate(layer, role)
        return self._storage[sp.pool_id][:, sp.offset, :].view(
            self.num_blocks, self.kv_heads[layer], self.block_size, self.head_dim)

    def _op_pool_view(self, layer: int, role: str) -> torch.Tensor:
        """Address ``layer`` as an attention op does: op pool pointer, scale, kv offset."""
        tables = self.op_tables
        op_pool, layer_offset = (int(x) for x in tables.pool_mapping[layer].tolist())
        j = tables.virtual_index(op_pool)
        if j is None:
            raise ValueError(f"draft layer {layer} maps to op pool {op_pool}, not a virtual pool")
        source = tables.op_pools[j][1]
        scale = int(tables.index_scales[j])
        kv_offset = int(tables.kv_offsets[j]) if role == "v" else 0
        base = int(tables.pool_pointers[op_pool].reshape(-1)[0])
        storage = self._storage[source]
        page_bytes = self.geometry.pool(source).page_bytes
        page_elems = page_bytes // self._itemsize
        heads = self.kv_heads[layer]
        if heads * self.block_size * self.head_dim != page_elems:
            raise ValueError(f"draft layer {layer}: {heads} heads do not fill a "
                             f"{page_bytes}-byte page of pool {source}")
        # the op roots a layer at pointer + layer offset x kv_factor (2) pages: the offset counts
        # K+V page pairs (TensorRT-LLM's attention op, `intra_pool_offset`), not single pages
        byte_offset = base - storage.data_ptr() + (_KV_FACTOR * layer_offset + kv_offset) * page_bytes
        last_page_end = byte_offset + ((self.num_blocks - 1) * scale + 1) * page_bytes
        storage_bytes = storage.numel() * self._itemsize
        if byte_offset < 0 or byte_offset % page_bytes or last_page_end > storage_bytes:
            raise ValueError(
                f"draft layer {layer}: op pool {op_pool} (base {base:#x}, scale {scale}, kv offset "
                f"{kv_offset}) does not address whole pages inside pool {source}'s storage"
            )
        return storage.as_strided(
            (self.num_blocks, heads, self.block_size, self.head_dim),
            (scale * page_elems, self.block_size * self.head_dim, self.head_dim, 1),
            storage.storage_offset() + byte_offset // self._itemsize,
        )

    # ---- attention-op block offsets -------------------------------------------------------
    def block_offsets(self, rids: Sequence[Hashable], width: Optional[int] = None) -> torch.Tensor:
        """int32 ``[op_pools, R, 2, width]`` K/V page indices per op pool (``-1`` unused).

        Page of (layer, role) for block ``b`` of row ``i``: ``offsets[pool, i, role, b] +
        pool_mapping[layer][1]`` with ``pool = pool_mapping[layer][0]`` (role 0 = K, 1 = V); a row of -1
        marks a layer id the cache has no K/V pages for, which names no pool. A target
        row's offset here is its sub-page in the slot, this cache's own convention (a mega-slot's sparse
        layers sit at odd sub-pages, which an attention op's K+V-pair offset cannot name); a draft row's
        is 0, which both read alike.
        """
        table = self.block_table(rids, width)
        num_pools = len(self._storage)
        host = table.unsqueeze(0).unsqueeze(2).expand(num_pools, -1, 2, -1).contiguous()
        dst = torch.full((self.op_tables.num_op_pools, *host.shape[1:]), -1, dtype=torch.int32)
        copy_block_offsets(
            dst, host, torch.arange(len(rids)), self.op_tables,
            base_index_scales=[p.sub_pages for p in self.geometry.pools],
            base_kv_offsets=[1] * num_pools,
        )
        return dst


def minimax_m3_cache_layout(
    num_layers: int,
    sparse_layer_ids: Iterable[int],
    num_kv_heads: int,
    head_dim: int,
    index_dim: int,
    block_size: int,
    *,
    num_draft_layers: int = 0,
    draft_num_kv_heads: Optional[int] = None,
    dtype: torch.dtype = torch.bfloat16,
):
    """(pool geometry, KV heads per layer) of `PagedKVCache.for_minimax_m3`, nothing allocated: a
    draft layer the target's pages cannot host is refused here, before any weight is read."""
    draft_heads = num_kv_heads if draft_num_kv_heads is None else as_int("draft_num_kv_heads", draft_num_kv_heads)
    heads = [int(num_kv_heads)] * int(num_layers) + [draft_heads] * int(num_draft_layers)
    draft_ids, num_target = derive_shared_draft_layout(num_layers, heads, num_draft_layers)
    itemsize = torch.empty((), dtype=dtype).element_size()
    geometry = minimax_m3_geometry(
        num_target, sparse_layer_ids, num_kv_heads, head_dim, index_dim, block_size,
        num_draft_layers=len(draft_ids), draft_num_kv_heads=draft_heads,
        kv_bytes_per_elem=itemsize, index_bytes_per_elem=itemsize,
    )
    return geometry, heads


def _checked_shard(shard: object) -> tuple[int, int]:
    if not isinstance(shard, (tuple, list)) or len(shard) != 2:
        raise TypeError(f"shard must be a (rank, tp_size) pair, got {shard!r}")
    rank, tp_size = as_int("shard rank", shard[0]), as_int("shard tp_size", shard[1])
    if not 0 <= rank < tp_size:
        raise ValueError(f"shard rank {rank} is outside [0, {tp_size})")
    return rank, tp_size
