"""Paged attention references for MSA layers: block-sparse (layers 3+) and dense causal.

Both read K/V through the step metadata (``token_request``, ``positions``, ``block_tables``) so a
mixed batch of prompt chunks, verify rows and single decode tokens runs in one call, each token
following its own causal ladder: it sees keys ``j <= position``. The sparse variant further
restricts keys to the blocks chosen by the selector, per KV head. Math is fp32; work is chunked
over tokens so a long prompt never materialises ``T x cache`` tensors at once.
"""

from __future__ import annotations

import math

import torch

from .blocks import MsaInputError

__all__ = ["sparse_attention", "dense_attention"]

# Upper bound on gathered fp32 elements per token chunk.
_GATHER_CHUNK_ELEMS = 1 << 24


def _check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> tuple[int, int]:
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
            f"k_cache [P, Hkv, B, D] = {tuple(k_cache.shape)} does not match block_size {meta.block_size} / head dim {dim}"
        )
    if num_q_heads % num_kv_heads:
        raise MsaInputError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads, num_kv_heads


def _attend_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    token_blocks,
    num_blocks: int,
    scale: float,
) -> torch.Tensor:
    """Attention of each token over logical blocks ``token_blocks(chunk) -> [Tc, Hkv|1, N]``.

    Keys are masked when the block id is negative, unmapped in the block table, or the key's
    position is past the token's own. Tokens with no visible key produce zeros.
    """
    group, num_kv_heads = _check_qkv(q, k_cache, v_cache, meta)
    num_tokens, num_q_heads, dim = q.shape
    block_size = meta.block_size
    out = torch.zeros((num_tokens, num_q_heads, dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_blocks == 0:
        return out
    tables = meta.block_tables.to(torch.int64)
    table_width = tables.shape[1]
    requests = meta.token_request.to(torch.int64)
    positions = meta.positions.to(torch.int64)
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    offsets = torch.arange(block_size, device=q.device)
    per_token = num_blocks * block_size * (num_kv_heads * 2 * dim + num_q_heads)
    step = max(1, _GATHER_CHUNK_ELEMS // per_token)
    for start in range(0, num_tokens, step):
        chunk = slice(start, min(num_tokens, start + step))
        blocks = token_blocks(chunk).to(torch.int64)  # [Tc, Hkv or 1, N]
        tc, hb, nb = blocks.shape
        token_table = tables[requests[chunk]]  # [Tc, W]
        pages = token_table.gather(1, blocks.clamp(0, table_width - 1).reshape(tc, hb * nb)).view(tc, hb, nb)
        mapped = (blocks >= 0) & (blocks < table_width) & (pages >= 0)
        pages = pages.clamp(min=0)
        keys = k_cache[pages, heads].float()  # [Tc, Hkv, N, B, D]
        values = v_cache[pages, heads].float()
        key_pos = blocks[..., None] * block_size + offsets  # [Tc, Hkv|1, N, B]
        visible = mapped[..., None] & (key_pos <= positions[chunk, None, None, None])
        visible = visible.expand(tc, num_kv_heads, nb, block_size).reshape(tc, num_kv_heads, 1, nb * block_size)
        queries = q[chunk].float().view(tc, num_kv_heads, group, dim)
        scores = torch.einsum("thgd,thnd->thgn", queries, keys.reshape(tc, num_kv_heads, nb * block_size, dim))
        scores = (scores * scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(visible.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
        # Unwritten or stale slots may hold NaN/inf: zero masked values so 0 * NaN cannot leak.
        values = values.reshape(tc, num_kv_heads, nb * block_size, dim).masked_fill(~visible[:, :, 0, :, None], 0.0)
        context = torch.einsum("thgn,thnd->thgd", probs, values)
        out[chunk] = context.reshape(tc, num_q_heads, dim).to(q.dtype)
    return out


def _check_scale(scale: float) -> float:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
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
    group, num_kv_heads = _check_qkv(q, k_cache, v_cache, meta)
    if selection.dim() != 3 or selection.shape[:2] != (num_kv_heads, q.shape[0]):
        raise MsaInputError(
            f"selection must be [Hkv={num_kv_heads}, T={q.shape[0]}, topk], got {tuple(selection.shape)}"
        )
    by_token = selection.permute(1, 0, 2)
    return _attend_blocks(q, k_cache, v_cache, meta, lambda chunk: by_token[chunk], selection.shape[2], scale)


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
    num_blocks = meta.max_step_blocks
    all_blocks = torch.arange(num_blocks, device=q.device).view(1, 1, num_blocks)

    def token_blocks(chunk: slice) -> torch.Tensor:
        return all_blocks.expand(chunk.stop - chunk.start, 1, num_blocks)

    return _attend_blocks(q, k_cache, v_cache, meta, token_blocks, num_blocks, scale)
