"""The attention kernels' shared tile functions (`attention_tiles`) against a naive fp64 attention.

A probe kernel walks a small paged cache through `attend_page_tile` (one page a tile) or
`attend_two_pages` (two pages a tile), with bytes or 16-bit lane pairs of e4m3 V (`VPAIR`), and
writes the normalised rows. Keys past the rows' largest position hold NaN (as an unwritten cache
tail does) and one block-table entry is unmapped: neither may reach an output. On CPU the cases
run through Triton's interpreter (`tests._interpreter`), on a GPU here.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import needs_gpu

triton = pytest.importorskip("triton")
tl = triton.language

from m3_eagle_plugin.msa.kernels.attention_tiles import (  # noqa: E402
    LOG2E, attend_page_tile, attend_two_pages, join_dim_halves)

ROWS, DIM, BLOCK, PAGES = 16, 32, 16, 4


@triton.jit
def _probe(q_ptr, k_ptr, v_ptr, s_k_p, s_k_b, s_v_p, s_v_b, table_ptr, pos_ptr, has_ptr, o_ptr, qk_scale,
           ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PAGES: tl.constexpr, VPAIR: tl.constexpr,
           TWO: tl.constexpr):
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :]).to(tl.float16)
    pos = tl.load(pos_ptr + rows)
    row_has = tl.load(has_ptr + rows) != 0
    pos_max = tl.max(pos, axis=0)
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D // 2 if VPAIR else D], tl.float32)
    acc_hi = tl.zeros([ROWS, D // 2 if VPAIR else 1], tl.float32)
    if TWO:
        jn = tl.arange(0, 2 * BLOCK)
        second = jn >= BLOCK
        kin = jn % BLOCK
        for it in range(PAGES // 2):
            page = tl.where(second, tl.load(table_ptr + 2 * it + 1), tl.load(table_ptr + 2 * it))
            kpos = (2 * it + second.to(tl.int32)) * BLOCK + kin
            m_i, l_i, acc, acc_hi = attend_two_pages(q, k_ptr, s_k_p, 0, s_k_b, v_ptr, s_v_p, 0, s_v_b, 0, page, kin,
                                                     kpos, d, row_has, pos, pos_max, m_i, l_i, acc, acc_hi, qk_scale,
                                                     False, VPAIR, False)
    else:
        key = tl.arange(0, BLOCK)
        for b in range(PAGES):
            page = tl.load(table_ptr + b)
            m_i, l_i, acc, acc_hi = attend_page_tile(q, k_ptr, s_k_p, 0, s_k_b, v_ptr, s_v_p, 0, s_v_b, 0, page, key,
                                                     b * BLOCK + key, d, row_has, pos, pos_max, m_i, l_i, acc,
                                                     acc_hi, qk_scale, False, VPAIR, False)
    acc = join_dim_halves(acc, acc_hi, VPAIR)
    tl.store(o_ptr + rows[:, None] * D + d[None, :], acc / tl.where(l_i > 0, l_i, 1.0)[:, None])


def _case(device, seed, fp8):
    """(q, k_cache, v_cache, table, pos, has): pages shuffled in a bigger pool, logical block 2
    unmapped, K/V past the largest position NaN, two rows that see nothing."""
    gen = torch.Generator().manual_seed(seed)
    pool = PAGES + 3
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.float16
    k = (torch.randn(pool, BLOCK, DIM, generator=gen) * 0.5).to(kv_dtype)
    v = torch.randn(pool, BLOCK, DIM, generator=gen).to(kv_dtype)
    table = torch.randperm(pool, generator=gen)[:PAGES].to(torch.int32)
    table[2] = -1
    pos = torch.randint(0, PAGES * BLOCK - 5, (ROWS,), generator=gen, dtype=torch.int32)
    has = (torch.rand(ROWS, generator=gen) > 0.15).to(torch.int32)
    has[0] = 0
    pos[1] = 2 * BLOCK + 3  # its visible keys end inside the unmapped block
    last = int(pos.max())
    for b in range(PAGES):  # an unwritten tail: NaN past the largest position
        if table[b] >= 0 and (b + 1) * BLOCK > last + 1:
            start = max(0, last + 1 - b * BLOCK)
            k[table[b], start:] = float("nan")
            v[table[b], start:] = float("nan")
    q = torch.randn(ROWS, DIM, generator=gen).half()
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(table), to(pos), to(has)


def naive(q, k, v, table, pos, has, scale):
    """fp64 `[ROWS, D]`: each row attends the mapped keys at or below its position."""
    out = torch.zeros(ROWS, DIM, dtype=torch.float64)
    keys, vals, kpos = [], [], []
    for b, page in enumerate(table.tolist()):
        if page >= 0:
            keys.append(k[page].double().cpu())
            vals.append(v[page].double().cpu())
            kpos.append(torch.arange(b * BLOCK, (b + 1) * BLOCK))
    keys, vals, kpos = torch.cat(keys), torch.cat(vals), torch.cat(kpos)
    for r in range(ROWS):
        seen = kpos <= int(pos[r])
        if not int(has[r]) or not seen.any():
            continue
        w = torch.softmax(q[r].double().cpu() @ keys[seen].T * scale, dim=0)
        out[r] = w @ vals[seen]
    return out


def check_tiles_match_naive(device, *, vpair=False, two=False, seed=0):
    q, k, v, table, pos, has = _case(device, seed, fp8=vpair)
    scale = 1 / math.sqrt(DIM)
    out = torch.full((ROWS, DIM), float("nan"), device=device)
    _probe[(1,)](q, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), table, pos, has, out, scale * LOG2E,
                 ROWS=ROWS, D=DIM, BLOCK=BLOCK, PAGES=PAGES, VPAIR=vpair, TWO=two)
    assert torch.isfinite(out).all(), "a NaN key or an unmapped page reached an output"
    torch.testing.assert_close(out.double().cpu(), naive(q, k, v, table, pos, has, scale), rtol=3e-3, atol=3e-3)
    assert (out[0] == 0).all()  # a row that selected nothing


def check_tiling_does_not_change_rows(device, *, vpair=True, seed=5):
    """One-page and two-page tiles fold the same keys: the online softmax is order-free up to rounding."""
    q, k, v, table, pos, has = _case(device, seed, fp8=vpair)
    outs = []
    for two in (False, True):
        out = torch.empty(ROWS, DIM, device=device)
        _probe[(1,)](q, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), table, pos, has, out,
                     LOG2E / math.sqrt(DIM), ROWS=ROWS, D=DIM, BLOCK=BLOCK, PAGES=PAGES, VPAIR=vpair, TWO=two)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)


#: One-page and two-page tiles, byte (f16) and paired e4m3 V.
INTERPRETER_CASES = [
    (check_tiles_match_naive, dict()),
    (check_tiles_match_naive, dict(two=True, seed=1)),
    (check_tiles_match_naive, dict(vpair=True, seed=2)),
    (check_tiles_match_naive, dict(vpair=True, two=True, seed=3)),
    (check_tiling_does_not_change_rows, dict()),
]


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_gpu
@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vpair=st.booleans(), two=st.booleans())
def test_property_random_cases_on_gpu(seed, vpair, two):
    check_tiles_match_naive("cuda", vpair=vpair, two=two, seed=seed)


@needs_interpreter
def test_tiles_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_attention_tiles")
