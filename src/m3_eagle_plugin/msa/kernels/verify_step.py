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

Applies to the per-token layout with one index head per KV head, on SM90+ (PDL), where it pays
(`early_pays`): steps of `EARLY_MIN_UNITS` (token, KV head) rows or more whose programs get at
most two pages each; elsewhere the two calls run as before. (H200, 2026-11-30, the step, plain
-> early, best of three interleaved rounds, two fresh input sets each: B16/32K q1 46.8 / 46.6 ->
45.7 / 45.6 us, B8 q4 34.3 -> 33.9, B4 q4 23.3 / 23.2 -> 22.7 / 22.5. Where a program gets four
or more pages it does not pay: B16 q4 53.4 / 53.3 -> 53.4 / 53.4, B64 q1 142.3 / 142.5 -> 143.9 /
143.7, B64 q4 159.6 / 159.7 -> 167.2 / 167.7, and 156-159 in other runs: early varies from run
to run there, plain does not. B1/8K q4 8.7 -> 9.0: the one request's attention can only follow
its own scoring.)
"""
from __future__ import annotations

from typing import Any

import torch

from ._common import device_sm_count, qo_len_hint, require
from .block_union import chunk_count
from .handoff import handoff_enabled
from .index_select import select_announcing, select_blocks_verify
from .pdl import pdl_args
from .sparse_verify import check_attention_inputs, default_layout, sparse_verify_attention

#: Fewest (token, KV head) rows a step needs for the early attention (B16 q1 and B4 q4 have 16).
EARLY_MIN_UNITS = 16


def early_splits(units: int, topk: int, device: torch.device | str) -> int:
    """Splits of each token's pages for the early attention: about two programs per SM, at most
    one page each."""
    return int(max(1, min(topk, 2 * device_sm_count(torch.device(device)) // max(1, units))))


def early_pays(units: int, topk: int, device: torch.device | str) -> bool:
    """Whether the measured rule launches the attention early: at least EARLY_MIN_UNITS rows, and
    at most two pages a program (`early_splits` at least half of topk)."""
    return units >= EARLY_MIN_UNITS and 2 * early_splits(units, topk, device) >= topk


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
    overrides the early attention's splits."""
    check_attention_inputs(q, k_cache, v_cache, meta)  # before anything is launched or armed
    max_qo_len = qo_len_hint(meta, max_qo_len)
    num_tokens, num_heads, _ = q.shape
    hkv = k_cache.shape[1]
    require(index_q.shape[0] == num_tokens, f"index_q has {index_q.shape[0]} tokens, q has {num_tokens}")
    kw = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, max_qo_len=max_qo_len)
    attend = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len)
    if early is not False and splits is None:
        units = chunk_count(num_tokens, meta.kv_lens.shape[0], 1, max_qo_len) * meta.kv_lens.shape[0] * hkv
        if early or early_pays(units, topk, q.device):
            splits = early_splits(units, topk, q.device)
    applies = (early is not False and splits is not None and index_q.shape[1] == hkv and handoff_enabled()
               and default_layout(num_heads // hkv) == "token"
               and (early or pdl_args(q.device, (), every_grid=True)["PDL"]))
    if applies:  # ready is None without a board or flags (a capture before they existed)
        selection, _, ready = select_announcing(index_q, index_k_cache, meta, consumers=splits, **kw)
    else:
        selection, ready = select_blocks_verify(index_q, index_k_cache, meta, **kw), None
    if ready is None:
        return selection, sparse_verify_attention(q, k_cache, v_cache, meta, selection, **attend)
    try:
        out = sparse_verify_attention(q, k_cache, v_cache, meta, selection, splits=splits, ready=ready, **attend)
    except BaseException:
        ready.zero_()  # in stream order, after the top-k has set them: the next step must find zeros
        raise
    return selection, out

