"""Triton sparse verify attention over paged K/V, in two layouts.

Why: the 1 + draft_len verify tokens of a request select nearly the same pages. `token` (the
default): one program per (request, KV head, token, split) walks that token's own pages; the
pages its request's other tokens share come from L2, so the tile stays small (the GQA group) and
many programs keep loads in flight. `union`: one program per (request, KV head, token chunk,
split) walks the chunk's block-union list (`block_union`), loads every page of the union once and
applies it to all of the chunk's query rows (tokens x GQA group in one MMA tile); a row only sees
a page its own token selected (bitmask) and keys up to its own position. Splits plus an LSE merge
keep small batches busy. e4m3 V is read in 16-bit pairs of head dims where it can be
(`paired_v_applies`) and Triton compiles it right (`paired_v_tile_ok`). Mirrors `m3_eagle_plugin.msa.sparse_attention`.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._common import (
    MAX_TILE_ROWS,
    attention_scales,
    byte_aligned,
    check_grid,
    check_same_device,
    qo_len_hint,
    device_sm_count,
    is_pow2,
    next_pow2,
    require,
    tokens_per_tile,
    triton_interpreting,
)
from .attention_io import check_attention_inputs, check_splits, max_partial_splits, merge_outputs, split_outputs
from .attention_tiles import LOG2E, attend_page_tile, attend_two_pages, join_dim_halves, store_rows, zero_graph_padding
from .block_union import BlockUnion, chunk_count, union_from_selection
from .launch import launch
from .merge import split_arrivals
from .pdl import pdl_args, wait_for_prior_grid, wait_for_prior_grid_only

@triton.jit
def _sparse_verify_kernel(
    q_ptr, s_q_t, s_q_h,
    k_ptr, s_k_p, s_k_h, s_k_b,
    v_ptr, s_v_p, s_v_h, s_v_b,
    ids_ptr, pages_ptr, bits_ptr, cnt_ptr,
    bt_ptr, s_bt_r, cu_ptr, pos_ptr,
    o_ptr, s_o_t, s_o_h, lse_ptr, num_tokens,
    qk_scale, v_scale,
    G: tl.constexpr, QP: tl.constexpr, UMAX: tl.constexpr, NCH: tl.constexpr,
    BLOCK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, F16: tl.constexpr,
    IEEE: tl.constexpr, VPAIR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    c = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    num_heads = tl.num_programs(1) * G
    unit = (r * tl.num_programs(1) + g) * NCH + c
    t1 = tl.load(cu_ptr + r + 1)
    c0 = tl.load(cu_ptr + r) + c * QP

    rows = tl.arange(0, QP * G)
    tok_i = rows // G
    tok = c0 + tok_i
    head = g * G + rows % G
    row_ok = tok < t1
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if F16:
        q = q.to(tl.float16)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
    pos_max = tl.max(pos, axis=0)
    count = tl.load(cnt_ptr + unit)

    m_i = tl.full([QP * G], -1.0e30, tl.float32)
    l_i = tl.zeros([QP * G], tl.float32)
    acc = tl.zeros([QP * G, D // 2 if VPAIR else D], tl.float32)
    acc_hi = tl.zeros([QP * G, D // 2 if VPAIR else 1], tl.float32)
    jn = tl.arange(0, BN)
    mine = tl.maximum(count - split + SPLITS - 1, 0) // SPLITS
    # Flat loop over (this split's union entries) x (BN-key sub-tiles of each page).
    for it in range(0, mine * (BLOCK // BN)):
        entry = unit * UMAX + split + (it // (BLOCK // BN)) * SPLITS
        b = tl.load(ids_ptr + entry)
        bits = tl.load(bits_ptr + entry)
        page = tl.load(pages_ptr + entry)
        key = (it % (BLOCK // BN)) * BN + jn
        m_i, l_i, acc, acc_hi = attend_page_tile(q, k_ptr, s_k_p, s_k_h, s_k_b, v_ptr, s_v_p, s_v_h, s_v_b, g, page,
                                                 key, b * BLOCK + key, d, ((bits >> tok_i) & 1) != 0, pos, pos_max,
                                                 m_i, l_i, acc, acc_hi, qk_scale, IEEE, VPAIR, ASM)

    acc = join_dim_halves(acc, acc_hi, VPAIR)
    store_rows(o_ptr, s_o_t, s_o_h, lse_ptr, acc, m_i, l_i, tok, head, d, row_ok, num_heads, split, v_scale,
               D, SPLITS)
    if SPLITS == 1:
        zero_graph_padding(o_ptr, s_o_t, s_o_h, cu_ptr, num_tokens, g, G, D)


@triton.jit
def _sparse_token_kernel(
    q_ptr, s_q_t, s_q_h,
    k_ptr, s_k_p, s_k_h, s_k_b,
    v_ptr, s_v_p, s_v_h, s_v_b,
    sel_ptr, s_sel_h, s_sel_t,
    bt_ptr, s_bt_r, cu_ptr, pos_ptr,
    o_ptr, s_o_t, s_o_h, lse_ptr, num_tokens, fin_ptr, arrived_ptr, ready_ptr,
    qk_scale, v_scale,
    G: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
    BLOCK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    F16: tl.constexpr, PREFETCH: tl.constexpr, IEEE: tl.constexpr, VPAIR: tl.constexpr, ASM: tl.constexpr,
    SELF_MERGE: tl.constexpr = False, READY: tl.constexpr = False, PDL: tl.constexpr = False,
    REQUEST_MAJOR: tl.constexpr = False,
):
    """One program per (request, KV head, token of the request, split): the token's GQA group
    (ROWS >= 16 rows, padded) walks its own selected pages; pages shared with the request's other
    tokens come from L2, so the tile stays small and many programs keep loads in flight. With
    SELF_MERGE the last split of a token to finish (an arrival counter it resets) merges the
    splits into `fin_ptr`, so no merge launch follows. With READY the program was launched while
    the top-k still runs (`verify_step`): it waits for its token's `ready_ptr` flag instead of
    the top-k grid (acquire loads), for the grid only before its first store, and takes one off
    the flag at its end. BN = 2 x BLOCK (PREFETCH) makes each tile two of the token's pages
    (`attend_two_pages`). REQUEST_MAJOR renumbers the programs (`_token_program`)."""
    if not READY:
        wait_for_prior_grid(PDL)
    r, tok_i, split = _token_program(SPLITS, REQUEST_MAJOR)
    g = tl.program_id(1)
    num_heads = tl.num_programs(1) * G
    tok0 = tl.load(cu_ptr + r) + tok_i
    live = tok0 < tl.load(cu_ptr + r + 1)
    flag = ready_ptr + g * num_tokens + tok0
    if READY:
        if live:  # every thread polls with acquire order (syncs with the top-k's release)
            _wait_until_set(flag, ASM)
    rows = tl.arange(0, ROWS)
    tok = tok0 + 0 * rows
    head = g * G + rows
    row_ok = live & (rows < G)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if F16:
        q = q.to(tl.float16)
    pos1 = tl.load(pos_ptr + tok0, mask=live, other=-1)
    pos = pos1 + 0 * rows
    jj = tl.arange(0, TOPK_P)
    sel_row = sel_ptr + g * s_sel_h + tok0.to(tl.int64) * s_sel_t
    ids = tl.load(sel_row + jj, mask=live & (jj < TOPK), other=-1, cache_modifier=".cg")
    count = tl.sum((ids >= 0).to(tl.int32), axis=0)  # ascending, -1 padded at the end
    if PREFETCH:
        pages = tl.load(bt_ptr + r * s_bt_r + ids, mask=ids >= 0, other=-1)

    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D // 2 if VPAIR else D], tl.float32)
    acc_hi = tl.zeros([ROWS, D // 2 if VPAIR else 1], tl.float32)
    jn = tl.arange(0, BN)
    mine = tl.maximum(count - split + SPLITS - 1, 0) // SPLITS
    if BN > BLOCK:  # two pages a tile (PREFETCH): keys [0, BLOCK) from entry e0, the rest from e0 + SPLITS
        second = jn >= BLOCK
        kin = jn % BLOCK
        for it in range(0, (mine + 1) // 2):
            e0 = split + 2 * it * SPLITS
            e1 = e0 + SPLITS
            b0 = tl.sum(tl.where(jj == e0, ids, 0), axis=0)
            b1 = tl.sum(tl.where(jj == e1, ids, 0), axis=0)
            p0 = tl.sum(tl.where(jj == e0, pages, 0), axis=0)
            p1 = tl.sum(tl.where(jj == e1, pages + 1, 0), axis=0) - 1  # -1 past the list
            m_i, l_i, acc, acc_hi = attend_two_pages(q, k_ptr, s_k_p, s_k_h, s_k_b, v_ptr, s_v_p, s_v_h, s_v_b, g,
                                                     tl.where(second, p1, p0), kin,
                                                     tl.where(second, b1, b0) * BLOCK + kin, d, row_ok, pos, pos1,
                                                     m_i, l_i, acc, acc_hi, qk_scale, IEEE, VPAIR, ASM)
    else:
        for it in range(0, mine * (BLOCK // BN)):
            e = split + (it // (BLOCK // BN)) * SPLITS
            if PREFETCH:
                b = tl.sum(tl.where(jj == e, ids, 0), axis=0)
                page = tl.sum(tl.where(jj == e, pages, 0), axis=0)
            else:
                b = tl.load(sel_row + e)
                page = tl.load(bt_ptr + r * s_bt_r + b)
            key = (it % (BLOCK // BN)) * BN + jn
            m_i, l_i, acc, acc_hi = attend_page_tile(q, k_ptr, s_k_p, s_k_h, s_k_b, v_ptr, s_v_p, s_v_h, s_v_b, g,
                                                     page, key, b * BLOCK + key, d, row_ok, pos, pos1, m_i, l_i, acc,
                                                     acc_hi, qk_scale, IEEE, VPAIR, ASM)

    acc = join_dim_halves(acc, acc_hi, VPAIR)
    if READY:  # outputs may reuse memory the scoring still reads until the top-k grid is done
        wait_for_prior_grid_only(PDL)
    store_rows(o_ptr, s_o_t, s_o_h, lse_ptr, acc, m_i, l_i, tok, head, d, row_ok, num_heads, split, v_scale,
               D, SPLITS)
    if SPLITS == 1 or SELF_MERGE:
        zero_graph_padding(fin_ptr, s_o_t, s_o_h, cu_ptr, num_tokens, g, G, D)
    if READY:
        if live:  # off the critical path: the last of the row's readers leaves it 0 for the next step
            tl.debug_barrier()  # every thread of this program is past its poll
            tl.atomic_add(flag, -1, sem="relaxed", scope="gpu")
    if SELF_MERGE:
        if live:  # a dead program's tok0 is the next request's token: it must not count
            tl.debug_barrier()  # every thread's partial is stored before the release below
            slot = arrived_ptr + tok0 * tl.num_programs(1) + g
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                tl.atomic_xchg(slot, 0)
                _merge_rows(o_ptr, lse_ptr, fin_ptr, s_o_t, s_o_h, tok, head, d, row_ok, num_heads, v_scale,
                            D, SPLITS)


@triton.jit
def _token_program(SPLITS: tl.constexpr, REQUEST_MAJOR: tl.constexpr):
    """(request, token of the request, split) of this program of the grid (requests, KV heads,
    tokens x splits): the grid's own order (request r's token t at r + R x t: every request's
    first token, then every second), or with REQUEST_MAJOR renumbered request by request, a
    request's tokens at one split adjacent.

    Why: an early attention's programs start in launch order as the scoring frees SMs, and the
    requests are scored in order, so request-major programs start roughly as their tokens are
    selected, and a request's tokens, which select mostly the same pages, read them from L2 at
    about the same time (ncu, the attention alone at B64/8K q4 in this order: 146 MB through L2
    against 174). Figures in `verify_step`'s `early_order`.
    """
    if REQUEST_MAJOR:
        per_request = tl.num_programs(2) // SPLITS
        lin = tl.program_id(0) + tl.num_programs(0) * tl.program_id(2)
        rest = lin % tl.num_programs(2)
        return lin // tl.num_programs(2), rest % per_request, rest // per_request
    return tl.program_id(0), tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS


@triton.jit
def _wait_until_set(flag, ASM: tl.constexpr):
    """Spin until the int32 at `flag` is nonzero (`_load_flag`)."""
    seen = _load_flag(flag, ASM)
    while seen == 0:
        seen = _load_flag(flag, ASM)


@triton.jit
def _load_flag(flag, ASM: tl.constexpr):
    """The int32 at `flag`. With ASM the load has acquire order at GPU scope, so what the setter
    released is visible to this thread after it (the interpreter runs programs one by one: a
    plain volatile load there)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flag], dtype=tl.int32,
                                         is_pure=False, pack=1)
    return tl.load(flag, volatile=True)


@triton.jit
def _merge_rows(o_ptr, lse_ptr, fin_ptr, s_o_t, s_o_h, tok, head, d, row_ok, num_heads, v_scale,
                D: tl.constexpr, SPLITS: tl.constexpr):
    """Fold rows' SPLITS partials (other programs wrote them: read from L2) by their LSE into the
    output, as `merge_splits` does."""
    prow = (tok.to(tl.int64) * num_heads + head) * SPLITS
    top = tl.full(tok.shape, float("-inf"), tl.float32)
    for s in range(SPLITS):
        top = tl.maximum(top, tl.load(lse_ptr + prow + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([tok.shape[0], D], tl.float32)
    denom = tl.zeros(tok.shape, tl.float32)
    for s in range(SPLITS):
        w = tl.exp2(tl.load(lse_ptr + prow + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - top)
        part = tl.load(o_ptr + (prow + s)[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0,
                       cache_modifier=".cg")
        acc += w[:, None] * part
        denom += w
    o = acc / tl.where(denom > 0, denom, 1.0)[:, None] * v_scale
    tl.store(fin_ptr + tok[:, None] * s_o_t + head[:, None] * s_o_h + d[None, :], o.to(fin_ptr.dtype.element_ty),
             mask=row_ok[:, None])


#: The largest two-page K + V tile (`pages_per_tile=2`) measured to fit shared memory with its two
#: stages: the production one, e4m3 at block 128 and head dim 128 (64 KB; the kernel took 76 KB on
#: the H200). A bf16 one (128 KB) asked for 274 KB there, past the 227 KB an SM has (2026-12-01).
MAX_TWO_PAGE_TILE_BYTES = 64 * 1024


def two_page_tile_bytes(block: int, dim: int, elem_bytes: int) -> int:
    """Bytes of a two-page K + V tile of pages `block` x `dim`."""
    return 2 * 2 * block * dim * elem_bytes


def two_page_tile_fits(block: int, dim: int, elem_bytes: int) -> bool:
    """Whether a two-page K + V tile of pages `block` x `dim` fits (`MAX_TWO_PAGE_TILE_BYTES`)."""
    return two_page_tile_bytes(block, dim, elem_bytes) <= MAX_TWO_PAGE_TILE_BYTES

#: Key rows per MMA tile by layout (H200 sweep, scripts/tune_verify_kernels.py --sparse-only, 2026-11-29).
DEFAULT_KEY_TILE = {"union": 64, "token": 128}


def default_layout(group: int) -> str:
    """'token' unless the GQA group is too tall for one tile. On the top-k's own selections the
    union read once per request does not pay (H200, scripts/tune_verify_kernels.py --union-grid,
    2026-11-29, 32K context, q4): the per-token attention beat every union variant (key tile
    64/128 x 2/3 stages x splits) at B64 (45.0 us vs 58.5), B16 (20.0 vs 23.6), B8 (13.2 vs 16.0)
    and B1/8K (6.5 vs 9.1), and the whole step with each layout forced (union at key tile 128,
    3 stages, a program per SM) took B64 173.5 vs 194.0 us, B16 60.0 vs 68.1."""
    return "token" if group <= MAX_TILE_ROWS else "union"


def choose_splits(num_requests: int, num_kv_heads: int, max_work: int, device: torch.device,
                  partial_row: int = 0) -> int:
    """Splits per (request, KV head) so the grid has about two programs per SM, with the split
    partials (`partial_row` = T x Hq x D elements per split) within MAX_PARTIAL_ELEMENTS: a long
    prefill chunk has parallelism enough without splits (measured: 4096 tokens x 264 splits
    overflowed 32-bit offsets)."""
    target = 2 * device_sm_count(device)
    splits = -(-target // max(1, num_requests * num_kv_heads))
    return int(max(1, min(splits, max_work, max_partial_splits(partial_row))))


def token_splits(units: int, topk: int, device: torch.device, partial_row: int = 0) -> int:
    """Splits of each token's selected pages for the per-token layout (`units` = requests x tokens
    per request x KV heads): about one program per SM, at most one page per split, partials bounded
    as in `choose_splits`. (H200 sweep, scripts/tune_verify_kernels.py --sparse-only, 2026-11-29:
    B64/32K q4 1 split 45.0 us vs 2 51.6; B64 q1 2 vs 5 20.8 vs 26.3; B16 q4 2 vs 5 19.7 vs 24.0;
    B1 q4 16 vs 8 6.5 vs 8.2; B16 q1 8 vs 16 9.1 vs 8.8, the one shape it misses.)"""
    return int(max(1, min(device_sm_count(device) // max(1, units), topk, max_partial_splits(partial_row))))


def union_splits(num_units: int, chunk: int, topk: int, device: torch.device, partial_row: int = 0) -> int:
    """Splits of each union list (`num_units` = requests x KV heads x token chunks): about 2
    programs per SM and at least one union entry each; a verify chunk's union holds about 2 x topk
    blocks (tokens share about half), a single token's exactly topk. (H200 sweep,
    scripts/tune_verify_kernels.py, 2026-11-29: at B16/32K q4 16 splits take 24.5 us, 32 splits
    28.0; at B64/32K 4 splits 66.6 us, 9 splits 74.2.)"""
    return choose_splits(num_units, 1, topk * min(chunk, 2), device, partial_row=partial_row)


def sparse_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    selection: torch.Tensor,
    *,
    scale: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_qo_len: int | None = None,
    union: BlockUnion | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    key_tile: int | None = None,
    layout: str | None = None,
    compute_f16: bool | None = None,
    prefetch: bool = True,
    paired_v: bool | None = None,
    self_merge: bool | None = None,
    ready: torch.Tensor | None = None,
    pages_per_tile: int = 1,
    request_major: bool = False,
    checked: bool = False,
) -> torch.Tensor:
    """`[T, Hq, D]` in `q.dtype`; `selection` int32 `[Hkv, T, topk]` of logical block ids, each row
    ascending without duplicates and -1 padded at its end (the selectors' form; not checked).

    `max_qo_len` (the most query tokens any request has; 1 + draft_len on verify steps) sizes the
    grid; leave it None only when unknown (then a worst-case bound is used). `layout` "union"
    reads each request's union of selected pages once for all its tokens (`union` is the block
    list the fused top-k wrote, `select_blocks_verify(..., union_group=)`; without it a small
    kernel derives it); "token" walks each token's own pages. `compute_f16` (default: fp8 K/V
    with a 16-bit q) runs the MMAs in fp16, which fp8 converts to in one instruction and holds
    exactly. `paired_v` reads e4m3 V as 16-bit pairs of head dims (`attend_page_tile`); by
    default on the per-token layout whenever `paired_v_applies` and the tile takes it
    (`paired_v_tile_ok`; refused where asked on a tile it does not). `self_merge` (per-token layout;
    default up to SELF_MERGE_SPLITS splits) has a token's last split merge the others in-kernel.
    `ready` (per-token flags a top-k launched just before sets, `index_select.select_announcing`
    with `consumers=splits`; per-token layout, explicit splits) launches the attention early (PDL)
    with each program waiting for its own token's flag. `pages_per_tile` 2 (per-token layout,
    `prefetch`) makes each MMA tile two pages of keys (`attend_two_pages`; `key_tile` unused).
    `request_major` (per-token layout) numbers the programs request by request, a request's tokens
    at one split adjacent, instead of request-fastest (`_token_program`; the outputs are the same).
    `checked`: the caller already ran `check_attention_inputs` on these inputs (`verify_step`).
    """
    if not checked:
        check_attention_inputs(q, k_cache, v_cache, meta)
    qk_scale, vs = attention_scales(scale, k_scale, v_scale)  # refused by name before any launch
    qk_scale *= LOG2E
    max_qo_len = qo_len_hint(meta, max_qo_len)
    require(selection.dim() == 3 and selection.dtype == torch.int32 and selection.stride(-1) == 1,
            f"selection must be int32 [Hkv, T, topk] with unit last stride, got {selection.dtype} "
            f"{tuple(selection.shape)}")
    check_same_device(q.device, selection=selection, ready=ready)
    num_tokens, num_heads, dim = q.shape
    _, hkv, block, _ = k_cache.shape
    require(selection.shape[0] == hkv and selection.shape[1] == num_tokens,
            f"selection shape {tuple(selection.shape)} does not match [Hkv={hkv}, T={num_tokens}, topk]")
    group = num_heads // hkv
    topk = selection.shape[2]
    num_requests = meta.kv_lens.shape[0]
    if compute_f16 is None:
        compute_f16 = k_cache.element_size() == 1 and q.dtype != torch.float32
    require(not compute_f16 or q.dtype != torch.float32, "compute_f16 needs 16-bit queries")
    if layout is None:
        layout = default_layout(group)
    require(layout in ("union", "token"), f"layout must be 'union' or 'token', got {layout!r}")
    require(layout == "token" or is_pow2(group), f"layout 'union' tiles whole GQA groups: query heads per KV head "
            f"must be a power of two, got {group}" + (f" (over {MAX_TILE_ROWS}, too tall for layout 'token')"
                                                      if group > MAX_TILE_ROWS else ""))
    require(pages_per_tile in (1, 2), f"pages_per_tile must be 1 or 2, got {pages_per_tile!r}")
    require(pages_per_tile == 1 or (layout == "token" and prefetch),
            "pages_per_tile=2 needs layout 'token' with prefetch (the tile's page ids come from registers)")
    tile_kb = two_page_tile_bytes(block, dim, k_cache.element_size()) // 1024
    require(pages_per_tile == 1 or two_page_tile_fits(block, dim, k_cache.element_size()),
            f"pages_per_tile=2: a two-page K and V tile of {tile_kb} KB ({k_cache.dtype}, block {block}, head dim "
            f"{dim}) is past the {MAX_TWO_PAGE_TILE_BYTES // 1024} KB that fit shared memory; use pages_per_tile=1 "
            "(or 1-byte K/V)")
    require(not paired_v or paired_v_applies(v_cache, compute_f16),
            "paired_v needs an e4m3 V cache with even strides and offset, and compute_f16")
    if key_tile is None:
        key_tile = DEFAULT_KEY_TILE[layout]
    check_key_tile(key_tile)
    if layout == "token":
        return _token_attention(q, k_cache, v_cache, meta, selection, qk_scale=qk_scale, vs=vs,
                                max_qo_len=max_qo_len, splits=splits, num_warps=num_warps, num_stages=num_stages,
                                key_tile=key_tile, compute_f16=compute_f16, prefetch=prefetch, paired_v=paired_v,
                                self_merge=self_merge, ready=ready, pages_per_tile=pages_per_tile,
                                request_major=request_major)
    require(ready is None, "ready flags need layout 'token'")
    require(not request_major, "request_major needs layout 'token'")
    qp = tokens_per_tile(num_tokens, num_requests, group, max_qo_len) if union is None else union.chunk
    require(qp * group >= 16, f"union chunk {qp} x group {group} must give >= 16 rows")
    paired_v = _paired_v_for_tile(paired_v, False, qp * group, dim, min(block, key_tile))
    nch = chunk_count(num_tokens, num_requests, qp, max_qo_len) if union is None else union.num_chunks
    partial_row = num_tokens * num_heads * dim
    if splits is None:
        splits = union_splits(num_requests * hkv * nch, qp, topk, q.device, partial_row=partial_row)
    splits = check_splits(splits, partial_row)
    grid = (num_requests, hkv, nch * splits)
    check_grid("sparse verify attention (layout 'union')", grid, f"requests, KV heads, {nch} chunks of {qp} tokens "
               f"a request x {splits} splits{_UNHINTED if max_qo_len is None else ''}")
    if union is None:
        union = union_from_selection(selection, meta.cu_qo_lens, meta.block_tables, chunk=qp, num_chunks=nch)
    require(union.counts.shape[:2] == (num_requests, hkv), "union does not match requests x KV heads")
    out, o_buf, lse = split_outputs(q, v_cache, splits)
    if num_tokens == 0 or num_requests == 0:
        return out.zero_()
    launch(_sparse_verify_kernel, grid,
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        union.ids, union.pages, union.bits, union.counts,
        meta.block_tables, meta.block_tables.stride(0), meta.cu_qo_lens, meta.positions,
        o_buf, out.stride(0), out.stride(1), lse, num_tokens,
        qk_scale, vs,
        G=group, QP=qp, UMAX=union.umax, NCH=nch, BLOCK=block, BN=min(block, key_tile), D=dim, SPLITS=splits,
        F16=compute_f16, IEEE=q.dtype == torch.float32, VPAIR=paired_v, ASM=not triton_interpreting(),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device, grid),
    )
    return merge_outputs(out, o_buf, lse, meta, splits, vs)


def check_key_tile(key_tile: int) -> None:
    """Refuse a key tile the MMAs cannot take (a Triton compile error that names no option otherwise)."""
    require(isinstance(key_tile, int) and not isinstance(key_tile, bool) and key_tile >= 16 and is_pow2(key_tile),
            f"key_tile must be a power of two >= 16 (keys a tl.dot tile takes), got {key_tile!r}")


def paired_v_applies(v_cache: torch.Tensor, compute_f16: bool) -> bool:
    """Whether V can be read as 16-bit pairs of head dims: e4m3 (the byte convert is e4m3's), f16
    MMAs, and every stride and the offset even.

    The per-token attention's default (H200, 2026-11-29, an A/B in one run, 32K context, top-k
    selections, off -> on): B64 q4 42.5 -> 32.5 us, B64 q1 21.1 -> 17.9, B16 q4 19.8 -> 16.3, B16
    q1 8.9 -> 7.9, B1/8K 6.4 -> 6.2; `scripts/tune_verify_kernels.py --paired-v` re-measures it.
    Its loop drops from about 4,200 to 2,900 warp instructions a page (no byte-wise shared loads of
    V) and ptxas gives 168 registers instead of 255. Not the union layout's default: B64 q4 77.8 ->
    84.0 there.
    """
    return compute_f16 and v_cache.dtype == torch.float8_e4m3fn and byte_aligned(v_cache, 2)


#: Triton 3.6 on the H200 (sm_90) miscomputes the paired-V MMAs (`paired_v`) of a 64-row tile (its
#: warp-group MMA, 4 warps) whose V halves are narrower than 64 columns (head dim below
#: PAIRED_V_WIDE_DIM) with key tiles of 64 or more: relative errors near 1 or illegal addresses, in
#: both layouts, at head dims 32 and 64, bf16 and fp16 queries, 1-3 stages, 1-4 splits. Measured
#: right there: head dim 128, rows up to 32, key tiles of 16 and 32, 8 warps, the byte read
#: (2026-12-01: `scripts/kernel_fuzz.py --seed 35 --case 17` and a 56-variant sweep;
#: tests/msa/kernels/test_sparse_verify_paired_v.py keeps the shapes). Triton's interpreter
#: computes these tiles right, so only a GPU run shows it.
PAIRED_V_MAX_NARROW_ROWS = 32
PAIRED_V_WIDE_DIM = 128
PAIRED_V_MAX_NARROW_KEYS = 32


def paired_v_tile_ok(rows: int, dim: int, key_cols: int) -> bool:
    """Whether a tile of `rows` query rows x `key_cols` keys at head dim `dim` may take the
    paired-V read (see PAIRED_V_WIDE_DIM for the miscompile it steers around)."""
    return rows <= PAIRED_V_MAX_NARROW_ROWS or dim >= PAIRED_V_WIDE_DIM or key_cols <= PAIRED_V_MAX_NARROW_KEYS


def _paired_v_for_tile(asked: bool | None, default: bool, rows: int, dim: int, key_cols: int) -> bool:
    """The paired-V choice for a tile: `default` where None was asked; a tile it would be
    miscomputed on (`paired_v_tile_ok`) reads V as bytes by default and refuses an explicit request."""
    ok = paired_v_tile_ok(rows, dim, key_cols)
    require(not asked or ok, f"paired_v: a tile of {rows} query rows x {key_cols} keys at head dim {dim} is "
            "miscomputed by Triton's warp-group MMA on sm_90 (wrong results, illegal addresses); above "
            f"{PAIRED_V_MAX_NARROW_ROWS} rows below head dim {PAIRED_V_WIDE_DIM} it takes key tiles of at most "
            f"{PAIRED_V_MAX_NARROW_KEYS} (key_tile=); or leave paired_v unset")
    return default and ok if asked is None else asked


#: What a grid refusal adds where no `max_qo_len` sized it.
_UNHINTED = "; without max_qo_len one request may hold every token of the step"


def _token_attention(q, k_cache, v_cache, meta, selection, *, qk_scale, vs, max_qo_len, splits,
                     num_warps, num_stages, key_tile, compute_f16, prefetch, paired_v, self_merge,
                     ready=None, pages_per_tile=1, request_major=False) -> torch.Tensor:
    """Layout 'token' of `sparse_verify_attention`; `qk_scale` = softmax x K scale x log2(e), `vs` the V scale."""
    num_tokens, num_heads, dim = q.shape
    _, hkv, block, _ = k_cache.shape
    group = num_heads // hkv
    topk = selection.shape[2]
    num_requests = meta.kv_lens.shape[0]
    require(group <= MAX_TILE_ROWS,
            f"layout 'token' takes at most {MAX_TILE_ROWS} query heads per KV head, got {group}")
    rows = next_pow2(max(16, group))  # the GQA group, padded for tl.dot
    key_cols = 2 * block if pages_per_tile == 2 else min(block, key_tile)
    paired_v = _paired_v_for_tile(paired_v, paired_v_applies(v_cache, compute_f16), rows, dim, key_cols)
    per_request = chunk_count(num_tokens, num_requests, 1, max_qo_len)
    partial_row = num_tokens * num_heads * dim
    if splits is None:
        require(ready is None, "ready flags need explicit splits (the top-k's consumers per row)")
        splits = token_splits(num_requests * per_request * hkv, topk, q.device, partial_row=partial_row)
    splits = check_splits(splits, partial_row)
    require(ready is None or (ready.dtype == torch.int32 and ready.numel() >= hkv * num_tokens),
            "ready flags must be int32 with one entry per KV head and token")
    grid = (num_requests, hkv, per_request * splits)
    check_grid("sparse verify attention (layout 'token')", grid, f"requests, KV heads, {per_request} tokens a "
               f"request x {splits} splits{_UNHINTED if max_qo_len is None else ''}")
    out, o_buf, lse = split_outputs(q, v_cache, splits)
    if num_tokens == 0 or num_requests == 0:
        return out.zero_()
    if self_merge is None:
        self_merge = 1 < splits <= SELF_MERGE_SPLITS
    arrivals = split_arrivals(q.device, num_tokens * hkv) if self_merge and splits > 1 else None
    self_merge = arrivals is not None
    launch(_sparse_token_kernel, grid,
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        selection, selection.stride(0), selection.stride(1),
        meta.block_tables, meta.block_tables.stride(0), meta.cu_qo_lens, meta.positions,
        o_buf, out.stride(0), out.stride(1), lse, num_tokens, out, out if arrivals is None else arrivals,
        out if ready is None else ready, qk_scale, vs,
        G=group, ROWS=rows, TOPK=topk, TOPK_P=next_pow2(topk), BLOCK=block, BN=key_cols, D=dim, SPLITS=splits,
        F16=compute_f16, PREFETCH=prefetch,
        IEEE=q.dtype == torch.float32, VPAIR=paired_v, ASM=not triton_interpreting(), SELF_MERGE=self_merge,
        READY=ready is not None, REQUEST_MAJOR=request_major, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(q.device, grid, every_grid=ready is not None),
    )
    return out if self_merge else merge_outputs(out, o_buf, lse, meta, splits, vs)


#: Most splits the per-token attention merges itself (its last split to finish), not with a merge
#: launch. H200, 2026-11-30, `scripts/tune_verify_kernels.py --splits` (the step, merge launch ->
#: self-merge): 4 splits B16/32K q4 54.6 -> 52.7 us, B64/32K q1 144.6 -> 142.5, B8/32K q4 34.4 ->
#: 33.9; 8 splits B8 q4 34.2 -> 35.0, B16 q1 46.7 -> 47.8 (2026-11-29, with the hand-off: 2 splits
#: B16 q4 53.2 -> 53.1, B64 q1 140.5 -> 140.1; a session-8 run: 16 splits at B1/8K 10.4 vs 7.3).
SELF_MERGE_SPLITS = 4

