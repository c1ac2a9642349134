"""Triton sparse verify attention (both layouts: union-loading and per-token) vs the naive torch reference."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from .kernel_case_helpers import (M3, SMALL, assert_close_rel, msa_metadata, needs_gpu, poison_allocator_like,
                                  random_step)
from m3_eagle_plugin.bench import torch_reference as ref

pytestmark = needs_gpu


def _run(q, cache, meta, sel, **kw):
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    return sparse_verify_attention(q, cache.k, cache.v, meta, sel, **kw)


def _random_selection(meta, hkv, topk, block, seed):
    """Each token: its own local block plus random earlier blocks (ascending, -1 padded)."""
    gen = torch.Generator().manual_seed(seed)
    pos = meta.positions.tolist()
    live = int(meta.cu_qo_lens[-1])
    sel = torch.full((hkv, len(pos), topk), -1, dtype=torch.int32)
    for h in range(hkv):
        for t in range(live):
            local = pos[t] // block
            others = torch.randperm(local, generator=gen)[: topk - 1].tolist() if local else []
            ids = sorted(set(others + [local]))
            sel[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel.to(meta.positions.device)


LAYOUTS = ["union", "token"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_matches_reference_fp32(splits, layout):
    meta, cache, q, _ = random_step(SMALL, [4, 1, 3], [150, 20, 64], kv_dtype=torch.float32, q_dtype=torch.float32)
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 1)
    out = _run(q, cache, meta, sel, scale=0.3, splits=splits, layout=layout)
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.3), 1e-4)


@pytest.mark.parametrize("layout,compute_f16,prefetch", [("union", None, False), ("union", False, False),
                                                        ("token", None, False), ("token", True, True)])
def test_m3_geometry_fp8_with_scales_and_padding(layout, compute_f16, prefetch):
    meta, cache, q, _ = random_step(M3, [4, 4, 4, 4], [5000, 300, 2048, 4], kv_dtype=torch.float8_e4m3fn,
                                    pad_tokens=2)
    sel = _random_selection(meta, M3.kv_heads, M3.topk, M3.block, 2)
    scale = 1 / math.sqrt(M3.head_dim)
    out = _run(q, cache, meta, sel, scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale, max_qo_len=4,
               layout=layout, compute_f16=compute_f16, prefetch=prefetch)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale, k_scale=cache.k_scale,
                                  v_scale=cache.v_scale)
    assert_close_rel(out, expect, 2e-2)
    assert (out[16:] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_split_zeroes_graph_padding_rows_itself(layout):
    """One split writes `out` with no memset: the kernel zeroes the rows past the last request."""
    meta, cache, q, _ = random_step(M3, [4, 2, 4], [900, 300, 129], kv_dtype=torch.float8_e4m3fn, pad_tokens=7)
    sel = _random_selection(meta, M3.kv_heads, M3.topk, M3.block, 3)
    scale = 1 / math.sqrt(M3.head_dim)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    poison_allocator_like(q)
    out = _run(q, cache, meta, sel, scale=scale, max_qo_len=4, splits=1, layout=layout, **kw)
    assert_close_rel(out[:10], ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale, **kw)[:10], 2e-2)
    assert (out[10:] == 0).all()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 300)), min_size=1, max_size=4),
    topk=st.integers(1, 6),
    splits=st.sampled_from([None, 1, 2, 5]),
    hint=st.sampled_from([None, 2, 9]),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_property_random_steps(reqs, topk, splits, hint, layout, seed):
    qo_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    meta, cache, q, _ = random_step(SMALL, qo_lens, kv_lens, kv_dtype=torch.float32, q_dtype=torch.float32, seed=seed)
    sel = _random_selection(meta, SMALL.kv_heads, topk, SMALL.block, seed)
    out = _run(q, cache, meta, sel, scale=0.2, splits=splits, layout=layout,
               max_qo_len=None if hint is None else max(hint, max(qo_lens)))
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.2), 1e-4)


def test_fused_union_from_topk_gives_same_output():
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    meta, cache, q, index_q = random_step(M3, [4, 4, 1], [3000, 700, 129], kv_dtype=torch.float8_e4m3fn,
                                          correlation=0.9)
    sel, union = select_blocks_verify(index_q, cache.index_k, meta, topk=M3.topk, max_qo_len=4, union_group=16)
    kw = dict(scale=0.088, k_scale=cache.k_scale, v_scale=cache.v_scale, max_qo_len=4)
    fused = _run(q, cache, meta, sel, union=union, **kw)
    assert_close_rel(fused, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.088, k_scale=cache.k_scale,
                                                 v_scale=cache.v_scale), 2e-2)
    # Same blocks, possibly another order (ascending vs first-seen): equal up to summation order.
    assert_close_rel(fused, _run(q, cache, meta, sel, **kw), 2e-3)


@pytest.mark.parametrize("key_tile", [16, 64])
def test_main_loop_variants_agree_with_reference(key_tile):
    meta, cache, q, _ = random_step(M3, [4, 1, 4], [900, 300, 4000], kv_dtype=torch.float8_e4m3fn)
    sel = _random_selection(meta, M3.kv_heads, M3.topk, M3.block, 5)
    kw = dict(scale=0.088, k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = _run(q, cache, meta, sel, max_qo_len=4, key_tile=key_tile, splits=3, **kw)
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, **kw), 2e-2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_selected_page_propagates(layout):
    meta, cache, q, _ = random_step(SMALL, [2], [40], kv_dtype=torch.float32, q_dtype=torch.float32)
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 3)
    page = int(meta.block_tables[0, 2])  # the local block of both tokens: always selected
    cache.v[page, 0, 0, 0] = float("nan")
    out = _run(q, cache, meta, sel, scale=0.2, layout=layout)
    assert torch.isnan(out[:, : SMALL.q_heads // SMALL.kv_heads]).any()


def test_matches_package_reference_on_msa_metadata():
    from m3_eagle_plugin.msa import sparse_attention

    step, cache, q, _ = random_step(M3, [4, 4, 1, 4], [3000, 129, 700, 6000], kv_dtype=torch.bfloat16)
    meta = msa_metadata(step)
    sel = _random_selection(step, M3.kv_heads, M3.topk, M3.block, 9)
    out = _run(q, cache, meta, sel, scale=0.088, max_qo_len=4)
    assert_close_rel(out, sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.088), 1e-2)


@pytest.mark.parametrize("kw,match", [({"layout": "ragged"}, "layout"), ({"layout": ""}, "layout"),
                                      ({"compute_f16": True}, "16-bit")])
def test_bad_options_are_refused(kw, match):
    from m3_eagle_plugin.msa.kernels import KernelInputError

    meta, cache, q, _ = random_step(SMALL, [1], [20], kv_dtype=torch.float32, q_dtype=torch.float32)
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 4)
    with pytest.raises(KernelInputError, match=match):
        _run(q, cache, meta, sel, scale=0.2, **kw)
