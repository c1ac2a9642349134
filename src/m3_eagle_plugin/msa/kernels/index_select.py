"""Triton index scoring and per-token top-k block selection for decode / verify rows.

Why: on a sparse layer the index-K read dominates the verify step's bytes. One program owns a
slice of one request's pages and scores every verify token of that request against it, so each
index-K page is read once per step whatever the draft length, and the slices spread a single
long request over the whole GPU. A second tiny kernel turns the per-token block-score rows into
the selection contract of `m3_eagle_plugin.msa.select_blocks_paged`: `[Hi, T, topk]` int32,
logical block ids ascending, local block(s) forced, `-1` padded.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .block_union import BlockUnion, allocate_union, chunk_count
from .handoff import (SENTINEL as _SENTINEL, handoff_enabled, ready_flags, reset_handoff, reset_while_raising,
                      score_board)
from .launch import launch
from .pdl import pdl_args, release_dependents, wait_for_prior_grid, wait_then_release
from ._common import (
    CACHE_DTYPES,
    QUERY_DTYPES,
    KernelInputError,
    check_grid,
    qo_len_hint,
    byte_aligned,
    check_cache_block,
    check_cache_view,
    check_meta,
    check_same_device,
    check_step_rows,
    device_capability,
    entries_apart,
    device_sm_count,
    fits_one_tile,
    is_pow2,
    next_pow2,
    require,
    selection_counts,
    tokens_per_tile,
    triton_interpreting,
)

SENTINEL = tl.constexpr(_SENTINEL)


@triton.jit
def _block_score_kernel(
    iq_ptr, s_iq_t, s_iq_h,
    ik_ptr, s_ik_p, s_ik_b, ik_desc,
    bt_ptr, s_bt_r,
    cu_ptr, pos_ptr, kvl_ptr,
    score_ptr, s_sc_h, s_sc_t,
    HI: tl.constexpr, QP: tl.constexpr, BLOCK: tl.constexpr, DI: tl.constexpr,
    BLOCKS_PER_PROG: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, RELEASE: tl.constexpr = False,
    PDL: tl.constexpr = False, ONE_TILE: tl.constexpr = False,
):
    """Max visible score of each of a request's pages [chunk x BLOCKS_PER_PROG, ...) for every
    token of the request. With TMA a page arrives whole through `ik_desc` (a `[P, B, Di]` tensor
    descriptor of the cache) instead of per-thread copies. Programs run request by request (the
    chunk is the fastest grid axis); RELEASE lets a top-k that polls for its request's scores
    (`handoff`) launch (PDL) as soon as every scoring program has started (and, under PDL itself,
    waited for the previous kernel).

    ONE_TILE (TMA, one page a program, and the caller's max_qo_len within one QP-token tile: decode
    and verify steps) shortens what a program waits through before its page's copy starts, and a
    program holds its shared memory, which bounds how many sit on an SM, for all of it. It reads
    the page's table entry with the request's bounds and length, then the queries, then copies:
    two L2 round trips ahead of the copy instead of three; 52-61 registers instead of 86 (six
    programs an SM, as the shared memory allows, instead of five). H200, 2026-11-30,
    `scripts/ab/score24b.py`, the sparse step graph-replayed, five alternating rounds, outputs
    identical, us: B1/8K q4 8.48 -> 8.20 (0.967x), q1 7.93 -> 7.73; B1/32K q4 11.15 -> 10.88;
    B1/128K q4 21.06 -> 20.83; B16/8K q4 26.31 -> 26.16; B16/32K q4 49.98 -> 49.66, q1 44.63 ->
    44.38; B16/128K q4 139.47 -> 138.80; B64/8K q4 66.90 -> 66.56, q1 50.90 -> 50.44; B64/32K q4
    154.62 -> 154.24; B64/128K q4 506.62 -> 505.18; 16 requests of 2K-32K (mixed) 38.46 -> 37.54.
    Issuing the copy first and reading the queries after it lost at B16-B64 (1.01-1.03x): the page
    then stays in registers (128 of them, four programs an SM)."""
    if RELEASE:  # wait first: the early top-k reads step metadata an earlier kernel may still write
        wait_then_release(PDL)
    else:
        wait_for_prior_grid(PDL)
    chunk = tl.program_id(0)
    r = tl.program_id(1)
    if TMA and BLOCKS_PER_PROG == 1 and ONE_TILE:
        page = tl.load(bt_ptr + r * s_bt_r + chunk)
        t0 = tl.load(cu_ptr + r)
        t1 = tl.load(cu_ptr + r + 1)
        if chunk < tl.cdiv(tl.load(kvl_ptr + r), BLOCK):
            tok, q, pos = _token_rows(iq_ptr, s_iq_t, s_iq_h, pos_ptr, t0, t1, HI, QP, DI)
            k = tl.reshape(ik_desc.load([page, 0, 0]), [BLOCK, DI])
            _store_page_scores(q, pos, k, chunk, tok, t1, score_ptr, s_sc_h, s_sc_t, HI, QP, BLOCK, IEEE)
            for c0 in range(t0 + QP, t1, QP):  # a max_qo_len hint below a request's tokens: copied again
                tok, q, pos = _token_rows(iq_ptr, s_iq_t, s_iq_h, pos_ptr, c0, t1, HI, QP, DI)
                k = tl.reshape(ik_desc.load([page, 0, 0]), [BLOCK, DI])
                _store_page_scores(q, pos, k, chunk, tok, t1, score_ptr, s_sc_h, s_sc_t, HI, QP, BLOCK, IEEE)
    else:
        t1 = tl.load(cu_ptr + r + 1)
        num_blocks = tl.cdiv(tl.load(kvl_ptr + r), BLOCK)
        j = tl.arange(0, BLOCK)
        d = tl.arange(0, DI)
        for c0 in range(tl.load(cu_ptr + r), t1, QP):
            tok, q, pos = _token_rows(iq_ptr, s_iq_t, s_iq_h, pos_ptr, c0, t1, HI, QP, DI)
            for b in range(chunk * BLOCKS_PER_PROG, tl.minimum((chunk + 1) * BLOCKS_PER_PROG, num_blocks)):
                page = tl.load(bt_ptr + r * s_bt_r + b)
                if TMA:
                    k = tl.reshape(ik_desc.load([page, 0, 0]), [BLOCK, DI])
                else:
                    k = tl.load(ik_ptr + page.to(tl.int64) * s_ik_p + j[:, None] * s_ik_b + d[None, :])
                _store_page_scores(q, pos, k, b, tok, t1, score_ptr, s_sc_h, s_sc_t, HI, QP, BLOCK, IEEE)


@triton.jit
def _token_rows(iq_ptr, s_iq_t, s_iq_h, pos_ptr, c0, t1, HI: tl.constexpr, QP: tl.constexpr, DI: tl.constexpr):
    """(token, index query, position) of each (token, index head) row of the QP tokens from c0."""
    rows = tl.arange(0, QP * HI)
    tok = c0 + rows // HI
    row_ok = tok < t1
    q = tl.load(iq_ptr + tok[:, None] * s_iq_t + (rows % HI)[:, None] * s_iq_h + tl.arange(0, DI)[None, :],
                mask=row_ok[:, None], other=0.0)
    return tok, q, tl.load(pos_ptr + tok, mask=row_ok, other=-1)


@triton.jit
def _store_page_scores(q, pos, k, b, tok, t1, score_ptr, s_sc_h, s_sc_t,
                       HI: tl.constexpr, QP: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """The max visible score of page `b` (index-K `k`, `[BLOCK, Di]`) for each row of `q`."""
    kq = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(kq), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kq))
    visible = (b * BLOCK + tl.arange(0, BLOCK))[None, :] <= pos[:, None]
    s = tl.where(visible, s, float("-inf"))
    best = tl.reduce(s, 1, _max_keeping_nan)  # a visible NaN key makes its block's score NaN, as torch's amax
    tl.store(score_ptr + (tl.arange(0, QP * HI) % HI) * s_sc_h + tok * s_sc_t + b, best, mask=tok < t1)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _topk_mask(vals, visible, NBP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr):
    """int32 1 where a visible block is among its row's TOPK best scores (ties: the lower id).

    Each score becomes an int32 whose signed order is the float's, so one `tl.topk` (a descending,
    power-of-two long list) gives each row's TOPK-th best value; every block above it is chosen,
    and of the blocks equal to it the lowest ids until the row has TOPK. 32-bit keys, not one
    int64 key (value, reversed id) per block: the top-k's compare-and-swap network moves half the
    bits, and ties are rare enough that their scan mostly does not run. H200, 2026-11-30,
    scripts/ab/topk_ab18.py, int64 -> int32 keys: the top-k alone at 128K (1024 blocks) 3.96 -> 3.54
    us (B1 q4), 4.46 -> 3.82 (B16); the step B1/128K q4 22.01 -> 21.27, q1 21.07 -> 20.33; at 8K-32K
    the top-k alone moved by -0.10..+0.12 us and the step by -0.6..+0.2%.
    """
    if NBP <= TOPK:
        chosen = visible.to(tl.int32)
    else:
        bits = tl.where(vals == 0.0, 0.0, vals).to(tl.int32, bitcast=True)  # -0.0 ties +0.0
        # Every NaN, whatever its sign bit, ranks first and ties the others, as torch's sort ranks it.
        key = tl.where(vals != vals, 2147483647, bits ^ ((bits >> 31) & 0x7FFFFFFF))
        ordered = tl.where(visible, key, -2147483647 - 1)
        if TOPK == 1:
            kth = tl.max(ordered, axis=1)
        else:
            top = tl.topk(ordered, TOPK_P, dim=1)  # sorted descending, a power-of-two count
            kth = tl.sum(tl.where(tl.arange(0, TOPK_P)[None, :] == TOPK - 1, top, 0), axis=1)
        above = visible & (ordered > kth[:, None])
        tied = visible & (ordered == kth[:, None])
        need = TOPK - tl.sum(above.to(tl.int32), axis=1)
        chosen = (above | tied).to(tl.int32)
        if tl.max(tl.sum(tied.to(tl.int32), axis=1) - need) > 0:  # more tied than places left
            rank = tl.cumsum(tied.to(tl.int32), axis=1)
            chosen = (above | (tied & (rank <= need[:, None]))).to(tl.int32)
    return chosen


@triton.jit
def _topk_union_kernel(
    score_ptr, s_sc_h, s_sc_t,
    vb_ptr, cu_ptr, num_tokens,
    out_ptr, s_o_h, s_o_t, bt_ptr, s_bt_r,
    ids_ptr, pages_ptr, bits_ptr, cnt_ptr, kvl_ptr, block, ready_ptr,
    QP: tl.constexpr, NCH: tl.constexpr, NBP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, WRITE_UNION: tl.constexpr, HANDOFF: tl.constexpr = False,
    ANNOUNCE: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """One program per (request, index head, token chunk). With HANDOFF the scores are a
    `handoff.score_board`: the program polls its rows until the scoring has written every entry
    of its request's pages (none is SENTINEL), not for the scoring grid, and puts the sentinel
    back once it has selected. With ANNOUNCE (> 0) each finished row sets its `ready_ptr` flag
    (index head x token) to ANNOUNCE, with release order, for an attention launched early that
    polls it (`verify_step`); that attention's launch is released at once."""
    if not HANDOFF:
        wait_for_prior_grid(PDL)
    elif PDL and ANNOUNCE > 0:
        release_dependents()
    r = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    t1 = tl.load(cu_ptr + r + 1)
    c0 = tl.load(cu_ptr + r) + c * QP
    rows = tl.arange(0, QP)
    tok = c0 + rows
    row_ok = tok < t1
    nv = tl.load(vb_ptr + tok, mask=row_ok, other=0)
    ids = tl.arange(0, NBP)
    visible = ids[None, :] < nv[:, None]
    at = h * s_sc_h + tok[:, None] * s_sc_t + ids[None, :]
    if HANDOFF:
        board = score_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        written = row_ok[:, None] & (ids[None, :] < tl.cdiv(tl.load(kvl_ptr + r), block))
        if NBP <= TOPK:
            # Every visible block is chosen: only the wait matters. A polled row no later code reads
            # (a dead loop-carried tensor) crashes Triton 3.6's compiler from NBP >= 32 x warps.
            while tl.sum(((tl.load(board + at, mask=written, other=0, volatile=True) == SENTINEL)
                          & written).to(tl.int32)) > 0:
                pass
            raw = tl.zeros([QP, NBP], tl.int32)
        else:
            raw = tl.load(board + at, mask=written, other=0, volatile=True)
            while tl.sum(((raw == SENTINEL) & written).to(tl.int32)) > 0:
                raw = tl.load(board + at, mask=written, other=0, volatile=True)
        if PDL and ANNOUNCE == 0:  # only now: an attention waiting for this whole grid would hold SMs
            release_dependents()
        vals = tl.where(visible, raw.to(tl.float32, bitcast=True), float("-inf"))
    else:
        vals = tl.load(score_ptr + at, mask=visible, other=float("-inf"))
    forced = visible & ((ids[None, :] >= nv[:, None] - LOCAL) | (ids[None, :] < INIT))
    vals = tl.where(forced, float("inf"), vals)
    chosen = _topk_mask(vals, visible, NBP, TOPK, TOPK_P)
    count = tl.sum(chosen, axis=1)
    slot = tl.cumsum(chosen, axis=1) - 1
    base = out_ptr + h * s_o_h + tok * s_o_t
    tl.store(base[:, None] + slot, ids[None, :] + 0 * slot, mask=chosen != 0)
    pad = tl.arange(0, TOPK_P)
    tl.store(base[:, None] + pad[None, :], tl.full([QP, TOPK_P], -1, tl.int32),
             mask=row_ok[:, None] & (pad[None, :] >= count[:, None]) & (pad[None, :] < TOPK))
    if WRITE_UNION:
        unit = (r * tl.num_programs(1) + h) * NCH + c
        in_union = tl.max(chosen, axis=0)
        bits = tl.sum(chosen << rows[:, None], axis=0)
        rank = tl.cumsum(in_union, axis=0) - 1
        tl.store(ids_ptr + unit * (QP * TOPK_P) + rank, ids, mask=in_union != 0)
        page = tl.load(bt_ptr + r * s_bt_r + ids, mask=in_union != 0, other=0)
        tl.store(pages_ptr + unit * (QP * TOPK_P) + rank, page, mask=in_union != 0)
        tl.store(bits_ptr + unit * (QP * TOPK_P) + rank, bits, mask=in_union != 0)
        tl.store(cnt_ptr + unit, tl.sum(in_union, axis=0))
    # Graph-padding tokens past the last request: all -1 (written once, by one program).
    if (r == tl.num_programs(0) - 1) & (c == 0):
        for t in range(t1, num_tokens):
            tl.store(out_ptr + h * s_o_h + t * s_o_t + pad, tl.full([TOPK_P], -1, tl.int32), mask=pad < TOPK)
    if ANNOUNCE > 0:
        tl.debug_barrier()  # every thread's selection stores precede the release below
        tl.atomic_xchg(ready_ptr + h * num_tokens + tok, tl.full([QP], ANNOUNCE, tl.int32), mask=row_ok,
                       sem="release", scope="gpu")
    if HANDOFF:
        tl.store(board + at, tl.full([QP, NBP], SENTINEL, tl.int32), mask=written)


def index_block_scores(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    meta: Any,
    *,
    out: torch.Tensor | None = None,
    max_qo_len: int | None = None,
    blocks_per_program: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    tma: bool | None = None,
    release_dependents: bool = False,
) -> torch.Tensor:
    """Max score of every visible block for every token: fp32 `[Hi, T, max_blocks]`.

    Entries past a token's own request length are left unwritten (the top-k reads only
    `[0, valid_blocks[t])`). `tma` (default: where `page_descriptor` gives one) loads each page
    whole through a tensor descriptor, one page a program. `max_qo_len` (default: the metadata's)
    is a hint: within one token tile it picks the kernel's decode / verify program (`ONE_TILE`),
    which stays correct, only slower, for a request with more tokens. `release_dependents` lets a
    top-k that polls a `handoff.score_board` (`out`) launch (PDL) once every scoring program has started.
    """
    check_meta(meta, index_q.device)
    check_cache_view("index_k_cache", index_k_cache, 3)
    check_same_device(index_q.device, index_k_cache=index_k_cache, out=out)
    max_qo_len = qo_len_hint(meta, max_qo_len)
    require(index_q.dim() == 3, f"index_q must be [T, Hi, Di], got {tuple(index_q.shape)}")
    require(index_q.stride(-1) == 1, "index_q must be contiguous in its last dim")
    # The keys are cast to the queries' dtype for the dot: an fp8 query would round them to fp8.
    require(index_q.dtype in QUERY_DTYPES, f"index_q must be float32, float16 or bfloat16, got {index_q.dtype}")
    num_tokens, num_heads, dim = index_q.shape
    _, block, kdim = index_k_cache.shape
    require(kdim == dim, f"index dims differ: index_q {dim} vs index_k_cache {kdim}")
    require(is_pow2(num_heads), f"the scoring tiles all index heads of a token: their count must be a power of two, "
            f"got {num_heads}")
    check_step_rows("index_q", index_q, meta)
    check_cache_block("index_k_cache", block, meta)
    require(block >= 16 and dim >= 16 and block & (block - 1) == 0 and dim & (dim - 1) == 0,
            "block size and index dim must be powers of two >= 16")
    require(index_k_cache.dtype in CACHE_DTYPES, f"unsupported index_k dtype {index_k_cache.dtype}")
    num_requests = meta.kv_lens.shape[0]
    width = meta.block_tables.shape[1]
    if out is None:
        out = torch.empty((num_heads, num_tokens, width), device=index_q.device, dtype=torch.float32)
    else:
        check_scores_out(out, num_heads, num_tokens, width)
    qp = tokens_per_tile(num_tokens, num_requests, num_heads, max_qo_len)
    desc = page_descriptor(index_k_cache) if tma is not False else None
    require(tma is not True or desc is not None, "tma needs a 16-bit or 8-bit index-K cache with 16-byte aligned "
            "base and strides on a GPU with TMA (SM90+)")
    if blocks_per_program is None:
        blocks_per_program = 1 if desc is not None else default_blocks_per_program(width * num_requests, index_q.device)
    require(blocks_per_program >= 1, f"blocks_per_program must be >= 1, got {blocks_per_program}")
    if num_stages is None:
        num_stages = 1 if desc is not None else 2
    grid = (triton.cdiv(width, blocks_per_program), num_requests)
    check_grid("block scoring", grid, "block groups, requests")  # too large: `auto` runs the reference
    if num_requests and num_tokens:
        launch(_block_score_kernel, grid,
            index_q, index_q.stride(0), index_q.stride(1),
            index_k_cache, index_k_cache.stride(0), index_k_cache.stride(1),
            index_k_cache if desc is None else desc,
            meta.block_tables, meta.block_tables.stride(0),
            meta.cu_qo_lens, meta.positions, meta.kv_lens,
            out, out.stride(0), out.stride(1),
            HI=num_heads, QP=qp, BLOCK=block, DI=dim,
            BLOCKS_PER_PROG=blocks_per_program, IEEE=index_q.dtype == torch.float32, TMA=desc is not None,
            RELEASE=release_dependents, ONE_TILE=fits_one_tile(max_qo_len, qp),
            num_warps=num_warps, num_stages=num_stages, **pdl_args(index_q.device, grid),
        )
    return out


def check_score_layout(name: str, scores: torch.Tensor) -> None:
    """`scores` laid out as the scoring writes and the top-k reads them: fp32 `[Hi, T, blocks]`, a
    row's blocks adjacent (the kernels address them as `row + block`)."""
    require(scores.dim() == 3 and scores.dtype == torch.float32,
            f"{name} must be float32 [Hi, T, blocks], got {scores.dtype} of shape {tuple(scores.shape)}")
    require(scores.stride(-1) == 1 or scores.shape[-1] <= 1,
            f"{name} must have unit stride in its last (block) dim, got strides {tuple(scores.stride())}")


def check_scores_out(out: torch.Tensor, num_heads: int, num_tokens: int, width: int) -> None:
    """A caller's `out` for the scoring: `[Hi, T, block-table width]` fp32, its entries apart (the
    kernel stores every entry through `out`'s own strides; overlapping ones would overwrite each other)."""
    check_score_layout("out", out)
    require(tuple(out.shape) == (num_heads, num_tokens, width),
            f"out must be [Hi={num_heads}, T={num_tokens}, {width}] (index heads, index_q rows, block-table width), "
            f"got {tuple(out.shape)}")
    require(entries_apart(out), f"out's strides {tuple(out.stride())} give two entries one address")


def page_descriptor(index_k_cache: torch.Tensor):
    """A `[P, B, Di]` TMA descriptor of the index-K cache (one page a box), or None where TMA does
    not apply: not a GPU with TMA (SM90+; Triton's interpreter emulates it), an fp32 cache, a page
    past one TMA box (over 256 rows or 256 bytes a row), a base or stride not 16-byte aligned, or
    no page at all (Triton's descriptor refuses a zero dim with a bare AssertionError).

    Why: one page a program, loaded whole by the copy engine, as FlashInfer's SM90 proxy score
    does, reads index-K faster than per-thread copies. H200, 2026-11-29, scoring alone:
    - A/B in one run against the former default (2-4 pages a program, per-thread copies):
      B16/32K q4 34.4 vs 36.3 us, B64/32K 123.1 vs 126.8, B1/8K 2.7 vs 3.7, B1/128K 12.0 vs 13.6.
    - `scripts/tune_verify_kernels.py --scoring`: one page, one stage, 4 warps was the fastest of
      its 39 variants at all eight shapes, e.g. B16/32K q4 33.5 us, B64/32K 120.1.
    """
    elem = index_k_cache.element_size()
    _, block, dim = index_k_cache.shape
    capability = device_capability(index_k_cache.device)
    if not (triton_interpreting() or (capability is not None and capability[0] >= 9)) or elem not in (1, 2):
        return None
    if block > 256 or dim * elem > 256:
        return None
    if not byte_aligned(index_k_cache, 16) or index_k_cache.numel() == 0:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(index_k_cache, list(index_k_cache.shape), list(index_k_cache.stride()), [1, block, dim])


def default_blocks_per_program(total_pages: int, device: torch.device) -> int:
    """Pages a program for the per-thread-copy scoring: about 4 programs per SM over the widest
    possible step, 2..4 pages each (H200 sweep, scripts/tune_verify_kernels.py, 2026-11-29: 4
    pages and 2 stages read index-K at 100% of the copy ceiling at B64/32K, vs 95% for 16 pages
    and 3 stages)."""
    target = 4 * device_sm_count(device)
    return min(4, max(2, -(-total_pages // target)))


def topk_from_block_scores(
    block_scores: torch.Tensor,
    meta: Any,
    *,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
    max_qo_len: int | None = None,
    union_group: int | None = None,
    topk_warps: int | None = None,
    handoff: bool = False,
    block_size: int | None = None,
    early: bool = False,
    ready: torch.Tensor | None = None,
    consumers: int = 0,
) -> tuple[torch.Tensor, BlockUnion | None]:
    """Per-token top-k over `block_scores[:, t, :valid_blocks[t]]` -> (int32 `[Hi, T, topk]`, union).

    With `union_group` (query heads per KV head of the attention that consumes the selection) it
    also writes the per-request block union lists that `sparse_verify_attention` takes. With
    `handoff` the scores are a `handoff.score_board` view: each program polls for its own
    request's scores only (the `block_size`-token pages its request has, default
    `meta.block_size`) and restores the sentinel; `early` launches it with PDL on SM90+ (the
    scoring must have been launched with `release_dependents=True`).
    """
    topk, local_blocks, init_blocks = selection_counts(topk, local_blocks, init_blocks)
    check_meta(meta, block_scores.device, dense_fields=("kv_lens", "cu_qo_lens", "valid_blocks"))
    check_same_device(block_scores.device, ready=ready)
    check_score_layout("block_scores", block_scores)
    num_heads, num_tokens, width = block_scores.shape
    # the selection is allocated for block_scores' tokens but written for every metadata token
    require(num_tokens >= meta.valid_blocks.shape[0], f"block_scores has {num_tokens} token rows, fewer than the "
            f"metadata's {meta.valid_blocks.shape[0]} tokens (meta.valid_blocks)")
    # each row is read up to valid_blocks[t] entries: at most the table's width, or the host's
    # max_step_blocks where the metadata keeps one (the device values cannot be read without a sync)
    blocks = meta.block_tables.shape[1]
    step_blocks = getattr(meta, "max_step_blocks", None)
    blocks = blocks if step_blocks is None else min(blocks, int(step_blocks))
    require(width >= blocks, f"block_scores has {width} block columns, fewer than the {blocks} blocks the "
            "metadata's tokens may hold (block-table width, or meta.max_step_blocks): rows would be read "
            "past their end")
    num_requests = meta.kv_lens.shape[0]
    max_qo_len = qo_len_hint(meta, max_qo_len)
    block_size = block_size or getattr(meta, "block_size", None)
    require(not handoff or block_size, "handoff needs the index-K block size (block_size= or meta.block_size)")
    require(ready is None or (handoff and consumers >= 1), "ready flags need the hand-off and consumers >= 1")
    out = torch.empty((num_heads, num_tokens, topk), device=block_scores.device, dtype=torch.int32)
    # Verify/decode steps without union lists: one token per program (selection rows are independent;
    # more, smaller programs). Union lists cover a chunk of a request's tokens; long prefill chunks
    # keep multi-token programs so the grid stays small.
    if union_group is None and max_qo_len is not None and max_qo_len <= 16:
        qp = 1
    else:
        qp = tokens_per_tile(num_tokens, num_requests, union_group or 16, max_qo_len)
    nch = chunk_count(num_tokens, num_requests, qp, max_qo_len)
    check_grid("block top-k", (num_requests, num_heads, nch), f"requests, index heads, {nch} chunks of {qp} tokens")
    union = None
    if union_group is not None:
        union = allocate_union(num_requests, num_heads, nch, qp, topk, block_scores.device)
    if num_tokens and num_heads and num_requests:
        nbp = next_pow2(max(width, 2))
        dummy = out
        grid = (num_requests, num_heads, nch)
        launch(_topk_union_kernel, grid,
            block_scores, block_scores.stride(0), block_scores.stride(1),
            meta.valid_blocks, meta.cu_qo_lens, num_tokens,
            out, out.stride(0), out.stride(1), meta.block_tables, meta.block_tables.stride(0),
            union.ids if union else dummy, union.pages if union else dummy, union.bits if union else dummy,
            union.counts if union else dummy, meta.kv_lens, block_size or 1, dummy if ready is None else ready,
            QP=qp, NCH=nch, NBP=nbp, TOPK=topk, TOPK_P=next_pow2(topk),
            LOCAL=local_blocks, INIT=init_blocks, WRITE_UNION=union is not None, HANDOFF=handoff,
            ANNOUNCE=0 if ready is None else int(consumers),
            num_warps=topk_warps if topk_warps else default_topk_warps(qp, nbp),
            **pdl_args(block_scores.device, grid, every_grid=early),
        )
    elif num_tokens and num_heads:
        out.fill_(-1)
    return out, union


def default_topk_warps(tokens_per_program: int, padded_blocks: int) -> int:
    """Warps of the top-k program: 8 for token chunks (union lists), else one per 64 blocks up to 8
    (H200, scripts/tune_verify_kernels.py --topk, 2026-11-29, one token per program: 8K context
    1 warp 2.2 us, any count within 0.2; 32K 4 warps 2.8 us vs 1 warp 4.4 (B16), 3.1 vs 4.5 (B64);
    128K 8 warps 4.4 vs 4 warps 6.3 vs 1 warp 14.4). Re-checked with 32-bit keys (2026-11-30,
    scripts/ab/topk_warps18.py, the whole step B1 q4): 128K 8 warps 21.25 us vs 16 warps 21.50, 64K 8
    15.25 vs 4 15.55 vs 16 15.69, 32K 4 11.05 vs 2 11.33 vs 8 11.25."""
    if tokens_per_program > 1:
        return 8
    return int(min(8, max(1, padded_blocks // 64)))


def select_blocks_verify(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    meta: Any,
    *,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
    max_qo_len: int | None = None,
    union_group: int | None = None,
    handoff: bool | None = None,
):
    """Triton twin of `msa.select_blocks_paged`: int32 `[Hi, T, topk]`, ascending, `-1` padded.

    With `union_group` returns `(selection, union)` for `sparse_verify_attention(..., union=union)`.
    `handoff` (default: on unless `M3_EAGLE_HANDOFF=0`) overlaps the top-k with the scoring:
    scoring programs run request by request and each top-k program, launched early, starts once
    its own request is scored (`handoff`); without it (or while capturing a graph before the
    board is big enough) the top-k waits for the whole scoring grid.
    """
    selection, union, _ = select_announcing(index_q, index_k_cache, meta, topk=topk, local_blocks=local_blocks,
                                            init_blocks=init_blocks, max_qo_len=max_qo_len,
                                            union_group=union_group, handoff=handoff)
    return selection if union_group is None else (selection, union)


def select_announcing(index_q, index_k_cache, meta, *, topk: int, local_blocks: int = 1, init_blocks: int = 0,
                      max_qo_len: int | None = None, union_group: int | None = None, handoff: bool | None = None,
                      consumers: int = 0) -> tuple[torch.Tensor, BlockUnion | None, torch.Tensor | None]:
    """`select_blocks_verify` -> (selection, union, ready flags or None). With `consumers` (> 0)
    and the hand-off, each selected row also sets a `handoff.ready_flags` entry (index head x
    token) to `consumers`; the flags are returned only then, and the caller must then launch
    exactly that many flag-polling attention programs per row (`verify_step`)."""
    topk, local_blocks, init_blocks = selection_counts(topk, local_blocks, init_blocks)  # before the scoring runs
    kw = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, max_qo_len=max_qo_len,
              union_group=union_group)
    num_tokens, num_heads, _ = index_q.shape
    if handoff is None:
        handoff = handoff_enabled()
    board = None
    if handoff and num_tokens and num_heads and meta.kv_lens.shape[0] and meta.block_tables.shape[1]:
        board = score_board(index_q.device, num_heads * num_tokens * meta.block_tables.shape[1])
    if board is None:
        scores = index_block_scores(index_q, index_k_cache, meta, max_qo_len=max_qo_len)
        selection, union = topk_from_block_scores(scores, meta, **kw)
        return selection, union, None
    early = pdl_args(index_q.device, (), every_grid=True)["PDL"]
    ready = ready_flags(index_q.device, num_heads * num_tokens) if consumers > 0 else None
    scored = False
    try:
        scores = index_block_scores(index_q, index_k_cache, meta, max_qo_len=max_qo_len,
                                    out=board.view(num_heads, num_tokens, -1), release_dependents=early)
        scored = True
        selection, union = topk_from_block_scores(scores, meta, handoff=True, block_size=index_k_cache.shape[1],
                                                  early=early, ready=ready, consumers=consumers, **kw)
    except BaseException as error:
        # A refused scoring wrote nothing; past it, or cut off (a Ctrl-C raised as the scoring's launch
        # returned), scores may sit on the board and flags be set for no attention.
        if scored or not isinstance(error, KernelInputError):
            reset_while_raising(error, lambda: reset_handoff(index_q.device))
        raise
    return selection, union, ready
