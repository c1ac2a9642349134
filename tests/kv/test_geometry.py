"""Pool geometry: coalescing into the mega-slot, non-uniform offsets, split pools, draft hosting."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.kv import (
    BufferSpec,
    DraftLayerPlacementError,
    build_pool_geometry,
    minimax_m3_buffers,
    minimax_m3_geometry,
)

B, D, DI = 128, 128, 128


def _m3_tp4(**kw):
    return minimax_m3_geometry(60, range(3, 60), 1, D, DI, B, num_draft_layers=1, **kw)


def test_production_tp4_is_one_mega_slot_of_179_sub_pages():
    geo = _m3_tp4()
    assert len(geo.pools) == 1
    assert geo.pools[0].sub_pages == 179 == 3 * 2 + 57 * 3 + 1 * 2
    assert geo.pools[0].page_bytes == B * 1 * D * 2
    assert geo.draft_layer_ids == (60,)
    assert geo.target_layer_ids == tuple(range(60))


def test_production_offsets_are_not_a_uniform_stride():
    geo = _m3_tp4()
    # dense layers 0..2: K, V at 2L, 2L+1; sparse layer L >= 3: K, V, index-K from 6 + 3(L-3).
    for layer in range(3):
        assert geo.locate(layer, "k").offset == 2 * layer
        assert geo.locate(layer, "v").offset == 2 * layer + 1
        assert not geo.has(layer, "index_k")
    for layer in range(3, 60):
        base = 6 + 3 * (layer - 3)
        offsets = [geo.locate(layer, r).offset for r in ("k", "v", "index_k")]
        assert offsets == [base, base + 1, base + 2]
    assert geo.locate(60, "k").offset == 177 and geo.locate(60, "v").offset == 178
    assert not geo.has(60, "index_k")
    strides = {geo.locate(i + 1, "k").offset - geo.locate(i, "k").offset for i in range(60)}
    assert strides == {2, 3}


def test_four_kv_heads_per_rank_splits_into_two_pools():
    geo = minimax_m3_geometry(6, [3, 4, 5], 4, D, DI, B, num_draft_layers=1)
    pools = [(p.page_bytes, p.sub_pages) for p in geo.pools]
    assert pools == [(4 * B * D * 2, 14), (B * DI * 2, 3)]
    assert geo.locate(6, "k").pool_id == 0 and geo.locate(6, "k").offset == 12
    assert [geo.locate(layer, "index_k").offset for layer in (3, 4, 5)] == [0, 1, 2]
    assert all(geo.locate(layer, "index_k").pool_id == 1 for layer in (3, 4, 5))


def test_fp8_kv_next_to_bf16_index_k_splits():
    geo = minimax_m3_geometry(4, [3], 1, D, DI, B, num_draft_layers=1, kv_bytes_per_elem=1)
    assert [(p.page_bytes, p.sub_pages) for p in geo.pools] == [(16384, 10), (32768, 1)]


def test_unhostable_draft_layer_is_refused_with_the_reason():
    with pytest.raises(DraftLayerPlacementError, match=r"draft layer 60 cannot be hosted.*32768"):
        minimax_m3_geometry(60, range(3, 60), 1, D, DI, B, num_draft_layers=1, draft_num_kv_heads=8)
    # a draft page equal to the index-K page is still refused: that pool holds no target K/V
    with pytest.raises(DraftLayerPlacementError, match="cannot be hosted"):
        minimax_m3_geometry(4, [3], 4, D, DI, B, num_draft_layers=1, draft_num_kv_heads=1)


def test_draft_with_same_heads_in_split_geometry_is_hosted():
    geo = minimax_m3_geometry(4, [3], 4, D, DI, B, num_draft_layers=2)
    assert geo.draft_layer_ids == (4, 5)
    assert geo.locate(5, "v").offset == 11 and geo.locate(5, "v").pool_id == 0


@pytest.mark.parametrize(
    "buffers, match",
    [
        ([], "at least one buffer"),
        ([BufferSpec(0, "k", 8), BufferSpec(0, "k", 8)], "duplicate"),
        ([BufferSpec(0, "k", 8)], "no V buffer"),
        ([BufferSpec(0, "v", 8)], "no K buffer"),
        ([BufferSpec(0, "k", 8), BufferSpec(1, "k", 8),
          BufferSpec(0, "v", 8), BufferSpec(1, "v", 8)],
         "directly follow"),
        ([BufferSpec(0, "k", 8), BufferSpec(0, "v", 16)], "directly follow"),
    ],
)
def test_bad_buffer_lists_are_rejected(buffers, match):
    with pytest.raises(ValueError, match=match):
        build_pool_geometry(buffers)


def test_bad_buffer_specs_are_rejected():
    with pytest.raises(ValueError, match="role"):
        BufferSpec(0, "q", 8)
    with pytest.raises(ValueError, match="page size"):
        BufferSpec(0, "k", 0)
    with pytest.raises(ValueError, match="sparse_layer_ids"):
        minimax_m3_buffers(4, [4], 1, D, DI, B)
    with pytest.raises(ValueError, match="block_size"):
        minimax_m3_buffers(4, [3], 1, D, DI, 0)


def test_fingerprint_tells_geometries_apart():
    a = _m3_tp4().fingerprint()
    assert a == _m3_tp4().fingerprint()
    assert a != minimax_m3_geometry(60, range(4, 60), 1, D, DI, B, num_draft_layers=1).fingerprint()
    assert json.loads(a)["pools"] == [[32768, 179]]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    num_layers=st.integers(1, 12),
    sparse_bits=st.integers(0, 2**12 - 1),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16]),
    index_dim=st.sampled_from([8, 16, 32]),
    block=st.sampled_from([2, 4]),
    drafts=st.integers(0, 2),
)
def test_geometry_matches_a_naive_packing(num_layers, sparse_bits, heads, head_dim, index_dim,
                                          block, drafts):
    sparse = [i for i in range(num_layers) if sparse_bits >> i & 1]
    geo = minimax_m3_geometry(num_layers, sparse, heads, head_dim, index_dim, block,
                              num_draft_layers=drafts)
    kv_page, ik_page = heads * block * head_dim * 2, block * index_dim * 2
    # naive reference: walk the layers, append each page to the pool of its size
    expected, counts, order = {}, {}, []
    for layer in range(num_layers + drafts):
        roles = ["k", "v"] + (["index_k"] if layer in sparse else [])
        for role in roles:
            size = ik_page if role == "index_k" else kv_page
            if size not in counts:
                counts[size] = 0
                order.append(size)
            expected[(layer, role)] = (order.index(size), counts[size])
            counts[size] += 1
    got = {key: (sp.pool_id, sp.offset) for key, sp in geo.placements.items()}
    assert got == expected
    assert [(p.page_bytes, p.sub_pages) for p in geo.pools] == [(s, counts[s]) for s in order]
    for pool in geo.pools:
        offsets = sorted(sp.offset for sp in geo.placements.values() if sp.pool_id == pool.pool_id)
        assert offsets == list(range(pool.sub_pages))


LAYER = st.tuples(st.sampled_from([8, 16, 24]), st.sampled_from([None, "first", "last"]), st.sampled_from([8, 16]),
                  st.booleans())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(layers=st.lists(LAYER, min_size=1, max_size=6), ids=st.permutations(range(6)),
       drafts_bits=st.integers(0, 63))
def test_any_buffer_list_packs_like_a_naive_walk(layers, ids, drafts_bits):
    """Arbitrary layer ids and order, K/V/index-K page sizes that coalesce or split, index-K listed
    before K or after V, any subset of K/V-only layers named draft: placements, pool sizes and the
    draft-hosting verdict against a naive walk; each slot's sub-pages tile it without overlap."""
    buffers, drafts, target_kv_sizes, draft_sizes = [], [], set(), []
    for (kv, index, index_bytes, _), layer in zip(layers, ids):
        if index == "first":
            buffers.append(BufferSpec(layer, "index_k", index_bytes))
        buffers += [BufferSpec(layer, "k", kv), BufferSpec(layer, "v", kv)]
        if index == "last":
            buffers.append(BufferSpec(layer, "index_k", index_bytes))
        if index is None and drafts_bits >> layer & 1:
            drafts.append(layer)
            draft_sizes.append(kv)
        else:
            target_kv_sizes.add(kv)
    sizes, counts, expected = [], [], {}
    for buf in buffers:  # naive: a pool per distinct page size, in first-seen order, filled in list order
        if buf.page_bytes not in sizes:
            sizes.append(buf.page_bytes)
            counts.append(0)
        pool = sizes.index(buf.page_bytes)
        expected[(buf.layer, buf.role)] = (pool, counts[pool])
        counts[pool] += 1
    if any(size not in target_kv_sizes for size in draft_sizes):
        with pytest.raises(DraftLayerPlacementError, match="cannot be hosted"):
            build_pool_geometry(buffers, draft_layer_ids=drafts)
        return
    geo = build_pool_geometry(buffers, draft_layer_ids=drafts)
    assert {key: (sp.pool_id, sp.offset) for key, sp in geo.placements.items()} == expected
    assert [(p.pool_id, p.page_bytes, p.sub_pages) for p in geo.pools] == [
        (i, s, c) for i, (s, c) in enumerate(zip(sizes, counts))]
    assert geo.draft_layer_ids == tuple(drafts)
    assert geo.target_layer_ids == tuple(sorted(set(ids[: len(layers)]) - set(drafts)))
    for pool in geo.pools:  # byte ranges inside one slot: disjoint, inside slot_bytes, page aligned
        spans = sorted((sp.offset * pool.page_bytes, (sp.offset + 1) * pool.page_bytes)
                       for sp in geo.placements.values() if sp.pool_id == pool.pool_id)
        assert spans[0][0] == 0 and spans[-1][1] == pool.slot_bytes
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for layer in ids[: len(layers)]:
        k, v = geo.locate(layer, "k"), geo.locate(layer, "v")
        assert (v.pool_id, v.offset) == (k.pool_id, k.offset + 1)


def _small_buffers(spec):
    """K, V (and index-K last) per (layer, kv bytes, index bytes or None)."""
    buffers = []
    for layer, kv, index in spec:
        buffers += [BufferSpec(layer, "k", kv), BufferSpec(layer, "v", kv)]
        if index is not None:
            buffers.append(BufferSpec(layer, "index_k", index))
    return buffers


SMALL_LAYER = st.tuples(st.sampled_from([8, 16]), st.sampled_from([None, 8, 16]))


def _geometry(spec, ids, draft):
    """Layers listed in order with ids `ids`; the last one a draft layer when `draft` and it can be hosted."""
    last = len(spec) - 1
    hosted = spec[last][1] is None and any(kv == spec[last][0] for kv, _ in spec[:last])
    buffers = _small_buffers([(layer, kv, ix) for layer, (kv, ix) in zip(ids, spec)])
    return build_pool_geometry(buffers, draft_layer_ids=[ids[last]] if draft and hosted else [])


@settings(max_examples=50, deadline=None, derandomize=True)
@given(spec=st.lists(SMALL_LAYER, min_size=2, max_size=4), draft=st.booleans(),
       edit=st.sampled_from(["none", "draft", "reorder", "resize", "drop_index"]), data=st.data())
def test_fingerprints_agree_exactly_when_slot_layouts_do(spec, draft, edit, data):
    """Transfer refuses a payload whose fingerprint differs: two geometries must share it iff their pools,
    every (layer, role) placement and the draft layers are equal (compared field by field here). The
    second geometry is the first after one small edit, so near misses are the common case."""
    if edit == "draft":
        spec = spec[:-1] + [(spec[0][0], None)]  # a hostable last layer: the edit really moves a draft
    ids = list(range(len(spec)))
    other_spec, other_ids, other_draft = list(spec), list(ids), draft
    if edit == "draft":
        other_draft = not draft
    elif edit == "reorder":  # the same layers, listed in another order: other offsets
        i, j = data.draw(st.lists(st.integers(0, len(spec) - 1), min_size=2, max_size=2, unique=True))
        other_ids[i], other_ids[j] = other_ids[j], other_ids[i]
        other_spec[i], other_spec[j] = other_spec[j], other_spec[i]
    elif edit == "resize":
        i = data.draw(st.integers(0, len(spec) - 1))
        other_spec[i] = (24, other_spec[i][1])
    elif edit == "drop_index":
        other_spec = [(kv, None) for kv, _ in spec]
    ga, gb = _geometry(spec, ids, draft), _geometry(other_spec, other_ids, other_draft)
    same = (ga.pools == gb.pools and dict(ga.placements) == dict(gb.placements)
            and ga.draft_layer_ids == gb.draft_layer_ids)
    assert (ga.fingerprint() == gb.fingerprint()) == same


def test_a_negative_pool_id_is_refused_not_read_as_the_last_pool():
    geo = minimax_m3_geometry(6, [3, 4, 5], 4, D, DI, B)  # two pools: K/V, index-K
    assert len(geo.pools) == 2
    assert geo.pool(1).page_bytes == B * DI * 2
    for bad in (-1, -2, 2):
        with pytest.raises(IndexError, match="outside"):
            geo.pool(bad)


def test_a_draft_layer_listed_twice_is_refused():
    buffers = [BufferSpec(0, "k", 8), BufferSpec(0, "v", 8), BufferSpec(1, "k", 8), BufferSpec(1, "v", 8)]
    assert build_pool_geometry(buffers, draft_layer_ids=[1]).draft_layer_ids == (1,)
    with pytest.raises(ValueError, match="duplicate draft layer"):
        build_pool_geometry(buffers, draft_layer_ids=[1, 1])


def test_a_draft_layer_with_an_index_k_page_is_refused():
    """The Eagle3 draft layer is dense: an index-K page on it means the layer list is wrong."""
    buffers = [BufferSpec(0, "k", 8), BufferSpec(0, "v", 8),
               BufferSpec(1, "k", 8), BufferSpec(1, "v", 8), BufferSpec(1, "index_k", 8)]
    build_pool_geometry(buffers)  # fine as a sparse target layer
    with pytest.raises(DraftLayerPlacementError, match="draft layer 1 is dense"):
        build_pool_geometry(buffers, draft_layer_ids=[1])


def test_a_negative_buffer_layer_is_refused():
    """Layer ids start at 0: layer -1 is no layer of the cache, not a wrapped last layer."""
    with pytest.raises(ValueError, match="layer id must be >= 0"):
        BufferSpec(-1, "k", 8)
    assert BufferSpec(0, "k", 8).layer == 0


def test_k_and_v_of_one_layer_in_pools_of_different_page_size_are_refused():
    """K 8 bytes (pool 0, sub-page 0), index-K then V 16 bytes (pool 1, sub-pages 0 and 1): V's
    offset is K's + 1, but in another pool, so "kv offset 1" from K's page would not reach it."""
    buffers = [BufferSpec(0, "k", 8), BufferSpec(0, "index_k", 16), BufferSpec(0, "v", 16)]
    with pytest.raises(ValueError, match="V must directly follow K in the same pool"):
        build_pool_geometry(buffers)


@pytest.mark.parametrize("extra", [[], [BufferSpec(5, "index_k", 8)]])
def test_a_draft_layer_without_k_v_buffers_is_refused_naming_it(extra):
    buffers = [BufferSpec(0, "k", 8), BufferSpec(0, "v", 8), *extra]
    with pytest.raises(DraftLayerPlacementError, match="draft layer 5 has no K/V buffers"):
        build_pool_geometry(buffers, draft_layer_ids=[5])


@pytest.mark.parametrize("buffers", [
    [BufferSpec(0, "k", 8), BufferSpec(0, "v", 8), BufferSpec(1, "index_k", 8)],
    [BufferSpec(1, "index_k", 8)],
])
def test_an_index_k_page_without_its_layers_k_v_is_refused_naming_the_layer(buffers):
    """Index-K is a sparse layer's third page (K, V, index-K). Alone, layer 1 became a target layer
    whose attention-op mapping row the cache never set: [0, 0], layer 0's K page."""
    with pytest.raises(ValueError, match="layer 1 has an index-K buffer but no K/V buffers"):
        build_pool_geometry(buffers)
    sparse = build_pool_geometry([*buffers[:-1], BufferSpec(1, "k", 8), BufferSpec(1, "v", 8), buffers[-1]])
    assert sparse.target_layer_ids == tuple(sorted({b.layer for b in buffers} | {1}))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sparse_layer_ids": [-1]}, ValueError, "sparse_layer_ids must lie in"),  # not silently dropped
        ({"sparse_layer_ids": b"\x01\x02"}, TypeError, "sparse_layer_ids must be an iterable"),  # bytes iterate to ints
        ({"num_draft_layers": -1}, ValueError, "num_draft_layers must be >= 0"),
        ({"num_draft_layers": 1, "draft_num_kv_heads": 0}, ValueError, "draft_num_kv_heads must be > 0"),
        ({"num_draft_layers": 0, "draft_num_kv_heads": 0}, ValueError, "draft_num_kv_heads must be > 0"),
    ],
)
def test_m3_buffer_lists_refuse_out_of_range_arguments_naming_them(kwargs, error, match):
    args = {"sparse_layer_ids": [3], **kwargs}
    with pytest.raises(error, match=match):
        minimax_m3_buffers(4, args.pop("sparse_layer_ids"), 1, D, DI, B, **args)


def test_production_tp1_stores_the_references_68736_elements_a_token():
    """minimax_m3_msa.md §1.3: dense K+V = 2*4*128 = 1024 elements a token, sparse layers 128 more
    (index-K): 60*1024 + 57*128 = 68,736 elements, 134.25 KiB in bf16. At TP1 (4 KV heads) the K/V
    pages (128 KiB) and the index-K pages (32 KiB) split into two pools (§3.1)."""
    geo = minimax_m3_geometry(60, range(3, 60), 4, D, DI, B)
    assert [(p.page_bytes, p.sub_pages) for p in geo.pools] == [(4 * B * D * 2, 120), (B * DI * 2, 57)]
    slot_bytes = sum(p.slot_bytes for p in geo.pools)
    assert slot_bytes == B * 2 * (60 * 1024 + 57 * 128) == B * 2 * 68_736
    assert slot_bytes / B / 1024 == 134.25


@pytest.mark.parametrize("int32", [np.int32, lambda v: torch.tensor(v, dtype=torch.int32)], ids=["numpy", "torch"])
def test_page_sizes_from_int32_scalars_are_the_exact_products_not_wrapped(int32):
    """Sizes may be any integer (numpy, a 0-d torch tensor), but the page products were taken in the
    argument's own int32: 65537 heads x 65536 dims x 1 byte (2**32 + 2**16 bytes) became a 65536-byte
    page, silently, and 65536 x 65536 a 0-byte one refused as a bad page size. Reference: Python ints."""
    heads, head_dim, index_dim = 2**16 + 1, 2**16, 2**16
    buffers = minimax_m3_buffers(1, [0], int32(heads), int32(head_dim), int32(index_dim), int32(1),
                                 num_draft_layers=1, kv_bytes_per_elem=int32(1), index_bytes_per_elem=int32(2))
    kv_page, index_page = heads * 1 * head_dim * 1, 1 * index_dim * 2
    assert [(b.layer, b.role, int(b.page_bytes)) for b in buffers] == [
        (0, "k", kv_page), (0, "v", kv_page), (0, "index_k", index_page), (1, "k", kv_page), (1, "v", kv_page)]
    geo = minimax_m3_geometry(1, [0], int32(heads), int32(head_dim), int32(index_dim), int32(1), num_draft_layers=1,
                              kv_bytes_per_elem=int32(1), index_bytes_per_elem=int32(2))
    assert [(p.page_bytes, p.sub_pages) for p in geo.pools] == [(kv_page, 4), (index_page, 1)]
    assert minimax_m3_buffers(1, [], int32(2**16), int32(2**16), int32(8), int32(1),
                              kv_bytes_per_elem=int32(1))[0].page_bytes == 2**32
