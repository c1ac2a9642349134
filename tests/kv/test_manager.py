"""PagedKVCache: zero-copy views, draft layers addressed through the virtual-pool tables."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.kv import (
    DraftLayerPlacementError,
    OutOfBlocksError,
    PagedKVCache,
    UnknownBufferError,
)

B, D, DI = 4, 8, 8


def _coalesced(num_blocks=6, **kw):
    # 1 KV head: a K page (1*4*8) equals an index-K page (4*8) -> one 13-sub-page mega-slot
    return PagedKVCache.for_minimax_m3(4, [1, 2, 3], 1, D, DI, B, num_blocks,
                                       num_draft_layers=1, dtype=torch.float32, **kw)


def _regions(cache):
    """Every (layer, role) view of the cache."""
    out = {}
    for layer in range(cache.num_target_layers + len(cache.draft_layer_ids)):
        out[(layer, "k")] = cache.k(layer)
        out[(layer, "v")] = cache.v(layer)
        if layer in cache.sparse_layer_ids:
            out[(layer, "index_k")] = cache.index_k(layer)
    return out


def test_layout_and_shapes_of_a_tiny_m3_cache():
    cache = _coalesced()
    assert cache.draft_layer_ids == [4] and cache.num_target_layers == 4
    assert cache.sparse_layer_ids == [1, 2, 3]
    assert [tuple(cache.storage(p.pool_id).shape) for p in cache.geometry.pools] == [(6, 13, 32)]
    assert cache.k(0).shape == (6, 1, B, D) and cache.v(4).shape == (6, 1, B, D)
    assert cache.index_k(2).shape == (6, B, DI)
    assert cache.op_tables.op_pools == [(1, 0)]
    assert cache.op_tables.index_scales.tolist() == [13]
    assert cache.op_tables.pool_mapping[4].tolist() == [1, 0]


def test_views_are_zero_copy_at_the_hand_computed_sub_pages():
    cache = _coalesced()
    storage = cache.storage(0)
    # dense layer 0: K 0, V 1; sparse layer L in 1..3: K, V, index-K from 2 + 3(L-1); draft: 11, 12
    expected = {(0, "k"): 0, (0, "v"): 1, (4, "k"): 11, (4, "v"): 12}
    for layer in (1, 2, 3):
        for i, role in enumerate(("k", "v", "index_k")):
            expected[(layer, role)] = 2 + 3 * (layer - 1) + i
    regions = _regions(cache)
    assert set(regions) == set(expected)
    for key, view in regions.items():
        for slot in range(cache.num_blocks):
            assert view[slot].data_ptr() == storage[slot, expected[key]].data_ptr(), key
    cache.k(4)[3, 0, 2, 5] = 42.0
    assert storage[3, 11].view(1, B, D)[0, 2, 5] == 42.0


def test_draft_layer_view_is_derived_from_the_tables():
    cache = _coalesced()
    good_v = cache.v(4)
    # a wrong kv offset makes V alias K: writing V corrupts K, as it would for an attention op
    cache.op_tables = dataclasses.replace(cache.op_tables,
                                          kv_offsets=torch.zeros(1, dtype=torch.int32))
    assert cache.v(4).data_ptr() == cache.k(4).data_ptr() != good_v.data_ptr()
    # a wrong index scale walks past the storage: refused instead of reading garbage
    cache.op_tables = dataclasses.replace(cache.op_tables,
                                          kv_offsets=torch.ones(1, dtype=torch.int32),
                                          index_scales=torch.tensor([14], dtype=torch.int32))
    with pytest.raises(ValueError, match="does not address whole pages"):
        cache.k(4)
    # a misaligned pool pointer is refused
    pointers = cache.op_tables.pool_pointers.clone()
    pointers[1, 0] += 4
    cache.op_tables = dataclasses.replace(cache.op_tables, pool_pointers=pointers,
                                          index_scales=torch.tensor([13], dtype=torch.int32))
    with pytest.raises(ValueError, match="whole pages"):
        cache.k(4)


def test_tokens_written_through_slots_read_back_like_a_dense_cache():
    """Naive reference: a dense per-request [T, Hkv, D] tensor vs the paged K of every layer."""
    torch.manual_seed(0)
    cache = _coalesced(num_blocks=8)
    lengths = {"a": 7, "b": 5, "c": 9}
    dense = {}
    for rid, n in lengths.items():
        cache.add_request(rid)
        cache.reserve(rid, n)
    for layer in range(5):
        for rid, n in lengths.items():
            k = torch.randn(n, 1, D)
            dense[(layer, rid)] = k
            pages = cache.pages(rid)
            kc = cache.k(layer)
            for t in range(n):
                slot = pages[t // B] * B + t % B
                kc[slot // B, :, slot % B] = k[t]
    for layer in range(5):
        kc = cache.k(layer)
        for rid, n in lengths.items():
            table = cache.block_table([rid])[0]
            got = torch.stack([kc[table[t // B], :, t % B] for t in range(n)])
            assert torch.equal(got, dense[(layer, rid)])


def test_block_offsets_address_the_same_pages_as_the_views():
    cache = PagedKVCache.for_minimax_m3(3, [2], 4, D, DI, B, 5, num_draft_layers=1,
                                        dtype=torch.float32)
    cache.add_request(0)
    cache.reserve(0, 9)
    cache.add_request(1)
    cache.reserve(1, 2)
    offsets = cache.block_offsets([1, 0], width=4)
    assert offsets.shape == (cache.op_tables.num_op_pools, 2, 2, 4)
    tables = cache.op_tables
    for layer in range(4):
        pool, layer_offset = tables.pool_mapping[layer].tolist()
        virtual = tables.virtual_index(pool)
        source = pool if virtual is None else tables.op_pools[virtual][1]
        page_bytes = cache.geometry.pool(source).page_bytes
        for row, rid in enumerate([1, 0]):
            for b, page in enumerate(cache.pages(rid)):
                for role_i, view in enumerate((cache.k(layer), cache.v(layer))):
                    address = int(tables.pool_pointers[pool, 0]) + \
                        (int(offsets[pool, row, role_i, b]) + layer_offset) * page_bytes
                    assert address == view[page].data_ptr()
    assert offsets[:, 0, :, 1:].eq(-1).all()


def test_out_of_blocks_leaves_other_requests_untouched():
    cache = _coalesced(num_blocks=4)
    cache.add_request("a")
    cache.reserve("a", 9)
    cache.k(4)[cache.pages("a")] = 7.0
    cache.add_request("b")
    snapshot = cache.storage(0).clone()
    with pytest.raises(OutOfBlocksError):
        cache.reserve("b", 5)
    assert cache.pages("b") == [] and cache.num_tokens("b") == 0
    assert cache.pages("a") == [0, 1, 2] and cache.num_tokens("a") == 9
    assert cache.num_free_blocks == 1
    assert torch.equal(cache.storage(0), snapshot)
    assert isinstance(OutOfBlocksError("x"), RuntimeError)


def test_request_lifecycle_delegates_to_the_allocator():
    cache = _coalesced(num_blocks=5)
    cache.add_request(3)
    cache.reserve(3, 6)  # prompt
    cache.reserve(3, 6 + 1 + 3)  # verify tokens
    assert cache.block_table([3], width=4).tolist() == [[0, 1, 2, -1]]
    cache.rewind(3, 8)
    assert cache.num_tokens(3) == 8 and cache.block_table([3]).tolist() == [[0, 1]]
    cache.free(3)
    assert cache.num_free_blocks == 5


def test_non_coalesced_geometry_works():
    cache = PagedKVCache.for_minimax_m3(3, [1, 2], 4, D, DI, B, 5, num_draft_layers=1,
                                        dtype=torch.bfloat16)
    assert [tuple(cache.storage(p.pool_id).shape) for p in cache.geometry.pools] == \
        [(5, 8, 4 * B * D), (5, 2, B * DI)]
    assert cache.storage(0).dtype == torch.bfloat16
    assert cache.k(3).shape == (5, 4, B, D)
    assert cache.k(3)[2].data_ptr() == cache.storage(0)[2, 6].data_ptr()
    assert cache.v(3)[4].data_ptr() == cache.storage(0)[4, 7].data_ptr()
    assert cache.index_k(2)[1].data_ptr() == cache.storage(1)[1, 1].data_ptr()


def test_bad_configurations_are_rejected():
    with pytest.raises(DraftLayerPlacementError, match="cannot be hosted"):
        PagedKVCache.for_minimax_m3(4, [1], 1, D, DI, B, 4, num_draft_layers=1,
                                    draft_num_kv_heads=2)
    cache = _coalesced()
    with pytest.raises(UnknownBufferError):
        cache.index_k(0)
    with pytest.raises(ValueError):
        cache.index_k(4)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache.for_minimax_m3(2, [1], 1, D, DI, B, 2, dtype=torch.int32)



@pytest.mark.parametrize("name, value", [("num_blocks", 7.5), ("block_size", 4.5), ("head_dim", 8.9),
                                         ("index_dim", 8.2), ("kv_heads", {0: 1.5})])
def test_a_non_integer_size_is_refused_naming_it_not_truncated(name, value):
    """block_size=4.5 used to build a 4-token cache (its geometry matched 4), num_blocks=7.5 a 7-block one."""
    from m3_eagle_plugin.kv.geometry import minimax_m3_geometry

    geometry = minimax_m3_geometry(1, [0], 1, D, DI, B, kv_bytes_per_elem=4, index_bytes_per_elem=4)
    sizes = dict(block_size=B, num_blocks=8, kv_heads={0: 1}, head_dim=D, index_dim=DI, dtype=torch.float32)
    PagedKVCache(geometry, **sizes)  # the same cache with int sizes is fine
    with pytest.raises(TypeError, match=rf"{name}.* must be an int, got float"):
        PagedKVCache(geometry, **{**sizes, name: value})

def test_kv_heads_as_the_per_layer_list_the_layout_returns_is_refused_naming_the_form():
    """`minimax_m3_cache_layout` returns the heads as a per-layer list; passed on as ``kv_heads`` it failed
    with "'list' object has no attribute 'items'", naming neither the argument nor the form it takes."""
    from m3_eagle_plugin.kv.manager import minimax_m3_cache_layout

    geometry, heads = minimax_m3_cache_layout(2, [1], 1, D, DI, B, num_draft_layers=1, dtype=torch.float32)
    assert heads == [1, 1, 1]
    sizes = dict(block_size=B, num_blocks=2, head_dim=D, index_dim=DI, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"kv_heads must be a mapping \{layer: KV heads\}, got list"):
        PagedKVCache(geometry, kv_heads=heads, **sizes)
    cache = PagedKVCache(geometry, kv_heads=dict(enumerate(heads)), **sizes)  # the form the message names
    assert cache.k(2).shape == (2, 1, B, D)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    num_layers=st.integers(1, 5),
    sparse_bits=st.integers(0, 31),
    heads=st.sampled_from([1, 2]),
    num_drafts=st.integers(1, 2),
    lengths=st.lists(st.integers(1, 13), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_writing_the_draft_layer_never_touches_a_target_region(num_layers, sparse_bits, heads,
                                                               num_drafts, lengths, seed):
    sparse = [i for i in range(num_layers) if sparse_bits >> i & 1]
    cache = PagedKVCache.for_minimax_m3(num_layers, sparse, heads, D, DI, B, 12,
                                        num_draft_layers=num_drafts, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for rid, n in enumerate(lengths):
        cache.add_request(rid)
        cache.reserve(rid, n)
    regions = _regions(cache)
    # a distinct constant per (layer, role), on every page of every request
    for i, view in enumerate(regions.values()):
        for rid in range(len(lengths)):
            view[cache.pages(rid)] = float(i + 1)
    before = {key: view.clone() for key, view in regions.items()}
    for d in cache.draft_layer_ids:
        for rid in range(len(lengths)):
            pages = cache.pages(rid)
            cache.k(d)[pages] = torch.randn(cache.k(d)[pages].shape, generator=gen) + 100 * d
            cache.v(d)[pages] = torch.randn(cache.v(d)[pages].shape, generator=gen) - 100 * d
    for (layer, role), view in regions.items():
        if layer in cache.draft_layer_ids:
            continue
        assert torch.equal(view, before[(layer, role)]), (layer, role)
    # and the draft data really sits at the draft's sub-pages of the real storage
    for d in cache.draft_layer_ids:
        sp = cache.geometry.locate(d, "v")
        direct = cache.storage(sp.pool_id)[:, sp.offset].view(cache.num_blocks, heads, B, D)
        assert torch.equal(direct, cache.v(d))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draft_view_on_cuda_matches_storage():
    cache = _coalesced(device="cuda")
    cache.add_request(0)
    cache.reserve(0, 5)
    cache.v(4)[cache.pages(0)] = 3.0
    assert cache.k(4).device.type == "cuda"
    assert torch.all(cache.storage(0)[cache.pages(0), 12] == 3.0)
    assert torch.all(cache.storage(0)[cache.pages(0), 11] == 0.0)


def test_production_tp4_cache_reproduces_the_worked_example_tables():
    cache = PagedKVCache.for_minimax_m3(60, range(3, 60), 1, 128, 128, 128, 2,
                                        num_draft_layers=1, dtype=torch.bfloat16)
    tables = cache.op_tables
    assert cache.draft_layer_ids == [60]
    assert tables.index_scales.tolist() == [179] and tables.kv_offsets.tolist() == [1]
    assert tables.op_pools == [(1, 0)]
    assert tables.pool_mapping[60].tolist() == [1, 0]
    storage = cache.storage(0)
    assert tables.pool_pointers.tolist() == [[storage.data_ptr(), 0],
                                             [storage[0, 177].data_ptr(), 0]]
    assert cache.k(60)[1].data_ptr() == storage.data_ptr() + (179 + 177) * 128 * 128 * 2
    assert cache.v(60)[1].data_ptr() == storage.data_ptr() + (179 + 178) * 128 * 128 * 2


def naive_packing(num_layers, sparse, num_drafts, kv_page, index_page, draft_page):
    """(pool sizes in first-seen order, sub-page count per pool, {(layer, role): (pool, offset)})."""
    sizes, counts, where = [], [], {}
    for layer in range(num_layers + num_drafts):
        draft = layer >= num_layers
        roles = ("k", "v") if draft or layer not in sparse else ("k", "v", "index_k")
        for role in roles:
            size = draft_page if draft else index_page if role == "index_k" else kv_page
            if size not in sizes:
                sizes.append(size)
                counts.append(0)
            pool = sizes.index(size)
            where[(layer, role)] = (pool, counts[pool])
            counts[pool] += 1
    return sizes, counts, where


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    num_layers=st.integers(1, 5),
    sparse_bits=st.integers(0, 31),
    heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([4, 8]),
    index_dim=st.sampled_from([4, 8, 16]),
    block=st.sampled_from([1, 2, 4]),
    num_drafts=st.integers(0, 2),
    num_blocks=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
)
def test_every_page_sits_at_its_naive_byte_offset_and_pages_tile_each_pool(
        num_layers, sparse_bits, heads, head_dim, index_dim, block, num_drafts, num_blocks, dtype):
    """Byte ranges of every (layer, role, slot) page, read off the views' data pointers, against a
    naive packing: start = (slot * sub_pages + offset) * page_bytes inside its own pool, each range
    one contiguous page, no two overlapping, and together they cover each pool's allocation exactly."""
    sparse = {i for i in range(num_layers) if sparse_bits >> i & 1}
    cache = PagedKVCache.for_minimax_m3(num_layers, sparse, heads, head_dim, index_dim, block, num_blocks,
                                        num_draft_layers=num_drafts, dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    kv_page = heads * block * head_dim * item
    sizes, counts, where = naive_packing(num_layers, sparse, num_drafts, kv_page, block * index_dim * item, kv_page)
    assert [(p.page_bytes, p.sub_pages) for p in cache.geometry.pools] == list(zip(sizes, counts))
    ranges = {pool: [] for pool in range(len(sizes))}
    for (layer, role), (pool, offset) in where.items():
        view = cache.index_k(layer) if role == "index_k" else cache.k(layer) if role == "k" else cache.v(layer)
        base = cache.storage(pool).data_ptr()
        for slot in range(num_blocks):
            page = view[slot]
            start = page.data_ptr() - base
            assert page.is_contiguous() and page.numel() * item == sizes[pool]
            assert start == (slot * counts[pool] + offset) * sizes[pool], (layer, role, slot)
            assert start % item == 0
            ranges[pool].append((start, start + sizes[pool]))
    for pool, spans in ranges.items():
        spans.sort()
        storage = cache.storage(pool)
        assert spans[0][0] == 0 and spans[-1][1] == storage.numel() * item  # inside the allocation
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no overlap, no gap


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    num_layers=st.integers(1, 4),
    sparse_bits=st.integers(0, 15),
    heads=st.sampled_from([1, 2]),
    index_dim=st.sampled_from([4, 8]),
    num_drafts=st.integers(0, 2),
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=3),
    extra_width=st.integers(0, 2),
)
def test_block_offsets_address_every_layers_pages_at_their_naive_bytes(num_layers, sparse_bits, heads, index_dim,
                                                                       num_drafts, lengths, extra_width):
    """What an attention op computes from `block_offsets` + op tables (pointer + (offset + layer offset) x
    page bytes) for every K/V page of every layer, drafts included, against the naive packing's byte
    address of (request page, layer, role) in the real storage; unused entries -1 in every op pool."""
    sparse = {i for i in range(num_layers) if sparse_bits >> i & 1}
    cache = PagedKVCache.for_minimax_m3(num_layers, sparse, heads, D, index_dim, B, 12,
                                        num_draft_layers=num_drafts, dtype=torch.float32)
    kv_page = heads * B * D * 4
    sizes, counts, where = naive_packing(num_layers, sparse, num_drafts, kv_page, B * index_dim * 4, kv_page)
    rids = list(range(len(lengths)))
    for rid, n in zip(rids, lengths):
        cache.add_request(rid)
        cache.reserve(rid, n)
    width = max([len(cache.pages(r)) for r in rids] + [1]) + extra_width
    offsets = cache.block_offsets(rids[::-1], width=width)  # rows in another order than the requests
    tables = cache.op_tables
    assert offsets.shape == (tables.num_op_pools, len(rids), 2, width) and offsets.dtype == torch.int32
    for layer in range(num_layers + num_drafts):
        op_pool, layer_offset = tables.pool_mapping[layer].tolist()
        for row, rid in enumerate(rids[::-1]):
            pages = cache.pages(rid)
            for role_i, role in enumerate(("k", "v")):
                pool, sub_page = where[(layer, role)]
                for b in range(width):
                    got = int(offsets[op_pool, row, role_i, b])
                    if b >= len(pages):
                        assert got == -1, (layer, role, rid, b)
                        continue
                    address = int(tables.pool_pointers[op_pool].reshape(-1)[0]) + (got + layer_offset) * sizes[pool]
                    naive = cache.storage(pool).data_ptr() + (pages[b] * counts[pool] + sub_page) * sizes[pool]
                    assert address == naive, (layer, role, rid, b)


def test_num_layers_counts_target_and_draft_layers():
    assert _coalesced().num_layers == 4 + 1
    assert PagedKVCache.for_minimax_m3(3, [1], 1, D, DI, B, 2, dtype=torch.float32).num_layers == 3


def test_a_v_page_one_past_the_storage_is_refused_naming_the_tables():
    """The draft's V is the last sub-page of the mega-slot (12 of 13). A kv offset of 2 puts the V
    page of the last block exactly at the storage end: refused by the bounds check, not by torch."""
    cache = _coalesced()
    assert cache.geometry.locate(4, "v").offset == cache.geometry.pool(0).sub_pages - 1
    cache.op_tables = dataclasses.replace(cache.op_tables, kv_offsets=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="does not address whole pages"):
        cache.v(4)


def test_a_virtual_pool_fed_from_a_pool_of_another_page_size_is_refused_naming_the_heads():
    # split geometry: pool 0 holds 4-head K/V pages (4*B*D), pool 1 the index-K pages (B*16)
    cache = PagedKVCache.for_minimax_m3(3, [1, 2], 4, D, 16, B, 5, num_draft_layers=1,
                                        dtype=torch.float32)
    assert [p.page_bytes for p in cache.geometry.pools] == [4 * B * D * 4, B * 16 * 4]
    op_pool, source = cache.op_tables.op_pools[0]
    assert source == 0
    cache.op_tables.op_pools[0] = (op_pool, 1)
    with pytest.raises(ValueError, match="4 heads do not fill"):
        cache.k(3)


def test_a_page_size_that_is_not_whole_elements_is_refused_naming_that():
    from m3_eagle_plugin.kv import BufferSpec, build_pool_geometry

    geometry = build_pool_geometry([BufferSpec(0, "k", 6), BufferSpec(0, "v", 6)])
    with pytest.raises(ValueError, match="not a whole number of torch.float32 elements"):
        PagedKVCache(geometry, block_size=1, num_blocks=2, kv_heads={0: 1}, head_dim=1, index_dim=1,
                     dtype=torch.float32)


@pytest.mark.parametrize("view", ["k", "v"])
@pytest.mark.parametrize("layer", [2.7, 4.0, True])
def test_a_non_integer_layer_is_refused_not_read_as_another_layer(view, layer):
    """k(2.7) returned layer 2's pages and v(True) layer 1's (index_k already refused them)."""
    cache = _coalesced()
    with pytest.raises(TypeError, match="layer must be an int"):
        getattr(cache, view)(layer)


@pytest.mark.parametrize("pool_id", [-1, 1])
def test_a_pool_id_outside_the_geometry_is_refused_naming_it(pool_id):
    """storage(-1) returned the last pool's storage; storage(1) of a one-pool cache was a bare IndexError."""
    cache = _coalesced()
    with pytest.raises(IndexError, match=rf"pool {pool_id} is outside \[0, 1\)"):
        cache.storage(pool_id)


@pytest.mark.parametrize("heads", [2.5, "2"])
def test_a_non_integer_draft_head_count_is_refused_not_truncated(heads):
    """draft_num_kv_heads=2.5 built a cache with 2-head draft pages."""
    with pytest.raises(TypeError, match="draft_num_kv_heads must be an int"):
        PagedKVCache.for_minimax_m3(4, [1], 2, D, DI, B, 6, num_draft_layers=1, draft_num_kv_heads=heads,
                                    dtype=torch.float32)


@pytest.mark.parametrize("name, value, named", [("head_dim", -D, "head_dim"), ("kv_heads", {0: -1}, r"kv_heads\[0\]"),
                                                 ("block_size", 0, "block_size"), ("index_dim", 0, "index_dim")])
def test_a_size_below_one_is_refused_naming_it(name, value, named):
    """The page-size check compares products: -1 head x -D dims passed it and built negative-stride views."""
    from m3_eagle_plugin.kv.geometry import minimax_m3_geometry

    geometry = minimax_m3_geometry(1, [0], 1, D, DI, B, kv_bytes_per_elem=4, index_bytes_per_elem=4)
    sizes = dict(block_size=B, num_blocks=8, kv_heads={0: 1}, head_dim=D, index_dim=DI, dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"{named} must be >= 1"):
        PagedKVCache(geometry, **{**sizes, name: value})
    if name == "kv_heads":  # both factors of the page size negative: the product check alone took it
        with pytest.raises(ValueError, match="head_dim must be >= 1"):
            PagedKVCache(geometry, **{**sizes, "kv_heads": {0: -1}, "head_dim": -D})


def test_the_draft_view_adds_the_mappings_layer_offset_in_k_v_page_pairs_as_the_attention_op_does():
    """TensorRT-LLM's attention op roots a layer at ``pool_pointers[pool] + layer_idx_in_cache_pool *
    kv_factor * bytes_per_block`` (kv_factor 2: a layer offset counts K+V page pairs; thop
    attentionOp.cpp, ``intra_pool_offset``), then adds the block offsets' K / V page indices. A table
    whose pointer is two pages lower and whose layer offset is 1 addresses the same pages; the
    view once counted the offset in single pages, so such a table read one page below the op's."""
    cache = _coalesced()
    page_bytes = cache.geometry.pool(0).page_bytes
    assert page_bytes == 1 * B * D * 4
    pointers = cache.op_tables.pool_pointers.clone()
    mapping = cache.op_tables.pool_mapping.clone()
    pointers[1, 0] -= 2 * page_bytes
    mapping[4, 1] = 1
    cache.op_tables = dataclasses.replace(cache.op_tables, pool_pointers=pointers, pool_mapping=mapping)
    storage = cache.storage(0)
    for slot in range(cache.num_blocks):
        assert cache.k(4)[slot].data_ptr() == storage[slot, 11].data_ptr()
        assert cache.v(4)[slot].data_ptr() == storage[slot, 12].data_ptr()


def test_kv_heads_without_an_entry_for_a_layer_is_refused_naming_it():
    from m3_eagle_plugin.kv import minimax_m3_geometry

    geometry = minimax_m3_geometry(2, [1], 1, D, DI, B)  # bf16 pages
    with pytest.raises(ValueError, match="kv_heads has no entry for layer 1"):
        PagedKVCache(geometry, block_size=B, num_blocks=2, kv_heads={0: 1}, head_dim=D, index_dim=DI)


def test_op_tables_have_the_hosts_dtypes():
    """The host's pool mapping is int32 [layers, 2] (reference/trtllm_host_api.md), pointers int64."""
    tables = _coalesced().op_tables
    assert tables.pool_mapping.dtype == torch.int32 and tables.pool_pointers.dtype == torch.int64
    assert tables.index_scales.dtype == torch.int32 and tables.kv_offsets.dtype == torch.int32
    assert tables.pool_mapping.tolist() == [[0, 0], [0, 2], [0, 5], [0, 8], [1, 0]]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    num_layers=st.integers(1, 5),
    sparse_bits=st.integers(0, 31),
    heads=st.sampled_from([1, 2, 4]),
    draft_heads=st.sampled_from([None, 1, 2, 4]),
    index_dim=st.sampled_from([4, 8, 16, 32]),
    num_drafts=st.integers(0, 2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
)
def test_cache_layout_is_the_naive_packing_at_the_dtypes_bytes(num_layers, sparse_bits, heads, draft_heads,
                                                                index_dim, num_drafts, dtype):
    """`minimax_m3_cache_layout` (what the reference host sizes its memory by before reading weights):
    pools in first-seen page-size order at the dtype's bytes, the naive sub-page of every (layer, role),
    KV heads per layer with the drafts' own count appended; a draft page no target K/V pool holds (the
    draft layer reads the target pool's block offsets) is refused, whatever page it does match."""
    from m3_eagle_plugin.kv.manager import minimax_m3_cache_layout

    sparse = {i for i in range(num_layers) if sparse_bits >> i & 1}
    item = {torch.float32: 4, torch.bfloat16: 2, torch.float8_e4m3fn: 1}[dtype]
    kv_page, index_page = heads * B * D * item, B * index_dim * item
    draft_page = (heads if draft_heads is None else draft_heads) * B * D * item
    args = (num_layers, sorted(sparse), heads, D, index_dim, B)
    kwargs = dict(num_draft_layers=num_drafts, draft_num_kv_heads=draft_heads, dtype=dtype)
    if num_drafts and draft_page != kv_page:
        with pytest.raises(DraftLayerPlacementError, match=f"shared draft layer {num_layers} cannot be hosted"):
            minimax_m3_cache_layout(*args, **kwargs)
        return
    geometry, layer_heads = minimax_m3_cache_layout(*args, **kwargs)
    sizes, counts, where = naive_packing(num_layers, sparse, num_drafts, kv_page, index_page, draft_page)
    assert [(p.page_bytes, p.sub_pages) for p in geometry.pools] == list(zip(sizes, counts))
    assert {key: (sp.pool_id, sp.offset) for key, sp in geometry.placements.items()} == where
    assert geometry.draft_layer_ids == tuple(range(num_layers, num_layers + num_drafts))
    assert layer_heads == [heads] * num_layers + [heads if draft_heads is None else draft_heads] * num_drafts


def test_a_layer_id_the_cache_skips_maps_to_no_pool_not_to_another_layers_page():
    """Layers 1, 2 and draft 4 (ids 0 and 3 skipped, as on a later pipeline rank): the skipped ids'
    mapping rows were [0, 0], pool 0 at offset 0, layer 1's K page, so an op reading layer 0 through
    the tables read layer 1's memory. Hand-computed: one pool, sub-pages K1 V1 K2 V2 K4 V4, draft in op pool 1."""
    from m3_eagle_plugin.kv import BufferSpec, build_pool_geometry

    page = 1 * B * D * 4
    geometry = build_pool_geometry([BufferSpec(layer, role, page) for layer in (1, 2, 4) for role in ("k", "v")],
                                   draft_layer_ids=[4])
    cache = PagedKVCache(geometry, block_size=B, num_blocks=3, kv_heads={1: 1, 2: 1, 4: 1}, head_dim=D,
                         index_dim=DI, dtype=torch.float32)
    tables = cache.op_tables
    assert tables.pool_mapping.tolist() == [[-1, -1], [0, 0], [0, 2], [-1, -1], [1, 0]]
    for layer in (0, 3):
        with pytest.raises(UnknownBufferError, match=f"layer {layer}"):
            cache.k(layer)
    storage = cache.storage(0)
    for slot in range(cache.num_blocks):  # the draft layer is still addressed through its virtual pool
        assert cache.k(4)[slot].data_ptr() == storage[slot, 4].data_ptr()
        assert cache.v(4)[slot].data_ptr() == storage[slot, 5].data_ptr()
