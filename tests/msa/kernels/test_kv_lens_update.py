"""Fused on_update_kv_lens vs MsaDecodeMetadata's own torch derivation (the contract), graph-safe."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from .kernel_case_helpers import needs_gpu
from m3_eagle_plugin.bench.inputs import shuffled_block_tables

FIELDS = ("_kv_lens", "_qo_offsets", "_positions", "_token_kv_lens", "_valid_blocks", "_cache_slots")


def _pair(qo_lens, kv_lens, block=16, max_draft_len=4, seed=0):
    """Two identically prepared metadata objects (one for the torch path, one for the kernel)."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata

    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-kv // block) for kv in kv_lens) + 2
    tables = shuffled_block_tables(kv_lens, block, pages, gen)
    metas = []
    for _ in range(2):
        m = MsaDecodeMetadata(len(qo_lens) + 2, sum(qo_lens) + 5, tables.shape[1] + 1, block, "cuda",
                              max_draft_len=max_draft_len)
        m.prepare(qo_lens, kv_lens, tables)
        metas.append(m)
    return metas


def _poison(meta):
    for name in FIELDS[2:]:
        getattr(meta, name).fill_(12345)


def _assert_same(torch_meta, fused_meta):
    torch.cuda.synchronize()
    for name in FIELDS:
        a, b = getattr(torch_meta, name), getattr(fused_meta, name)
        assert torch.equal(a, b), f"{name}: torch {a.tolist()} vs fused {b.tolist()}"


def _fused(meta, kv=None):
    from m3_eagle_plugin.msa.kernels.kv_lens_update import on_update_kv_lens_fused

    on_update_kv_lens_fused(meta, kv)


@needs_gpu
def test_correction_matches_metadata_and_replays_in_graph():
    ref_meta, meta = _pair([4, 4, 1, 4], [70, 40, 17, 5])
    new = torch.tensor([67, 100, 16, 3], dtype=torch.int32, device="cuda")  # 100 > staged; 3 < qo_len
    ref_meta.on_update_kv_lens(new)
    _poison(meta)
    _fused(meta, new)
    _assert_same(ref_meta, meta)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fused(meta, new)
    new.copy_(torch.tensor([66, 38, 15, 4], dtype=torch.int32))
    ref_meta.on_update_kv_lens(new)
    _poison(meta)
    graph.replay()
    _assert_same(ref_meta, meta)


@needs_gpu
def test_without_new_lengths_rederives_current():
    ref_meta, meta = _pair([2, 5], [33, 80])
    ref_meta.on_update_kv_lens()
    _poison(meta)
    _fused(meta)
    _assert_same(ref_meta, meta)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 90), st.integers(0, 6)), min_size=1, max_size=6),
    seed=st.integers(0, 100),
)
@needs_gpu
def test_property_matches_metadata_and_is_idempotent(reqs, seed):
    qo_lens = [q for q, _, _ in reqs]
    kv_lens = [q + extra + (1 if q == 0 and extra == 0 else 0) for q, extra, _ in reqs]
    ref_meta, meta = _pair(qo_lens, kv_lens, seed=seed)
    new = torch.tensor([max(kv - s, 0) for kv, (_, _, s) in zip(kv_lens, reqs)], dtype=torch.int32, device="cuda")
    ref_meta.on_update_kv_lens(new)
    _poison(meta)
    _fused(meta, new)
    _assert_same(ref_meta, meta)
    _fused(meta, meta.kv_lens.clone())
    _assert_same(ref_meta, meta)


def test_a_strided_kv_lens_is_refused_before_anything_runs():
    """The kernel reads `kv_lens` densely; a strided view would be read as other requests' lengths."""
    import pytest

    from m3_eagle_plugin.msa import MsaDecodeMetadata
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.kv_lens_update import on_update_kv_lens_fused

    meta = MsaDecodeMetadata(3, 12, 4, 32, "cpu", max_draft_len=3)
    meta.prepare([4, 4, 4], [38, 67, 19], torch.arange(12, dtype=torch.int32).view(3, 4))
    staged = meta.kv_lens.tolist()
    with pytest.raises(KernelInputError, match="kv_lens must be contiguous"):
        on_update_kv_lens_fused(meta, torch.tensor([38, 0, 67, 0, 19, 0])[::2])
    assert meta.kv_lens.tolist() == staged


@needs_gpu
def test_kv_lengths_near_int32_max_do_not_wrap():
    from .interpret_kv_lens import near_int32_max_mismatches

    assert near_int32_max_mismatches("cuda") == []
