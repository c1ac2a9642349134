"""Tests for msa.attention: paged sparse and dense attention references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.msa import (
    MsaDecodeMetadata,
    MsaInputError,
    dense_attention,
    select_blocks_paged,
    sparse_attention,
    write_index_k,
    write_kv,
)

from ._hf_oracle import BLOCK_SIZE, TOPK, OracleRun, SparseLayerOracle
from ._paged import PooledCache, naive_attention, naive_selection, padded_table, random_page_tables

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def oracle() -> SparseLayerOracle:
    return SparseLayerOracle(seed=1)


class PagedRuns:
    """HF runs of several requests held in a pooled paged cache, written through the step metadata."""

    def __init__(self, runs: list[OracleRun], seed: int = 0) -> None:
        self.runs = runs
        lengths = [r.k.shape[0] for r in runs]
        pages = sum(-(-n // BLOCK_SIZE) for n in lengths) + 4
        self.cache = PooledCache(pages, BLOCK_SIZE, kv_heads=2, head_dim=16, index_dim=16)
        self.table = padded_table(random_page_tables(lengths, BLOCK_SIZE, pages, seed), 12)
        self.meta = MsaDecodeMetadata(len(runs), 64, 12, BLOCK_SIZE, "cpu", max_draft_len=4, num_index_heads=2)

    def tokens(self, name: str, qo: list[int], kv: list[int]) -> torch.Tensor:
        """The step's rows of one HF tensor (``q``, ``k``, ``v``, ``index_q``, ``index_k``)."""
        return torch.cat([getattr(r, name)[k - q : k] for r, q, k in zip(self.runs, qo, kv)])

    def step(self, qo: list[int], kv: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's tokens, select, attend; returns (selection, sparse output)."""
        meta = self.meta
        meta.prepare(qo, kv, self.table)

        def pick(name: str) -> torch.Tensor:
            return self.tokens(name, qo, kv)

        write_kv(self.cache.k, self.cache.v, meta.cache_slots, pick("k"), pick("v"))
        write_index_k(self.cache.index_k, meta.cache_slots, pick("index_k"))
        sel = select_blocks_paged(pick("index_q"), self.cache.index_k, meta, topk=TOPK)
        out = sparse_attention(pick("q"), self.cache.k, self.cache.v, meta, sel, scale=self.runs[0].scale)
        return sel, out

    def expected(self, qo: list[int], kv: list[int]) -> torch.Tensor:
        return torch.cat([r.attention[k - q : k] for r, q, k in zip(self.runs, qo, kv)])


def test_sparse_attention_matches_hf_on_a_mixed_batch(oracle: SparseLayerOracle) -> None:
    lengths, prefixes = [30, 26, 19, 8], [0, 22, 18, 3]  # prompt, 4-token verify, decode, chunk
    paged = PagedRuns([oracle.run(n, seed=20 + i) for i, n in enumerate(lengths)], seed=1)
    paged.step(prefixes, prefixes)
    qo = [n - p for n, p in zip(lengths, prefixes)]
    _, out = paged.step(qo, lengths)
    torch.testing.assert_close(out, paged.expected(qo, lengths), **TOL)


def test_dense_attention_equals_hf_before_sparsity_starts(oracle: SparseLayerOracle) -> None:
    # Up to topk * block tokens every visible block is selected: sparse == dense causal.
    run = oracle.run(TOPK * BLOCK_SIZE, seed=7)
    paged = PagedRuns([run])
    paged.step([TOPK * BLOCK_SIZE], [TOPK * BLOCK_SIZE])
    q = run.q
    out = dense_attention(q, paged.cache.k, paged.cache.v, paged.meta, scale=run.scale)
    torch.testing.assert_close(out, run.attention, **TOL)


def test_dense_attention_matches_hf_dense_layer_on_a_mixed_batch() -> None:
    oracle = SparseLayerOracle(seed=2, dense=True)
    lengths, prefixes = [21, 14, 9, 6], [0, 10, 8, 2]  # prompt, 4-token verify, decode, chunk
    paged = PagedRuns([oracle.run(n, seed=40 + i) for i, n in enumerate(lengths)], seed=4)
    qo = [n - p for n, p in zip(lengths, prefixes)]
    for step_qo, step_kv in ((prefixes, prefixes), (qo, lengths)):
        paged.meta.prepare(step_qo, step_kv, paged.table)
        k, v = paged.tokens("k", step_qo, step_kv), paged.tokens("v", step_qo, step_kv)
        write_kv(paged.cache.k, paged.cache.v, paged.meta.cache_slots, k, v)
    q = paged.tokens("q", qo, lengths)
    out = dense_attention(q, paged.cache.k, paged.cache.v, paged.meta, scale=paged.runs[0].scale)
    torch.testing.assert_close(out, paged.expected(qo, lengths), **TOL)


def test_verify_chunk_equals_single_token_steps(oracle: SparseLayerOracle) -> None:
    run = oracle.run(30, seed=9)
    prefix, draft = 25, 4
    verify = PagedRuns([run], seed=2)
    verify.step([prefix], [prefix])
    sel_chunk, out_chunk = verify.step([1 + draft], [prefix + 1 + draft])

    single = PagedRuns([run], seed=3)
    single.step([prefix], [prefix])
    steps = [single.step([1], [prefix + t + 1]) for t in range(1 + draft)]
    assert torch.equal(sel_chunk, torch.cat([s for s, _ in steps], dim=1))
    torch.testing.assert_close(out_chunk, torch.cat([o for _, o in steps]), **TOL)
    torch.testing.assert_close(out_chunk, run.attention[prefix:], **TOL)


def _random_step(rows, block, heads_q, heads_kv, dim, seed, shrink):
    gen = torch.Generator().manual_seed(seed)
    staged = [k for _, k in rows]
    pages = sum(-(-k // block) for k in staged) + 2
    cache = PooledCache(pages, block, heads_kv, dim, index_dim=4)
    tables = random_page_tables(staged, block, pages, seed)
    width = max([len(t) for t in tables] + [1])
    meta = MsaDecodeMetadata(len(rows), 64, width, block, "cpu", max_draft_len=3)
    seqs = [(torch.randn(k, heads_kv, dim, generator=gen), torch.randn(k, heads_kv, dim, generator=gen)) for k in staged]
    for r, k in enumerate(staged):
        if k:
            meta.prepare([k], [k], padded_table([tables[r]], width))
            write_kv(cache.k, cache.v, meta.cache_slots, *seqs[r])
    meta.prepare([q for q, _ in rows], staged, padded_table(tables, width))
    corrected = [max(0, k - s) for k, s in zip(staged, shrink)]
    meta.on_update_kv_lens(torch.tensor(corrected))
    q = torch.randn(meta.num_tokens, heads_q, dim, generator=gen)
    return meta, cache, seqs, q, corrected, gen


@PROPERTY
@given(
    rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 14)), min_size=1, max_size=3),
    log_block=st.integers(0, 3),
    group=st.sampled_from([1, 2]),
    topk=st.integers(1, 4),
    shrink=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_sparse_and_dense_match_naive(rows, log_block, group, topk, shrink, seed) -> None:
    block, heads_kv, dim = 1 << log_block, 2, 4
    rows = [(q, q + extra) for q, extra in rows]
    meta, cache, seqs, q, corrected, gen = _random_step(rows, block, heads_kv * group, heads_kv, dim, seed, shrink)
    # Random selections: distinct block ids (some past the token's block, some -1 padding).
    num_blocks = max(1, meta.max_step_blocks)
    if meta.num_tokens == 0:
        return
    sel = torch.stack(
        [torch.randperm(num_blocks + topk, generator=gen)[:topk] for _ in range(heads_kv * meta.num_tokens)]
    ).view(heads_kv, meta.num_tokens, topk)
    sel = torch.where(sel < num_blocks, sel, torch.full_like(sel, -1)).to(torch.int32)
    scale = 0.7
    sparse = sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale)
    dense = dense_attention(q, cache.k, cache.v, meta, scale=scale)
    t = 0
    for r, (qo, _) in enumerate(rows):
        keys, values = seqs[r]
        for i in range(qo):
            p = corrected[r] - qo + i
            visible = list(range(p + 1))
            allowed = [[j for j in visible if j // block in sel[h, t].tolist()] for h in range(heads_kv)]
            exp_sparse = naive_attention(q[t], keys, values, allowed, scale)
            exp_dense = naive_attention(q[t], keys, values, [visible] * heads_kv, scale)
            torch.testing.assert_close(sparse[t].double(), exp_sparse, **TOL)
            torch.testing.assert_close(dense[t].double(), exp_dense, **TOL)
            t += 1


def test_output_dtype_follows_q() -> None:
    meta = MsaDecodeMetadata(1, 4, 1, 4, "cpu")
    meta.prepare([2], [2], torch.tensor([[0]], dtype=torch.int32))
    k_cache = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
    q = torch.randn(2, 2, 8, dtype=torch.bfloat16)
    out = dense_attention(q, k_cache, k_cache, meta, scale=0.3)
    assert out.dtype == torch.bfloat16
    sel = torch.tensor([[[0], [0]]], dtype=torch.int32)
    torch.testing.assert_close(sparse_attention(q, k_cache, k_cache, meta, sel, scale=0.3), out)


def test_bad_arguments_raise() -> None:
    meta = MsaDecodeMetadata(1, 4, 1, 4, "cpu")
    meta.prepare([2], [2], torch.tensor([[0]], dtype=torch.int32))
    k_cache = torch.zeros(1, 2, 4, 8)
    with pytest.raises(MsaInputError, match="multiple of KV heads"):
        dense_attention(torch.zeros(2, 3, 8), k_cache, k_cache, meta, scale=1.0)
    no_heads = torch.zeros(1, 0, 4, 8)  # refused by name, not a ZeroDivisionError
    with pytest.raises(MsaInputError, match="at least one KV head"):
        dense_attention(torch.zeros(2, 2, 8), no_heads, no_heads, meta, scale=1.0)
    with pytest.raises(MsaInputError, match="selection"):
        sparse_attention(torch.zeros(2, 2, 8), k_cache, k_cache, meta, torch.zeros(1, 2, 1, dtype=torch.int32), scale=1.0)
    with pytest.raises(MsaInputError, match="scale"):
        dense_attention(torch.zeros(2, 2, 8), k_cache, k_cache, meta, scale=0.0)
    with pytest.raises(MsaInputError, match="q must be"):
        dense_attention(torch.zeros(3, 2, 8), k_cache, k_cache, meta, scale=1.0)
    with pytest.raises(MsaInputError, match="block_size"):
        dense_attention(torch.zeros(2, 2, 8), torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), meta, scale=1.0)


def test_an_argument_that_is_not_a_tensor_is_named() -> None:
    """A list is refused by name, not an AttributeError on `.dim` naming nothing."""
    meta = MsaDecodeMetadata(1, 4, 1, 4, "cpu")
    meta.prepare([2], [2], torch.tensor([[0]], dtype=torch.int32))
    q, cache, sel = torch.zeros(2, 2, 8), torch.zeros(1, 2, 4, 8), torch.zeros(2, 2, 1, dtype=torch.int32)
    for args, name in (((q.tolist(), cache, cache), "q"), ((q, cache.tolist(), cache), "k_cache"),
                       ((q, cache, cache.tolist()), "v_cache")):
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            dense_attention(*args, meta, scale=1.0)
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            sparse_attention(*args, meta, sel, scale=1.0)
    with pytest.raises(TypeError, match="selection must be a tensor, got list"):
        sparse_attention(q, cache, cache, meta, sel.tolist(), scale=1.0)


def test_scale_may_be_a_numpy_scalar_and_a_tensor_is_refused_by_type() -> None:
    """np.float32(0.7) is a positive finite scale: it was refused as if it were not one."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(0)
    meta = MsaDecodeMetadata(1, 4, 1, 4, "cpu")
    meta.prepare([3], [3], torch.tensor([[0]], dtype=torch.int32))
    keys, values = torch.randn(3, 1, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    k_cache, v_cache = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    write_kv(k_cache, v_cache, meta.cache_slots, keys, values)
    q = torch.randn(3, 2, 8, generator=gen)
    scale = np.float32(0.7)
    out = dense_attention(q, k_cache, v_cache, meta, scale=scale)
    sel = torch.zeros(1, 3, 1, dtype=torch.int32)
    sparse = sparse_attention(q, k_cache, v_cache, meta, sel, scale=scale)
    for t in range(3):
        expected = naive_attention(q[t], keys, values, [list(range(t + 1))], float(scale))
        torch.testing.assert_close(out[t].double(), expected, **TOL)
        torch.testing.assert_close(sparse[t].double(), expected, **TOL)
    with pytest.raises(TypeError, match="scale must be a real number"):
        dense_attention(q, k_cache, v_cache, meta, scale=torch.tensor(0.7))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_references_match_cpu_without_host_sync(oracle: SparseLayerOracle) -> None:
    lengths, prefixes = [30, 26, 19, 8], [0, 22, 18, 3]
    paged = PagedRuns([oracle.run(n, seed=20 + i) for i, n in enumerate(lengths)], seed=1)
    paged.step(prefixes, prefixes)
    qo = [n - p for n, p in zip(lengths, prefixes)]
    sel_cpu, out_cpu = paged.step(qo, lengths)
    dense_cpu = dense_attention(paged.tokens("q", qo, lengths), paged.cache.k, paged.cache.v, paged.meta, scale=0.25)

    meta = MsaDecodeMetadata(4, 64, 12, BLOCK_SIZE, "cuda", max_draft_len=4, num_index_heads=2)
    meta.prepare(qo, lengths, paged.table)
    k_cache = torch.zeros_like(paged.cache.k, device="cuda")
    v_cache = torch.zeros_like(paged.cache.v, device="cuda")
    ik_cache = torch.zeros_like(paged.cache.index_k, device="cuda")
    meta_prefix = MsaDecodeMetadata(4, 128, 12, BLOCK_SIZE, "cuda")  # prefill: all 83 tokens
    meta_prefix.prepare(lengths, lengths, paged.table)
    every = {name: paged.tokens(name, lengths, lengths).cuda() for name in ("k", "v", "index_k")}
    step = {name: paged.tokens(name, qo, lengths).cuda() for name in ("q", "index_q")}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_kv(k_cache, v_cache, meta_prefix.cache_slots, every["k"], every["v"])
        write_index_k(ik_cache, meta_prefix.cache_slots, every["index_k"])
        sel = select_blocks_paged(step["index_q"], ik_cache, meta, topk=TOPK)
        out = sparse_attention(step["q"], k_cache, v_cache, meta, sel, scale=0.25)
        dense = dense_attention(step["q"], k_cache, v_cache, meta, scale=0.25)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(sel.cpu(), sel_cpu)
    torch.testing.assert_close(out.cpu(), out_cpu, **TOL)
    torch.testing.assert_close(dense.cpu(), dense_cpu, **TOL)


def test_a_non_integer_selection_is_refused() -> None:
    # A float selection was truncated to block ids (0.7 -> block 0) and attended to silently.
    meta = MsaDecodeMetadata(1, 4, 1, 4, "cpu")
    meta.prepare([2], [2], torch.tensor([[0]], dtype=torch.int32))
    k_cache = torch.randn(1, 1, 4, 8)
    for bad in (torch.tensor([[[0.7], [0.2]]]), torch.tensor([[[True], [True]]])):
        with pytest.raises(MsaInputError, match="selection must be an integer tensor"):
            sparse_attention(torch.randn(2, 1, 8), k_cache, k_cache, meta, bad, scale=1.0)


def masked_reference(q, keys, values, positions, sel, block, scale):
    """One request's tokens at once, float64: scores ``[Hq, T, S]`` under an additive mask that is 0
    where the key is causal (``j <= p``) and its block is listed for the head's KV group, -inf elsewhere;
    rows with no allowed key give zeros. ``sel`` ``[Hkv, T, k]`` may repeat ids or list absent ones."""
    num_q, num_kv, seq = q.shape[1], keys.shape[1], keys.shape[0]
    group = num_q // num_kv
    j = torch.arange(seq)
    causal = j[None, :] <= torch.tensor(positions)[:, None]  # [T, S]
    listed = (j[None, None, :, None] // block == sel.long()[:, :, None, :]).any(-1)  # [Hkv, T, S]
    allowed = (causal[None] & listed).repeat_interleave(group, dim=0)  # [Hq, T, S]
    scores = torch.einsum("thd,shd->hts", q.double(), keys.double().repeat_interleave(group, dim=1)) * scale
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hts,shd->thd", weights, values.double().repeat_interleave(group, dim=1))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), min_size=1, max_size=3),
    log_block=st.integers(0, 3),
    heads_kv=st.integers(1, 2),
    group=st.integers(1, 3),
    topk=st.integers(1, 4),
    shrink=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_sparse_attention_matches_a_dense_masked_reference(rows, log_block, heads_kv, group, topk, shrink, seed):
    block, dim = 1 << log_block, 4
    rows = [(q, q + extra) for q, extra in rows]
    meta, cache, seqs, q, corrected, gen = _random_step(rows, block, heads_kv * group, heads_kv, dim, seed, shrink)
    # Ids drawn with repeats from [-1, blocks + 1]: -1 padding, repeats, blocks no request has.
    hi = meta.max_step_blocks + 2
    sel = (torch.randint(0, hi + 1, (heads_kv, meta.num_tokens, topk), generator=gen) - 1).to(torch.int32)
    _assert_sparse_and_dense_match_masked(rows, block, meta, cache, seqs, q, corrected, sel, hi)


def _assert_sparse_and_dense_match_masked(rows, block, meta, cache, seqs, q, corrected, sel, num_blocks):
    """`sparse_attention` over `sel` and `dense_attention` against float64 masked attention, request by
    request (`dense` as a selection of blocks 0 .. num_blocks - 1)."""
    heads_kv = sel.shape[0]
    out = sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.6)
    dense = dense_attention(q, cache.k, cache.v, meta, scale=0.6)
    everything = torch.arange(num_blocks)[None, None, :].expand(heads_kv, meta.num_tokens, -1)
    start = 0
    for r, (qo, _) in enumerate(rows):
        rows_r = slice(start, start + qo)
        start += qo
        if not qo:
            continue
        keys, values = seqs[r]
        positions = list(range(corrected[r] - qo, corrected[r]))
        exp = masked_reference(q[rows_r], keys, values, positions, sel[:, rows_r], block, 0.6)
        torch.testing.assert_close(out[rows_r].double(), exp, **TOL)
        exp_dense = masked_reference(q[rows_r], keys, values, positions, everything[:, rows_r], block, 0.6)
        torch.testing.assert_close(dense[rows_r].double(), exp_dense, **TOL)


def test_tied_index_scores_give_the_naive_loops_output_in_any_batch() -> None:
    """Every index query zero: all visible blocks tie. Which tied blocks win changes the attention
    output, so it must not depend on the step's other requests: a 20-token request's verify rows,
    alone and beside a long request, equal float64 attention over the python loop's selection (the
    lower block id wins ties). The reference used torch.topk's tie order, which follows the score
    row's width (the step's widest request), and gave other blocks (other outputs) alone."""
    block, topk, heads_kv, group, dim, scale = 2, 3, 2, 2, 4, 0.5
    for other in (None, 44, 9):
        staged = [20] if other is None else [20, other]
        rows = [(3, staged[0])] + ([(1, other)] if other else [])
        meta, cache, seqs, q, corrected, gen = _random_step(rows, block, heads_kv * group, heads_kv, dim, 5, [0, 0])
        index_keys = [torch.randn(k, 4, generator=gen) for k in staged]
        table = meta.block_tables[: len(staged)].clone()
        for r, k in enumerate(staged):
            meta.prepare([k], [k], table[r : r + 1])
            write_index_k(cache.index_k, meta.cache_slots, index_keys[r])
        meta.prepare([n for n, _ in rows], staged, table)
        iq = torch.zeros(meta.num_tokens, heads_kv, 4)
        sel = select_blocks_paged(iq, cache.index_k, meta, topk=topk)
        out = sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale)
        keys, values = seqs[0]
        for t in range(rows[0][0]):
            p = staged[0] - rows[0][0] + t
            chosen = naive_selection(iq[t], index_keys[0], p, block, topk, 1, 0)
            allowed = [[j for j in range(p + 1) if j // block in chosen[h]] for h in range(heads_kv)]
            torch.testing.assert_close(out[t].double(), naive_attention(q[t], keys, values, allowed, scale), **TOL)


@pytest.mark.parametrize("stale", [(5.0, 100.0), (float("nan"), float("nan"))], ids=["large", "nan"])
def test_keys_on_an_unmapped_page_are_invisible(stale) -> None:
    """A block-table entry ``-1`` (unmapped page; `prepare` does not check a device table) holds no
    keys: sparse attention that lists the block and dense attention both skip its tokens, instead
    of reading page 0. One request of 12 tokens, block 4, block 1 unmapped, tokens at 8..11; float64
    attention over keys j <= p outside block 1 is the reference. Page 0 (block 1's page before it was
    unmapped, no other block's) holds keys that would dominate, or NaN (another request's stale or
    never written bytes), which a masked score or a zero weight would still carry into the output."""
    block, heads_kv, group, dim, scale = 4, 2, 2, 4, 0.5
    meta, cache, seqs, q, corrected, gen = _random_step([(4, 12)], block, heads_kv * group, heads_kv, dim, 3, [0])
    assert meta.block_tables[0].tolist() == [1, 0, 3]
    meta.block_tables[0, 1] = -1
    cache.k[0].fill_(stale[0])
    cache.v[0].fill_(stale[1])
    sel = torch.tensor([0, 1, 2], dtype=torch.int32).expand(heads_kv, meta.num_tokens, 3).contiguous()
    sparse = sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale)
    dense = dense_attention(q, cache.k, cache.v, meta, scale=scale)
    keys, values = seqs[0]
    pages = meta.block_tables[0, :3].tolist()
    for t in range(4):
        p = 8 + t
        allowed = [j for j in range(p + 1) if j // block != 1]
        # the mapped pages (1 and 3) still hold the sequence
        kk = torch.stack([cache.k[pages[j // block], :, j % block] for j in allowed])
        vv = torch.stack([cache.v[pages[j // block], :, j % block] for j in allowed])
        expected = naive_attention(q[t], kk, vv, [list(range(len(allowed)))] * heads_kv, scale)
        torch.testing.assert_close(sparse[t].double(), expected, **TOL)
        torch.testing.assert_close(dense[t].double(), expected, **TOL)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf")])
def test_a_non_finite_scale_is_refused(bad) -> None:
    meta = MsaDecodeMetadata(1, 4, 1, 4, "cpu")
    meta.prepare([2], [2], torch.tensor([[0]], dtype=torch.int32))
    k_cache = torch.zeros(1, 1, 4, 8)
    with pytest.raises(MsaInputError, match="positive finite"):
        dense_attention(torch.zeros(2, 1, 8), k_cache, k_cache, meta, scale=bad)
    with pytest.raises(MsaInputError, match="positive finite"):
        sparse_attention(torch.zeros(2, 1, 8), k_cache, k_cache, meta, torch.zeros(1, 2, 1, dtype=torch.int32),
                         scale=bad)


@pytest.mark.parametrize("chunk_elems", [1, 70, 150])
def test_token_chunks_cover_every_token_once(chunk_elems, monkeypatch) -> None:
    """Long prompts are attended a few tokens at a time (tokens x keys bounded by _GATHER_CHUNK_ELEMS).
    Shrunk here so requests split into chunks of 1 to 4 tokens (4 query heads, 8 to 20 keys): every
    token still equals the float64 masked reference, the dense and the sparse variant alike."""
    monkeypatch.setattr("m3_eagle_plugin.msa.attention._GATHER_CHUNK_ELEMS", chunk_elems)
    rows = [(7, 19), (5, 5), (3, 12)]
    block, heads_kv, group, topk = 4, 2, 2, 2
    meta, cache, seqs, q, corrected, gen = _random_step(rows, block, heads_kv * group, heads_kv, 4, 13, [2, 0, 1])
    sel = (torch.randint(0, meta.max_step_blocks + 1, (heads_kv, meta.num_tokens, topk), generator=gen) - 1)
    _assert_sparse_and_dense_match_masked(rows, block, meta, cache, seqs, q, corrected, sel.to(torch.int32),
                                          meta.max_step_blocks)


def test_slots_past_the_corrected_length_may_hold_nan() -> None:
    """After a shrinking correction the slots from the corrected length up to the staged one are no
    longer the request's keys: stale or never written (NaN here). No token reads them (they lie past
    every position), and NaN must not leak through a masked score or a zero weight either: each token
    equals float64 attention over keys j <= p of the sequence."""
    block, heads_kv, group, dim = 4, 2, 2, 4
    rows, shrink = [(3, 14), (2, 9)], [3, 2]  # corrected 11 and 7: NaN in slots 11..13 and 7..8
    meta, cache, seqs, q, corrected, gen = _random_step(rows, block, heads_kv * group, heads_kv, dim, 21, shrink)
    for r, (_, staged) in enumerate(rows):
        pages = meta.block_tables[r].tolist()
        for j in range(corrected[r], staged):
            cache.k[pages[j // block], :, j % block] = float("nan")
            cache.v[pages[j // block], :, j % block] = float("nan")
    every_block = torch.arange(4, dtype=torch.int32).expand(heads_kv, meta.num_tokens, 4).contiguous()
    _assert_sparse_and_dense_match_masked(rows, block, meta, cache, seqs, q, corrected, every_block, 4)
