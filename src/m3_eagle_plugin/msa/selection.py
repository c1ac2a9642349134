"""Per-token MSA block selection (the "indexer" top-k), as plain torch references.

Every query token scores each causally visible key block by the max raw dot product between its
index query and the block's index keys, forces its local (and optional init) blocks, and keeps the
top-k blocks per index head. ``select_blocks`` works on one dense sequence; ``select_blocks_paged``
reads index-K through the step metadata's block tables for a whole mixed batch. Triton kernels in
``msa.kernels`` mirror these functions and are tested against them.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .blocks import (
    MsaInputError, as_int64, checked_int, is_integer_dtype, request_pages, require_tensors, validate_block_size,
)

__all__ = ["select_blocks", "select_blocks_paged", "select_from_block_scores"]

# Upper bound on the fp32 elements of one score chunk; keeps long prompts affordable on CPU.
_SCORE_CHUNK_ELEMS = 1 << 24


def _validate_selection_args(topk: int, local_blocks: int, init_blocks: int) -> None:
    for name, value, low in (("topk", topk, 1), ("local_blocks", local_blocks, 0), ("init_blocks", init_blocks, 0)):
        checked_int(name, value, low)
    if local_blocks + init_blocks > topk:
        raise MsaInputError(
            f"local_blocks + init_blocks ({local_blocks} + {init_blocks}) exceed topk ({topk}): "
            "forced blocks would not all fit"
        )


def _require_real(**named: torch.Tensor) -> None:
    """Scores and index vectors are real: torch casts a complex one to its real part, warning only."""
    for name, value in named.items():
        if value.is_complex():
            raise MsaInputError(f"{name} must be a real tensor, got {value.dtype}")


def _token_chunks(num_tokens: int, elems_per_token: int) -> Iterator[slice]:
    step = max(1, _SCORE_CHUNK_ELEMS // max(1, elems_per_token))
    for start in range(0, num_tokens, step):
        yield slice(start, min(num_tokens, start + step))


def select_from_block_scores(
    block_scores: torch.Tensor,
    query_blocks: torch.Tensor,
    *,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """Top-k selection from block scores ``[H, T, N]`` given each token's own block ``[T]``.

    Blocks after a token's own block are invisible whatever their score. Forced blocks (the
    ``local_blocks`` blocks ending at the token's block, and blocks ``0..init_blocks-1``) win over
    any real score, ``+inf`` included (a NaN score ranks first, where torch's sort puts it, as the
    kernels do); a free block scoring ``-inf`` is not kept; among equal scores the lower block id
    wins, so a token's selection never depends on ``N`` (the step's widest request). Scores are
    ranked in fp32, fp64 ones in fp64.
    Returns int32 ``[H, T, topk]``: ascending block ids, ``-1`` padded. A token's own block must be
    among the ``N`` scored ones (its local block is forced); checking that reads ``query_blocks``
    back once.
    """
    _validate_selection_args(topk, local_blocks, init_blocks)
    require_tensors(block_scores=block_scores, query_blocks=query_blocks)
    _require_real(block_scores=block_scores)
    if block_scores.dim() != 3:
        raise MsaInputError(f"block_scores must be [H, T, N], got {tuple(block_scores.shape)}")
    num_heads, num_tokens, num_blocks = block_scores.shape
    if query_blocks.dim() != 1 or query_blocks.shape[0] != num_tokens:  # [1] would broadcast to every token
        raise MsaInputError(f"query_blocks must be [T={num_tokens}], got {tuple(query_blocks.shape)}")
    if not is_integer_dtype(query_blocks.dtype):
        raise MsaInputError(f"query_blocks must be an integer tensor, got {query_blocks.dtype}")
    query_blocks = as_int64("query_blocks", query_blocks)  # torch has no max of uint16/32/64 tensors
    if num_tokens and int(query_blocks.max()) >= num_blocks:
        raise MsaInputError(f"query_blocks reach block {int(query_blocks.max())} but block_scores score "
                            f"{num_blocks} blocks: that token's own (forced) block would be dropped")
    return _select_from_scores(block_scores, query_blocks, topk, local_blocks, init_blocks)


def _select_from_scores(block_scores, query_blocks, topk: int, local_blocks: int, init_blocks: int) -> torch.Tensor:
    """`select_from_block_scores` on checked arguments whose query blocks lie among the scored ones
    (the callers below derive both from the same positions): no read-back, so it can be captured."""
    num_heads, num_tokens, num_blocks = block_scores.shape
    out = torch.full((num_heads, num_tokens, topk), -1, dtype=torch.int32, device=block_scores.device)
    if num_blocks == 0 or num_tokens == 0:
        return out
    block_ids = torch.arange(num_blocks, device=block_scores.device)
    kept = min(topk, num_blocks)
    # fp64 stays fp64: in fp32, distinct scores tied (the lower id won) and one past fp32's range
    # became +inf, tied with the forced blocks (which it could then displace)
    rank_dtype = torch.float64 if block_scores.dtype == torch.float64 else torch.float32
    # Ties go to the lower block id (the kernels' rule). A stable descending sort, not topk: topk
    # breaks ties by its internal order, which changes with the row width N, so a token's blocks
    # depended on the longest request of its step (and transformers' own choice is just as arbitrary).
    # Then a stable sort by tier: NaN scores first (where torch's sort ranks them, as the kernels do),
    # then the forced blocks, then the rest by score. On scores alone a real +inf (an fp32 overflow)
    # tied the forced blocks' +inf and, from a lower id, displaced the forced local block.
    # Token chunks bound the sort's [H, Tc, N] copies on long prompts.
    for chunk in _token_chunks(num_tokens, num_heads * num_blocks):
        own_block = query_blocks[chunk].to(torch.int64)[:, None]
        visible = block_ids[None, :] <= own_block
        forced = visible & ((block_ids[None, :] > own_block - local_blocks) | (block_ids[None, :] < init_blocks))
        scores = block_scores[:, chunk].to(rank_dtype)
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(forced, float("inf"))
        tier = scores.isnan().to(torch.int8) * 2 + forced.to(torch.int8)  # a forced score is +inf, never NaN
        by_score = scores.sort(dim=-1, descending=True, stable=True).indices
        by_tier = tier.gather(-1, by_score).sort(dim=-1, descending=True, stable=True).indices
        top_ids = by_score.gather(-1, by_tier[..., :kept])
        top_scores = scores.gather(-1, top_ids)
        top_ids = top_ids.masked_fill(top_scores == float("-inf"), num_blocks).sort(dim=-1).values
        out[:, chunk, :kept] = top_ids.masked_fill(top_ids == num_blocks, -1).to(torch.int32)
    return out


def _block_scores_into(
    out: torch.Tensor,
    index_q: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    key_ok: torch.Tensor | None,
    block_size: int,
) -> None:
    """Write max-over-visible-keys block scores ``[H, T, N]`` of queries against one sequence.

    ``keys`` is ``[N * B, D]`` (fp32); key ``j`` is visible to a query at ``p`` iff ``j <= p``
    and ``key_ok[j]`` (when given). Blocks with no visible key score ``-inf``.
    """
    num_heads, num_tokens, num_blocks = out.shape
    key_pos = torch.arange(num_blocks * block_size, device=keys.device)
    for chunk in _token_chunks(num_tokens, num_heads * keys.shape[0]):
        scores = torch.einsum("thd,sd->hts", index_q[chunk].float(), keys)
        hidden = key_pos[None, :] > positions[chunk, None]
        if key_ok is not None:
            hidden = hidden | ~key_ok[None, :]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[:, chunk] = scores.view(num_heads, -1, num_blocks, block_size).amax(dim=-1)


def select_blocks(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """Dense single-sequence block selection, int32 ``[H_idx, T, topk]``.

    ``index_q`` is ``[T, H_idx, D]`` and ``index_k`` ``[S, D]`` (already normed and rotated);
    ``q_positions`` ``[T]`` (integers) are the queries' absolute positions in the sequence, each in
    ``[0, S)`` (checked: a read back on a GPU; this is the reference, not a step kernel).
    Key ``j`` is visible to a query at ``p`` iff ``j <= p``; a block scores the max raw fp32 dot
    product over its visible keys.
    """
    block_size = validate_block_size(block_size)
    _validate_selection_args(topk, local_blocks, init_blocks)
    for name, value in (("index_q", index_q), ("index_k", index_k), ("q_positions", q_positions)):
        if not isinstance(value, torch.Tensor):  # a list failed on `.dim`, naming no argument
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    _require_real(index_q=index_q, index_k=index_k)
    if index_q.dim() != 3 or index_k.dim() != 2 or q_positions.dim() != 1:
        raise MsaInputError(
            "expected index_q [T, H, D], index_k [S, D], q_positions [T]; got "
            f"{tuple(index_q.shape)}, {tuple(index_k.shape)}, {tuple(q_positions.shape)}"
        )
    num_tokens, num_heads, dim = index_q.shape
    if index_k.shape[1] != dim or q_positions.shape[0] != num_tokens:
        raise MsaInputError(
            f"shape mismatch: index_q {tuple(index_q.shape)}, index_k {tuple(index_k.shape)}, "
            f"q_positions {tuple(q_positions.shape)}"
        )
    seq_len = index_k.shape[0]
    if not is_integer_dtype(q_positions.dtype):
        raise MsaInputError(f"q_positions must be an integer tensor, got {q_positions.dtype}")
    positions = as_int64("q_positions", q_positions)  # torch has no min / max of uint16/32/64 tensors
    if num_tokens and not (0 <= int(positions.min()) and int(positions.max()) < seq_len):
        raise MsaInputError(f"q_positions must lie in [0, {seq_len}) (the index keys), got "
                            f"[{int(positions.min())}, {int(positions.max())}]")
    num_blocks = -(-seq_len // block_size)
    keys = torch.nn.functional.pad(index_k.float(), (0, 0, 0, num_blocks * block_size - seq_len))
    key_ok = torch.arange(num_blocks * block_size, device=index_k.device) < seq_len
    block_scores = torch.empty((num_heads, num_tokens, num_blocks), dtype=torch.float32, device=index_q.device)
    _block_scores_into(block_scores, index_q, keys, positions, key_ok, block_size)
    query_blocks = torch.div(positions, block_size, rounding_mode="floor")
    return _select_from_scores(block_scores, query_blocks, topk, local_blocks, init_blocks)


def select_blocks_paged(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    meta,
    *,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """Block selection for a whole step, reading index-K through ``meta.block_tables``.

    ``index_q`` is ``[T, Hi, Di]``; ``index_k_cache`` ``[P, B, Di]`` may be a strided view into
    a pooled cache (it is only indexed, never reshaped). ``meta`` is an ``MsaDecodeMetadata``
    after ``prepare`` (and possibly ``on_update_kv_lens``). Returns int32 ``[Hi, T, topk]`` of
    logical block ids of each token's request, ascending, ``-1`` padded. Each request's index-K
    is gathered once, up to its staged length; keys past the (corrected) length never count
    because every token only sees keys up to its own position.
    """
    _validate_selection_args(topk, local_blocks, init_blocks)
    require_tensors(index_q=index_q, index_k_cache=index_k_cache)
    _require_real(index_q=index_q, index_k_cache=index_k_cache)
    block_size = meta.block_size
    num_tokens = meta.num_tokens
    if index_q.dim() != 3 or index_q.shape[0] != num_tokens:
        raise MsaInputError(f"index_q must be [T={num_tokens}, Hi, Di], got {tuple(index_q.shape)}")
    if index_k_cache.dim() != 3 or index_k_cache.shape[1] != block_size or index_k_cache.shape[2] != index_q.shape[2]:
        raise MsaInputError(
            f"index_k_cache must be [P, B={block_size}, Di={index_q.shape[2]}], got {tuple(index_k_cache.shape)}"
        )
    num_heads, dim = index_q.shape[1], index_q.shape[2]
    num_blocks = meta.max_step_blocks
    block_scores = torch.full(
        (num_heads, num_tokens, num_blocks), float("-inf"), dtype=torch.float32, device=index_q.device
    )
    positions = meta.positions.to(torch.int64)
    for _, rows, pages in request_pages(meta):
        request_blocks = pages.shape[0]
        keys = index_k_cache[pages.clamp(min=0)].float().reshape(request_blocks * block_size, dim)
        key_ok = (pages >= 0).repeat_interleave(block_size)
        _block_scores_into(
            block_scores[:, rows, :request_blocks], index_q[rows], keys, positions[rows], key_ok, block_size
        )
    query_blocks = torch.div(positions, block_size, rounding_mode="floor")
    return _select_from_scores(block_scores, query_blocks, topk, local_blocks, init_blocks)
