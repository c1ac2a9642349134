"""A sparse layer's verify step (block selection, then sparse attention) as one call, with the
attention launched while the top-k still runs.

Why: with the hand-off (`handoff`) the top-k of most requests finishes in the scoring's tail,
but an attention launched in stream order (or waiting in `griddepcontrol.wait`) still starts
only after the slowest request's top-k. Here the attention is launched early (PDL) and each of
its programs waits only for its own token's selection row, so the attention of the requests
scored first runs while the last ones are still scored and selected.

How: the top-k (`index_select.select_announcing`) releases the attention's launch at its start;
after writing a row it sets that row's `handoff.ready_flags` entry to the number of attention
programs that read the row (the splits), with release order. Every thread of an attention
program polls its flag with acquire loads, so nothing stands between seeing the flag and
loading the selection; the program takes one off the flag at its end (so the last reader
leaves it zero for the next step) and waits for the top-k grid (`griddepcontrol.wait`) only
before its first store: its outputs may reuse memory the scoring still reads until then.
Deadlock-free: a PDL kernel is scheduled only once every program of its predecessor has
started, so every producer an attention program waits for is already resident. The attention
gets about two programs per SM here (16 splits at B16 q1, where the plain rule gives 8).
With fp8 K/V its programs are numbered request by request (`early_order`), so they start in
about the order their rows are selected.

Applies to the per-token layout with one index head per KV head, on SM90+ (PDL), where it pays
(`early_rule`); elsewhere the two calls run as before. With fp8 K/V (the production cache): from
`EARLY_MIN_UNITS` to two (token, KV head) rows per SM, and where a program gets two pages or more
its key tile spans two pages (two pipeline stages, `early_tiling`). H200, 2026-11-30, fp8 K/V,
the step, the former rule (early only up to two pages a program, one-page tiles) -> this one,
three interleaved rounds, two processes:
B16/32K q4 53.47 / 53.35 -> 50.60 / 50.66 us, B64 q1 142.16 / 142.20 -> 140.77 / 140.84, B32 q4
90.32 -> 86.85, B8 q4 33.74 -> 32.73; B16 q1 and B4 q4 (one page a program) keep one-page tiles
(two-page tiles with 8 splits: 45.70 vs 45.52, 22.67 vs 22.54). Early with one-page tiles (4
splits) was no faster: B16 q4 53.44 / 53.03 at 3 / 2 stages, B64 q1 142.38 at 2: the two-page tile
is what pays. From one to two rows per SM, one split (2026-11-30, `scripts/ab/early_ab18.py`, plain
-> early): B64/8K q4 68.95 -> 66.84, B64/32K q4 160.23 -> 156.71, B64/128K q4 521.3 -> 516.8, B48/32K
q4 129.39 -> 125.75, B200/8K q1 133.87 -> 133.25, B256/8K q1 164.44 -> 163.98 (early 4 splits had
been slower at B64/32K q4: 175.1 two-page, 168.8 one-page). Past two rows per SM the plain launch
stays: B128/8K q4 (512 rows) 127.06 vs 127.95 early, B128/32K q4 307.9 vs 307.2, B256/4K q4 (1024)
193.6 vs 205.4. B1/8K q4 8.7 plain: the one request's attention can only follow its own scoring.
With bf16 K/V the former rule stays (early only up to two pages a program, one-page tiles): there
this rule took B16/32K q4 59.7 vs 56.5 us, B32 q4 104.7 vs 94.3, B64 q1 152.8 vs 148.8, B16/4K q4
(the reference host's shape) 33.4 vs 27.9.
"""
from __future__ import annotations

from typing import Any

import torch

from m3_eagle_plugin._ints import exact_index

from ._common import (KernelInputError, attention_scales, check_same_device, device_sm_count, qo_len_hint,
                      require)
from .attention_io import check_attention_inputs
from .block_union import chunk_count
from .handoff import handoff_enabled, reset_handoff, reset_while_raising
from .index_select import select_announcing, select_blocks_verify
from .pdl import pdl_args
from .replay import Replayer, call_signature
from .sparse_verify import default_layout, sparse_verify_attention, two_page_tile_fits

#: Fewest (token, KV head) rows a step needs for the early attention (B16 q1 and B4 q4 have 16).
EARLY_MIN_UNITS = 16


def early_splits(units: int, topk: int, device: torch.device | str) -> int:
    """Splits of each token's pages for the early attention: about two programs per SM, at most
    one page each."""
    return int(max(1, min(topk, 2 * device_sm_count(torch.device(device)) // max(1, units))))


def early_rule(units: int, topk: int, device: torch.device | str, kv_bytes: int = 1) -> int | None:
    """The early attention's splits (`early_splits`) where the measured rule launches it early,
    else None: at least EARLY_MIN_UNITS rows, and for 1-byte K/V at most two rows per SM, for wider
    K/V at most two pages a program (their two-page tiles were slower, see the module docstring)."""
    splits = early_splits(units, topk, device)
    if kv_bytes == 1:
        pays = units <= 2 * device_sm_count(torch.device(device))
    else:
        pays = 2 * splits >= topk
    return splits if units >= EARLY_MIN_UNITS and pays else None


def early_order(kv_bytes: int = 1) -> bool:
    """Whether the early attention numbers its programs request by request
    (`sparse_verify_attention(request_major=True)`): for 1-byte K/V. H200, 2026-11-30,
    `scripts/ab/order26.py`, the step graph-replayed, seven alternating rounds, outputs identical,
    the grid's order -> request-major, us: B4/8K q4 13.18 -> 12.93, B4/32K q4 21.66 -> 21.11, B16/8K
    q4 25.73 -> 25.57, q1 20.82 -> 20.31, B16/32K q4 49.34 -> 49.26, q1 44.20 -> 43.97, B32/8K q4
    40.23 -> 39.97, B64/8K q4 65.77 -> 65.26, q1 49.92 -> 49.91, B64/32K q4 153.84 -> 153.58; B8/32K
    q4 31.23 -> 31.25 and B64/128K q4 504.17 -> 504.16 level. With bf16 K/V it lost in every
    round (B16/4K q1 20.20 -> 20.85, B8/32K q4 35.42 -> 35.79), so there the grid's order stays."""
    return kv_bytes == 1


def early_tiling(splits: int, topk: int, kv_bytes: int = 1, block: int = 128, dim: int = 128) -> dict:
    """The early attention's tile options: for 1-byte K/V, two-page key tiles with two pipeline
    stages where a program gets two pages or more (`sparse_verify_attention(pages_per_tile=2)`)
    and such a tile fits (`two_page_tile_fits`: pages `block` x `dim`); else the defaults."""
    two = kv_bytes == 1 and -(-topk // splits) >= 2 and two_page_tile_fits(block, dim, kv_bytes)
    return dict(pages_per_tile=2, num_stages=2) if two else {}


def sparse_verify_step(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    *,
    topk: int,
    scale: float,
    local_blocks: int = 1,
    init_blocks: int = 0,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_qo_len: int | None = None,
    early: bool | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection int32 `[Hi, T, topk]`, attention `[T, Hq, D]`): `select_blocks_verify` then
    `sparse_verify_attention`, the attention launched early where it applies (`early=None`: by
    the measured rule; True: wherever the hand-off runs, PDL or not; False: never). `splits`
    overrides the early attention's splits (its key tiles follow them: `early_tiling`).

    Replayed (`replay`) after the first call of a signature: the later layers of a step launch
    what the first one decided, with their own tensors."""
    inputs = (index_q, index_k_cache, q, k_cache, v_cache)
    scalars = (topk, scale, local_blocks, init_blocks, k_scale, v_scale, max_qo_len, early, splits)
    try:
        return _REPLAYER.call(call_signature(inputs, meta, scalars), inputs, meta, lambda: _step(
            index_q, index_k_cache, q, k_cache, v_cache, meta, topk=topk, scale=scale, local_blocks=local_blocks,
            init_blocks=init_blocks, k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len, early=early,
            splits=splits))
    except BaseException as error:
        # Cut off between launches (a Ctrl-C raised as one returns, in `_step` or in a replay): the top-k may
        # have set flags for an attention never launched. Refusals come before a launch or clean up themselves.
        if isinstance(q, torch.Tensor) and not isinstance(error, KernelInputError):
            reset_while_raising(error, lambda: reset_handoff(q.device))
        raise


_REPLAYER = Replayer()


def _step(index_q, index_k_cache, q, k_cache, v_cache, meta, *, topk, scale, local_blocks, init_blocks, k_scale,
          v_scale, max_qo_len, early, splits) -> tuple[torch.Tensor, torch.Tensor]:
    check_attention_inputs(q, k_cache, v_cache, meta)  # before anything is launched or armed
    attention_scales(scale, k_scale, v_scale)  # refused before the selection launches
    max_qo_len = qo_len_hint(meta, max_qo_len)
    num_tokens, num_heads, _ = q.shape
    hkv = k_cache.shape[1]
    require(index_q.dim() == 3, f"index_q must be [T, Hi, Di], got {tuple(index_q.shape)}")
    require(index_q.shape[0] == num_tokens, f"index_q has {index_q.shape[0]} tokens, q has {num_tokens}")
    require(index_q.shape[1] == hkv, f"index_q has {index_q.shape[1]} heads, k_cache {hkv} KV heads: the attention "
            "reads one selection row per KV head")
    check_same_device(q.device, index_q=index_q, index_k_cache=index_k_cache)
    count = None if splits is None else exact_index(splits)  # a NumPy int is one, as for the attention's splits
    require(splits is None or (count is not None and count >= 1),  # 0 or -1 fell back to the rule unsaid
            f"splits must be None or an int >= 1, got {splits!r}")
    splits = count
    kw = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, max_qo_len=max_qo_len)
    attend = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len, checked=True)
    kv_bytes = k_cache.element_size()
    if early is not False and splits is None:
        units = chunk_count(num_tokens, meta.kv_lens.shape[0], 1, max_qo_len) * meta.kv_lens.shape[0] * hkv
        splits = early_splits(units, topk, q.device) if early else early_rule(units, topk, q.device, kv_bytes)
    applies = (early is not False and splits is not None and index_q.shape[1] == hkv and handoff_enabled()
               and default_layout(num_heads // hkv) == "token"
               and (early or pdl_args(q.device, (), every_grid=True)["PDL"]))
    if applies:  # ready is None without a board or flags (a capture before they existed)
        selection, _, ready = select_announcing(index_q, index_k_cache, meta, consumers=splits, **kw)
    else:
        selection, ready = select_blocks_verify(index_q, index_k_cache, meta, **kw), None
    if ready is None:
        return selection, sparse_verify_attention(q, k_cache, v_cache, meta, selection, **attend)
    tiling = early_tiling(splits, topk, kv_bytes, k_cache.shape[2], q.shape[-1])
    try:
        out = sparse_verify_attention(q, k_cache, v_cache, meta, selection, splits=splits, ready=ready,
                                      request_major=early_order(kv_bytes), **tiling, **attend)
    except BaseException as error:
        reset_while_raising(error, ready.zero_)  # in stream order, after the top-k set them: the next step finds 0
        raise
    return selection, out

