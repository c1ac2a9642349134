"""Paged attention references for MSA layers: block-sparse (layers 3+) and dense causal.

Both read K/V through the step metadata (``token_request``, ``positions``, ``block_tables``) so a
mixed batch of prompt chunks, verify rows and single decode tokens runs in one call, each token
following its own causal ladder: it sees keys ``j <= position``. The sparse variant further
restricts keys to the blocks chosen by the selector, per KV head. Math is fp32; each request's
pages are gathered once and its tokens are processed in chunks, so a long prompt never holds more
than a bounded ``tokens x keys`` score tile.
"""

from __future__ import annotations

import math
import numbers

import torch

from .blocks import MsaInputError, is_integer_dtype, request_pages, require_tensors

__all__ = ["sparse_attention", "dense_attention"]

# Upper bound on the fp32 score elements of one token chunk.
_GATHER_CHUNK_ELEMS = 1 << 24


def _check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> tuple[int, int]:
    require_tensors(q=q, k_cache=k_cache, v_cache=v_cache)
    if q.dim() != 3 or q.shape[0] != meta.num_tokens:
        raise MsaInputError(f"q must be [T={meta.num_tokens}, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise MsaInputError(
            f"k_cache and v_cache must both be [P, Hkv, B, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_q_heads, dim = q.shape[1], q.shape[2]
    _, num_kv_heads, block_size, cache_dim = k_cache.shape
    if block_size != meta.block_size or cache_dim != dim:
        raise MsaInputError(
            f"k_cache [P, Hkv, B, D] = {tuple(k_cache.shape)} does not match "
            f"block_size {meta.block_size} / head dim {dim}"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise MsaInputError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads}), "
                            "and there must be at least one KV head")
    return num_q_heads // num_kv_heads, num_kv_heads


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    selection: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of each token over its request's cache, optionally restricted to selected blocks.

    Each request's K/V pages are gathered once (up to its staged kv length). Key ``j`` is
    visible to a token at ``p`` iff ``j <= p``, its page is mapped and, when ``selection``
    (``[Hkv, T, topk]``) is given, its block is selected for the token's KV head. Tokens with no
    visible key produce zeros.
    """
    group, num_kv_heads = _check_qkv(q, k_cache, v_cache, meta)
    num_tokens, num_q_heads, dim = q.shape
    block_size = meta.block_size
    out = torch.zeros((num_tokens, num_q_heads, dim), dtype=q.dtype, device=q.device)
    positions = meta.positions.to(torch.int64)
    kv_lens = meta.kv_lens
    for r, rows, pages in request_pages(meta):
        num_blocks = pages.shape[0]
        num_keys = num_blocks * block_size
        keys = k_cache[pages.clamp(min=0)].float().permute(1, 0, 2, 3).reshape(num_kv_heads, num_keys, dim)
        values = v_cache[pages.clamp(min=0)].float().permute(1, 0, 2, 3).reshape(num_kv_heads, num_keys, dim)
        key_pos = torch.arange(num_keys, device=q.device)
        key_ok = (pages >= 0).repeat_interleave(block_size)
        # Slots past the (corrected) length may hold stale or uninitialised data (NaN even), which a
        # masked score or a zero weight would still propagate: clear them.
        unwritten = ~(key_ok & (key_pos < kv_lens[r]))[None, :, None]
        keys = keys.masked_fill(unwritten, 0.0)
        values = values.masked_fill(unwritten, 0.0)
        step = max(1, _GATHER_CHUNK_ELEMS // (num_q_heads * num_keys))
        for chunk_start in range(rows.start, rows.stop, step):
            chunk = slice(chunk_start, min(rows.stop, chunk_start + step))
            visible = key_ok[None, :] & (key_pos[None, :] <= positions[chunk, None])  # [Tc, S]
            if selection is None:
                visible = visible[None].expand(num_kv_heads, -1, -1)
            else:
                visible = visible[None] & _selected_keys(selection[:, chunk], num_blocks, block_size)
            queries = q[chunk].float().unflatten(1, (num_kv_heads, group)).permute(1, 2, 0, 3)  # [Hkv, G, Tc, D]
            context = torch.nn.functional.scaled_dot_product_attention(
                queries,
                keys[:, None].expand(-1, group, -1, -1),
                values[:, None].expand(-1, group, -1, -1),
                attn_mask=visible[:, None],
                scale=scale,
            )  # [Hkv, G, Tc, D]; rows without a visible key are undefined here and zeroed below
            has_key = visible.any(dim=-1)[:, None, :, None]
            context = torch.where(has_key, context, torch.zeros_like(context)).permute(2, 0, 1, 3)
            out[chunk] = context.reshape(-1, num_q_heads, dim).to(q.dtype)
    return out


def _selected_keys(selection: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Key mask ``[Hkv, Tc, N * B]`` of the blocks listed in ``selection`` ``[Hkv, Tc, topk]``."""
    heads, tokens, _ = selection.shape
    ids = selection.to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < num_blocks), ids, torch.full_like(ids, num_blocks))
    chosen = torch.zeros((heads, tokens, num_blocks + 1), dtype=torch.bool, device=selection.device)
    chosen.scatter_(2, ids, True)
    return chosen[..., :num_blocks].repeat_interleave(block_size, dim=-1)


def _check_scale(scale: float) -> float:
    # numbers.Real takes NumPy scalars too; a tensor is refused by type (reading it would sync a device).
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number (a Python or NumPy scalar), got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise MsaInputError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    selection: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Block-sparse attention, ``[T, Hq, D]`` in ``q.dtype``.

    ``selection`` is ``[Hkv, T, topk]`` logical block ids (``-1`` = none); query head ``h`` uses
    row ``h // (Hq // Hkv)``. Inside the selected blocks each token attends keys ``j <= position``.
    """
    scale = _check_scale(scale)
    require_tensors(selection=selection)
    group, num_kv_heads = _check_qkv(q, k_cache, v_cache, meta)
    if selection.dim() != 3 or selection.shape[:2] != (num_kv_heads, q.shape[0]):
        raise MsaInputError(
            f"selection must be [Hkv={num_kv_heads}, T={q.shape[0]}, topk], got {tuple(selection.shape)}"
        )
    if not is_integer_dtype(selection.dtype):
        raise MsaInputError(f"selection must be an integer tensor of block ids, got {selection.dtype}")  # not truncated
    return _attend(q, k_cache, v_cache, meta, selection, scale)


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention over each token's request cache: keys at positions ``< token_kv_lens``."""
    scale = _check_scale(scale)
    return _attend(q, k_cache, v_cache, meta, None, scale)
