"""Tests for msa.cache_write: scatter of K/V/index-K into strided paged caches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.msa import MsaInputError, write_index_k, write_kv

from ._paged import PooledCache


def naive_write(cache_k, cache_v, cache_i, slots, k, v, ik, block):
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        page, off = divmod(slot, block)
        cache_k[page, :, off] = k[t]
        cache_v[page, :, off] = v[t]
        cache_i[page, off] = ik[t]


def test_writes_land_in_pool_storage_and_skip_negative_slots() -> None:
    cache = PooledCache(num_pages=3, block_size=4, kv_heads=2, head_dim=3, index_dim=5)
    before = cache.pool.clone()
    k, v, ik = torch.randn(3, 2, 3), torch.randn(3, 2, 3), torch.randn(3, 5)
    slots = torch.tensor([9, -1, 2], dtype=torch.int32)
    write_kv(cache.k, cache.v, slots, k, v)
    write_index_k(cache.index_k, slots, ik)
    assert torch.equal(cache.k[2, :, 1], k[0]) and torch.equal(cache.v[0, :, 2], v[2])
    assert torch.equal(cache.index_k[2, 1], ik[0]) and torch.equal(cache.index_k[0, 2], ik[2])
    changed = ~(cache.pool.isnan() & before.isnan()) & (cache.pool != before)
    assert int(changed.sum()) == 2 * (2 * 2 * 3) + 2 * 5  # nothing but the two kept tokens


def test_all_skipped_leaves_cache_untouched() -> None:
    cache = PooledCache(num_pages=2, block_size=2, kv_heads=1, head_dim=2, index_dim=2)
    cache.pool.normal_()
    before = cache.pool.clone()
    slots = torch.tensor([-1, -5])
    write_kv(cache.k, cache.v, slots, torch.zeros(2, 1, 2), torch.zeros(2, 1, 2))
    write_index_k(cache.index_k, slots, torch.zeros(2, 2))
    assert torch.equal(cache.pool, before)


def test_values_are_cast_to_cache_dtype() -> None:
    k_cache = torch.zeros(2, 1, 2, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(1, 1, 4)
    write_kv(k_cache, v_cache, torch.tensor([3]), k, k)
    assert torch.equal(k_cache[1, 0, 1], k[0, 0].to(torch.bfloat16))


def test_shape_errors_name_the_argument() -> None:
    k_cache = torch.zeros(2, 1, 2, 4)
    with pytest.raises(MsaInputError, match="k and v"):
        write_kv(k_cache, k_cache.clone(), torch.tensor([0]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(MsaInputError, match="slots"):
        write_kv(k_cache, k_cache.clone(), torch.tensor([0, 1]), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(TypeError, match="slots"):
        write_index_k(torch.zeros(2, 2, 4), torch.tensor([0.0]), torch.zeros(1, 4))
    with pytest.raises(MsaInputError, match="ik"):
        write_index_k(torch.zeros(2, 2, 4), torch.tensor([0]), torch.zeros(1, 3))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    num_pages=st.integers(1, 5),
    log_block=st.integers(0, 3),
    data=st.data(),
)
def test_matches_naive_scatter(num_pages: int, log_block: int, data) -> None:
    block = 1 << log_block
    capacity = num_pages * block
    slots = data.draw(
        st.lists(st.integers(-3, capacity - 1), max_size=capacity + 2).filter(
            lambda s: len({x for x in s if x >= 0}) == len([x for x in s if x >= 0])
        )
    )
    cache = PooledCache(num_pages, block, kv_heads=2, head_dim=3, index_dim=4)
    cache.pool.normal_()
    expected = PooledCache(num_pages, block, kv_heads=2, head_dim=3, index_dim=4)
    expected.pool.copy_(cache.pool)
    gen = torch.Generator().manual_seed(len(slots))
    k, v = torch.randn(len(slots), 2, 3, generator=gen), torch.randn(len(slots), 2, 3, generator=gen)
    ik = torch.randn(len(slots), 4, generator=gen)
    write_kv(cache.k, cache.v, torch.tensor(slots, dtype=torch.int64), k, v)
    write_index_k(cache.index_k, torch.tensor(slots, dtype=torch.int32), ik)
    naive_write(expected.k, expected.v, expected.index_k, slots, k, v, ik, block)
    assert torch.equal(cache.pool, expected.pool)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_writers_are_capturable_in_a_cuda_graph() -> None:
    k_cache = torch.zeros(4, 2, 4, 8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    ik_cache = torch.zeros(4, 4, 8, device="cuda")
    slots = torch.tensor([5, -1, 6], device="cuda")
    k = torch.randn(3, 2, 8, device="cuda")
    ik = torch.randn(3, 8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        write_kv(k_cache, v_cache, slots, k, k)  # warm-up
        write_index_k(ik_cache, slots, ik)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            write_kv(k_cache, v_cache, slots, k, k)
            write_index_k(ik_cache, slots, ik)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    k_cache.zero_()
    ik_cache.zero_()
    slots.copy_(torch.tensor([-1, 9, -1]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k_cache[2, :, 1], k[1]) and torch.equal(ik_cache[2, 1], ik[1])
    assert int((k_cache != 0).sum()) == 2 * 8


@pytest.mark.parametrize("slots", [[0, 12], [12, 0], [5, -1, 30]])
def test_a_slot_past_the_cache_writes_nothing(slots) -> None:
    """3 pages of 4 slots hold slots 0..11, so 12 is one past the end: the call fails before
    writing any token, the in-range ones included, in the K, the V and the index-K cache alike."""
    cache = PooledCache(num_pages=3, block_size=4, kv_heads=2, head_dim=3, index_dim=5)
    cache.pool.normal_()
    before = cache.pool.clone()
    n = len(slots)
    with pytest.raises(MsaInputError, match="past the cache"):
        write_kv(cache.k, cache.v, torch.tensor(slots), torch.randn(n, 2, 3), torch.randn(n, 2, 3))
    with pytest.raises(MsaInputError, match="past the cache"):
        write_index_k(cache.index_k, torch.tensor(slots), torch.randn(n, 5))
    assert torch.equal(cache.pool, before)


def test_skipped_tokens_need_no_page_of_an_empty_cache() -> None:
    """Every token skipped (padding rows) into a cache of 0 pages writes nothing: the skipped-token
    redirect to slot 0 read a page that does not exist (IndexError). A real slot is still refused."""
    k_cache, ik_cache = torch.zeros(0, 2, 4, 3), torch.zeros(0, 4, 5)
    write_kv(k_cache, k_cache.clone(), torch.tensor([-1, -1]), torch.randn(2, 2, 3), torch.randn(2, 2, 3))
    write_index_k(ik_cache, torch.tensor([-1, -1]), torch.randn(2, 5))
    with pytest.raises(MsaInputError, match="past the cache"):
        write_index_k(ik_cache, torch.tensor([-1, 0]), torch.randn(2, 5))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_round_trips_through_the_attention_references(dtype) -> None:
    """fp8 K/V pages (scale 1: the writers only cast, a dequantisation scale is the kernels' read
    side) written by a mixed step with skipped rows, read by the CPU attention references: each
    token equals float64 attention over its keys rounded through the cache dtype, and skipped rows
    leave their slots as they were."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata, dense_attention, sparse_attention

    from ._paged import naive_attention

    block, heads_kv, dim, pages = 4, 2, 8, 6
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(pages, heads_kv, block, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    meta = MsaDecodeMetadata(2, 32, 3, block, "cpu", max_draft_len=3, num_pages=pages)
    table = torch.tensor([[4, 0, 2], [5, 1, -1]], dtype=torch.int32)
    kv = [11, 6]
    keys = [torch.randn(n, heads_kv, dim, generator=gen) * 3 for n in kv]
    values = [torch.randn(n, heads_kv, dim, generator=gen) * 3 for n in kv]
    meta.prepare(kv, kv, table)
    slots = meta.cache_slots.clone()
    slots[3] = -1  # request 0's token 3 is skipped: its slot keeps the zeros
    write_kv(k_cache, v_cache, slots, torch.cat(keys), torch.cat(values))
    assert not k_cache[4, :, 3].float().any()
    keys[0][3], values[0][3] = 0.0, 0.0
    meta.prepare([3, 1], kv, table)  # a verify chunk of request 0, a decode row of request 1
    q = torch.randn(4, heads_kv * 2, dim, generator=gen)
    sel = torch.tensor([[0, 2, -1]] * 3 + [[1, -1, -1]], dtype=torch.int32)[None].expand(heads_kv, -1, -1)
    sparse = sparse_attention(q, k_cache, v_cache, meta, sel.contiguous(), scale=0.3)
    dense = dense_attention(q, k_cache, v_cache, meta, scale=0.3)
    rounded = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in zip(keys, values)]
    for t, (r, p) in enumerate([(0, 8), (0, 9), (0, 10), (1, 5)]):
        blocks = sel[0, t].tolist()
        allowed = [j for j in range(p + 1) if j // block in blocks]
        exp = naive_attention(q[t], *rounded[r], [allowed] * heads_kv, 0.3)
        torch.testing.assert_close(sparse[t].double(), exp, atol=1e-5, rtol=1e-5)
        exp = naive_attention(q[t], *rounded[r], [list(range(p + 1))] * heads_kv, 0.3)
        torch.testing.assert_close(dense[t].double(), exp, atol=1e-5, rtol=1e-5)


def test_bool_slots_are_refused_and_write_nothing() -> None:
    # A bool mask passed for slots would read as slots 0 / 1 and overwrite those tokens.
    cache = PooledCache(num_pages=2, block_size=2, kv_heads=1, head_dim=2, index_dim=2)
    cache.pool.normal_()
    before = cache.pool.clone()
    slots = torch.tensor([True, False])
    with pytest.raises(TypeError, match="slots must be an integer tensor"):
        write_kv(cache.k, cache.v, slots, torch.zeros(2, 1, 2), torch.zeros(2, 1, 2))
    with pytest.raises(TypeError, match="slots must be an integer tensor"):
        write_index_k(cache.index_k, slots, torch.zeros(2, 2))
    assert torch.equal(cache.pool, before)


def test_complex_slots_are_refused_and_write_nothing() -> None:
    # A complex slot 1 + 5j was cast to slot 1 (the imaginary part dropped) and written.
    cache = PooledCache(num_pages=2, block_size=2, kv_heads=1, head_dim=2, index_dim=2)
    cache.pool.normal_()
    before = cache.pool.clone()
    slots = torch.tensor([1 + 5j, -1 + 0j])
    with pytest.raises(TypeError, match="slots must be an integer tensor, got torch.complex64"):
        write_kv(cache.k, cache.v, slots, torch.zeros(2, 1, 2), torch.zeros(2, 1, 2))
    with pytest.raises(TypeError, match="slots must be an integer tensor, got torch.complex64"):
        write_index_k(cache.index_k, slots, torch.zeros(2, 2))
    assert torch.equal(cache.pool, before)


def test_a_uint64_slot_past_int64_is_refused_not_skipped() -> None:
    """uint64 slot 2**63 cast to int64 is -2**63, a "do not write": the token was dropped without a word
    (and slot 1 beside it written). Refused before any write; uint64 slots inside int64 write as int64 ones."""
    cache = PooledCache(num_pages=3, block_size=4, kv_heads=2, head_dim=3, index_dim=5)
    cache.pool.normal_()
    before = cache.pool.clone()
    k, v, ik = torch.randn(2, 2, 3), torch.randn(2, 2, 3), torch.randn(2, 5)
    big = torch.tensor([1, 2**63], dtype=torch.uint64)
    with pytest.raises(MsaInputError, match=f"slots has an entry past int64: {2**63}"):
        write_kv(cache.k, cache.v, big, k, v)
    with pytest.raises(MsaInputError, match=f"slots has an entry past int64: {2**63}"):
        write_index_k(cache.index_k, big, ik)
    assert torch.equal(cache.pool, before)
    expected = PooledCache(num_pages=3, block_size=4, kv_heads=2, head_dim=3, index_dim=5)
    expected.pool.copy_(before)
    write_kv(cache.k, cache.v, torch.tensor([1, 9], dtype=torch.uint64), k, v)
    write_index_k(cache.index_k, torch.tensor([1, 9], dtype=torch.uint64), ik)
    write_kv(expected.k, expected.v, torch.tensor([1, 9]), k, v)
    write_index_k(expected.index_k, torch.tensor([1, 9]), ik)
    assert torch.equal(cache.pool, expected.pool) and not torch.equal(cache.pool, before)


def test_a_v_of_another_shape_than_k_is_refused_not_broadcast_and_writes_nothing() -> None:
    # one V row beside three K rows broadcast to all three tokens: V of tokens 1 and 2 silently became token 0's
    k_cache = torch.zeros(2, 1, 4, 2)
    v_cache = k_cache.clone()
    k, v = torch.arange(6.0).view(3, 1, 2), torch.full((1, 1, 2), 9.0)
    with pytest.raises(MsaInputError, match=r"k and v must both be \[T, Hkv=1, D=2\], got \(3, 1, 2\) and \(1, 1, 2\)"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1, 2]), k, v)
    assert not k_cache.any() and not v_cache.any()


def test_an_argument_that_is_not_a_tensor_is_named_and_nothing_is_written() -> None:
    """A list (slots as a caller might hand-write them) is refused by name, not an AttributeError on `.dim`."""
    cache = PooledCache(2, 4, kv_heads=1, head_dim=8, index_dim=8)
    before = cache.pool.clone()
    slots, k, ik = torch.tensor([1, 5]), torch.ones(2, 1, 8), torch.ones(2, 8)
    for args, name in (((cache.k, cache.v, [1, 5], k, k), "slots"), ((cache.k, cache.v, slots, k.tolist(), k), "k"),
                       ((cache.k, cache.v, slots, k, k.tolist()), "v"),
                       ((cache.k.tolist(), cache.v, slots, k, k), "k_cache")):
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            write_kv(*args)
    for args, name in (((cache.index_k, [1, 5], ik), "slots"), ((cache.index_k, slots, ik.tolist()), "ik"),
                       ((cache.index_k.tolist(), slots, ik), "index_k_cache")):
        with pytest.raises(TypeError, match=f"{name} must be a tensor, got list"):
            write_index_k(*args)
    assert torch.equal(cache.pool.isnan(), before.isnan())
