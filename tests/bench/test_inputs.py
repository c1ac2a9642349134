"""Bench inputs: strided pool views, shuffled distinct pages, anchor-style shared selections."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench.inputs import Geometry, make_step, shuffled_block_tables, union_blocks

GEO = Geometry(q_heads=4, kv_heads=1, head_dim=8, index_heads=1, index_dim=8, block=8, topk=4)


def test_cache_views_are_strided_into_a_pool():
    step = make_step(2, 50, 4, GEO, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                     device="cpu")
    cache = step["cache"]
    assert not cache.k.is_contiguous() and cache.k.stride(0) == 3 * GEO.block * GEO.head_dim
    assert cache.k.data_ptr() != cache.v.data_ptr() and cache.index_k.stride(0) == 2 * GEO.block * GEO.index_dim


def test_v_is_the_second_sub_page_and_index_k_sits_past_its_pools_start():
    """`make_cache`: K at sub-page 0 and V at sub-page 1 of each slot; index-K not at its pool's start,
    so a kernel that drops a view's storage offset reads the wrong pages."""
    step = make_step(2, 50, 4, GEO, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                     device="cpu")
    cache = step["cache"]
    pool, index_pool = cache.storage
    num_pages = pool.shape[0]
    assert torch.equal(cache.k.reshape(num_pages, -1), pool[:, 0])
    assert torch.equal(cache.v.reshape(num_pages, -1), pool[:, 1])
    assert cache.v.data_ptr() - cache.k.data_ptr() == GEO.kv_heads * GEO.block * GEO.head_dim * 4
    assert cache.index_k.data_ptr() != index_pool.data_ptr() and cache.index_k.storage_offset() > 0


@settings(max_examples=25, deadline=None, derandomize=True)
@given(kv=st.lists(st.integers(1, 60), min_size=1, max_size=5), spare=st.integers(0, 5), seed=st.integers(0, 99))
def test_property_tables_use_distinct_pages(kv, spare, seed):
    need = [-(-k // 8) for k in kv]
    table = shuffled_block_tables(kv, 8, sum(need) + spare, torch.Generator().manual_seed(seed))
    used = [p for r, n in enumerate(need) for p in table[r, :n].tolist()]
    assert len(set(used)) == len(used) and all(0 <= p < sum(need) + spare for p in used)
    assert all((table[r, n:] == -1).all() for r, n in enumerate(need))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(batch=st.integers(1, 4), context=st.integers(4, 200), qo=st.integers(1, 4), seed=st.integers(0, 99))
def test_property_shared_selection_is_valid_and_mostly_shared(batch, context, qo, seed):
    step = make_step(batch, context, qo, GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                     q_dtype=torch.float32, device="cpu", seed=seed)
    meta, sel = step["meta"], step["selection"]
    for t, p in enumerate(meta.positions.tolist()):
        ids = [b for b in sel[0, t].tolist() if b >= 0]
        assert ids == sorted(set(ids)) and p // GEO.block in ids and all(b <= p // GEO.block for b in ids)
    # every token adds at most its local block and one swapped block to the request's union
    assert union_blocks(sel, meta) <= batch * (GEO.topk + 2 * (qo - 1))


def test_tables_refuse_a_pool_one_page_too_small():
    import pytest

    with pytest.raises(ValueError, match="3 pages needed, pool has 2"):
        shuffled_block_tables([9, 1], 8, 2, torch.Generator().manual_seed(0))
    assert shuffled_block_tables([9, 1], 8, 3, torch.Generator().manual_seed(0)).shape == (2, 2)


def test_correlated_queries_keep_unit_variance_and_share_the_base():
    """q = c * base + sqrt(1 - c^2) * noise: unit variance, and two tokens of one request correlate c^2."""
    from m3_eagle_plugin.bench.inputs import verify_queries

    c = 0.9
    q = verify_queries(4000, 2, 1, 8, torch.float64, "cpu", torch.Generator().manual_seed(0), correlation=c)
    pairs = q.view(4000, 2, 8)
    assert abs(float(q.std()) - 1.0) < 0.02
    first, second = pairs[:, 0].flatten(), pairs[:, 1].flatten()
    corr = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    assert abs(corr - c * c) < 0.02


def test_a_token_seeing_at_most_topk_blocks_selects_them_all_as_a_top_k_does():
    """Verify tokens 14, 15, 16 of a 17-token context (block 8, top-4): token 16 sees blocks 0-2,
    which a top-4 selects whatever the scores; the shared selection gave it [0, 2] (its base set
    is drawn from the blocks before the request's first local block only)."""
    from m3_eagle_plugin.bench import torch_reference as ref

    for seed in range(3):
        step = make_step(2, 17, 3, GEO, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                         device="cpu", seed=seed)
        topk = ref.select_blocks(step["index_q"], step["cache"].index_k, step["meta"], topk=GEO.topk)
        assert torch.equal(step["selection"], topk)
        assert step["selection"][0, 2].tolist() == [0, 1, 2, -1]


@pytest.mark.parametrize("batch, seed", [(1, 0), (2, 1), (3, 2)])
def test_shared_selection_has_a_top_ks_size(batch, seed):
    """As a top-k over the visible blocks (topk 4 here; q_len <= block, so a request's tokens span at
    most two blocks): a token seeing at most topk blocks selects every one of them, a token seeing
    more selects exactly topk distinct visible blocks. Every context through block 6, so verify
    tokens cross each block boundary (local block topk - 1 from topk - 2 among them)."""
    for context in range(4, 6 * GEO.block):
        for qo in range(1, 5):
            step = make_step(batch, context, qo, GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                             q_dtype=torch.float32, device="cpu", seed=seed + context)
            meta, sel = step["meta"], step["selection"]
            for t, p in enumerate(meta.positions.tolist()):
                visible = p // GEO.block + 1
                ids = [b for b in sel[0, t].tolist() if b >= 0]
                if visible <= GEO.topk:
                    assert ids == list(range(visible)), (context, qo, t, ids)
                else:
                    assert len(set(ids)) == GEO.topk and max(ids) < visible, (context, qo, t, ids)
