"""Per (request, KV head, token chunk) union of the chunk's selected blocks, with token bitmasks.

Why: the sparse verify attention reads each selected page once for all verify tokens. Giving it
a compact list (block id, bitmask of the chunk's tokens that selected it) turns its main loop into
a plain gather over a list, which Triton software-pipelines like paged attention. The fused
top-k kernel (`index_select`) writes the same lists directly; this kernel derives them from a
selection given by someone else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_grid, next_pow2
from .launch import launch


@dataclass
class BlockUnion:
    """`ids` (logical block), `pages` (physical page from the block table) and `bits` int32
    `[R, Hkv, num_chunks, umax]` (first `counts` entries valid), `counts` int32 `[R, Hkv, num_chunks]`;
    chunk c of request r covers its tokens `[c * chunk, (c + 1) * chunk)`; bit i of `bits` is set
    when token `c * chunk + i` selected the block."""

    ids: torch.Tensor
    pages: torch.Tensor
    bits: torch.Tensor
    counts: torch.Tensor
    chunk: int

    @property
    def num_chunks(self) -> int:
        return int(self.counts.shape[2])

    @property
    def umax(self) -> int:
        return int(self.ids.shape[3])


def allocate_union(num_requests: int, num_heads: int, num_chunks: int, chunk: int, topk: int,
                   device: torch.device) -> BlockUnion:
    umax = chunk * next_pow2(topk)
    shape = (num_requests, num_heads, num_chunks, umax)
    return BlockUnion(
        ids=torch.empty(shape, device=device, dtype=torch.int32),
        pages=torch.empty(shape, device=device, dtype=torch.int32),
        bits=torch.empty(shape, device=device, dtype=torch.int32),
        counts=torch.empty(shape[:3], device=device, dtype=torch.int32),
        chunk=chunk,
    )


def chunk_count(num_tokens: int, num_requests: int, chunk: int, max_qo_len: int | None) -> int:
    """Chunks per request: from `max_qo_len`, else from the worst case (one request has every token:
    a request may have none this step, `MsaDecodeMetadata` takes qo_len 0 with kv_len > 0)."""
    bound = max_qo_len if max_qo_len is not None else max(1, num_tokens)
    return max(1, -(-int(bound) // chunk))


@triton.jit
def _union_kernel(
    sel_ptr, s_sel_h, s_sel_t, cu_ptr, bt_ptr, s_bt_r,
    ids_ptr, pages_ptr, bits_ptr, cnt_ptr,
    QP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    c = tl.program_id(2)
    unit = (r * tl.num_programs(1) + g) * tl.num_programs(2) + c
    t0 = tl.load(cu_ptr + r)
    t1 = tl.load(cu_ptr + r + 1)
    c0 = t0 + c * QP
    n = tl.arange(0, QP * TOPK_P)
    tok_i = n // TOPK_P
    ok = (c0 + tok_i < t1) & (n % TOPK_P < TOPK)
    cand = tl.load(sel_ptr + g * s_sel_h + (c0 + tok_i) * s_sel_t + n % TOPK_P, mask=ok, other=-1)
    same = (cand[:, None] == cand[None, :]) & (cand[:, None] >= 0)
    earlier = same & (n[None, :] < n[:, None])
    first = (cand >= 0) & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    token_bit = tl.full([QP * TOPK_P], 1, tl.int32) << tok_i
    bits = tl.sum(tl.where(same, token_bit[None, :], 0), axis=1)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
    base = unit * (QP * TOPK_P)
    tl.store(ids_ptr + base + rank, cand, mask=first)
    tl.store(pages_ptr + base + rank, tl.load(bt_ptr + r * s_bt_r + cand, mask=first, other=0), mask=first)
    tl.store(bits_ptr + base + rank, bits, mask=first)
    tl.store(cnt_ptr + unit, tl.sum(first.to(tl.int32), axis=0))


def union_from_selection(selection: torch.Tensor, cu_qo_lens: torch.Tensor, block_tables: torch.Tensor, *,
                         chunk: int, num_chunks: int) -> BlockUnion:
    """Union lists of `selection` int32 `[Hkv, T, topk]` for chunks of `chunk` tokens (<= 31)."""
    num_heads, _, topk = selection.shape
    num_requests = cu_qo_lens.shape[0] - 1
    grid = (num_requests, num_heads, num_chunks)
    check_grid("block union", grid, "requests, KV heads, token chunks a request")
    union = allocate_union(num_requests, num_heads, num_chunks, chunk, topk, selection.device)
    if num_requests and num_heads:
        launch(_union_kernel, grid,
            selection, selection.stride(0), selection.stride(1), cu_qo_lens, block_tables, block_tables.stride(0),
            union.ids, union.pages, union.bits, union.counts,
            QP=chunk, TOPK=topk, TOPK_P=next_pow2(topk), num_warps=4,
        )
    return union
