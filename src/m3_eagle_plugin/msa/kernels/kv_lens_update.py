"""Fused `on_update_kv_lens`: re-derive a step's per-token metadata from corrected kv lengths.

Why: the overlap scheduler stages optimistic kv lengths and corrects them on the device after the
previous step's acceptance is known. Re-deriving the lengths, offsets, positions, token kv
lengths, valid-block counts and write slots with separate torch ops costs a dozen launches per
step; this is one launch with no host sync, safe inside a CUDA graph, and idempotent
(`min(new, staged)` gives the same result when fed its own output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import require

ELEMS_PER_PROGRAM = 1024


@triton.jit
def _update_kv_lens_kernel(
    new_ptr, staged_ptr, qo_ptr, cu_ptr, req_ptr, bt_ptr, s_bt_r, width,
    kv_out, qoff_out, pos_out, tkv_out, vb_out, slot_out,
    num_requests, num_tokens,
    BLOCK: tl.constexpr, HAS_NEW: tl.constexpr, EPP: tl.constexpr,
):
    i = tl.program_id(0) * EPP + tl.arange(0, EPP)
    live_req = i < num_requests
    staged = tl.load(staged_ptr + i, mask=live_req, other=0)
    if HAS_NEW:
        kv = tl.minimum(tl.load(new_ptr + i, mask=live_req, other=0), staged)
    else:
        kv = staged
    qo = tl.load(qo_ptr + i, mask=live_req, other=0)

    total = tl.load(cu_ptr + num_requests)
    is_tok = i < num_tokens
    live_tok = is_tok & (i < total)
    r = tl.load(req_ptr + i, mask=live_tok, other=0)
    kv_t = tl.load(staged_ptr + r, mask=live_tok, other=0)
    if HAS_NEW:
        kv_t = tl.minimum(tl.load(new_ptr + r, mask=live_tok, other=0), kv_t)
    pos = kv_t - tl.load(qo_ptr + r, mask=live_tok, other=0) + (i - tl.load(cu_ptr + r, mask=live_tok, other=0))
    blk = pos // BLOCK
    page = tl.load(bt_ptr + r.to(tl.int64) * s_bt_r + blk,
                   mask=live_tok & (blk >= 0) & (blk < width), other=-1).to(tl.int64)
    slot = tl.where(live_tok & (page >= 0), page * BLOCK + pos % BLOCK, -1)
    # All loads above happen before any store below, so outputs may alias inputs.
    tl.debug_barrier()
    tl.store(kv_out + i, kv, mask=live_req)
    tl.store(qoff_out + i, kv - qo, mask=live_req)
    tl.store(pos_out + i, pos, mask=live_tok)
    tl.store(tkv_out + i, pos + 1, mask=live_tok)
    tl.store(vb_out + i, (pos + BLOCK) // BLOCK, mask=live_tok)
    tl.store(slot_out + i, slot, mask=is_tok)


def update_kv_lens(
    *,
    staged_kv_lens: torch.Tensor,
    qo_lens: torch.Tensor,
    cu_qo_lens: torch.Tensor,
    token_request: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    kv_lens_out: torch.Tensor,
    qo_offsets_out: torch.Tensor,
    positions_out: torch.Tensor,
    token_kv_lens_out: torch.Tensor,
    valid_blocks_out: torch.Tensor,
    cache_slots_out: torch.Tensor,
    new_kv_lens: torch.Tensor | None = None,
) -> None:
    """One launch: `kv = min(new_kv_lens, staged_kv_lens)` per request, then per token t of request r
    `pos = kv[r] - qo[r] + (t - cu[r])`, `token_kv_len = pos + 1`, `valid_blocks = ceil((pos + 1) / B)`,
    `cache_slot = block_tables[r, pos // B] * B + pos % B` (`-1` past the live tokens or on an
    unmapped page); `qo_offsets = kv - qo`, `kv_lens = kv`. Outputs are written in place.
    """
    num_requests = staged_kv_lens.shape[0]
    num_tokens = token_request.shape[0]
    require(block_size > 0 and block_size & (block_size - 1) == 0, f"block_size must be a power of two, got {block_size}")
    require(cu_qo_lens.shape[0] == num_requests + 1, "cu_qo_lens must have num_requests + 1 entries")
    require(qo_lens.shape[0] == num_requests and kv_lens_out.shape[0] == num_requests
            and qo_offsets_out.shape[0] == num_requests, "per-request tensors must have num_requests entries")
    for name, t in (("positions_out", positions_out), ("token_kv_lens_out", token_kv_lens_out),
                    ("valid_blocks_out", valid_blocks_out), ("cache_slots_out", cache_slots_out)):
        require(t.shape[0] == num_tokens, f"{name} must have {num_tokens} entries, got {t.shape[0]}")
    require(new_kv_lens is None or new_kv_lens.shape[0] >= num_requests,
            "new_kv_lens must have an entry per request")
    require(block_tables.dim() == 2 and block_tables.stride(1) == 1, "block_tables must be [R, W] with unit last stride")
    n = max(num_requests, num_tokens)
    if n == 0:
        return
    grid = (triton.cdiv(n, ELEMS_PER_PROGRAM),)
    _update_kv_lens_kernel[grid](
        new_kv_lens if new_kv_lens is not None else staged_kv_lens, staged_kv_lens, qo_lens, cu_qo_lens,
        token_request, block_tables, block_tables.stride(0), block_tables.shape[1],
        kv_lens_out, qo_offsets_out, positions_out, token_kv_lens_out, valid_blocks_out, cache_slots_out,
        num_requests, num_tokens,
        BLOCK=block_size, HAS_NEW=new_kv_lens is not None, EPP=ELEMS_PER_PROGRAM, num_warps=4,
    )
