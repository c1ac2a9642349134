"""Fused `on_update_kv_lens`: re-derive a step's per-token metadata from corrected kv lengths.

Why: the overlap scheduler stages optimistic kv lengths and corrects them on the device after the
previous step's acceptance is known. `MsaDecodeMetadata` re-derives the lengths, offsets,
positions, token kv lengths, valid-block counts and write slots with about fifteen small torch
ops; this is the same derivation in one launch, with no host sync, safe inside a CUDA graph and
idempotent. It works on the metadata's whole fixed-size buffers, exactly as the torch path does:

    kv[r]        = max(min(kv[r] (or new[r] for r < len(new)), staged[r]), 0)
    qo_offset[r] = kv[r] - qo[r]
    pos[t]       = qo_offset[req[t]] + intra[t] if live[t] else -1
    token_kv[t]  = max(pos + 1, 0);  valid_blocks[t] = ceil(token_kv / B)  (no int32 wrap near 2^31)
    slot[t]      = page * B + pos % B with page = table[req, min(max(pos, 0) // B, W - 1)],
                   or -1 when not live, pos < 0 or page < 0
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ..blocks import is_integer_dtype
from ._common import check_same_device, require
from .launch import launch

ELEMS_PER_PROGRAM = 1024


@triton.jit
def _corrected_kv(new_ptr, num_new, kv_ptr, staged_ptr, r, mask, HAS_NEW: tl.constexpr):
    cur = tl.load(kv_ptr + r, mask=mask, other=0)
    if HAS_NEW:
        cur = tl.where(r < num_new, tl.load(new_ptr + r, mask=mask & (r < num_new), other=0), cur)
    return tl.maximum(tl.minimum(cur, tl.load(staged_ptr + r, mask=mask, other=0)), 0)


@triton.jit
def _derive_token_fields_kernel(
    new_ptr, num_new, kv_ptr, staged_ptr, qo_ptr, qoff_ptr,
    req_ptr, intra_ptr, live_ptr, table_ptr, width,
    pos_ptr, tkv_ptr, vb_ptr, slot_ptr,
    num_requests, num_tokens,
    BLOCK: tl.constexpr, HAS_NEW: tl.constexpr, EPP: tl.constexpr,
):
    i = tl.program_id(0) * EPP + tl.arange(0, EPP)
    is_req = i < num_requests
    kv = _corrected_kv(new_ptr, num_new, kv_ptr, staged_ptr, i, is_req, HAS_NEW)
    qo = tl.load(qo_ptr + i, mask=is_req, other=0)

    is_tok = i < num_tokens
    r = tl.load(req_ptr + i, mask=is_tok, other=0)
    live = is_tok & (tl.load(live_ptr + i, mask=is_tok, other=0) != 0)
    kv_r = _corrected_kv(new_ptr, num_new, kv_ptr, staged_ptr, r, is_tok, HAS_NEW)
    pos = kv_r - tl.load(qo_ptr + r, mask=is_tok, other=0) + tl.load(intra_ptr + i, mask=is_tok, other=0)
    pos = tl.where(live, pos, -1)
    token_kv = tl.maximum(pos + 1, 0)
    column = tl.minimum(tl.maximum(pos, 0) // BLOCK, width - 1)
    page = tl.load(table_ptr + r.to(tl.int64) * width + column, mask=is_tok, other=-1)
    slot = tl.where(live & (pos >= 0) & (page >= 0), page * BLOCK + (pos & (BLOCK - 1)), -1)
    # Every load above precedes every store below, so kv_lens may be updated in place; programs
    # racing on kv_lens still agree because the correction is idempotent.
    tl.debug_barrier()
    tl.store(kv_ptr + i, kv, mask=is_req)
    tl.store(qoff_ptr + i, kv - qo, mask=is_req)
    tl.store(pos_ptr + i, pos, mask=is_tok)
    tl.store(tkv_ptr + i, token_kv, mask=is_tok)
    # ceil without `token_kv + BLOCK - 1`, which wraps for kv lengths within BLOCK of 2^31
    tl.store(vb_ptr + i, token_kv // BLOCK + ((token_kv & (BLOCK - 1)) != 0).to(tl.int32), mask=is_tok)
    tl.store(slot_ptr + i, slot, mask=is_tok)


def derive_token_fields(
    *,
    kv_lens: torch.Tensor,
    kv_lens_staged: torch.Tensor,
    qo_lens: torch.Tensor,
    qo_offsets: torch.Tensor,
    token_request: torch.Tensor,
    token_intra: torch.Tensor,
    token_live: torch.Tensor,
    block_table_flat: torch.Tensor,
    max_blocks_per_seq: int,
    block_size: int,
    positions: torch.Tensor,
    token_kv_lens: torch.Tensor,
    valid_blocks: torch.Tensor,
    cache_slots: torch.Tensor,
    new_kv_lens: torch.Tensor | None = None,
) -> None:
    """One launch over whole buffers (see the module docstring); `kv_lens` and the outputs are
    updated in place. `new_kv_lens` (first `len(new_kv_lens)` requests) replaces `kv_lens` first."""
    num_requests = kv_lens.shape[0]
    num_tokens = token_request.shape[0]
    require(block_size > 0 and block_size & (block_size - 1) == 0,
            f"block_size must be a power of two, got {block_size}")
    require(max_blocks_per_seq >= 1, "max_blocks_per_seq must be >= 1")
    for name, t in (("kv_lens_staged", kv_lens_staged), ("qo_lens", qo_lens), ("qo_offsets", qo_offsets)):
        require(t.shape[0] >= num_requests, f"{name} must have >= {num_requests} entries, got {t.shape[0]}")
    for name, t in (("token_intra", token_intra), ("token_live", token_live), ("positions", positions),
                    ("token_kv_lens", token_kv_lens), ("valid_blocks", valid_blocks), ("cache_slots", cache_slots)):
        require(t.shape[0] >= num_tokens, f"{name} must have >= {num_tokens} entries, got {t.shape[0]}")
    require(block_table_flat.dim() == 1 and block_table_flat.shape[0] >= num_requests * max_blocks_per_seq,
            "block_table_flat must be 1-D with num_requests * max_blocks_per_seq entries")
    require(new_kv_lens is None or (new_kv_lens.dim() == 1 and new_kv_lens.shape[0] <= num_requests),
            "new_kv_lens must be 1-D with at most num_requests entries")
    n = max(num_requests, num_tokens)
    if n == 0:
        return
    launch(_derive_token_fields_kernel, (triton.cdiv(n, ELEMS_PER_PROGRAM),),
        new_kv_lens if new_kv_lens is not None else kv_lens, 0 if new_kv_lens is None else new_kv_lens.shape[0],
        kv_lens, kv_lens_staged, qo_lens, qo_offsets,
        token_request, token_intra, token_live, block_table_flat, max_blocks_per_seq,
        positions, token_kv_lens, valid_blocks, cache_slots,
        num_requests, num_tokens,
        BLOCK=block_size, HAS_NEW=new_kv_lens is not None, EPP=ELEMS_PER_PROGRAM, num_warps=4,
    )


def on_update_kv_lens_fused(meta: Any, kv_lens: torch.Tensor | None = None) -> None:
    """`MsaDecodeMetadata.on_update_kv_lens` in one launch, on the metadata's own buffers.

    Reads the buffer attributes `MsaDecodeMetadata` keeps (`_kv_lens`, `_kv_lens_staged`, ...):
    the metadata owner can call this from `_derive_token_fields` on CUDA.
    """
    if kv_lens is None and getattr(meta, "max_draft_len", 0) == 0:
        return
    if kv_lens is not None:
        require(isinstance(kv_lens, torch.Tensor) and kv_lens.dim() == 1 and kv_lens.shape[0] == meta.num_requests,
                f"kv_lens must be a 1-D device tensor of num_requests={meta.num_requests} entries")
        require(is_integer_dtype(kv_lens.dtype), "kv_lens must be integer")
        require(kv_lens.stride(0) == 1 or kv_lens.shape[0] <= 1,
                f"kv_lens must be contiguous (the kernel reads it densely), got stride {kv_lens.stride(0)}")
        check_same_device(meta._kv_lens.device, kv_lens=kv_lens)
    derive_token_fields(
        kv_lens=meta._kv_lens, kv_lens_staged=meta._kv_lens_staged, qo_lens=meta._qo_lens,
        qo_offsets=meta._qo_offsets, token_request=meta._token_request, token_intra=meta._token_intra,
        token_live=meta._token_live, block_table_flat=meta._block_table_flat,
        max_blocks_per_seq=meta.max_blocks_per_seq, block_size=meta.block_size, positions=meta._positions,
        token_kv_lens=meta._token_kv_lens, valid_blocks=meta._valid_blocks, cache_slots=meta._cache_slots,
        new_kv_lens=kv_lens,
    )
