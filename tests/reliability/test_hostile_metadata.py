"""Step metadata and MSA functions under hostile lengths: clamped or refused, never out of bounds.

Every case runs a full step (prepare, write K/V/index-K, block selection, sparse and dense
attention) on a `PoisonedPool`: unowned slots hold NaN, so an out-of-bounds write shows as a
finite unowned slot and an out-of-bounds read shows as a non-finite output.
"""
from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m3_eagle_plugin.msa as msa_api

from ._counts import bump
from ._poison import PoisonedPool, blocks_for, distinct_block_tables
from ._reference import token_fields

B = 4            # block size (= page size), small so several blocks and sparsity are active
HKV, HQ, D = 2, 4, 8
DI = 8           # index dim (index heads = HKV)
TOPK = 2
MAX_REQ, MAX_TOK, MAX_BLOCKS, PAGES = 4, 16, 6, 32
CLEAR_ERRORS = (ValueError, TypeError)


def _msa():
    """The module under test; a missing export fails the test instead of skipping it."""
    missing = [n for n in ("MsaDecodeMetadata", "write_kv", "write_index_k", "select_blocks_paged",
                           "sparse_attention", "dense_attention") if not hasattr(msa_api, n)]
    assert not missing, f"m3_eagle_plugin.msa lacks {missing}"
    return msa_api


def _meta(msa):
    return msa.MsaDecodeMetadata(MAX_REQ, MAX_TOK, MAX_BLOCKS, B, torch.device("cpu"))


def _ints(view) -> list[int]:
    return [int(x) for x in torch.as_tensor(view).flatten().tolist()]


def _num_tokens(meta) -> int:
    return len(_ints(meta.cache_slots))


def _run_step(msa, meta, pool: PoisonedPool, num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """Write the step's K/V/index-K, select blocks, attend; returns the outputs."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, HKV, D, generator=g)
    v = torch.randn(num_tokens, HKV, D, generator=g)
    ik = torch.randn(num_tokens, DI, generator=g)
    q = torch.randn(num_tokens, HQ, D, generator=g)
    iq = torch.randn(num_tokens, HKV, DI, generator=g)
    slots = meta.cache_slots
    msa.write_kv(pool.k, pool.v, slots, k, v)
    msa.write_index_k(pool.index_k, slots, ik)
    selection = msa.select_blocks_paged(iq, pool.index_k, meta, topk=TOPK)
    sparse = msa.sparse_attention(q, pool.k, pool.v, meta, selection, scale=D ** -0.5)
    dense = msa.dense_attention(q, pool.k, pool.v, meta, scale=D ** -0.5)
    return {"selection": selection, "sparse": sparse, "dense": dense}


def _check_in_bounds(meta, table: torch.Tensor, kv_bound: list[int]) -> None:
    """Each per-token field stays inside its request: slots in owned pages, counts within kv."""
    slots, rows = _ints(meta.cache_slots), _ints(meta.token_request)
    positions, valid, tkv = _ints(meta.positions), _ints(meta.valid_blocks), _ints(meta.token_kv_lens)
    for t, slot in enumerate(slots):
        r = rows[t]
        assert 0 <= r < len(kv_bound), f"token {t}: row {r} outside the batch"
        bound = kv_bound[r]
        assert valid[t] <= math.ceil(max(bound, 0) / B), f"token {t}: {valid[t]} valid blocks > kv {bound}"
        assert tkv[t] <= bound, f"token {t}: token_kv_len {tkv[t]} > staged kv {bound}"
        if slot < 0:
            continue
        p = positions[t]
        assert 0 <= p < bound, f"token {t}: slot {slot} written at position {p} outside [0, {bound})"
        assert slot == int(table[r, p // B]) * B + p % B, f"token {t}: slot {slot} is not its own position's"


def _prepare_or_refuse(meta, qo, kv, table) -> bool:
    """True if prepare accepted the input; a refusal must be a clear ValueError/TypeError."""
    try:
        meta.prepare(qo, kv, table)
    except CLEAR_ERRORS as exc:
        assert str(exc).strip(), "refusal without a message"
        bump("hostile.refused")
        return False
    bump("hostile.accepted")
    return True


def _valid_case(qo: list[int], kv: list[int], seed: int):
    table = distinct_block_tables([blocks_for(x, B) for x in kv], MAX_BLOCKS, PAGES, seed)
    pool = PoisonedPool(PAGES, HKV, B, D, DI, seed=seed)
    for r, (q_len, kv_len) in enumerate(zip(qo, kv)):
        pool.own_request(table[r].tolist(), kv_len, kv_len - q_len)
    return table, pool


# ---- reference cases: valid steps are exact; the poisoned pool proves no stray access ----

@pytest.mark.parametrize("qo,kv", [
    ([1], [1]),                     # first token of a request
    ([4, 1, 3], [9, 5, 3]),         # verify chunk, decode, a prompt that fills < one block
    ([1, 1, 1, 1], [4, 8, 12, 23]), # exact block boundaries and the last slot of the table
    ([5, 0], [7, 5]),               # a row that contributes no tokens this step
])
def test_valid_step_matches_reference_and_stays_in_bounds(qo, kv):
    msa = _msa()
    table, pool = _valid_case(qo, kv, seed=sum(kv))
    meta = _meta(msa)
    meta.prepare(qo, kv, table)
    expected = token_fields(qo, kv, table, B)
    for name, want in expected.items():
        assert _ints(getattr(meta, name)) == want.tolist(), name
    out = _run_step(msa, meta, pool, sum(qo), seed=1)
    pool.assert_unowned_untouched()
    pool.assert_owned_finite()
    for name in ("sparse", "dense"):
        assert torch.isfinite(out[name]).all(), f"{name} attention read a poisoned slot"
    sel = out["selection"]
    for t, vb in enumerate(_ints(meta.valid_blocks)):
        ids = [i for i in sel[:, t].flatten().tolist() if i >= 0]
        assert all(i < vb for i in ids), f"token {t} selected a block past its {vb} visible blocks"


# ---- hostile prepare() inputs: refused with a clear error, or clamped in bounds ----

HOSTILE_PREPARE = {  # (qo, kv, what the refusal must name)
    "negative kv": ([1], [-3], r"request 0: lengths must be >= 0, got qo_len=1, kv_len=-3"),
    "negative qo": ([-1], [4], r"request 0: lengths must be >= 0, got qo_len=-1, kv_len=4"),
    "qo longer than kv": ([6], [4], r"request 0: qo_len 6 exceeds kv_len 4"),
    "kv past the table width": ([1], [MAX_BLOCKS * B + 1], rf"request 0: kv_len {MAX_BLOCKS * B + 1} needs "
                                                            rf"{MAX_BLOCKS + 1} (blocks|pages)"),
    "more requests than max": ([1] * (MAX_REQ + 1), [1] * (MAX_REQ + 1),
                               rf"num_requests {MAX_REQ + 1} exceeds max_num_requests {MAX_REQ}"),
    "more tokens than max": ([MAX_TOK + 1], [MAX_TOK + 1],
                             rf"step has {MAX_TOK + 1} tokens, max_num_tokens is {MAX_TOK}"),
    "qo/kv length mismatch": ([1, 1], [3], r"qo_lens has 2 entries but kv_lens has 1"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PREPARE))
def test_hostile_prepare_is_refused_clearly(case):
    """These inputs have no meaning: prepare must refuse them with a ValueError/TypeError naming the
    cause (another check failing later, e.g. the decode scratch for too many requests, is no refusal
    of this input)."""
    msa = _msa()
    qo, kv, cause = HOSTILE_PREPARE[case]
    n_rows = max(len(qo), len(kv))
    table = distinct_block_tables([min(MAX_BLOCKS, blocks_for(max(x, 1), B)) for x in kv] + [1] * (n_rows - len(kv)),
                                  MAX_BLOCKS, PAGES, seed=3)
    meta = _meta(msa)
    bump("faults.injected")
    with pytest.raises(CLEAR_ERRORS, match=cause):
        meta.prepare(qo, kv, table)


def test_unallocated_page_inside_kv_is_refused_naming_it():
    """A `-1` table entry inside the request's kv range of a host table: refused naming the unmapped
    page. Without the check the step ran finite and touched no unowned slot, so "refused, or never
    touched" passed with no refusal at all."""
    msa = _msa()
    qo, kv = [2], [10]
    table = torch.full((1, MAX_BLOCKS), -1, dtype=torch.int32)
    table[0, 0], table[0, 2] = 0, 2  # block 1 (positions 4..7) was never allocated
    meta = _meta(msa)
    bump("faults.injected")
    with pytest.raises(CLEAR_ERRORS, match=r"^request 0: block_tables has an unmapped page \(< 0\) among its first 3$"):
        meta.prepare(qo, kv, table)


def test_fewer_table_rows_than_requests_is_refused_clearly():
    msa = _msa()
    meta = _meta(msa)
    table = torch.tensor([[0, 1, -1, -1, -1, -1]], dtype=torch.int32)
    bump("faults.injected")
    with pytest.raises(CLEAR_ERRORS):
        meta.prepare([1, 1], [5, 3], table)


def test_block_table_narrower_than_kv_is_refused_clearly():
    msa = _msa()
    meta = _meta(msa)
    table = torch.tensor([[0, 1]], dtype=torch.int32)  # 2 blocks = 8 tokens, kv needs 3 blocks
    bump("faults.injected")
    with pytest.raises(CLEAR_ERRORS):
        meta.prepare([1], [9], table)


def test_empty_batch_is_a_no_op_or_refused():
    msa = _msa()
    meta = _meta(msa)
    pool = PoisonedPool(PAGES, HKV, B, D, DI)
    table = torch.empty((0, MAX_BLOCKS), dtype=torch.int32)
    bump("faults.injected")
    if not _prepare_or_refuse(meta, [], [], table):
        return
    assert _num_tokens(meta) == 0
    out = _run_step(msa, meta, pool, 0, seed=0)
    pool.assert_unowned_untouched()
    assert out["sparse"].shape == (0, HQ, D) and out["dense"].shape == (0, HQ, D)


def test_zero_length_request_contributes_nothing():
    """kv = qo = 0: refused, or a row with no tokens that touches no slot."""
    msa = _msa()
    qo, kv = [0, 2], [0, 6]
    table, pool = _valid_case(qo, kv, seed=9)
    meta = _meta(msa)
    if not _prepare_or_refuse(meta, qo, kv, table):
        return
    assert _ints(meta.token_request) == [1, 1]
    out = _run_step(msa, meta, pool, 2, seed=3)
    pool.assert_unowned_untouched()
    assert torch.isfinite(out["sparse"]).all() and torch.isfinite(out["dense"]).all()


# ---- on_update_kv_lens: corrections only shrink; anything else is clamped to the staged lengths ----

def _staged_step(msa, seed: int = 11):
    qo, kv = [4, 4, 1], [10, 7, 13]
    table, pool = _valid_case(qo, kv, seed=seed)
    meta = _meta(msa)
    meta.prepare(qo, kv, table)
    return meta, table, pool, qo, kv


def test_update_above_staged_is_clamped_to_staged():
    msa = _msa()
    meta, table, pool, qo, kv = _staged_step(msa)
    staged = {n: _ints(getattr(meta, n)) for n in ("cache_slots", "valid_blocks", "token_kv_lens")}
    bump("faults.injected")
    meta.on_update_kv_lens(torch.tensor([k + 5 for k in kv], dtype=torch.int32))
    for name, want in staged.items():
        assert _ints(getattr(meta, name)) == want, f"{name} grew past the staged lengths"
    assert _ints(meta.kv_lens) == kv
    out = _run_step(msa, meta, pool, sum(qo), seed=4)
    pool.assert_unowned_untouched()
    assert torch.isfinite(out["sparse"]).all() and torch.isfinite(out["dense"]).all()


@pytest.mark.parametrize("corrected", [[0, 0, 0], [-5, 3, -1], [2, 1, 0]])
def test_update_below_qo_or_negative_stays_in_bounds(corrected):
    """Nonsense corrections (<= 0, < qo) must not move any write or read outside the request."""
    msa = _msa()
    meta, table, pool, qo, kv = _staged_step(msa)
    bump("faults.injected")
    meta.on_update_kv_lens(torch.tensor(corrected, dtype=torch.int32))
    _check_in_bounds(meta, table, kv)
    out = _run_step(msa, meta, pool, sum(qo), seed=5)
    pool.assert_unowned_untouched()
    positions = _ints(meta.positions)
    for t, p in enumerate(positions):
        if p >= 0:
            assert torch.isfinite(out["dense"][t]).all(), f"token {t} read a poisoned slot"


@pytest.mark.parametrize("bad", [torch.tensor([8, 7], dtype=torch.int32), torch.tensor([8.0, 7.0, 12.0]),
                                 [8, 7, 12]], ids=["wrong-length", "float", "list"])
def test_update_with_a_malformed_correction_is_refused_and_changes_nothing(bad):
    msa = _msa()
    meta, table, pool, qo, kv = _staged_step(msa)
    before = {n: _ints(getattr(meta, n)) for n in ("cache_slots", "valid_blocks", "token_kv_lens", "positions")}
    bump("faults.injected")
    with pytest.raises(CLEAR_ERRORS):
        meta.on_update_kv_lens(bad)
    assert {n: _ints(getattr(meta, n)) for n in before} == before


def test_update_is_idempotent():
    msa = _msa()
    meta, table, pool, qo, kv = _staged_step(msa)
    corrected = torch.tensor([8, 7, 12], dtype=torch.int32)
    meta.on_update_kv_lens(corrected)
    first = {n: _ints(getattr(meta, n)) for n in ("cache_slots", "valid_blocks", "token_kv_lens", "positions")}
    meta.on_update_kv_lens(corrected)
    second = {n: _ints(getattr(meta, n)) for n in first}
    assert first == second
    want = token_fields(qo, [8, 7, 12], table, B)
    assert first["cache_slots"] == want["cache_slots"].tolist()


# ---- selections naming blocks a token cannot see are masked, never read ----

def test_selection_past_the_tokens_position_is_masked():
    """A selected block beyond a token's position (here: an unallocated table entry) is never read."""
    msa = _msa()
    qo, kv = [3], [11]  # positions 8, 9, 10; blocks 0..2 allocated, block 3 is -1 in the table
    table, pool = _valid_case(qo, kv, seed=13)
    meta = _meta(msa)
    meta.prepare(qo, kv, table)
    _run_step(msa, meta, pool, 3, seed=6)  # writes positions 8..10
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(6))
    honest = torch.tensor([[[0, 2, -1], [1, 2, -1], [0, 2, -1]]] * HKV, dtype=torch.int32)
    hostile = honest.clone()
    hostile[:, 0, 2] = 3  # token 0 names block 3: all its keys (12..15) lie in token 0's future
    bump("faults.injected")
    a = msa.sparse_attention(q, pool.k, pool.v, meta, honest, scale=D ** -0.5)
    b = msa.sparse_attention(q, pool.k, pool.v, meta, hostile, scale=D ** -0.5)
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "a poisoned slot leaked into attention"
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


# ---- property: any lengths -> exact reference, or a clear refusal; never out of bounds ----

@pytest.mark.parametrize("valid", [False, True], ids=["free", "valid"])
def test_prepare_property(valid):
    """Freely drawn lengths are mostly refused (19 of 25 once, one valid case with tokens), so lengths
    valid by construction run too: prepare and every plausible correction give the naive reference.
    Reach counts are > 0, not counts tuned to one draw (they differ by hypothesis version)."""
    reached: collections.Counter = collections.Counter()

    @settings(max_examples=60 if valid else 25, deadline=None, derandomize=True)
    @given(data=st.data())
    def prop(data):
        _prepare_case(data, reached, valid=valid)

    prop()
    if valid:
        assert reached["valid with tokens"] > 0 and reached["exact correction"] > 0, reached
        assert reached["refused"] == 0, reached
    else:
        assert reached["refused"] > 0, reached


def _prepare_case(data, reached, valid: bool):
    msa = _msa()
    if valid:
        n = data.draw(st.integers(0, MAX_REQ), label="requests")
        kv = [data.draw(st.integers(0, MAX_BLOCKS * B), label="kv") for _ in range(n)]
        qo, budget = [], MAX_TOK
        for k in kv:
            qo.append(data.draw(st.integers(0, min(k, budget)), label="qo"))
            budget -= qo[-1]
    else:
        n = data.draw(st.integers(0, MAX_REQ + 1), label="requests")
        qo = [data.draw(st.integers(-1, 6), label="qo") for _ in range(n)]
        kv = [data.draw(st.integers(-1, MAX_BLOCKS * B + 2), label="kv") for _ in range(n)]
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    bump("hostile.cases")
    sane = (n <= MAX_REQ and sum(max(q, 0) for q in qo) <= MAX_TOK
            and all(0 <= q <= k <= MAX_BLOCKS * B for q, k in zip(qo, kv)))
    if sum(blocks_for(max(k, 0), B) for k in kv) > PAGES:
        return
    table = distinct_block_tables([min(blocks_for(max(k, 0), B), MAX_BLOCKS) for k in kv], MAX_BLOCKS, PAGES, seed)
    pool = PoisonedPool(PAGES, HKV, B, D, DI, seed=seed)
    meta = _meta(msa)
    if not sane:
        bump("faults.injected")
        with pytest.raises(CLEAR_ERRORS):
            meta.prepare(qo, kv, table)
        reached["refused"] += 1
        return
    for r, (q_len, kv_len) in enumerate(zip(qo, kv)):
        pool.own_request(table[r].tolist(), kv_len, kv_len - q_len)
    meta.prepare(qo, kv, table)
    want = token_fields(qo, kv, table, B)
    assert _ints(meta.cache_slots) == want["cache_slots"].tolist()
    assert _ints(meta.valid_blocks) == want["valid_blocks"].tolist()
    reached["valid with tokens"] += sum(qo) > 0
    out = _run_step(msa, meta, pool, sum(qo), seed=seed)
    pool.assert_unowned_untouched()
    pool.assert_owned_finite()
    assert torch.isfinite(out["sparse"]).all() and torch.isfinite(out["dense"]).all()
    # then a random correction: clamped to the staged lengths, still in bounds; half of them are one
    # the overlap scheduler can make (between the step's tokens and the staged length)
    if data.draw(st.booleans(), label="plausible correction"):
        corrected = [data.draw(st.integers(q, k), label="corrected") for q, k in zip(qo, kv)]
    else:
        corrected = [data.draw(st.integers(-2, k + 3), label="corrected") for k in kv]
    if n:
        meta.on_update_kv_lens(torch.tensor(corrected, dtype=torch.int32))
        _check_in_bounds(meta, table, kv)
        if sum(qo) and all(q <= c <= k for q, c, k in zip(qo, corrected, kv)):
            # a plausible correction: every per-token field is the naive reference's for those lengths
            want = token_fields(qo, corrected, table, B)
            for name in ("cache_slots", "valid_blocks", "token_kv_lens", "positions"):
                assert _ints(getattr(meta, name)) == want[name].tolist(), name
            reached["exact correction"] += 1
