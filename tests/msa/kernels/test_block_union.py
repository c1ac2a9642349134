"""Block-union lists (from a given selection, and from the fused top-k) vs a Python set oracle.

The `check_*` functions are device-agnostic: on CUDA they run here (`test_on_gpu`); on CPU
`tests._interpreter` runs `INTERPRETER_CASES` through Triton's interpreter, so CI executes the
union kernel and the fused top-k's union writer.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import SMALL, needs_gpu, random_step


def expected_union(selection, meta, chunk, num_chunks):
    """{(r, h, c): {block: bitmask}} computed with Python sets."""
    sel = selection.cpu()
    cu = meta.cu_qo_lens.tolist()
    out = {}
    for h in range(sel.shape[0]):
        for r in range(len(cu) - 1):
            for c in range(num_chunks):
                entry = {}
                for i in range(chunk):
                    t = cu[r] + c * chunk + i
                    if t >= cu[r + 1]:
                        break
                    for b in sel[h, t].tolist():
                        if b >= 0:
                            entry[b] = entry.get(b, 0) | (1 << i)
                out[(r, h, c)] = entry
    return out


def union_as_dict(union, block_tables):
    ids, bits, counts, pages = union.ids.cpu(), union.bits.cpu(), union.counts.cpu(), union.pages.cpu()
    tables = block_tables.cpu()
    out = {}
    for r, h, c in itertools.product(*map(range, counts.shape)):
        n = int(counts[r, h, c])
        got_ids = ids[r, h, c, :n].tolist()
        assert len(set(got_ids)) == n, f"duplicate ids in union {got_ids}"
        assert pages[r, h, c, :n].tolist() == [int(tables[r, b]) for b in got_ids], "pages differ from block table"
        out[(r, h, c)] = dict(zip(got_ids, bits[r, h, c, :n].tolist()))
    return out


def _random_selection(meta, heads, topk, block, seed):
    gen = torch.Generator().manual_seed(seed)
    pos = meta.positions.tolist()
    sel = torch.full((heads, len(pos), topk), -1, dtype=torch.int32)
    for h in range(heads):
        for t in range(int(meta.cu_qo_lens[-1])):
            local = pos[t] // block
            ids = sorted(set(torch.randperm(local + 1, generator=gen)[: topk - 1].tolist() + [local]))
            sel[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel.to(meta.positions.device)


def check_union_from_selection_matches_sets(device, *, qo_lens=(4, 3, 1, 6), kv_lens=(100, 64, 7, 90), chunk=4,
                                            topk=4, seed=0):
    """`union_from_selection` vs the Python-set union of each (request, head, chunk of tokens)."""
    from m3_eagle_plugin.msa.kernels.block_union import chunk_count, union_from_selection

    meta, _, _, _ = random_step(SMALL, list(qo_lens), list(kv_lens), seed=seed, device=device)
    sel = _random_selection(meta, SMALL.kv_heads, topk, SMALL.block, seed)
    nch = chunk_count(sum(qo_lens), len(qo_lens), chunk, max(qo_lens))
    union = union_from_selection(sel, meta.cu_qo_lens, meta.block_tables, chunk=chunk, num_chunks=nch)
    assert union_as_dict(union, meta.block_tables) == expected_union(sel, meta, chunk, nch)


def check_fused_topk_union_matches_its_own_selection(device, *, seed=0):
    """The union lists the fused top-k writes vs the Python-set union of the selection it returns."""
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    meta, cache, _, index_q = random_step(SMALL, [4, 4, 2], [90, 50, 21], index_dtype=torch.float32, pad_tokens=2,
                                          seed=seed, device=device)
    sel, union = select_blocks_verify(index_q, cache.index_k, meta, topk=SMALL.topk, max_qo_len=4, union_group=4)
    assert union.chunk == 4 and union.num_chunks == 1
    assert union_as_dict(union, meta.block_tables) == expected_union(sel, meta, 4, 1)
    assert (sel[:, 10:].cpu() == -1).all()


def check_unhinted_grids_reach_a_request_holding_every_token(device, *, seed=0):
    """No `max_qo_len` hint and a request with no token this step (`MsaDecodeMetadata` takes qo_len 0
    with kv_len > 0): request 1 holds all 5 tokens, more than the former bound T - R + 1 = 4. The
    top-k (hand-off on) and the per-token attention must still cover its last token: selection and
    output as the torch references', the score board back to the sentinel."""
    import types

    from m3_eagle_plugin.bench import torch_reference as ref
    from m3_eagle_plugin.msa.kernels import handoff
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    block, dim, tokens = 16, 16, 5
    positions = torch.arange(48 - tokens, 48, dtype=torch.int32)
    meta = types.SimpleNamespace(  # no max_qo_len field: the kernels take the worst case
        block_tables=torch.tensor([[0, -1, -1], [1, 2, 3]], dtype=torch.int32, device=device),
        kv_lens=torch.tensor([16, 48], dtype=torch.int32, device=device),
        cu_qo_lens=torch.tensor([0, 0, tokens], dtype=torch.int32, device=device),
        positions=positions.to(device), valid_blocks=(positions // block + 1).to(device), block_size=block)
    gen = torch.Generator().manual_seed(seed)
    index_q, index_k = torch.randn(tokens, 1, dim, generator=gen), torch.randn(4, block, dim, generator=gen)
    q = torch.randn(tokens, 2, dim, generator=gen)
    k_cache, v_cache = torch.randn(4, 1, block, dim, generator=gen), torch.randn(4, 1, block, dim, generator=gen)
    index_q, index_k, q, k_cache, v_cache = (t.to(device) for t in (index_q, index_k, q, k_cache, v_cache))
    handoff.reset_board(device)
    sel = select_blocks_verify(index_q, index_k, meta, topk=2, handoff=True)
    assert torch.equal(sel.cpu(), ref.select_blocks(index_q, index_k, meta, topk=2).cpu())
    board = handoff._BOARDS[index_q.device]  # keyed by the indexed device (cuda:0, not cuda)
    assert (board == handoff.SENTINEL).all(), "score-board entries left without the sentinel"
    out = sparse_verify_attention(q, k_cache, v_cache, meta, sel, scale=0.25, splits=1, layout="token")
    assert torch.allclose(out, ref.sparse_attention(q, k_cache, v_cache, meta, sel, scale=0.25), atol=1e-5)


#: The interpreter's share (CI has two cores): chunks of 4 (two a request for q_len 6) and of 1,
#: a top-k of 1, the fused top-k's writer, and grids sized without a hint for a 0-token request.
INTERPRETER_CASES = [
    (check_union_from_selection_matches_sets, dict()),
    (check_union_from_selection_matches_sets, dict(qo_lens=(2, 5), kv_lens=(40, 33), chunk=1, topk=1, seed=1)),
    (check_fused_topk_union_matches_its_own_selection, dict()),
    (check_unhinted_grids_reach_a_request_holding_every_token, dict()),
]


@pytest.mark.parametrize("tokens,requests,chunk,hint,want", [
    (5, 2, 1, None, 5),    # request 0 has no token: request 1 may hold all 5 (the former bound gave 4)
    (17, 2, 4, None, 5),   # ceil(17 / 4)
    (1, 64, 1, None, 1),   # fewer tokens than requests: still one chunk
    (0, 3, 1, None, 1),
    (5, 2, 1, 3, 3),       # a hint sizes it alone
    (17, 2, 4, 6, 2),
])
def test_chunk_count_bounds_every_request(tokens, requests, chunk, hint, want):
    from m3_eagle_plugin.msa.kernels.block_union import chunk_count

    assert chunk_count(tokens, requests, chunk, hint) == want


@pytest.mark.parametrize("chunk, topk, umax", [(4, 3, 16), (4, 16, 64), (1, 5, 8), (8, 1, 8)])
def test_union_lists_are_as_wide_as_the_kernels_store_stride(chunk, topk, umax):
    """The union kernel stores unit u's entries from u * chunk * next_pow2(topk) on (its padded lanes):
    the lists must be that wide, or a non-power-of-two topk would write into the next unit's list."""
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.block_union import allocate_union

    union = allocate_union(2, 3, 2, chunk, topk, torch.device("cpu"))
    assert union.umax == umax and union.ids.shape == union.pages.shape == union.bits.shape == (2, 3, 2, umax)
    assert union.counts.shape == (2, 3, 2) and union.num_chunks == 2


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_block_union")


@needs_gpu
def test_union_from_selection_matches_sets():
    from m3_eagle_plugin.msa.kernels.block_union import union_from_selection

    meta, _, _, _ = random_step(SMALL, [4, 3, 1, 6], [100, 64, 7, 90])
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 0)
    union = union_from_selection(sel, meta.cu_qo_lens, meta.block_tables, chunk=4, num_chunks=2)
    assert union_as_dict(union, meta.block_tables) == expected_union(sel, meta, 4, 2)


@needs_gpu
def test_fused_topk_union_matches_its_own_selection():
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    meta, cache, _, index_q = random_step(SMALL, [4, 4, 2], [300, 120, 50], index_dtype=torch.float32,
                                          pad_tokens=2)
    sel, union = select_blocks_verify(index_q, cache.index_k, meta, topk=SMALL.topk, max_qo_len=4, union_group=4)
    assert union.chunk == 4 and union.num_chunks == 1
    assert union_as_dict(union, meta.block_tables) == expected_union(sel, meta, 4, 1)
    assert (sel[:, 10:].cpu() == -1).all()


@needs_gpu
@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 200)), min_size=1, max_size=5),
    chunk=st.sampled_from([1, 2, 4, 8]),
    topk=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_property_union_from_selection(reqs, chunk, topk, seed):
    from m3_eagle_plugin.msa.kernels.block_union import chunk_count, union_from_selection

    qo_lens = [q for q, _ in reqs]
    meta, _, _, _ = random_step(SMALL, qo_lens, [q + e for q, e in reqs], seed=seed)
    sel = _random_selection(meta, SMALL.kv_heads, topk, SMALL.block, seed)
    nch = chunk_count(sum(qo_lens), len(qo_lens), chunk, max(qo_lens))
    union = union_from_selection(sel, meta.cu_qo_lens, meta.block_tables, chunk=chunk, num_chunks=nch)
    assert union_as_dict(union, meta.block_tables) == expected_union(sel, meta, chunk, nch)


def test_union_grid_past_cudas_z_limit_is_refused_before_launch(monkeypatch):
    """One program per (request, KV head, token chunk): 65536 chunks are past CUDA's 65535 on the
    z axis (`cuLaunchKernel`: "invalid argument"); refused as too large before any allocation or launch."""
    from m3_eagle_plugin.msa.kernels import KernelTooLargeError, block_union

    monkeypatch.setattr(block_union, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(block_union, "allocate_union", lambda *a, **k: pytest.fail("allocated"))
    sel = torch.zeros((1, 1, 2), dtype=torch.int32)
    with pytest.raises(KernelTooLargeError, match=r"block union: its grid \(1, 1, 65536\)"):
        block_union.union_from_selection(sel, torch.tensor([0, 1], dtype=torch.int32),
                                         torch.zeros((1, 1), dtype=torch.int32), chunk=1, num_chunks=65536)
