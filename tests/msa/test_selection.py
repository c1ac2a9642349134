"""Tests for msa.selection: dense and paged per-token block selection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.msa import (
    MsaDecodeMetadata,
    MsaInputError,
    select_blocks,
    select_blocks_paged,
    select_from_block_scores,
    write_index_k,
)

from ._hf_oracle import BLOCK_SIZE, TOPK, SparseLayerOracle, selection_sets
from ._paged import PooledCache, naive_selection, padded_table, random_page_tables

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def oracle() -> SparseLayerOracle:
    return SparseLayerOracle(seed=0)


def assert_well_formed(sel: torch.Tensor, topk: int) -> None:
    assert sel.dtype == torch.int32 and sel.shape[-1] == topk
    for row in sel.reshape(-1, topk).tolist():
        valid = [b for b in row if b >= 0]
        assert row == valid + [-1] * (topk - len(valid)), row  # -1 only as right padding
        assert valid == sorted(set(valid)), row  # ascending, no repeats


def test_select_from_block_scores_hand_example() -> None:
    scores = torch.tensor([[[5.0, 1.0, 9.0, 2.0, 7.0, 100.0]]])  # 1 head, 1 token, 6 blocks
    # own block 4: block 5 is invisible despite its score; block 4 forced; best others 2 then 0.
    sel = select_from_block_scores(scores, torch.tensor([4]), topk=3)
    assert sel.tolist() == [[[0, 2, 4]]]
    # init block 0 forced as well: block 2 remains the single free pick.
    sel = select_from_block_scores(scores, torch.tensor([4]), topk=3, init_blocks=1)
    assert sel.tolist() == [[[0, 2, 4]]]
    sel = select_from_block_scores(scores, torch.tensor([1]), topk=3)
    assert sel.tolist() == [[[0, 1, -1]]]
    sel = select_from_block_scores(scores, torch.tensor([-1]), topk=2)
    assert sel.tolist() == [[[-1, -1]]]


def test_fp64_block_scores_are_ranked_in_fp64() -> None:
    """Scores 1e-12 apart, and one past fp32's range, against the ranking Python's floats give:
    rounded to fp32 the first two tied (the lower id won) and the huge one became +inf, which
    displaced the forced local block."""
    def naive(row: list[float], own: int, topk: int) -> list[int]:
        free = sorted(range(own), key=lambda b: (-row[b], b))[:topk - 1]  # own block forced
        return sorted(free + [own])

    for row, topk in (([1.0, 1.0 + 1e-12, -5.0, 0.0], 2), ([1e300, 2.0, 3.0, 0.0], 1), ([1e300, 2.0, 3.0, 0.0], 2)):
        sel = select_from_block_scores(torch.tensor([[row]], dtype=torch.float64), torch.tensor([3]), topk=topk)
        assert sel.tolist() == [[naive(row, 3, topk)]], (row, topk)


def test_select_blocks_names_an_argument_that_is_not_a_tensor() -> None:
    """DESIGN.md's signature takes tensors; a list (positions as a stranger might pass them) is named,
    not an AttributeError on `.dim`."""
    q, k = torch.zeros(2, 1, 4), torch.zeros(6, 4)
    for args, name in (((q, k, [3, 4]), "q_positions"), ((q, k.tolist(), torch.tensor([3, 4])), "index_k"),
                       ((q.tolist(), k, torch.tensor([3, 4])), "index_q")):
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            select_blocks(*args, block_size=2, topk=2)


def test_the_paged_and_score_selectors_name_an_argument_that_is_not_a_tensor() -> None:
    """As select_blocks: a list is refused by name, not an AttributeError on `.dim` naming nothing."""
    meta = MsaDecodeMetadata(1, 4, 2, 2, "cpu")
    meta.prepare([2], [3], torch.tensor([[0, 1]], dtype=torch.int32))
    q, cache = torch.zeros(2, 1, 4), torch.zeros(2, 2, 4)
    for args, name in (((q.tolist(), cache), "index_q"), ((q, cache.tolist()), "index_k_cache")):
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            select_blocks_paged(*args, meta, topk=2)
    scores, blocks = torch.zeros(1, 2, 2), torch.tensor([0, 1])
    for args, name in (((scores.tolist(), blocks), "block_scores"), ((scores, [0, 1]), "query_blocks")):
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            select_from_block_scores(*args, topk=2)


def test_select_blocks_matches_hf_indexer(oracle: SparseLayerOracle) -> None:
    run = oracle.run(41, seed=3)
    positions = torch.arange(41)
    sel = select_blocks(run.index_q, run.index_k, positions, block_size=BLOCK_SIZE, topk=TOPK)
    assert sel.shape == (2, 41, TOPK)
    assert_well_formed(sel, TOPK)
    assert selection_sets(sel) == selection_sets(run.selection)
    # Sparsity is active past topk * block tokens: some token leaves a visible block out.
    assert any(len(s) < p // BLOCK_SIZE + 1 for head in selection_sets(sel) for p, s in enumerate(head))


def test_select_blocks_subset_of_queries_matches_hf(oracle: SparseLayerOracle) -> None:
    run = oracle.run(37, seed=4)
    positions = torch.tensor([36, 12, 30])
    sel = select_blocks(run.index_q[positions], run.index_k, positions, block_size=BLOCK_SIZE, topk=TOPK)
    expected = selection_sets(run.selection[:, positions])
    assert selection_sets(sel) == expected


@PROPERTY
@given(
    seq_len=st.integers(1, 40),
    log_block=st.integers(0, 3),
    topk=st.integers(1, 5),
    local=st.integers(0, 2),
    init=st.integers(0, 2),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_select_blocks_matches_naive(seq_len, log_block, topk, local, init, heads, seed) -> None:
    if local + init > topk:
        local, init = min(local, topk), 0
    block = 1 << log_block
    gen = torch.Generator().manual_seed(seed)
    iq = torch.randn(seq_len, heads, 8, generator=gen)
    ik = torch.randn(seq_len, 8, generator=gen)
    positions = torch.randperm(seq_len, generator=gen)[: max(1, seq_len // 2)]
    sel = select_blocks(iq[positions], ik, positions, block_size=block, topk=topk, local_blocks=local, init_blocks=init)
    assert sel.shape == (heads, positions.numel(), topk)
    assert_well_formed(sel, topk)
    for t, p in enumerate(positions.tolist()):
        expected = naive_selection(iq[p], ik, p, block, topk, local, init)
        assert [s[t] for s in selection_sets(sel)] == expected
        if p // block + 1 <= topk:  # few visible blocks: all of them
            assert all(s[t] == frozenset(range(p // block + 1)) for s in selection_sets(sel))


def test_select_blocks_rejects_bad_arguments() -> None:
    iq, ik, pos = torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.tensor([0, 1])
    with pytest.raises(MsaInputError, match="power of two"):
        select_blocks(iq, ik, pos, block_size=6, topk=2)
    with pytest.raises(MsaInputError, match="exceed topk"):
        select_blocks(iq, ik, pos, block_size=2, topk=2, local_blocks=2, init_blocks=1)
    with pytest.raises(MsaInputError, match="shape mismatch"):
        select_blocks(iq, torch.zeros(3, 5), pos, block_size=2, topk=2)
    with pytest.raises(MsaInputError, match="topk"):
        select_blocks(iq, ik, pos, block_size=2, topk=0)
    for bad in (torch.tensor([0, 3]), torch.tensor([-1, 1])):  # the own block must exist (S = 3)
        with pytest.raises(MsaInputError, match=r"q_positions must lie in \[0, 3\)"):
            select_blocks(iq, ik, bad, block_size=2, topk=2)
    with pytest.raises(MsaInputError, match="integer"):
        select_blocks(iq, ik, torch.tensor([0.0, 1.9]), block_size=2, topk=2)
    with pytest.raises(MsaInputError, match="lie in"):
        select_blocks(iq, torch.zeros(0, 4), pos, block_size=2, topk=2)


def _paged_batch(rows, block, heads, dim, seed, corrections=None):
    """Fill a pooled index-K cache for requests ``rows = [(qo, kv)]``; return meta, cache, data."""
    qo = [q for q, _ in rows]
    kv = [k for _, k in rows]
    pages = max(1, sum(-(-k // block) for k in kv)) + 3
    cache = PooledCache(pages, block, kv_heads=1, head_dim=dim, index_dim=dim)
    tables = random_page_tables(kv, block, pages, seed)
    width = max([len(t) for t in tables] + [1])
    meta = MsaDecodeMetadata(len(rows) + 1, max([1, sum(qo)] + kv), width + 1, block, "cpu", max_draft_len=3)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(k, dim, generator=gen) for k in kv]
    # Whole sequences go in through the writer (one "prefill" per request), then the step is staged.
    for r, k in enumerate(kv):
        if k:
            meta.prepare([k], [k], padded_table([tables[r]], width))
            write_index_k(cache.index_k, meta.cache_slots, seqs[r])
    meta.prepare(qo, kv, padded_table(tables, width))
    if corrections is not None:
        meta.on_update_kv_lens(torch.tensor(corrections, dtype=torch.int32))
    iq = torch.randn(sum(qo), heads, dim, generator=gen)
    return meta, cache, seqs, iq


@PROPERTY
@given(
    rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 20)), min_size=1, max_size=4),
    log_block=st.integers(0, 3),
    topk=st.integers(1, 4),
    shrink=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_select_blocks_paged_equals_dense_per_request(rows, log_block, topk, shrink, seed) -> None:
    block = 1 << log_block
    rows = [(q, q + extra) for q, extra in rows]
    corrected = [max(0, k - s) for (_, k), s in zip(rows, shrink)]
    meta, cache, seqs, iq = _paged_batch(rows, block, heads=2, dim=8, seed=seed, corrections=corrected)
    sel = select_blocks_paged(iq, cache.index_k, meta, topk=topk)
    assert sel.shape == (2, meta.num_tokens, topk)
    assert_well_formed(sel, topk)
    start = 0
    for r, (q, _) in enumerate(rows):
        rows_of_r = slice(start, start + q)
        start += q
        positions = torch.arange(corrected[r] - q, corrected[r])
        live = positions >= 0
        assert (sel[:, rows_of_r][:, ~live] == -1).all()  # overhang tokens see nothing
        if live.any():
            dense = select_blocks(
                iq[rows_of_r][live], seqs[r][: corrected[r]], positions[live], block_size=block, topk=topk
            )
            assert torch.equal(sel[:, rows_of_r][:, live], dense)


def test_select_blocks_paged_matches_hf_mixed_batch(oracle: SparseLayerOracle) -> None:
    lengths, prefixes = [30, 26, 19, 8], [0, 22, 18, 3]  # prompt, 4-token verify, decode, chunk
    runs = [oracle.run(n, seed=10 + i) for i, n in enumerate(lengths)]
    rows = [(n - p, n) for n, p in zip(lengths, prefixes)]
    pages = 40
    cache = PooledCache(pages, BLOCK_SIZE, kv_heads=1, head_dim=16, index_dim=16)
    tables = random_page_tables(lengths, BLOCK_SIZE, pages, seed=5)
    table = padded_table(tables, 10)
    meta = MsaDecodeMetadata(4, 64, 10, BLOCK_SIZE, "cpu", max_draft_len=3, num_index_heads=2)
    meta.prepare([p for p in prefixes], prefixes, table)
    write_index_k(cache.index_k, meta.cache_slots, torch.cat([r.index_k[:p] for r, p in zip(runs, prefixes)]))
    meta.prepare([q for q, _ in rows], [k for _, k in rows], table)
    write_index_k(cache.index_k, meta.cache_slots, torch.cat([r.index_k[p:] for r, p in zip(runs, prefixes)]))
    iq = torch.cat([r.index_q[p:] for r, p in zip(runs, prefixes)])
    sel = select_blocks_paged(iq, cache.index_k, meta, topk=TOPK)
    expected = [[], []]
    for run, p in zip(runs, prefixes):
        for h, head in enumerate(selection_sets(run.selection)):
            expected[h].extend(head[p:])
    assert selection_sets(sel) == expected


def test_select_blocks_paged_checks_cache_shape() -> None:
    meta = MsaDecodeMetadata(1, 4, 2, 4, "cpu")
    meta.prepare([2], [2], torch.tensor([[0]], dtype=torch.int32))
    with pytest.raises(MsaInputError, match="index_k_cache"):
        select_blocks_paged(torch.zeros(2, 1, 8), torch.zeros(3, 2, 8), meta, topk=2)
    with pytest.raises(MsaInputError, match="index_q"):
        select_blocks_paged(torch.zeros(3, 1, 8), torch.zeros(3, 4, 8), meta, topk=2)


def test_select_from_block_scores_refuses_query_blocks_of_another_length() -> None:
    # One own-block for three tokens broadcast silently: every token was selected as if it sat in block 4.
    scores = torch.randn(2, 3, 5)
    with pytest.raises(MsaInputError, match=r"query_blocks must be \[T=3\]"):
        select_from_block_scores(scores, torch.tensor([4]), topk=2)
    with pytest.raises(MsaInputError, match=r"query_blocks must be \[T=3\]"):
        select_from_block_scores(scores, torch.tensor([[4, 1, 0]]), topk=2)
    with pytest.raises(MsaInputError, match="integer"):
        select_from_block_scores(scores, torch.tensor([4.0, 1.5, 0.0]), topk=2)
    with pytest.raises(MsaInputError, match=r"block_scores must be \[H, T, N\]"):
        select_from_block_scores(scores[0], torch.tensor([4, 1, 0]), topk=2)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    heads=st.integers(1, 2),
    num_blocks=st.integers(0, 7),
    past=st.booleans(),
    topk=st.integers(1, 5),
    local=st.integers(0, 3),
    init=st.integers(0, 3),
    data=st.data(),
)
def test_select_from_block_scores_is_a_valid_top_k_even_with_ties(heads, num_blocks, past, topk, local, init, data):
    """Scores drawn from {-1, 0, 1} (ties everywhere), own blocks before block 0 (none visible) or
    past the scored range (refused: the forced own block would be dropped).

    The definition: the forced visible blocks are all in, exactly min(topk, visible) blocks are
    kept, and no dropped visible block beats a kept free one; and among tied scores the lower block
    id wins (the kernels' rule, which keeps a token's choice independent of the row width)."""
    if local + init > topk:
        local, init = min(local, topk), max(0, min(init, topk - min(local, topk)))
    # Own blocks inside the scored range unless `past`: drawn from [-1, 8] against up to 7 blocks, most
    # examples were refused and the rest saw nothing to choose (no token had a free slot to fill).
    own = data.draw(st.lists(st.integers(-1, 8 if past else num_blocks - 1), min_size=0, max_size=5))
    values = data.draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=heads * len(own) * num_blocks,
                                max_size=heads * len(own) * num_blocks))
    scores = torch.tensor(values, dtype=torch.float32).view(heads, len(own), num_blocks)
    if own and max(own) >= num_blocks:  # that token's forced own block is not among the scored ones
        with pytest.raises(MsaInputError, match=f"reach block {max(own)} but block_scores score {num_blocks}"):
            select_from_block_scores(scores, torch.tensor(own, dtype=torch.int64), topk=topk)
        return
    sel = select_from_block_scores(scores, torch.tensor(own, dtype=torch.int64), topk=topk,
                                   local_blocks=local, init_blocks=init)
    assert sel.shape == (heads, len(own), topk)
    assert_well_formed(sel, topk)
    for h in range(heads):
        for t, o in enumerate(own):
            visible = {b for b in range(num_blocks) if b <= o}
            forced = {b for b in visible if b > o - local or b < init}
            kept = {b for b in sel[h, t].tolist() if b >= 0}
            assert forced <= kept <= visible
            assert len(kept) == min(topk, len(visible))
            free_kept = [float(scores[h, t, b]) for b in kept - forced]
            dropped = [float(scores[h, t, b]) for b in visible - kept]
            assert not free_kept or not dropped or min(free_kept) >= max(dropped)
            # and the tie-break is the lower block id (the kernels' rule), whatever the row width
            ranked = sorted(visible, key=lambda b: (b not in forced, -float(scores[h, t, b]), b))
            assert kept == set(ranked[:topk]), (h, t, o)


@PROPERTY
@given(
    rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 20)), min_size=1, max_size=3),
    log_block=st.integers(0, 2),
    topk=st.integers(1, 5),
    local=st.integers(0, 3),
    init=st.integers(0, 3),
    shrink=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_select_blocks_paged_with_forced_blocks_matches_naive(rows, log_block, topk, local, init, shrink, seed):
    """Mixed batch, corrected lengths, any local / init forcing: each live token's block set per index head
    equals the python float64 loop over its request's own keys (not the dense twin, which shares the core)."""
    if local + init > topk:
        local, init = min(local, topk), max(0, topk - min(local, topk))
    block = 1 << log_block
    rows = [(q, q + extra) for q, extra in rows]
    corrected = [max(0, k - s) for (_, k), s in zip(rows, shrink)]
    meta, cache, seqs, iq = _paged_batch(rows, block, heads=2, dim=8, seed=seed, corrections=corrected)
    sel = select_blocks_paged(iq, cache.index_k, meta, topk=topk, local_blocks=local, init_blocks=init)
    assert_well_formed(sel, topk)
    got = selection_sets(sel)
    t = 0
    for r, (q, _) in enumerate(rows):
        for i in range(q):
            p = corrected[r] - q + i
            if p < 0:
                assert all(head[t] == frozenset() for head in got)
            else:
                expected = naive_selection(iq[t], seqs[r], p, block, topk, local, init)
                assert [head[t] for head in got] == expected, (r, i, p)
            t += 1


@pytest.mark.parametrize("chunk_elems", [None, 7], ids=["one-chunk", "token-chunks"])
@pytest.mark.parametrize("topk, local, init", [(3, 1, 0), (5, 2, 1), (3, 0, 0)])
def test_tied_scores_go_to_the_lower_block_id_whatever_the_step_holds(topk, local, init, chunk_elems,
                                                                      monkeypatch) -> None:
    """Zero index queries tie every visible block at 0 (head 0); head 1 is random. The reference
    took torch.topk's tie order, which changes with the score row's width, i.e. with the longest
    request of the step: the same token got other blocks (so another attention output) alone than
    beside a long request. Each token must get the python loop's choice (lower id wins), the
    kernels' rule, in every batch composition (transformers' own pick is arbitrary: its full
    forward and its cached decode disagree under such ties)."""
    if chunk_elems is not None:  # scoring and selection one token at a time
        monkeypatch.setattr("m3_eagle_plugin.msa.selection._SCORE_CHUNK_ELEMS", chunk_elems)
    block = 2
    for companions in ([], [(1, 400)], [(2, 61)], [(1, 7)]):
        rows = [(4, 20)] + companions
        meta, cache, seqs, iq = _paged_batch(rows, block, heads=2, dim=8, seed=7)
        iq[:, 0] = 0.0
        sel = select_blocks_paged(iq, cache.index_k, meta, topk=topk, local_blocks=local, init_blocks=init)
        got = selection_sets(sel)
        t = 0
        for r, (q, k) in enumerate(rows):
            for i in range(q):
                expected = naive_selection(iq[t], seqs[r], k - q + i, block, topk, local, init)
                assert [head[t] for head in got] == expected, (companions, r, i)
                t += 1


@pytest.mark.parametrize("topk", [2, 3])
def test_a_block_on_an_unmapped_page_has_no_keys_to_score(topk) -> None:
    """`request_pages`: a block-table entry ``-1`` is an unmapped page (a device table is not checked
    by `prepare`). Its keys do not exist: the block scores nothing and is never picked freely. Request
    of 12 tokens, block 4, page of block 1 unmapped, tokens at 8..11: block 2 is forced (own), block 0
    the only other block with keys, so every head keeps exactly {0, 2} whatever topk >= 2 (the
    unmapped page's table entry must not be read as page 0)."""
    meta, cache, seqs, iq = _paged_batch([(4, 12)], 4, heads=2, dim=8, seed=11)
    meta.block_tables[0, 1] = -1
    cache.index_k[0] = 1e3 * iq[0, 0]  # page 0, if read for block 1, would outscore everything
    sel = select_blocks_paged(iq, cache.index_k, meta, topk=topk)
    assert_well_formed(sel, topk)
    assert selection_sets(sel) == [[frozenset({0, 2})] * 4] * 2


def test_topk_below_one_is_refused_even_without_forced_blocks() -> None:
    # With local_blocks = 0 the "forced blocks exceed topk" check passes at topk = 0: the minimum must hold alone.
    for topk in (0, -2):
        with pytest.raises(MsaInputError, match=f"topk must be >= 1, got {topk}"):
            select_from_block_scores(torch.zeros(1, 2, 3), torch.tensor([0, 2]), topk=topk, local_blocks=0)
        with pytest.raises(MsaInputError, match=f"topk must be >= 1, got {topk}"):
            select_blocks(torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.tensor([0, 1]), block_size=2, topk=topk,
                          local_blocks=0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(1, 6),
    topk=st.integers(1, 4),
    local=st.integers(0, 2),
    init=st.integers(0, 2),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    data=st.data(),
)
def test_forced_blocks_win_over_a_real_plus_inf_score(num_blocks, topk, local, init, dtype, data):
    """Scores from {-inf, -1, 0, 1, +inf, NaN} against the documented order, in Python: NaN scores
    first (torch's sort order, the kernels' oracle), then the forced blocks, then score descending,
    lower id first; a free -inf block is not kept (transformers). A real +inf (an fp32 overflow)
    tied the forced +inf and, from a lower block id, displaced the forced local block."""
    if local + init > topk:
        local, init = min(local, topk), max(0, min(init, topk - min(local, topk)))
    own = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=4))
    pool = [float("-inf"), -1.0, 0.0, 1.0, float("inf"), float("nan")]
    values = data.draw(st.lists(st.sampled_from(pool), min_size=len(own) * num_blocks,
                                max_size=len(own) * num_blocks))
    scores = torch.tensor(values, dtype=torch.float64).view(1, len(own), num_blocks).to(dtype)
    sel = select_from_block_scores(scores, torch.tensor(own), topk=topk, local_blocks=local, init_blocks=init)
    assert_well_formed(sel, topk)
    for t, o in enumerate(own):
        row = [float(x) for x in scores[0, t].double()]

        def key(b: int, o: int = o, row: list = row) -> tuple:
            if b > o - local or b < init:
                return (1, 0.0, b)
            return (0, 0.0, b) if row[b] != row[b] else (2, -row[b], b)

        ranked = sorted(range(o + 1), key=key)[:topk]
        want = sorted(b for b in ranked if key(b)[0] < 2 or row[b] != float("-inf"))
        assert [b for b in sel[0, t].tolist() if b >= 0] == want, (row, o)


def test_select_blocks_keeps_the_local_block_when_a_dot_product_overflows_fp32() -> None:
    """An index key of 1e30 against a query of 1e30 scores +inf in fp32 (the documented raw fp32 dot
    product); the query's own block is forced whatever another block scores (DESIGN.md)."""
    q = torch.tensor([[[1e30]]])
    k = torch.tensor([[1e30], [0.0], [0.0], [1.0]])
    sel = select_blocks(q, k, torch.tensor([3]), block_size=1, topk=1)
    assert sel.tolist() == [[[3]]]
    sel = select_blocks(q, k, torch.tensor([3]), block_size=1, topk=2, local_blocks=1)
    assert sel.tolist() == [[[0, 3]]]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_positions_and_query_blocks_select_as_int64_ones(dtype) -> None:
    """Integer tensors are accepted, but torch has no min / max of uint16/32/64 tensors: the range
    checks raised NotImplementedError ("min_all" not implemented) naming no argument."""
    gen = torch.Generator().manual_seed(0)
    q, k, pos = torch.randn(3, 2, 4, generator=gen), torch.randn(9, 4, generator=gen), torch.tensor([2, 5, 8])
    want = select_blocks(q, k, pos, block_size=2, topk=2)
    assert torch.equal(select_blocks(q, k, pos.to(dtype), block_size=2, topk=2), want)
    scores, own = torch.randn(2, 3, 5, generator=gen), torch.tensor([1, 3, 4])
    want = select_from_block_scores(scores, own, topk=2)
    assert torch.equal(select_from_block_scores(scores, own.to(dtype), topk=2), want)
    if dtype == torch.uint64:  # an entry past int64 read as a negative position would select nothing
        with pytest.raises(MsaInputError, match="q_positions has an entry past int64"):
            select_blocks(q, k, torch.tensor([2, 5, 2**63], dtype=dtype), block_size=2, topk=2)


@pytest.mark.parametrize("side", ["index_q", "index_k"])
def test_block_scores_are_fp32_dot_products_not_rounded_to_a_narrower_dtype(side) -> None:
    """Block 1 outscores block 0 by 2**-11, below bf16's resolution (fp32 holds 1 + 2**-11 exactly):
    the fp64 naive keeps block 1 beside the forced own block 2; scores rounded to bf16 tie, and the tie
    went to block 0."""
    fine = 1.0 + 2.0**-11
    iq = torch.tensor([[[fine, 1.0]]]) if side == "index_q" else torch.tensor([[[1.0, 1.0]]])
    k1 = [1.0, 0.0] if side == "index_q" else [fine, 0.0]
    ik = torch.tensor([[0.0, 1.0], k1, [0.0, 0.0]])
    sel = select_blocks(iq, ik, torch.tensor([2]), block_size=1, topk=2)
    assert selection_sets(sel) == [[frozenset({1, 2})]] == [naive_selection(iq[0], ik, 2, 1, 2, 1, 0)]


def test_the_models_topk_of_16_matches_naive() -> None:
    """MiniMax-M3 keeps 16 blocks a token (reference/minimax_m3_msa.md); the property tests stop at 5."""
    gen = torch.Generator().manual_seed(3)
    iq, ik = torch.randn(40, 2, 8, generator=gen), torch.randn(40, 8, generator=gen)
    positions = torch.arange(40)
    for local, init in ((1, 0), (2, 3)):
        sel = select_blocks(iq, ik, positions, block_size=1, topk=16, local_blocks=local, init_blocks=init)
        assert_well_formed(sel, 16)
        sets = selection_sets(sel)
        for p in range(40):
            assert [s[p] for s in sets] == naive_selection(iq[p], ik, p, 1, 16, local, init)


def test_complex_scores_and_index_tensors_are_refused_naming_them() -> None:
    """Scores must be real: complex ones were cast to their real part with only a torch warning and
    ranked as if nothing was wrong (block 1 scoring 5j ranked as 0)."""
    scores = torch.tensor([[[1 + 0j, 5j, 2 + 0j]]])
    with pytest.raises(MsaInputError, match=r"^block_scores must be a real tensor, got torch.complex64$"):
        select_from_block_scores(scores, torch.tensor([2]), topk=2)
    iq, ik = torch.ones(1, 1, 2), torch.ones(3, 2)
    for name, args in (("index_q", (iq.to(torch.complex64), ik)), ("index_k", (iq, ik.to(torch.complex64)))):
        with pytest.raises(MsaInputError, match=rf"^{name} must be a real tensor, got torch.complex64$"):
            select_blocks(*args, torch.tensor([2]), block_size=1, topk=2)
    meta, cache, _, iq = _paged_batch([(2, 6)], 2, heads=1, dim=4, seed=0)
    for name, args in (("index_q", (iq.to(torch.complex64), cache.index_k)),
                       ("index_k_cache", (iq, cache.index_k.to(torch.complex64)))):
        with pytest.raises(MsaInputError, match=rf"^{name} must be a real tensor, got torch.complex64$"):
            select_blocks_paged(*args, meta, topk=2)
