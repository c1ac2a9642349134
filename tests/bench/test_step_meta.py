"""The bench's host-built step metadata vs the DESIGN formulas (and MsaDecodeMetadata)."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench.inputs import shuffled_block_tables
from m3_eagle_plugin.bench.step_meta import build_step_meta
from m3_eagle_plugin.msa import MsaDecodeMetadata


def test_worked_example():
    tables = torch.tensor([[5, 2, -1], [7, 1, 3]], dtype=torch.int32)
    meta = build_step_meta([4, 1], [18, 33], tables, 16, pad_tokens=1)
    assert meta.positions.tolist() == [14, 15, 16, 17, 32, 0]
    assert meta.valid_blocks.tolist() == [1, 1, 2, 2, 3, 0]
    assert meta.cache_slots.tolist() == [5 * 16 + 14, 5 * 16 + 15, 2 * 16, 2 * 16 + 1, 3 * 16, -1]
    assert meta.cu_qo_lens.tolist() == [0, 4, 5] and meta.qo_offsets.tolist() == [14, 32]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(reqs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 100)), min_size=1, max_size=6),
       block=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99))
def test_property_matches_design_formula_and_msa_metadata(reqs, block, seed):
    qo = [q for q, _ in reqs]
    kv = [q + e for q, e in reqs]
    tables = shuffled_block_tables(kv, block, sum(-(-k // block) for k in kv), torch.Generator().manual_seed(seed))
    meta = build_step_meta(qo, kv, tables, block)
    expect = [math.ceil(min(k - q + t + 1, k) / block) for q, k in zip(qo, kv) for t in range(q)]
    assert meta.valid_blocks.tolist() == expect
    msa = MsaDecodeMetadata(len(qo), sum(qo), tables.shape[1], block, "cpu")
    msa.prepare(qo, kv, tables)
    for field in ("positions", "valid_blocks", "token_kv_lens", "cache_slots", "token_request", "cu_qo_lens"):
        assert getattr(meta, field).tolist() == getattr(msa, field).tolist(), field


def test_padding_tokens_belong_to_request_zero_with_no_kv():
    tables = torch.tensor([[5, 2, -1], [7, 1, 3]], dtype=torch.int32)
    meta = build_step_meta([4, 1], [18, 33], tables, 16, pad_tokens=2)
    assert meta.token_request.tolist() == [0, 0, 0, 0, 1, 0, 0]
    assert meta.token_kv_lens.tolist() == [15, 16, 17, 18, 33, 0, 0]
    assert meta.cache_slots.tolist()[-2:] == [-1, -1]


def test_a_block_table_for_other_requests_is_refused():
    import pytest

    tables = torch.tensor([[5, 2, -1]], dtype=torch.int32)  # one row for two requests
    with pytest.raises(ValueError, match="same requests"):
        build_step_meta([4, 1], [18, 33], tables, 16)
    with pytest.raises(ValueError, match=r"request 1: need 1 <= qo_len <= kv_len"):
        build_step_meta([1, 4], [3, 3], torch.tensor([[0], [1]], dtype=torch.int32), 16)


def test_a_table_that_does_not_map_a_requests_kv_is_refused_naming_it():
    """Request 1's 20 tokens need 2 blocks of 16: a -1 entry among them gave cache slots -14 and -13
    (page -1) without a word, and a one-column table a bare IndexError. Refused as
    MsaDecodeMetadata.prepare refuses the same host tables."""
    import pytest

    unmapped = torch.tensor([[4, -1], [0, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^request 1: block_tables has an unmapped page \(< 0\) among its first 2$"):
        build_step_meta([1, 2], [3, 20], unmapped, 16)
    with pytest.raises(ValueError, match=r"^request 1: kv_len 20 needs 2 blocks, block_tables has 1$"):
        build_step_meta([1, 2], [3, 20], torch.tensor([[4], [0]], dtype=torch.int32), 16)
    ok = build_step_meta([1, 2], [3, 20], torch.tensor([[4, -1], [0, 7]], dtype=torch.int32), 16)
    assert ok.cache_slots.tolist() == [4 * 16 + 2, 7 * 16 + 2, 7 * 16 + 3]  # positions 2 and 18, 19


def test_cache_slots_past_int32_keep_their_exact_value():
    """`cache_slots` is int64 (the field's contract): page 2**24 at block 256 puts slot 2**32 + p,
    which an int32 tensor cannot hold. The slot is page * block + offset in Python ints."""
    page, block = 2**24, 256
    meta = build_step_meta([2], [300], torch.tensor([[3, page]], dtype=torch.int32), block)
    assert meta.cache_slots.dtype == torch.int64
    assert meta.cache_slots.tolist() == [page * block + 298 - block, page * block + 299 - block]


def test_qo_lens_host_are_the_requests_q_lens_without_the_padding_rows():
    """`qo_lens_host` is what MsaDecodeMetadata.prepare records (the FlashInfer route reads it to tell
    requests from graph padding): the requests' q_lens, padding rows not counted."""
    tables = torch.tensor([[5, 2, -1], [7, 1, 3]], dtype=torch.int32)
    meta = build_step_meta([4, 1], [18, 33], tables, 16, pad_tokens=3)
    msa = MsaDecodeMetadata(2, 8, 3, 16, "cpu", max_draft_len=3)
    msa.prepare([4, 1], [18, 33], tables)
    assert meta.qo_lens_host == msa.qo_lens_host == (4, 1)
