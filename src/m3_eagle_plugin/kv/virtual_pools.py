"""Virtual attention-op pools for shared draft layers, and the block-offset copy feeding them.

An attention op addresses layer ``L`` as ``pool_pointers[pool]`` plus page indices from the
per-pool block-offset table (K page ``slot * index_scale``, V page ``+ kv_offset``) plus the
layer offset from ``pool_mapping[L]``. Inside the M3 mega-slot a draft layer's pages are not on
a uniform stride, so each draft layer gets its own *virtual* pool rooted at its own K page:
slot ``s`` then maps to K page ``s * sub_pages_per_slot`` and V page ``+ 1``, with layer offset 0.
The virtual pool has no storage of its own; its block offsets are the source pool's slot ids
rescaled (see :func:`copy_block_offsets`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from m3_eagle_plugin._ints import as_int

_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1


def _integer_table(name: str, table: torch.Tensor) -> None:
    if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {table.dtype}")
    if table.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: its entries cannot be read")


DraftLayer = tuple[int, int, int]  # (local layer, K page base address, sub-pages per slot)


@dataclass(frozen=True, eq=False)
class VirtualPools:
    """Attention-op tables after adding one virtual pool per shared draft layer.

    ``pool_pointers``: int64 ``[pools + drafts, 2]`` (or ``[.., 2, 2]`` NVFP4 data/scale pairs);
    ``pool_mapping``: ``[layers, 2]`` = (op pool, layer offset), in the input's integer dtype (the
    host's own, int32 in TensorRT-LLM: its kernels read the table they allocated); a layer's row
    other than a draft layer's is the input's, so a negative row (`PagedKVCache` marks a layer id
    it has no K/V pages for with ``[-1, -1]``) stays one and names no pool;
    ``index_scales`` / ``kv_offsets``: int32 ``[drafts]``, one per virtual pool;
    ``op_pools``: ``[(op_pool_id, source_pool_id)]``.
    """

    pool_pointers: torch.Tensor
    pool_mapping: torch.Tensor
    index_scales: torch.Tensor
    kv_offsets: torch.Tensor
    op_pools: list[tuple[int, int]]

    @property
    def num_pools(self) -> int:
        """Storage pools (the op pools before the virtual ones)."""
        return int(self.pool_pointers.shape[0]) - len(self.op_pools)

    @property
    def num_op_pools(self) -> int:
        return int(self.pool_pointers.shape[0])

    def virtual_index(self, op_pool: int) -> Optional[int]:
        """Position of ``op_pool`` in ``op_pools`` (None for a storage pool)."""
        for i, (op, _) in enumerate(self.op_pools):
            if op == op_pool:
                return i
        return None


def extend_attention_op_pools(
    pool_pointers: torch.Tensor,
    pool_mapping: torch.Tensor,
    draft_layers: Sequence[DraftLayer],
    *,
    num_pools: Optional[int] = None,
) -> VirtualPools:
    """Append one virtual attention-op pool per draft layer; inputs are never mutated.

    ``draft_layers``: ``[(local_layer, k_base_address, sub_pages_per_slot)]``. The new pool's
    pointer row is ``[k_base_address, 0]`` (NVFP4 3-D rows: data pointer set, the rest 0), the
    layer's mapping row becomes ``[new_pool, 0]``, index scale ``sub_pages_per_slot`` and kv
    offset 1 (V page right after K). The source pool is the one the layer was mapped to.
    ``num_pools``: the storage pools among the pointer rows (default all); the rows past it
    (op pools of an earlier extension) are dropped, and a layer still mapped to one is refused.
    """
    if not isinstance(pool_pointers, torch.Tensor) or not isinstance(pool_mapping, torch.Tensor):
        raise TypeError("pool_pointers and pool_mapping must be tensors")
    if pool_pointers.dim() not in (2, 3) or pool_pointers.shape[1] != 2 or (
        pool_pointers.dim() == 3 and pool_pointers.shape[2] != 2
    ):
        raise ValueError(
            f"pool_pointers must be [pools, 2] or [pools, 2, 2], got {tuple(pool_pointers.shape)}"
        )
    if pool_mapping.dim() != 2 or pool_mapping.shape[1] != 2:
        raise ValueError(f"pool_mapping must be [layers, 2], got {tuple(pool_mapping.shape)}")
    if pool_pointers.dtype != torch.int64:  # a float32 row rounds 2**40 + 1 to 2**40
        raise TypeError(f"pool_pointers must be int64 addresses, got {pool_pointers.dtype}")
    _integer_table("pool_mapping", pool_mapping)
    rows = int(pool_pointers.shape[0])
    base_pools = rows if num_pools is None else as_int("num_pools", num_pools)
    if rows == 0:  # not num_pools' fault when it was not given
        raise ValueError("pool_pointers has no rows: there is no storage pool to extend")
    if not 0 < base_pools <= rows:
        raise ValueError(f"num_pools={num_pools} does not match {rows} pointer rows: the storage pools among "
                         f"them are 1 to {rows}")

    pointers = pool_pointers[:base_pools].clone()
    mapping = pool_mapping.clone()
    seen: set[int] = set()
    new_rows: list[torch.Tensor] = []
    scales: list[int] = []
    op_pools: list[tuple[int, int]] = []
    for entry in draft_layers:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise ValueError(
                f"draft layer entries are (layer, k_base_address, sub_pages), got {entry!r}")
        layer = as_int("draft layer", entry[0])
        address = as_int(f"draft layer {layer} K base address", entry[1])
        sub_pages = as_int(f"draft layer {layer} sub_pages_per_slot", entry[2])
        if not 0 <= layer < mapping.shape[0]:
            raise ValueError(
                f"draft layer {layer} is outside the {mapping.shape[0]}-row pool mapping")
        if layer in seen:
            raise ValueError(f"draft layer {layer} listed twice")
        if sub_pages < 2:
            raise ValueError(f"draft layer {layer}: a slot must hold its K and V pages, "
                             f"got sub_pages_per_slot={sub_pages}")
        if sub_pages > _INT32_MAX:  # index_scales are int32
            raise ValueError(f"draft layer {layer}: sub_pages_per_slot={sub_pages} does not fit int32")
        if not 0 < address <= _INT64_MAX:
            raise ValueError(f"draft layer {layer}: K base address must be in (0, 2**63), got {address}")
        source = int(pool_mapping[layer, 0])
        if not 0 <= source < base_pools:
            raise ValueError(f"draft layer {layer} maps to pool {source}, not a storage pool")
        seen.add(layer)
        # zeros_like kept a non-contiguous table's strides, and view(-1) then refused the row
        row = torch.zeros(pool_pointers.shape[1:], dtype=torch.int64, device=pool_pointers.device)
        row.view(-1)[0] = address
        new_rows.append(row)
        op_pool = base_pools + len(op_pools)
        mapping[layer, 0] = op_pool
        mapping[layer, 1] = 0
        scales.append(sub_pages)
        op_pools.append((op_pool, source))

    # ids from num_pools on go to the new pools (rows past it are dropped): a layer still mapped
    # there, to a dropped row or to one that never existed, would silently address a draft pool
    for layer, op_pool in enumerate(pool_mapping[:, 0].tolist()):
        if layer not in seen and base_pools <= op_pool < pool_pointers.shape[0]:
            raise ValueError(f"layer {layer} maps to op pool {op_pool}, which num_pools={base_pools} drops")
        if layer not in seen and op_pool >= pool_pointers.shape[0]:
            raise ValueError(f"layer {layer} maps to pool {op_pool}, but pool_pointers has "
                             f"{pool_pointers.shape[0]} rows")

    if new_rows:
        pointers = torch.cat([pointers, torch.stack(new_rows)], dim=0)
    index_scales = torch.tensor(scales, dtype=torch.int32)
    kv_offsets = torch.ones(len(scales), dtype=torch.int32)
    return VirtualPools(pointers, mapping, index_scales, kv_offsets, op_pools)


def copy_pool_block_offsets(
    dst: torch.Tensor,
    host_offsets: torch.Tensor,
    copy_index: torch.Tensor,
    index_scale: int,
    kv_offset: int,
    max_blocks: Optional[int] = None,
) -> None:
    """Expand one pool's slot ids into attention-op K/V page indices.

    ``host_offsets`` ``[rows, 2, W]`` holds slot ids in its K field (``[:, 0]``; negative =
    unused). Row ``i`` of ``dst`` ``[R', 2, W']`` receives host row ``copy_index[i]``:
    K = slot * index_scale, V = K + kv_offset; unused entries stay -1 in both fields.
    A refused input leaves ``dst`` as it was.
    """
    _check_tables(dst, host_offsets)  # before the index check reads their row counts
    idx = _check_index(copy_index, host_offsets, dst)
    _write_pool(dst, _check_pool(dst, host_offsets, idx, index_scale, kv_offset, max_blocks))


def _check_tables(dst: torch.Tensor, host_offsets: torch.Tensor, stacked: bool = False) -> None:
    """Shapes and dtypes of one pool's ``dst`` ``[R', 2, W']`` and ``host_offsets`` ``[rows, 2, W]``,
    or, ``stacked``, of every pool's at once (a leading pool dim)."""
    dims, layout = (4, "[pools, rows, 2, blocks]") if stacked else (3, "[rows, 2, blocks]")
    if dst.dim() != dims or host_offsets.dim() != dims or dst.shape[-2] != 2 or host_offsets.shape[-2] != 2:
        raise ValueError(f"block-offset tables must be {layout}, got dst "
                         f"{tuple(dst.shape)} and host {tuple(host_offsets.shape)}")
    # a float slot -0.5 would truncate to the valid slot 0
    _integer_table("host_offsets", host_offsets)
    _integer_table("dst", dst)
    if not dst.dtype.is_signed:  # uint8 stored an unused entry's -1 as page 255
        raise TypeError(f"dst must be a signed integer tensor, got {dst.dtype}")


def _check_index(copy_index: torch.Tensor, host_offsets: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``copy_index`` as long row ids on the host table's device; ``host_offsets`` and ``dst`` are
    one pool's tables or the stacked ones (rows on dim -3)."""
    if not isinstance(copy_index, torch.Tensor) or copy_index.dim() != 1:
        got = tuple(copy_index.shape) if isinstance(copy_index, torch.Tensor) else type(copy_index).__name__
        raise TypeError(f"copy_index must be a 1-D integer tensor, got {got}")
    _integer_table("copy_index", copy_index)  # a float row 1.7 would truncate to row 1
    rows, host_rows = int(copy_index.numel()), host_offsets.shape[-3]
    if rows > dst.shape[-3]:
        raise ValueError(f"{rows} rows to copy but dst holds {dst.shape[-3]}")
    idx = copy_index.to(device=host_offsets.device, dtype=torch.long)
    if idx.device.type == "cpu" and rows and not (0 <= int(idx.min()) and int(idx.max()) < host_rows):
        # a negative row would silently read from the end of the host table
        raise IndexError(f"copy_index entries must lie in [0, {host_rows}), got {idx.tolist()}")
    return idx


_PoolCopy = tuple[int, int, torch.Tensor]  # (index scale, kv offset, host slots [rows, width]): checked, ready to write


def _check_pool(
    dst: torch.Tensor,
    host_offsets: torch.Tensor,
    idx: torch.Tensor,
    index_scale: int,
    kv_offset: int,
    max_blocks: Optional[int],
) -> _PoolCopy:
    """Every refusal of one pool's copy (tables and index already checked); writes nothing."""
    index_scale = as_int("index_scale", index_scale)
    kv_offset = as_int("kv_offset", kv_offset)
    if index_scale < 1 or kv_offset < 0:
        raise ValueError(f"index_scale must be >= 1 and kv_offset >= 0, got {index_scale}, {kv_offset}")
    if max(index_scale, kv_offset) > _INT64_MAX:  # the write multiplies in int64: past it torch raised mid-copy
        raise ValueError(f"index_scale and kv_offset must fit int64, got {index_scale}, {kv_offset}")
    width = min(dst.shape[2], host_offsets.shape[2])
    if max_blocks is not None:
        max_blocks = as_int("max_blocks", max_blocks)
        if max_blocks < 0:  # a slice end of -1 would silently drop the last column
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        width = min(width, max_blocks)
    slots = host_offsets[idx, 0, :width]  # gathered once: the check and the write read it
    if slots.device.type == "cpu" and slots.numel():
        # in Python ints: an int64 product would wrap (slot 2**30 * 2**34 became page 0)
        slot = int(slots.max())
        page = slot * index_scale + kv_offset if slot >= 0 else -1
        if page > torch.iinfo(dst.dtype).max:  # would wrap in dst: slot 2**30 * 4 became page 0
            raise ValueError(f"page index {page} does not fit dst's {dst.dtype}")
    return index_scale, kv_offset, slots


def _write_pool(dst: torch.Tensor, copy: _PoolCopy) -> None:
    index_scale, kv_offset, slots = copy
    slots = slots.to(torch.int64)
    valid = slots >= 0
    k = torch.where(valid, slots * index_scale, torch.full_like(slots, -1))
    v = torch.where(valid, k + kv_offset, k)
    rows, width = k.shape
    dst[:rows, 0, :width] = k.to(device=dst.device, dtype=dst.dtype)
    dst[:rows, 1, :width] = v.to(device=dst.device, dtype=dst.dtype)


CopyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, Optional[int]], None]


def copy_block_offsets(
    dst: torch.Tensor,
    host_offsets: torch.Tensor,
    copy_index: torch.Tensor,
    pools: VirtualPools,
    *,
    base_index_scales: Sequence[int],
    base_kv_offsets: Sequence[int],
    max_blocks: Optional[int] = None,
    copy_fn: CopyFn = copy_pool_block_offsets,
) -> None:
    """Fill ``dst`` ``[op_pools, R, 2, W]`` from ``host_offsets`` ``[pools, rows, 2, W]``.

    The base copy runs first (storage pool ``p`` with its own scale and kv offset), then one
    copy per virtual pool from its *source* pool's host row with the draft scale and offset.
    ``copy_fn`` is the per-pool device copy (replaceable, e.g. by a fused kernel); it gets views
    ``dst[op_pool]``, ``host_offsets[source]`` and ``copy_index`` as given.

    All-or-nothing whatever ``copy_fn`` is: ``copy_index`` (once) and every pool are checked, as
    `copy_pool_block_offsets` checks them, before ``copy_fn`` runs for any pool, so a refused
    input leaves ``dst`` as it was. Only a ``copy_fn`` failing on its own after the checks passed
    (a launch error) leaves the pools copied before it written.
    """
    _check_tables(dst, host_offsets, stacked=True)
    num_pools = pools.num_pools
    if host_offsets.shape[0] != num_pools:
        raise ValueError(f"host table has {host_offsets.shape[0]} pools, the op tables {num_pools}")
    if dst.shape[0] < pools.num_op_pools:
        raise ValueError(f"dst has {dst.shape[0]} pool rows, need {pools.num_op_pools}")
    if len(base_index_scales) != num_pools or len(base_kv_offsets) != num_pools:
        raise ValueError(f"need one base index scale and kv offset per storage pool ({num_pools})")
    copies = [(p, p, as_int(f"base_index_scales[{p}]", base_index_scales[p]),
               as_int(f"base_kv_offsets[{p}]", base_kv_offsets[p])) for p in range(num_pools)]
    copies += [(op_pool, source, int(pools.index_scales[i]), int(pools.kv_offsets[i]))
               for i, (op_pool, source) in enumerate(pools.op_pools)]
    # check phase: every refusal is raised here, before any pool is written
    idx = _check_index(copy_index, host_offsets, dst)
    checked = [(op_pool, source, _check_pool(dst[op_pool], host_offsets[source], idx, scale, kv_offset, max_blocks))
               for op_pool, source, scale, kv_offset in copies]
    # write phase
    for op_pool, source, copy in checked:
        if copy_fn is copy_pool_block_offsets:  # already checked: write without checking the index again
            _write_pool(dst[op_pool], copy)
        else:
            copy_fn(dst[op_pool], host_offsets[source], copy_index, copy[0], copy[1], max_blocks)
