"""Tests for msa.metadata: step staging, per-token derivation and on_update_kv_lens."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.msa import MsaDecodeMetadata, MsaInputError, per_token_valid_blocks

from ._paged import padded_table, random_page_tables


def worked_example_tables() -> torch.Tensor:
    return torch.tensor([list(range(0, 8)), list(range(25, 33))], dtype=torch.int32)


def test_host_worked_example() -> None:
    meta = MsaDecodeMetadata(4, 8, 8, 4, "cpu", max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    meta.on_update_kv_lens(torch.tensor([8, 12], dtype=torch.int32))
    assert meta.cache_slots.tolist() == [6, 7, 109, 110, 111]
    assert meta.cache_slots_buffer.tolist() == [6, 7, 109, 110, 111, -1, -1, -1]
    assert meta.valid_blocks.tolist() == [2, 2, 3, 3, 3]
    assert meta.token_kv_lens.tolist() == [7, 8, 10, 11, 12]
    assert meta.positions.tolist() == [6, 7, 9, 10, 11]
    assert meta.qo_offsets.tolist() == [6, 9]
    assert meta.kv_lens.tolist() == [8, 12] and meta.kv_lens_staged.tolist() == [9, 12]
    assert meta.token_request.tolist() == [0, 0, 1, 1, 1]
    assert meta.cu_qo_lens.tolist() == [0, 2, 5]
    assert meta.qo_lens.tolist() == [2, 3]
    assert all(t.dtype == torch.int32 for t in (meta.cache_slots, meta.valid_blocks, meta.block_tables))
    # A second call changes nothing.
    fields = lambda: (meta.cache_slots_buffer, meta.valid_blocks, meta.token_kv_lens)  # noqa: E731
    before = [x.clone() for x in fields()]
    meta.on_update_kv_lens()
    assert all(torch.equal(a, b) for a, b in zip(before, fields()))


def test_staged_values_before_correction() -> None:
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    assert meta.cache_slots.tolist() == [7, 8, 109, 110, 111]
    assert meta.valid_blocks.tolist() == [2, 3, 3, 3, 3]
    assert meta.qo_offsets.tolist() == [7, 9]
    assert meta.max_step_blocks == 3 and meta.is_decode_only


def test_corrections_above_staged_lengths_are_clamped() -> None:
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    meta.on_update_kv_lens(torch.tensor([50, 11]))
    assert meta.kv_lens.tolist() == [9, 11]
    assert meta.cache_slots.tolist() == [7, 8, 108, 109, 110]


def test_no_op_without_speculation() -> None:
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu")
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    meta.cache_slots_buffer.fill_(99)  # a re-derivation would overwrite this
    meta.on_update_kv_lens()
    assert meta.cache_slots.tolist() == [99] * 5
    meta.on_update_kv_lens(torch.tensor([8, 12]))  # explicit lengths always apply
    assert meta.cache_slots.tolist() == [6, 7, 109, 110, 111]

    spec = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=1)
    spec.prepare([2, 3], [9, 12], worked_example_tables())
    spec.cache_slots_buffer.fill_(99)
    spec.on_update_kv_lens()
    assert spec.cache_slots.tolist() == [7, 8, 109, 110, 111]


def test_undersized_proxy_scratch_raises() -> None:
    tables = torch.arange(4, dtype=torch.int32).view(2, 2)
    by_batch = MsaDecodeMetadata(2, 16, 4, 4, "cpu")  # scratch sized by batch only: 2 tokens
    assert by_batch.scratch_decode_tokens == 2
    with pytest.raises(MsaInputError, match="proxy scratch"):
        by_batch.prepare([4, 4], [8, 8], tables, num_context_requests=0)
    per_token = MsaDecodeMetadata(2, 16, 4, 4, "cpu", max_draft_len=3, num_index_heads=2)
    assert per_token.scratch_decode_tokens == 8
    assert per_token.proxy_scores.shape == (2, 8, 4) and per_token.proxy_scores.dtype == torch.float32
    per_token.prepare([4, 4], [8, 8], tables)
    assert per_token.is_decode_only
    assert per_token.proxy_scores_view().shape == (2, 8, 2)
    # Prompt rows are not decode rows: a prefill step is not bound by the scratch.
    by_batch.prepare([4, 4], [8, 8], tables)
    assert not by_batch.is_decode_only
    with pytest.raises(MsaInputError, match="proxy scratch"):
        by_batch.proxy_scores_view()


@pytest.mark.parametrize(
    ("qo", "kv", "table", "match"),
    [
        ([3], [2], [[0]], "request 0: qo_len 3 exceeds kv_len 2"),
        ([0, 1], [1, 0], [[0], [1]], "request 1: kv_len is 0"),
        ([1], [9], [[0, 1]], "request 0: kv_len 9 needs 3 pages, block_tables has 2"),
        ([1], [40], [[0] * 10], "request 0: kv_len 40 needs 10 blocks, max_blocks_per_seq is 8"),
        ([1], [5], [[0, -1]], "request 0: block_tables has an unmapped page"),
        ([1, 1, 1], [1, 1, 1], [[0], [1], [2]], "num_requests 3 exceeds max_num_requests 2"),
        ([5, 5], [5, 5], [[0, 1], [2, 3]], "step has 10 tokens, max_num_tokens is 8"),
        ([1, 1], [1, 1], [[0]], "block_tables must be"),
        ([1], [1, 2], [[0]], "qo_lens has 1 entries but kv_lens has 2"),
        ([-1], [2], [[0]], "lengths must be >= 0"),
    ],
)
def test_prepare_rejects_bad_steps(qo, kv, table, match) -> None:
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=2)
    with pytest.raises(MsaInputError, match=match):
        meta.prepare(qo, kv, torch.tensor(table, dtype=torch.int32))


def test_page_ids_past_the_cache_are_refused_naming_the_entry() -> None:
    meta = MsaDecodeMetadata(2, 8, 4, 4, "cpu", num_pages=6)
    # request 1's second page is 6, one past the cache; entries past a request's pages are never read
    tables = torch.tensor([[5, 0, 99, 99], [1, 6, 99, 99]], dtype=torch.int32)
    with pytest.raises(MsaInputError, match=r"request 1: block_tables\[1, 1\] is page 6, past the cache's 6 pages"):
        meta.prepare([1, 1], [8, 5], tables)
    meta.prepare([1, 1], [8, 4], tables)  # request 1 now needs only its first page
    assert meta.cache_slots.tolist() == [0 * 4 + 3, 1 * 4 + 3]  # position 7 -> column 1 (page 0); 3 -> column 0 (page 1)
    with pytest.raises(MsaInputError, match="num_pages must be"):
        MsaDecodeMetadata(2, 8, 4, 4, "cpu", num_pages=0)


def test_values_past_int32_are_refused_or_clamped_not_wrapped() -> None:
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=3)
    with pytest.raises(MsaInputError, match="kv_len 2147483648 does not fit"):
        meta.prepare([1], [2**31], torch.zeros(1, 8, dtype=torch.int64))
    with pytest.raises(MsaInputError, match="page id past int32"):
        meta.prepare([1], [1], torch.tensor([[2**32 + 1]], dtype=torch.int64))
    meta.prepare([4], [10], torch.tensor([[0, 1, 2]], dtype=torch.int32))
    staged = (meta.positions.tolist(), meta.cache_slots.tolist())
    meta.on_update_kv_lens(torch.tensor([2**32 + 9], dtype=torch.int64))  # past the staged 10: stays 10
    assert meta.kv_lens.tolist() == [10] and (meta.positions.tolist(), meta.cache_slots.tolist()) == staged
    meta.on_update_kv_lens(torch.tensor([-(2**32) + 5], dtype=torch.int64))  # below 0: 0, not 5
    assert meta.kv_lens.tolist() == [0] and meta.valid_blocks.tolist() == [0, 0, 0, 0]


def test_constructor_and_update_validation() -> None:
    with pytest.raises(MsaInputError, match="power of two"):
        MsaDecodeMetadata(1, 1, 1, 48, "cpu")
    with pytest.raises(MsaInputError, match="max_num_tokens"):
        MsaDecodeMetadata(1, 0, 1, 4, "cpu")
    with pytest.raises(TypeError, match="qo_lens entries"):
        MsaDecodeMetadata(1, 4, 1, 4, "cpu").prepare([1.0], [1], torch.zeros(1, 1, dtype=torch.int32))
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=1)
    meta.prepare([1, 1], [2, 2], torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(MsaInputError, match="num_requests=2"):
        meta.on_update_kv_lens(torch.tensor([1]))
    with pytest.raises(TypeError, match="integer"):
        meta.on_update_kv_lens(torch.tensor([1.0, 2.0]))


def test_buffers_stay_put_and_wide_tables_are_cut() -> None:
    meta = MsaDecodeMetadata(2, 8, 3, 2, "cpu", max_draft_len=1)
    meta.prepare([2], [6], torch.tensor([[7, 8, 9, 10, 11]], dtype=torch.int32))
    pointers = [meta.cache_slots_buffer.data_ptr(), meta.block_tables.data_ptr(), meta.proxy_scores.data_ptr()]
    assert meta.block_tables.tolist() == [[7, 8, 9]]
    assert meta.cache_slots.tolist() == [18, 19]
    meta.prepare([1, 0], [1, 0], torch.tensor([[4], [-1]], dtype=torch.int32))  # empty second row
    assert meta.cache_slots_buffer.tolist() == [8] + [-1] * 7
    assert meta.block_tables.tolist() == [[4, -1, -1], [-1, -1, -1]]
    assert [meta.cache_slots_buffer.data_ptr(), meta.block_tables.data_ptr(), meta.proxy_scores.data_ptr()] == pointers


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_its_own_block_table_passed_back_is_kept(device) -> None:
    """A caller keeping the pages of the last step may hand `block_tables` back: on a device the
    table is a view of the buffer `prepare` restages, so it must be read before it is blanked."""
    meta = MsaDecodeMetadata(2, 8, 8, 4, device, max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables().to(device))
    meta.prepare([1, 1], [10, 13], meta.block_tables)
    assert meta.block_tables.cpu().tolist() == worked_example_tables().tolist()
    assert meta.cache_slots.cpu().tolist() == [9, 112]  # page 2 of request 0, page 28 of request 1


def naive_fields(qo, staged, corrected, tables, block):
    slots, valid, kv_tok, pos_all = [], [], [], []
    for r, q in enumerate(qo):
        kv = max(0, min(corrected[r], staged[r]))
        for t in range(q):
            p = kv - q + t
            pos_all.append(p)
            kv_tok.append(max(0, p + 1))
            valid.append(math.ceil(max(0, p + 1) / block))
            slots.append(tables[r][p // block] * block + p % block if p >= 0 else -1)
    return slots, valid, kv_tok, pos_all


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20)), min_size=0, max_size=5),
    log_block=st.integers(0, 4),
    deltas=st.lists(st.integers(-6, 2), min_size=5, max_size=5),
    seed=st.integers(0, 1000),
)
def test_derivation_matches_naive_and_stays_in_own_pages(rows, log_block, deltas, seed) -> None:
    block = 1 << log_block
    qo = [q for q, _ in rows]
    staged = [q + extra for q, extra in rows]
    corrected = [max(0, k + d) for k, d in zip(staged, deltas)]
    pages = sum(-(-k // block) for k in staged) + 1
    tables = random_page_tables(staged, block, pages, seed)
    width = max([len(t) for t in tables] + [1])
    meta = MsaDecodeMetadata(5, 32, width + 1, block, "cpu", max_draft_len=5)
    meta.prepare(qo, staged, padded_table(tables, width))
    meta.on_update_kv_lens(torch.tensor(corrected, dtype=torch.int64))
    slots, valid, kv_tok, positions = naive_fields(qo, staged, corrected, tables, block)
    n = sum(qo)
    assert meta.cache_slots_buffer.tolist() == slots + [-1] * (32 - n)
    assert meta.valid_blocks.tolist() == valid
    assert meta.token_kv_lens.tolist() == kv_tok
    assert meta.positions.tolist() == positions
    true_kv = [min(c, s) for c, s in zip(corrected, staged)]
    assert meta.kv_lens.tolist() == true_kv
    assert meta.qo_offsets.tolist() == [k - q for k, q in zip(true_kv, qo)]
    # Every written slot lies in a page its own request owns.
    for slot, r in zip(meta.cache_slots.tolist(), meta.token_request.tolist()):
        assert slot == -1 or slot // block in tables[r][: -(-staged[r] // block)]
    # Live tokens agree with the public per-token formula.
    expected_valid = per_token_valid_blocks(qo, true_kv, block).tolist()
    assert [v for v, p in zip(meta.valid_blocks.tolist(), positions) if p >= 0] == [
        v for v, p in zip(expected_valid, positions) if p >= 0
    ]
    # Idempotent, and identical to staging the corrected lengths directly (when they cover qo).
    fields = lambda: (meta.cache_slots_buffer, meta.valid_blocks, meta.token_kv_lens, meta.qo_offsets)  # noqa: E731
    snapshot = [x.clone() for x in fields()]
    meta.on_update_kv_lens()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, fields()))
    if all(k >= q for k, q in zip(true_kv, qo)):
        fresh = MsaDecodeMetadata(5, 32, width + 1, block, "cpu", max_draft_len=5)
        fresh.prepare(qo, true_kv, padded_table(tables, width))
        assert torch.equal(fresh.cache_slots_buffer, meta.cache_slots_buffer)
        assert torch.equal(fresh.valid_blocks, meta.valid_blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "auto"])  # the torch ops, and the fused kernel where Triton runs
def test_on_update_kv_lens_in_a_cuda_graph_equals_eager(backend, monkeypatch) -> None:
    monkeypatch.setenv("M3_EAGLE_KERNELS", backend)
    tables = worked_example_tables()
    graphed = MsaDecodeMetadata(4, 16, 8, 4, "cuda", max_draft_len=2)
    eager = MsaDecodeMetadata(4, 16, 8, 4, "cuda", max_draft_len=2)
    graphed.prepare([2, 3], [9, 12], tables.cuda())
    eager.prepare([2, 3], [9, 12], tables)
    corrections = torch.tensor([9, 12], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphed.on_update_kv_lens(corrections)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            graphed.on_update_kv_lens(corrections)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    names = ("cache_slots_buffer", "valid_blocks", "token_kv_lens", "positions", "qo_offsets", "kv_lens")
    for new in ([8, 12], [7, 10], [9, 11], [50, 50]):
        new_lens = torch.tensor(new, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            corrections.copy_(new_lens)
            graph.replay()
            eager.on_update_kv_lens(new_lens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for name in names:
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), (new, name)
    # After the last (too large) correction every length is clamped back to the staged one.
    assert graphed.cache_slots.cpu().tolist() == [7, 8, 109, 110, 111]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "auto"])  # the torch ops, and the fused kernel where Triton runs
def test_a_strided_correction_derives_as_a_contiguous_one(backend, monkeypatch) -> None:
    """Both paths take `lens[:, 0]`: the fused kernel reads kv_lens densely, so the metadata hands it
    a contiguous copy (the kernel alone refuses a strided one, by name)."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", backend)
    metas = [MsaDecodeMetadata(4, 16, 8, 4, "cuda", max_draft_len=2) for _ in range(2)]
    for meta in metas:
        meta.prepare([2, 3], [9, 12], worked_example_tables())
    wide = torch.tensor([[8, -1], [11, -1]], dtype=torch.int32, device="cuda")
    metas[0].on_update_kv_lens(wide[:, 0])
    metas[1].on_update_kv_lens(torch.tensor([8, 11], dtype=torch.int32, device="cuda"))
    for name in ("cache_slots_buffer", "valid_blocks", "token_kv_lens", "positions", "qo_offsets", "kv_lens"):
        assert torch.equal(getattr(metas[0], name), getattr(metas[1], name)), name
    assert metas[0].kv_lens.tolist() == [8, 11]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_corrections_on_another_device_are_refused_by_name() -> None:
    meta = MsaDecodeMetadata(4, 16, 8, 4, "cuda", max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    with pytest.raises(MsaInputError, match="kv_lens is on cpu"):
        meta.on_update_kv_lens(torch.tensor([8, 12], dtype=torch.int32))


@pytest.mark.parametrize("count", [0.5, 1.0, True])
def test_a_non_integer_context_row_count_is_refused_by_name(count) -> None:
    # 0.5 context rows was staged as a mixed step (0.5 != 0) and True as one context row.
    meta = MsaDecodeMetadata(4, 16, 8, 4, "cpu", max_draft_len=3)
    with pytest.raises(TypeError, match="num_context_requests must be an int"):
        meta.prepare([1, 4], [5, 8], torch.zeros(2, 2, dtype=torch.int32), num_context_requests=count)
    assert meta.num_requests == 0 and meta.prepare_count == 0


@pytest.mark.parametrize("count", [np.int64(0), np.int64(1), torch.tensor(0), torch.tensor(1)])
def test_a_numpy_or_tensor_context_row_count_gives_a_bool_decode_only(count) -> None:
    # Accepted as an int, but is_decode_only came out np.bool_ / tensor(True) (a device read per test).
    meta = MsaDecodeMetadata(4, 16, 8, 4, "cpu", max_draft_len=3)
    meta.prepare([1, 4], [5, 8], torch.zeros(2, 2, dtype=torch.int32), num_context_requests=count)
    assert type(meta.is_decode_only) is bool and meta.is_decode_only is (int(count) == 0)


def test_complex_lengths_and_tables_are_refused_by_name() -> None:
    # A complex table or length failed inside torch ("min_all" not implemented for complex), naming nothing.
    meta = MsaDecodeMetadata(4, 16, 8, 4, "cpu", max_draft_len=3)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_tables must be an integer tensor, got torch.complex64"):
        meta.prepare([2], [6], table.to(torch.complex64))
    with pytest.raises(MsaInputError, match="qo_lens must be a 1-D integer tensor, got torch.complex64"):
        meta.prepare(torch.tensor([2 + 0j]), [6], table)
    assert meta.prepare_count == 0
    meta.prepare([2], [6], table)
    with pytest.raises(TypeError, match="kv_lens must be an integer tensor, got torch.complex64"):
        meta.on_update_kv_lens(torch.tensor([5 + 1j]))
    assert meta.kv_lens.tolist() == [6] and meta.positions.tolist() == [4, 5]


def test_page_ids_whose_cache_slots_pass_int32_are_refused() -> None:
    # page * B + offset must fit the int32 slot: page 2**28 at B = 16 is slot 2**32, which wrapped to slot 0
    # (another request's page) instead of being refused.
    meta = MsaDecodeMetadata(1, 4, 2, 16, "cpu")
    with pytest.raises(MsaInputError, match="page id past int32"):
        meta.prepare([1], [1], torch.tensor([[2**28]], dtype=torch.int64))
    assert meta.num_requests == 0 and meta.prepare_count == 0  # nothing staged
    last = (2**31) // 16 - 1  # the last page whose slots all fit int32
    meta.prepare([2], [18], torch.tensor([[0, last]], dtype=torch.int64))
    assert meta.cache_slots.tolist() == [last * 16, last * 16 + 1]
    assert max(meta.cache_slots.tolist()) <= 2**31 - 1


def test_valid_blocks_of_a_length_near_int32_max_do_not_wrap() -> None:
    # ceil((p + 1) / B) computed as (p + 1 + B - 1) // B overflowed int32 for kv_len close to 2**31 - 1,
    # a length prepare accepts: the count came out negative.
    block = 1 << 20
    blocks = -(-(2**31 - 1) // block)
    meta = MsaDecodeMetadata(1, 2, blocks, block, "cpu")
    meta.prepare([2], [2**31 - 1], torch.arange(blocks, dtype=torch.int32)[None])
    assert meta.positions.tolist() == [2**31 - 3, 2**31 - 2]
    assert meta.token_kv_lens.tolist() == [2**31 - 2, 2**31 - 1]
    assert meta.valid_blocks.tolist() == [blocks, blocks] == [math.ceil((2**31 - 2) / block)] * 2


def naive_step(rows, tables, block, width_cut):
    """Every field of one step from first principles: ``rows = [(qo, kv)]``, python lists only."""
    f = {k: [] for k in ("slots", "valid", "kv_tok", "pos", "req", "intra")}
    for r, (q, k) in enumerate(rows):
        for t in range(q):
            p = k - q + t  # prefix k - q, then the step's tokens
            page = tables[r][p // block] if p >= 0 else -1
            f["slots"].append(page * block + p % block if p >= 0 else -1)
            f["valid"].append(-(-max(0, p + 1) // block))
            f["kv_tok"].append(max(0, p + 1))
            f["pos"].append(p)
            f["req"].append(r)
            f["intra"].append(t)
    cu = [0]
    for q, _ in rows:
        cu.append(cu[-1] + q)
    f["cu"] = cu
    f["tables"] = [[tables[r][c] if c < width_cut else -1 for c in range(len(tables[r]))] for r in range(len(rows))]
    return f


# A row is (kind, size, extra): a prompt chunk of `size` tokens after a cached prefix of `extra`, a
# verify row of 1 + K tokens, a single decode token, or an idle request (kv cached, no token).
ROW = st.tuples(st.sampled_from(["chunk", "verify", "decode", "idle"]), st.integers(1, 9), st.integers(0, 12))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    steps=st.lists(st.lists(ROW, min_size=0, max_size=5), min_size=1, max_size=3),
    draft_len=st.integers(0, 3),
    log_block=st.integers(0, 4),
    wide=st.integers(0, 3),
    int64_table=st.booleans(),
    data=st.data(),
)
def test_consecutive_mixed_steps_match_naive(steps, draft_len, log_block, wide, int64_table, data) -> None:
    """One metadata object over several steps mixing prompt chunks, verify rows, decodes and idle rows;
    random scattered pages, junk past each row's pages, tables wider than the metadata; then a
    verify-style correction (each verify row keeps 1 + accepted of its 1 + K tokens)."""
    block = 1 << log_block
    max_blocks = 6
    meta = MsaDecodeMetadata(5, 64, max_blocks, block, "cpu", max_draft_len=draft_len)
    for step in steps:
        rows = []
        for kind, size, extra in step:
            q = {"chunk": size, "verify": 1 + draft_len, "decode": 1, "idle": 0}[kind]
            k = max(q + extra, 1 if kind == "idle" else 0)
            if k > max_blocks * block:  # would need more pages than the metadata holds
                continue
            rows.append((q, k))
        if sum(q for q, _ in rows) > 64:
            rows = rows[:1]
        need = [-(-k // block) for _, k in rows]
        pool = data.draw(st.permutations(range(sum(need) + 8)))
        width = max(need + [1]) + wide
        tables, used = [], 0
        for n in need:
            junk = data.draw(st.lists(st.integers(-1, 500), min_size=width - n, max_size=width - n))
            tables.append(list(pool[used : used + n]) + junk)  # junk past the pages is never read
            used += n
        table = torch.tensor(tables, dtype=torch.int64 if int64_table else torch.int32).view(len(rows), width)
        meta.prepare([q for q, _ in rows], [k for _, k in rows], table)

        exp = naive_step(rows, tables, block, min(width, max_blocks))
        n_tok = sum(q for q, _ in rows)
        assert meta.num_tokens == n_tok and meta.num_requests == len(rows)
        assert meta.cache_slots_buffer.tolist() == exp["slots"] + [-1] * (64 - n_tok)  # stale tail cleared
        assert meta.valid_blocks.tolist() == exp["valid"]
        assert meta.token_kv_lens.tolist() == exp["kv_tok"]
        assert meta.positions.tolist() == exp["pos"]
        assert meta.token_request.tolist() == exp["req"]
        assert meta.token_intra.tolist() == exp["intra"]
        assert meta.cu_qo_lens.tolist() == exp["cu"]
        assert meta.qo_lens.tolist() == [q for q, _ in rows]
        assert meta.kv_lens.tolist() == meta.kv_lens_staged.tolist() == [k for _, k in rows]
        assert meta.qo_offsets.tolist() == [k - q for q, k in rows]
        cut = min(width, max_blocks)
        assert meta.block_tables.tolist() == [t[:cut] + [-1] * (max_blocks - cut) for t in exp["tables"]]
        assert meta.is_decode_only == (bool(rows) and all(q <= 1 + draft_len for q, _ in rows))
        assert meta.max_step_blocks == max(need, default=0)
        slots = [s for s in exp["slots"] if s >= 0]
        assert len(slots) == len(set(slots))  # no two tokens of a step write one slot

        # Rejection: verify rows keep 1 + accepted tokens, other rows keep everything.
        accepted = [data.draw(st.integers(0, draft_len)) if q == 1 + draft_len else q - 1 for q, _ in rows]
        corrected = [k - (q - 1 - a) if q else k for (q, k), a in zip(rows, accepted)]
        meta.on_update_kv_lens(torch.tensor(corrected, dtype=torch.int32))
        shrunk = naive_step([(q, c) for (q, _), c in zip(rows, corrected)], tables, block, cut)
        assert meta.kv_lens.tolist() == corrected and meta.kv_lens_staged.tolist() == [k for _, k in rows]
        assert meta.cache_slots.tolist() == shrunk["slots"]
        assert meta.valid_blocks.tolist() == shrunk["valid"]
        assert meta.token_kv_lens.tolist() == shrunk["kv_tok"]
        assert meta.positions.tolist() == shrunk["pos"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_staging_event_follows_the_copy_on_another_device() -> None:
    """With cuda:0 current, a cuda:1 object's staging copy runs on cuda:1's stream: its event must too."""
    torch.cuda.set_device(0)
    meta = MsaDecodeMetadata(4, 8, 8, 4, "cuda:1", max_draft_len=2)
    # A first launch of a kernel may load its module, which waits for the device to idle (lazy
    # loading): one prepare first, so the one below only queues work behind the sleep.
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(1 << 30)  # the copy queues behind this on cuda:1
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    assert not meta._staging_done.query()  # recorded on idle cuda:0 it would read done at once
    torch.cuda.synchronize(1)
    assert meta._staging_done.query()


@pytest.mark.parametrize("context_rows", [None, "none", "one", "all", "negative", "past"])
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    around_verify=st.lists(st.integers(-2, 2), min_size=0, max_size=4),
    draft_len=st.integers(0, 3),
    heads=st.integers(1, 2),
    log_block=st.integers(0, 2),
)
def test_decode_only_and_proxy_view_follow_the_stated_rule(context_rows, around_verify, draft_len, heads,
                                                           log_block) -> None:
    """is_decode_only is "no context row": every qo_len <= 1 + max_draft_len by default, or the host's
    count of leading context rows being 0; a count outside [0, R] is refused with nothing staged. A
    decode-only step past the scratch (R x (1 + K) tokens) is refused; the proxy view is
    [heads, tokens, ceil(max kv / B)]."""
    qo = [max(0, 1 + draft_len + d) for d in around_verify]  # rows on both sides of a full verify row
    context = {None: None, "none": 0, "one": min(1, len(qo)), "all": len(qo), "negative": -1,
               "past": len(qo) + 1}[context_rows]
    block = 1 << log_block
    kv = [q + 3 for q in qo]
    width = max([-(-k // block) for k in kv] + [1])
    table = torch.arange(len(qo) * width, dtype=torch.int32).view(len(qo), width)
    meta = MsaDecodeMetadata(4, 32, width, block, "cpu", max_draft_len=draft_len, num_index_heads=heads)
    if context is not None and not 0 <= context <= len(qo):
        with pytest.raises(MsaInputError, match="num_context_requests"):
            meta.prepare(qo, kv, table, num_context_requests=context)
        assert meta.prepare_count == 0 and meta.num_requests == 0
        return
    rule = all(q <= 1 + draft_len for q in qo) if context is None else context == 0
    decode_only = bool(qo) and rule
    if decode_only and sum(qo) > 4 * (1 + draft_len):
        with pytest.raises(MsaInputError, match="proxy scratch"):
            meta.prepare(qo, kv, table, num_context_requests=context)
        return
    meta.prepare(qo, kv, table, num_context_requests=context)
    assert meta.is_decode_only == decode_only
    assert meta.max_step_blocks == max([-(-k // block) for k in kv], default=0)
    if sum(qo) <= 4 * (1 + draft_len):
        view = meta.proxy_scores_view()
        assert view.shape == (heads, sum(qo), meta.max_step_blocks)
        assert view._base is meta.proxy_scores  # a view of the fixed scratch, no copy
    else:
        with pytest.raises(MsaInputError, match="proxy scratch"):
            meta.proxy_scores_view()


def _allocated_bytes(meta: MsaDecodeMetadata) -> int:
    """Bytes of the distinct storages behind the instance's tensors (views share their base's)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in vars(meta).values() if isinstance(t, torch.Tensor)}
    return sum(storages.values())


@pytest.mark.parametrize("scratch", [True, False])
@pytest.mark.parametrize("requests,tokens,blocks,draft_len,heads", [
    (2, 8, 3, 1, 1), (1, 1, 1, 0, 1), (5, 17, 9, 3, 4), (8, 256, 12, 0, 2),
])
def test_buffer_bytes_is_what_the_constructor_allocates(requests, tokens, blocks, draft_len, heads, scratch) -> None:
    meta = MsaDecodeMetadata(requests, tokens, blocks, 4, "cpu", max_draft_len=draft_len, num_index_heads=heads,
                             proxy_scratch=scratch)
    expected = MsaDecodeMetadata.buffer_bytes(requests, tokens, blocks, 4, "cpu", max_draft_len=draft_len,
                                              num_index_heads=heads, proxy_scratch=scratch)
    assert expected == _allocated_bytes(meta)
    assert (meta.proxy_scores is not None) == scratch


def test_without_proxy_scratch_the_views_work_and_the_scratch_view_is_refused() -> None:
    """A host whose kernels keep their own scratch (TensorRT-LLM) builds none: the step's views are
    those of a metadata object with it, and asking for the scratch names why there is none."""
    args = ((2, 8, 4, 4, "cpu"), dict(max_draft_len=1))
    with_scratch, without = MsaDecodeMetadata(*args[0], **args[1]), MsaDecodeMetadata(*args[0], **args[1],
                                                                                      proxy_scratch=False)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    for meta in (with_scratch, without):
        meta.prepare([2, 2], [6, 9], tables)
    for name in ("cache_slots", "valid_blocks", "token_kv_lens", "positions"):
        assert torch.equal(getattr(without, name), getattr(with_scratch, name)), name
    assert without.scratch_decode_tokens == with_scratch.scratch_decode_tokens == 4
    with pytest.raises(MsaInputError, match="proxy_scratch=False"):
        without.proxy_scores_view()


@pytest.mark.parametrize("args, kwargs", [
    ((1, 1, 1), dict(max_draft_len=-100)),  # was -300 bytes
    ((0, 8, 3), {}), ((2, 8, 3), dict(num_index_heads=0)), ((2.5, 8, 3), {}), ((2, 8, 3), dict(max_draft_len=True)),
])
def test_buffer_bytes_refuses_what_the_constructor_refuses(args, kwargs) -> None:
    with pytest.raises((TypeError, MsaInputError)) as refused:
        MsaDecodeMetadata(*args, 4, "cpu", **kwargs)
    with pytest.raises(type(refused.value), match=re.escape(str(refused.value))):
        MsaDecodeMetadata.buffer_bytes(*args, 4, "cpu", **kwargs)


def test_buffer_bytes_worked_example() -> None:
    """2 requests, 8 tokens, 3 blocks, 1 draft: int32 fields 4*2 + 3 + 3*8 + 2*3 = 41, staged twice
    (host, device); 4 per-token int32 buffers of 8; fp32 scores 1 head x 2*(1+1) tokens x 3 blocks."""
    assert MsaDecodeMetadata.buffer_bytes(2, 8, 3, 2, "cpu", max_draft_len=1) == 4 * (2 * 41 + 4 * 8) + 4 * 12


def test_in_place_length_corrections_are_clamped_to_the_staged_lengths() -> None:
    """`on_update_kv_lens()` without arguments re-derives from the lengths written into `meta.kv_lens`
    in place; corrections only shrink: a length above the staged one counts as the staged one, a
    negative one as 0. Hand-computed on the worked example (block 4, pages 0..7 and 25..32)."""
    meta = MsaDecodeMetadata(4, 8, 8, 4, "cpu", max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    meta.kv_lens.copy_(torch.tensor([20, 11], dtype=torch.int32))  # 20 > staged 9; 11 < staged 12
    meta.on_update_kv_lens()
    assert meta.kv_lens.tolist() == [9, 11]
    assert meta.positions.tolist() == [7, 8, 8, 9, 10]
    assert meta.cache_slots.tolist() == [7, 8, 108, 109, 110]
    assert meta.token_kv_lens.tolist() == [8, 9, 9, 10, 11]
    meta.kv_lens.copy_(torch.tensor([-3, 12], dtype=torch.int32))
    meta.on_update_kv_lens()
    assert meta.kv_lens.tolist() == [0, 12]
    # request 0 now sits at positions -2, -1: nothing written, nothing visible
    assert meta.positions.tolist() == [-2, -1, 9, 10, 11]
    assert meta.cache_slots.tolist() == [-1, -1, 109, 110, 111]
    assert meta.token_kv_lens.tolist() == [0, 0, 10, 11, 12]


@pytest.mark.parametrize("block", [1, 4, 16])
def test_the_first_page_whose_slots_pass_int32_is_refused(block) -> None:
    """Pages 0 .. 2**31 / B - 1 have every slot page * B + offset <= 2**31 - 1; page 2**31 / B has
    slot 2**31 at offset 0, which wraps in the int32 cache_slots: refused, the page below accepted."""
    first_bad = 2**31 // block
    meta = MsaDecodeMetadata(1, 2, 2, block, "cpu")
    with pytest.raises(MsaInputError, match="page id past int32"):
        meta.prepare([1], [1], torch.tensor([[first_bad]], dtype=torch.int64))
    assert meta.prepare_count == 0
    last = first_bad - 1
    meta.prepare([1], [block], torch.tensor([[last]], dtype=torch.int64))  # the token at the page's last slot
    assert meta.cache_slots.tolist() == [last * block + block - 1] == [2**31 - 1]


def test_prepare_count_counts_every_accepted_prepare_and_no_refused_one() -> None:
    meta = MsaDecodeMetadata(2, 8, 8, 4, "cpu", max_draft_len=2)
    assert meta.prepare_count == 0
    meta.prepare([2, 3], [9, 12], worked_example_tables())
    assert meta.prepare_count == 1
    meta.prepare([], [], torch.zeros(0, 8, dtype=torch.int32))  # an empty step is a step
    assert meta.prepare_count == 2
    with pytest.raises(MsaInputError):
        meta.prepare([3], [2], worked_example_tables()[:1])
    meta.on_update_kv_lens(torch.zeros(0, dtype=torch.int32))  # a correction is not a re-plan
    assert meta.prepare_count == 2
    meta.prepare([1], [1], worked_example_tables()[:1])
    assert meta.prepare_count == 3


@pytest.mark.parametrize("bad_page", [-1, -(2**31)])
def test_a_negative_page_in_the_table_gives_the_skip_sentinel(bad_page) -> None:
    """A table entry below 0 (a device table is not checked; here written in place) is no page: its
    tokens get slot -1. page * B in int32 is no guide: -2**31 * 4 wraps to 0, i.e. page 0's slots.
    Request of 12 tokens (block 4, pages 3, 5, 7), all in this step; block 1 unmapped after prepare."""
    meta = MsaDecodeMetadata(1, 12, 3, 4, "cpu")
    meta.prepare([12], [12], torch.tensor([[3, 5, 7]], dtype=torch.int32))
    meta.block_tables[0, 1] = bad_page
    meta.on_update_kv_lens(torch.tensor([12], dtype=torch.int32))  # re-derive from the edited table
    assert meta.cache_slots.tolist() == [12, 13, 14, 15, -1, -1, -1, -1, 28, 29, 30, 31]
    assert meta.positions.tolist() == list(range(12))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_update_kv_lens_from_another_gpu_is_refused_by_name_and_changes_nothing() -> None:
    meta = MsaDecodeMetadata(4, 8, 8, 4, "cuda:0", max_draft_len=2)
    meta.prepare([2, 3], [9, 12], worked_example_tables().cuda(0))
    before = meta.token_kv_lens.clone()
    with pytest.raises(MsaInputError, match="cuda:1"):
        meta.on_update_kv_lens(torch.tensor([8, 11], dtype=torch.int32, device="cuda:1"))
    assert torch.equal(meta.token_kv_lens, before)


def test_a_block_past_2_30_is_refused_by_name_and_2_30_derives_like_python() -> None:
    """The derivation divides and offsets int32 positions by the block size: 2**31 read as an int32
    scalar is -2**31, and request 1's token at position 1 got slot -2**31 + 1 (skipped) instead of 1."""
    block = 1 << 30
    meta = MsaDecodeMetadata(2, 8, 2, block, "cpu")
    meta.prepare([1, 2], [1, 2], torch.tensor([[0, 0], [1, 0]]))
    # slot = page * B + position % B in Python ints
    assert meta.cache_slots.tolist() == [0 * block + 0, 1 * block + 0, 1 * block + 1]
    assert meta.valid_blocks.tolist() == [1, 1, 1]
    for bad in (1 << 31, 1 << 32):
        with pytest.raises(MsaInputError, match=r"block_size \d+ is past 2\*\*30"):
            MsaDecodeMetadata(2, 8, 2, bad, "cpu")


def test_a_meta_block_table_is_refused_and_the_step_before_it_is_kept() -> None:
    """A meta table's copy failed after the new lengths were staged: qo_lens read the refused step's
    [1] beside the kept step's one request and slots."""
    meta = MsaDecodeMetadata(2, 8, 2, 4, "cpu", max_draft_len=2)
    meta.prepare([2], [6], torch.tensor([[0, 1]]))
    with pytest.raises(MsaInputError, match="block_tables is a meta tensor"):
        meta.prepare([1, 1], [3, 3], torch.zeros(2, 2, dtype=torch.int32, device="meta"))
    assert meta.prepare_count == 1 and meta.num_requests == 1
    assert meta.qo_lens.tolist() == [2] and meta.kv_lens.tolist() == [6]
    assert meta.cache_slots.tolist() == [1 * 4 + 4 % 4, 1 * 4 + 5 % 4]  # page 1, positions 4 and 5


@pytest.mark.parametrize("block", [1, 16])
def test_a_cache_whose_last_page_passes_int32_slots_is_refused_at_construction(block) -> None:
    """A device block table is copied in unchecked, so a known page count is checked up front: at B = 16,
    page 2**27 of a 2**27 + 1 page cache derived slot -2**31 (Python: 2**31). 2**31 / B pages fit: the
    last page's last slot is 2**31 - 1."""
    pages = 2**31 // block
    with pytest.raises(MsaInputError, match=f"num_pages {pages + 1} at block_size {block} gives cache slots past int32"):
        MsaDecodeMetadata(1, 2, 1, block, "cpu", num_pages=pages + 1)
    meta = MsaDecodeMetadata(1, 2, 1, block, "cpu", num_pages=pages)
    meta.prepare([1], [block], torch.tensor([[pages - 1]]))
    assert meta.cache_slots.tolist() == [(pages - 1) * block + block - 1] == [2**31 - 1]


def test_a_prepare_cut_off_while_staging_still_counts(monkeypatch):
    """A Ctrl-C (raised as a call returns) inside `prepare` after the host buffers were changed: the
    count still moves on, so a caller that skips re-planning an unchanged count (the reference host's
    graph steps) stages its plan again instead of reading the cut-off one as its own."""
    meta = MsaDecodeMetadata(2, 8, 4, 4, "cpu")
    meta.prepare([2], [5], torch.tensor([[3, 1]], dtype=torch.int32))
    before = meta.prepare_count

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "repeat_interleave", cut)  # called after the host fields were zeroed
    with pytest.raises(KeyboardInterrupt):
        meta.prepare([3], [9], torch.tensor([[5, 6, 7]], dtype=torch.int32))
    assert meta.prepare_count == before + 1


def test_a_list_where_a_tensor_is_required_is_refused_by_name_and_changes_nothing() -> None:
    """block_tables and an explicit kv_lens correction are tensors (the interface, and a device table
    is never read back): a Python list is named (without the check it failed on `.dim`, naming
    nothing), before any count, length or slot of the staged step moves."""
    meta = MsaDecodeMetadata(2, 8, 4, 4, "cpu", max_draft_len=1)
    meta.prepare([2], [6], torch.tensor([[3, 1]], dtype=torch.int32))
    staged = (meta.prepare_count, meta.kv_lens.tolist(), meta.cache_slots.tolist())
    assert staged == (1, [6], [1 * 4 + 0, 1 * 4 + 1])  # positions 4 and 5: page 1 of the table
    with pytest.raises(TypeError, match="^block_tables must be a tensor, got list$"):
        meta.prepare([1], [7], [[3, 1]])
    with pytest.raises(TypeError, match="^kv_lens must be a device tensor, got list$"):
        meta.on_update_kv_lens([5])
    assert (meta.prepare_count, meta.kv_lens.tolist(), meta.cache_slots.tolist()) == staged


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_block_tables_and_corrections_derive_as_int64_ones(dtype) -> None:
    """Integer tables and corrections are accepted, but torch has no min / max of uint16/32/64 tensors
    nor promotes them with int32: the page check and the correction raised NotImplementedError /
    RuntimeError naming no argument. The worked example's fields, against a plain int32 twin."""
    def step(table_dtype, kv_dtype):
        meta = MsaDecodeMetadata(4, 8, 8, 4, "cpu", max_draft_len=2, num_pages=40)
        meta.prepare([2, 3], [9, 12], worked_example_tables().to(table_dtype))
        meta.on_update_kv_lens(torch.tensor([8, 11], dtype=kv_dtype))
        return [t.tolist() for t in (meta.cache_slots, meta.valid_blocks, meta.positions, meta.kv_lens)]

    assert step(dtype, dtype) == step(torch.int32, torch.int32) == [[6, 7, 108, 109, 110], [2, 2, 3, 3, 3],
                                                                    [6, 7, 8, 9, 10], [8, 11]]
    meta = MsaDecodeMetadata(4, 8, 8, 4, "cpu", max_draft_len=2, num_pages=40)
    with pytest.raises(MsaInputError, match="request 1: block_tables\\[1, 2\\] is page 40, past the cache's 40"):
        meta.prepare([2, 3], [9, 12], torch.tensor([[0, 1, 2], [3, 4, 40]], dtype=dtype))
    if dtype == torch.uint64:  # past int64: refused by value, not read as an unmapped page or a length of 0
        with pytest.raises(MsaInputError, match="block_tables row 1 has an entry past int64"):
            meta.prepare([2, 3], [9, 12], torch.tensor([[0, 1, 2], [3, 4, 2**63]], dtype=dtype))
        meta.prepare([2, 3], [9, 12], worked_example_tables())
        before = meta.cache_slots.tolist()
        with pytest.raises(MsaInputError, match="kv_lens has an entry past int64"):
            meta.on_update_kv_lens(torch.tensor([8, 2**63], dtype=dtype))
        assert meta.cache_slots.tolist() == before and meta.kv_lens.tolist() == [9, 12]


def test_one_token_or_one_block_past_the_maximum_is_refused_by_name_and_the_step_before_is_kept() -> None:
    # max_num_tokens 8, max_blocks_per_seq 2 at block 4: 8 tokens and kv 8 (2 blocks) fit, one more does not
    meta = MsaDecodeMetadata(2, 8, 2, 4, "cpu")
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    meta.prepare([4, 4], [8, 4], table)
    kept = (meta.positions.tolist(), meta.cache_slots.tolist())
    assert kept == ([4, 5, 6, 7, 0, 1, 2, 3], [4 + p % 4 for p in range(4, 8)] + [12 + p for p in range(4)])
    with pytest.raises(MsaInputError, match="step has 9 tokens, max_num_tokens is 8"):
        meta.prepare([5, 4], [5, 4], table)
    # a third block would be cut from the table (column clamped to the second: page 1's slots, not page 2's)
    with pytest.raises(MsaInputError, match="request 0: kv_len 9 needs 3 blocks, max_blocks_per_seq is 2"):
        meta.prepare([1], [9], table[:1])
    assert (meta.num_tokens, meta.positions.tolist(), meta.cache_slots.tolist()) == (8, *kept)
