"""Virtual attention-op pools: the host's worked example, NVFP4 pairs, and the block-offset copy."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.kv import (
    VirtualPools,
    copy_block_offsets,
    copy_pool_block_offsets,
    extend_attention_op_pools,
)

DRAFT_LAYER = 60
SCALE = 179  # 3 dense x 2 + 57 sparse x 3 + 1 draft x 2
DRAFT_K_ADDR = 0x7000_0000
TARGET_ADDR = 0x6000_0000


def _worked_example_inputs():
    pointers = torch.tensor([[TARGET_ADDR, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, i] for i in range(61)], dtype=torch.int32)
    return pointers, mapping


def test_worked_example_virtual_pool_is_rooted_at_the_draft_k_page():
    pointers, mapping = _worked_example_inputs()
    pools = extend_attention_op_pools(pointers, mapping, [(DRAFT_LAYER, DRAFT_K_ADDR, SCALE)])
    assert isinstance(pools, VirtualPools)
    assert pools.pool_pointers.tolist() == [[TARGET_ADDR, 0], [DRAFT_K_ADDR, 0]]
    assert pools.pool_pointers.dtype == torch.int64
    assert pools.pool_mapping[DRAFT_LAYER].tolist() == [1, 0]
    assert pools.pool_mapping[:DRAFT_LAYER].tolist() == [[0, i] for i in range(60)]
    assert pools.pool_mapping.dtype == torch.int32
    assert pools.index_scales.tolist() == [SCALE]
    assert pools.kv_offsets.tolist() == [1]
    assert pools.op_pools == [(1, 0)]
    assert (pools.num_pools, pools.num_op_pools) == (1, 2)


def test_inputs_are_never_mutated_and_results_do_not_alias_them():
    pointers, mapping = _worked_example_inputs()
    before = (pointers.clone(), mapping.clone())
    pools = extend_attention_op_pools(pointers, mapping, [(DRAFT_LAYER, DRAFT_K_ADDR, SCALE)])
    assert torch.equal(pointers, before[0]) and torch.equal(mapping, before[1])
    pools.pool_mapping[0, 1] = 99
    pools.pool_pointers[0, 0] = 1
    assert torch.equal(pointers, before[0]) and torch.equal(mapping, before[1])


def test_nvfp4_pointer_tensors_keep_data_scale_pairs():
    pointers = torch.tensor([[[TARGET_ADDR, 0x6100_0000], [0, 0]]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0]], dtype=torch.int32)
    pools = extend_attention_op_pools(pointers, mapping, [(0, DRAFT_K_ADDR, SCALE)])
    assert pools.pool_pointers.shape == (2, 2, 2)
    assert pools.pool_pointers[0].tolist() == [[TARGET_ADDR, 0x6100_0000], [0, 0]]
    assert pools.pool_pointers[1].tolist() == [[DRAFT_K_ADDR, 0], [0, 0]]


def test_no_draft_layers_leaves_the_tables_alone():
    pointers = torch.tensor([[TARGET_ADDR, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 3]], dtype=torch.int32)
    pools = extend_attention_op_pools(pointers, mapping, [])
    assert pools.pool_pointers.tolist() == pointers.tolist()
    assert pools.pool_mapping.tolist() == mapping.tolist()
    assert pools.index_scales.numel() == 0 and pools.kv_offsets.numel() == 0
    assert pools.op_pools == []


def test_two_draft_layers_in_two_source_pools():
    pointers = torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [1, 0], [0, 2], [1, 2]], dtype=torch.int32)
    pools = extend_attention_op_pools(pointers, mapping, [(2, 0x1100, 4), (3, 0x2200, 6)])
    assert pools.pool_pointers[2:].tolist() == [[0x1100, 0], [0x2200, 0]]
    assert pools.pool_mapping.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]
    assert pools.op_pools == [(2, 0), (3, 1)]
    assert pools.index_scales.tolist() == [4, 6] and pools.kv_offsets.tolist() == [1, 1]


@pytest.mark.parametrize(
    "draft_layers, match",
    [
        ([(61, DRAFT_K_ADDR, SCALE)], "outside"),
        ([(60, DRAFT_K_ADDR, SCALE), (60, DRAFT_K_ADDR, SCALE)], "twice"),
        ([(60, DRAFT_K_ADDR, 1)], "K and V"),
        ([(60, 0, SCALE)], "address"),
        ([(60, DRAFT_K_ADDR)], "entries"),
    ],
)
def test_bad_draft_layers_are_rejected(draft_layers, match):
    pointers, mapping = _worked_example_inputs()
    with pytest.raises(ValueError, match=match):
        extend_attention_op_pools(pointers, mapping, draft_layers)


def test_bad_tables_are_rejected():
    with pytest.raises(ValueError, match="pool_pointers"):
        extend_attention_op_pools(torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 2), [])
    with pytest.raises(ValueError, match="pool_mapping"):
        extend_attention_op_pools(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(2), [])
    with pytest.raises(TypeError):
        extend_attention_op_pools([[1, 0]], torch.zeros(1, 2), [])


def test_pool_block_offset_copy_reference_values():
    host = torch.full((3, 2, 4), -1, dtype=torch.int32)
    host[0, :, :2] = torch.tensor([5, 7], dtype=torch.int32)
    host[2, :, :3] = torch.tensor([0, 1, 9], dtype=torch.int32)
    dst = torch.full((2, 2, 4), -7, dtype=torch.int32)
    copy_pool_block_offsets(dst, host, torch.tensor([2, 0]), SCALE, 1)
    assert dst[0].tolist() == [[0, 179, 1611, -1], [1, 180, 1612, -1]]
    assert dst[1].tolist() == [[895, 1253, -1, -1], [896, 1254, -1, -1]]
    dst2 = torch.full((1, 2, 4), -7, dtype=torch.int32)
    copy_pool_block_offsets(dst2, host, torch.tensor([2]), 3, 1, max_blocks=2)
    assert dst2[0].tolist() == [[0, 3, -7, -7], [1, 4, -7, -7]]


def test_block_offset_copy_runs_the_base_copy_first_then_one_per_op_pool():
    calls = []

    def recording_copy(dst, host, copy_index, scale, kv_offset, max_blocks):
        calls.append((dst.data_ptr(), host.data_ptr(), copy_index, scale, kv_offset, max_blocks))

    pointers = torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [1, 0], [1, 3]], dtype=torch.int32)
    pools = extend_attention_op_pools(pointers, mapping, [(2, 0x2300, 5)])
    host = torch.zeros((2, 4, 2, 8), dtype=torch.int32)
    dst = torch.zeros((3, 4, 2, 8), dtype=torch.int32)
    idx = torch.tensor([2, 0])
    copy_block_offsets(dst, host, idx, pools, base_index_scales=[7, 5], base_kv_offsets=[1, 1],
                       max_blocks=6, copy_fn=recording_copy)
    assert calls == [
        (dst[0].data_ptr(), host[0].data_ptr(), idx, 7, 1, 6),
        (dst[1].data_ptr(), host[1].data_ptr(), idx, 5, 1, 6),
        # the virtual pool, fed from its source pool 1
        (dst[2].data_ptr(), host[1].data_ptr(), idx, 5, 1, 6),
    ]


def test_block_offset_copy_is_untouched_without_draft_layers():
    calls = []
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0]]),
                                      torch.zeros(2, 2, dtype=torch.int32), [])
    table = torch.zeros(1, 1, 2, 4, dtype=torch.int32)
    copy_block_offsets(table.clone(), table,
                       torch.tensor([0]), pools, base_index_scales=[2], base_kv_offsets=[1],
                       copy_fn=lambda *a: calls.append(a))
    assert len(calls) == 1


def test_block_offset_copy_checks_table_shapes():
    pointers, mapping = _worked_example_inputs()
    pools = extend_attention_op_pools(pointers, mapping, [(DRAFT_LAYER, DRAFT_K_ADDR, SCALE)])
    host = torch.zeros((1, 2, 2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="pool rows"):
        copy_block_offsets(torch.zeros((1, 2, 2, 4), dtype=torch.int32), host, torch.tensor([0]),
                           pools,
                           base_index_scales=[SCALE], base_kv_offsets=[1])
    with pytest.raises(ValueError, match="host table"):
        copy_block_offsets(torch.zeros((2, 2, 2, 4), dtype=torch.int32), host.repeat(2, 1, 1, 1),
                           torch.tensor([0]), pools, base_index_scales=[SCALE], base_kv_offsets=[1])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    layer_sub_pages=st.lists(st.sampled_from([2, 3]), min_size=1, max_size=8),
    draft_sub_pages=st.integers(1, 3),
    page_bytes=st.sampled_from([64, 256, 4096]),
    slots=st.lists(st.integers(0, 50), min_size=1, max_size=6),
)
def test_virtual_pool_addresses_equal_real_pool_addresses(layer_sub_pages, draft_sub_pages,
                                                          page_bytes, slots):
    """Independent model: a slot is `sub_pages` consecutive pages; a layer's K is at its offset."""
    offsets, cursor = [], 0
    for n in layer_sub_pages:
        offsets.append(cursor)
        cursor += n
    draft = len(layer_sub_pages)
    offsets.append(cursor)
    sub_pages = cursor + 2 + draft_sub_pages - 1  # the draft's K, V and trailing padding pages
    base = 0x10_0000
    pointers = torch.tensor([[base, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, o] for o in offsets], dtype=torch.int32)
    k_addr = base + offsets[draft] * page_bytes
    pools = extend_attention_op_pools(pointers, mapping, [(draft, k_addr, sub_pages)])

    host = torch.full((1, 1, 2, len(slots) + 1), -1, dtype=torch.int32)
    host[0, 0, :, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    dst = torch.full((2, 1, 2, len(slots) + 1), -1, dtype=torch.int32)
    copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[sub_pages],
                       base_kv_offsets=[1])
    op_pool, layer_offset = pools.pool_mapping[draft].tolist()
    ptr = int(pools.pool_pointers[op_pool, 0])
    for b, slot in enumerate(slots):
        for kv in (0, 1):
            real = base + (slot * sub_pages + offsets[draft] + kv) * page_bytes
            virtual = ptr + (int(dst[op_pool, 0, kv, b]) + layer_offset) * page_bytes
            assert virtual == real
            # target layers keep addressing the storage pool unchanged
            for layer in range(draft):
                t_pool, t_off = pools.pool_mapping[layer].tolist()
                assert t_pool == 0
                assert base + (int(dst[0, 0, kv, b]) + t_off) * page_bytes == \
                    base + (slot * sub_pages + offsets[layer] + kv) * page_bytes
    assert dst[:, 0, :, len(slots)].eq(-1).all()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    host_rows=st.integers(1, 4),
    host_width=st.integers(1, 6),
    dst_rows_extra=st.integers(0, 2),
    dst_width=st.integers(1, 6),
    scale=st.integers(1, 200),
    kv_offset=st.integers(0, 3),
    max_blocks=st.one_of(st.none(), st.integers(0, 7)),
    data=st.data(),
)
def test_pool_block_offset_copy_matches_a_naive_loop(host_rows, host_width, dst_rows_extra, dst_width, scale,
                                                     kv_offset, max_blocks, data):
    """Any host rows (unused entries anywhere, V field junk), a copy index with repeats in any order,
    dst narrower or wider than host, max_blocks: entry by entry against a Python loop, and every
    dst entry outside the copied rows x width keeps its old value."""
    slots = data.draw(st.lists(st.integers(-3, 40), min_size=host_rows * host_width,
                               max_size=host_rows * host_width))
    host = torch.tensor(slots, dtype=torch.int32).view(host_rows, 1, host_width).repeat(1, 2, 1)
    host[:, 1] = 12345  # the V field of the host table is never read
    index = data.draw(st.lists(st.integers(0, host_rows - 1), min_size=0, max_size=host_rows + 1))
    dst = torch.full((len(index) + dst_rows_extra, 2, dst_width), -7, dtype=torch.int32)
    copy_pool_block_offsets(dst, host, torch.tensor(index, dtype=torch.int64), scale, kv_offset, max_blocks)
    width = min(host_width, dst_width, host_width if max_blocks is None else max_blocks)
    for i in range(dst.shape[0]):
        for b in range(dst_width):
            if i < len(index) and b < width:
                slot = int(host[index[i], 0, b])
                k = slot * scale if slot >= 0 else -1
                v = k + kv_offset if slot >= 0 else -1
            else:
                k = v = -7
            assert dst[i, :, b].tolist() == [k, v], (i, b)


def test_a_page_index_one_past_int32_is_refused_not_wrapped():
    """Slot 2**30 at scale 2 is page 2**31: one past int32's max, it would wrap to -2**31 in dst."""
    host = torch.tensor([[[1 << 30], [1 << 30]]], dtype=torch.int64)
    dst = torch.full((1, 2, 1), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit"):
        copy_pool_block_offsets(dst, host, torch.tensor([0]), 2, 0)
    assert dst.eq(-7).all()
    # one page lower (2**31 - 1) fits exactly
    host = torch.tensor([[[(1 << 31) - 1], [0]]], dtype=torch.int64)
    copy_pool_block_offsets(dst, host, torch.tensor([0]), 1, 0)
    assert dst[0, :, 0].tolist() == [(1 << 31) - 1, (1 << 31) - 1]


def test_a_draft_layer_mapped_past_the_storage_pools_is_refused():
    """With ``num_pools=2`` of 3 pointer rows, row 2 is an op pool already, not storage a virtual
    pool could be fed from."""
    pointers = torch.tensor([[0x1000, 0], [0x2000, 0], [0x3000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [2, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a storage pool"):
        extend_attention_op_pools(pointers, mapping, [(1, 0x3000, 4)], num_pools=2)
    mapping[1, 0] = 1
    pools = extend_attention_op_pools(pointers, mapping, [(1, 0x2000, 4)], num_pools=2)
    assert pools.op_pools == [(2, 1)]


def test_a_layer_left_on_a_dropped_op_pool_is_refused_not_readdressed():
    """``num_pools=2`` of 3 pointer rows drops row 2 (an earlier op pool at 0x3000); layer 1 still
    mapped to it would address the new draft pool that takes id 2 (layer 2's K at 0x2400)."""
    pointers = torch.tensor([[0x1000, 0], [0x2000, 0], [0x3000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [2, 0], [1, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="layer 1 maps to op pool 2, which num_pools=2 drops"):
        extend_attention_op_pools(pointers, mapping, [(2, 0x2400, 6)], num_pools=2)
    mapping[1, 0] = 1
    pools = extend_attention_op_pools(pointers, mapping, [(2, 0x2400, 6)], num_pools=2)
    assert pools.pool_mapping.tolist() == [[0, 0], [1, 0], [2, 0]]


def test_a_layer_mapped_past_the_pointer_rows_is_refused_not_aliased_to_a_draft_pool():
    """One pointer row (pool 0 at 0x1000) and layer 1 mapped to pool 1, which has no row: the draft
    layer 2 (K at 0x2000) gets op pool id 1, so layer 1 came back addressing the draft's pages."""
    pointers = torch.tensor([[0x1000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [1, 0], [0, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="layer 1 maps to pool 1, but pool_pointers has 1 rows"):
        extend_attention_op_pools(pointers, mapping, [(2, 0x2000, 4)])
    assert mapping.tolist() == [[0, 0], [1, 0], [0, 2]]
    mapping[1, 0] = 0
    pools = extend_attention_op_pools(pointers, mapping, [(2, 0x2000, 4)])
    assert pools.pool_mapping.tolist() == [[0, 0], [0, 0], [1, 0]]


@pytest.mark.parametrize("case", ["virtual pool", "last storage pool"])
def test_a_refused_copy_leaves_every_pool_of_dst_as_it_was(case):
    """Slot 2**12 gives page 2**13 in pool 0 (fits int32), but in the refusing pool K = 2**12 * 2**20
    = 2**32 (virtual pool) or 2**12 * 2**21 = 2**33 (storage pool 1), and V one more: neither fits.
    The copy is refused before it writes pool 0, so dst keeps its sentinel -7 everywhere."""
    if case == "virtual pool":
        pointers = torch.tensor([[0x1000, 0]], dtype=torch.int64)
        mapping = torch.tensor([[0, 0], [0, 2]], dtype=torch.int32)
        pools = extend_attention_op_pools(pointers, mapping, [(1, 0x2000, 1 << 20)])
        scales, refused_v = [2], (1 << 32) + 1
    else:
        pointers = torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64)
        mapping = torch.tensor([[0, 0], [1, 0]], dtype=torch.int32)
        pools = extend_attention_op_pools(pointers, mapping, [])
        scales, refused_v = [2, 1 << 21], (1 << 33) + 1
    host = torch.tensor([[[1 << 12, -1], [1 << 12, -1]]], dtype=torch.int64).repeat(pools.num_pools, 1, 1, 1)
    dst = torch.full((pools.num_op_pools, 1, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"page index {refused_v} does not fit dst's torch.int32"):
        copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=scales,
                           base_kv_offsets=[1] * len(scales))
    assert torch.equal(dst, torch.full_like(dst, -7))


def test_the_default_copy_keeps_max_blocks_in_every_pool():
    """Storage pool 0 at scale 3 and a virtual pool at scale 4 (both kv offset 1), host slots [2, 5, -1]:
    with max_blocks=1 only column 0 is written, K = 2 * scale and V = K + 1; the rest keeps -7."""
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0]], dtype=torch.int64),
                                      torch.tensor([[0, 0], [0, 2]], dtype=torch.int32), [(1, 0x2000, 4)])
    host = torch.tensor([[[[2, 5, -1], [2, 5, -1]]]], dtype=torch.int32)
    dst = torch.full((2, 1, 2, 3), -7, dtype=torch.int32)
    copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[3], base_kv_offsets=[1], max_blocks=1)
    assert dst[0, 0].tolist() == [[6, -7, -7], [7, -7, -7]]
    assert dst[1, 0].tolist() == [[8, -7, -7], [9, -7, -7]]


def _overflowing_virtual_pool():
    """Storage pool 0 at scale 2 fits int32 (page 2**13); the virtual pool at scale 2**20 gives page 2**32."""
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0]], dtype=torch.int64),
                                      torch.tensor([[0, 0], [0, 2]], dtype=torch.int32), [(1, 0x2000, 1 << 20)])
    host = torch.tensor([[[[1 << 12, -1], [1 << 12, -1]]]], dtype=torch.int64)
    return pools, host


@pytest.mark.parametrize("case, error, match", [
    ("virtual pool page too large", ValueError, r"page index 4294967297 does not fit dst's torch.int32"),
    ("negative copy index", IndexError, r"copy_index entries must lie in \[0, 1\)"),
    ("negative base kv offset", ValueError, "kv_offset >= 0"),
    ("float copy index", TypeError, "copy_index must be an integer tensor"),
])
def test_a_replaced_copy_fn_sees_no_call_when_any_pool_would_be_refused(case, error, match):
    """The checks run for every pool before the first copy, whatever copy_fn is: a refusal in the
    last (virtual) pool leaves pool 0 unwritten too, and the replacement is never called."""
    pools, host = _overflowing_virtual_pool()
    scale, kv_offsets, index = 2, [1], torch.tensor([0])
    if case == "virtual pool page too large":
        pass
    elif case == "negative copy index":
        host = host.clone()
        host[..., 0] = 1  # pages fit: only the index is wrong
        index = torch.tensor([-1])
    elif case == "negative base kv offset":
        host = torch.tensor([[[[1, -1], [1, -1]]]], dtype=torch.int64)
        kv_offsets = [-1]
    else:
        index = torch.tensor([0.0])
    calls = []

    def recording_copy(dst, host_offsets, copy_index, scale, kv_offset, max_blocks):
        calls.append(scale)
        dst.fill_(40 + len(calls))

    dst = torch.full((2, 1, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(error, match=match):
        copy_block_offsets(dst, host, index, pools, base_index_scales=[scale], base_kv_offsets=kv_offsets,
                           copy_fn=recording_copy)
    assert calls == []
    assert torch.equal(dst, torch.full_like(dst, -7))


def test_a_replaced_copy_fn_gets_every_pool_once_the_checks_pass_and_its_own_failure_is_not_undone():
    """Checked inputs go to the replacement pool by pool; when it fails on its own for the second
    pool (a launch error, not a refusal) the first stays written."""
    pools, host = _overflowing_virtual_pool()
    host = host.clone()
    host[..., 0] = 3  # virtual pool page 3 * 2**20 + 1 fits int32
    calls = []

    def marking_copy(dst, host_offsets, copy_index, scale, kv_offset, max_blocks):
        calls.append(scale)
        if fail_on == len(calls):
            raise RuntimeError("kernel launch failed")
        dst[0, 0, 0] = 40 + len(calls)

    fail_on = None
    dst = torch.full((2, 1, 2, 2), -7, dtype=torch.int32)
    copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[2], base_kv_offsets=[1],
                       copy_fn=marking_copy)
    assert calls == [2, 1 << 20]
    assert dst.flatten().tolist() == [41, -7, -7, -7, 42, -7, -7, -7]

    calls.clear()
    fail_on = 2
    dst = torch.full((2, 1, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[2], base_kv_offsets=[1],
                           copy_fn=marking_copy)
    assert dst.flatten().tolist() == [41, -7, -7, -7, -7, -7, -7, -7]  # pool 1 never written


def test_a_page_index_past_int64_is_refused_not_wrapped():
    """Slot 2**30 at scale 2**34 is page 2**64: computed in int64 it wrapped to page 0 in an int64 dst."""
    host = torch.tensor([[[1 << 30], [0]]], dtype=torch.int64)
    dst = torch.full((1, 2, 1), -7, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"page index {1 << 64} does not fit dst's torch.int64"):
        copy_pool_block_offsets(dst, host, torch.tensor([0]), 1 << 34, 0)
    assert dst.eq(-7).all()
    copy_pool_block_offsets(dst, host, torch.tensor([0]), 1 << 32, 0)  # page 2**62 fits
    assert dst[0, :, 0].tolist() == [1 << 62, 1 << 62]


def test_an_unsigned_dst_is_refused_it_cannot_hold_the_unused_minus_one():
    """uint8 stored an unused entry's -1 as 255, a page index like any other."""
    host = torch.tensor([[[2, -1], [0, 0]]], dtype=torch.int32)
    dst = torch.full((1, 2, 2), 7, dtype=torch.uint8)
    with pytest.raises(TypeError, match="dst must be a signed integer tensor, got torch.uint8"):
        copy_pool_block_offsets(dst, host, torch.tensor([0]), 3, 1)
    assert dst.eq(7).all()


def test_a_copy_index_one_past_the_host_rows_is_refused_naming_the_range():
    """Row 2 of a 2-row host table is past its end: refused by name, as row -1 is."""
    host = torch.tensor([[[3, -1], [0, 0]], [[5, -1], [0, 0]]], dtype=torch.int32)
    dst = torch.full((1, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(IndexError, match=r"copy_index entries must lie in \[0, 2\), got \[2\]"):
        copy_pool_block_offsets(dst, host, torch.tensor([2]), 3, 1)
    assert dst.eq(-7).all()
    copy_pool_block_offsets(dst, host, torch.tensor([1]), 3, 1)  # the last row is in range
    assert dst[0].tolist() == [[15, -1], [16, -1]]


def test_tables_of_the_wrong_rank_are_refused_naming_the_layout():
    """One pool's tables are [rows, 2, blocks], the stacked ones [pools, rows, 2, blocks]: another
    rank is a ValueError naming that layout, not an index error from reading a missing dim."""
    host3 = torch.zeros((1, 2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must be \[rows, 2, blocks\]"):
        copy_pool_block_offsets(torch.zeros((2, 4), dtype=torch.int32), host3, torch.tensor([0]), 3, 1)
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0]], dtype=torch.int64),
                                      torch.zeros(2, 2, dtype=torch.int32), [])
    with pytest.raises(ValueError, match=r"must be \[pools, rows, 2, blocks\]"):
        copy_block_offsets(torch.zeros((1, 2, 4), dtype=torch.int32), host3, torch.tensor([0]), pools,
                           base_index_scales=[3], base_kv_offsets=[1])


@pytest.mark.parametrize("host_dtype, dst_dtype, error", [
    (torch.float32, torch.int32, "host_offsets must be an integer tensor, got torch.float32"),
    (torch.int32, torch.uint8, "dst must be a signed integer tensor, got torch.uint8"),
])
def test_the_stacked_copy_checks_each_pools_table_dtypes(host_dtype, dst_dtype, error):
    """copy_block_offsets refuses what copy_pool_block_offsets refuses of one pool's tables (a float
    slot, an unsigned dst), with the default copy, before any pool is written."""
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0]], dtype=torch.int64),
                                      torch.tensor([[0, 0], [0, 2]], dtype=torch.int32), [(1, 0x2000, 4)])
    host = torch.tensor([[[[2, -1], [0, 0]]]], dtype=host_dtype)
    dst = torch.full((2, 1, 2, 2), 7, dtype=dst_dtype)
    with pytest.raises(TypeError, match=error):
        copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[2], base_kv_offsets=[1])
    assert dst.eq(7).all()


def test_virtual_index_is_each_virtual_pools_position_and_none_for_storage_pools():
    pointers = torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [1, 0], [0, 2], [1, 2]], dtype=torch.int32)
    pools = extend_attention_op_pools(pointers, mapping, [(2, 0x1100, 4), (3, 0x2200, 6)])
    assert [pools.virtual_index(p) for p in range(4)] == [None, None, 0, 1]
    assert pools.num_pools == 2 and pools.num_op_pools == 4


@pytest.mark.parametrize("mapping_rows", [0, 1])
def test_zero_storage_pools_is_refused(mapping_rows):
    pointers = torch.tensor([[0x1000, 0]], dtype=torch.int64)
    mapping = torch.zeros(mapping_rows, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_pools=0 does not match"):
        extend_attention_op_pools(pointers, mapping, [], num_pools=0)


@pytest.mark.parametrize("rows, num_pools, message", [
    (0, None, r"^pool_pointers has no rows: there is no storage pool to extend$"),  # was "num_pools=None ..."
    (2, 3, r"^num_pools=3 does not match 2 pointer rows: the storage pools among them are 1 to 2$"),
])
def test_pointer_rows_and_num_pools_are_refused_naming_the_one_at_fault(rows, num_pools, message):
    pointers = torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64)[:rows]
    mapping = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        extend_attention_op_pools(pointers, mapping, [], num_pools=num_pools)
    if rows:  # fewer storage pools than rows are taken: "does not match" is not "must equal"
        assert extend_attention_op_pools(pointers, mapping, [], num_pools=1).num_pools == 1


def test_the_new_tables_are_int32_whatever_the_count():
    pointers, mapping = _worked_example_inputs()
    for drafts in ([], [(DRAFT_LAYER, DRAFT_K_ADDR, SCALE)]):
        pools = extend_attention_op_pools(pointers, mapping, drafts)
        assert pools.index_scales.dtype == torch.int32 and pools.kv_offsets.dtype == torch.int32
        assert pools.pool_pointers.dtype == torch.int64 and pools.pool_mapping.dtype == torch.int32


def test_re_extending_replaces_the_earlier_virtual_rows():
    """Extending the already extended pointers again with num_pools=1: the old virtual row is
    dropped and the new pool takes its id (row 1) with the new address; no third row appears."""
    pointers = torch.tensor([[TARGET_ADDR, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [0, 2]], dtype=torch.int32)
    first = extend_attention_op_pools(pointers, mapping, [(1, TARGET_ADDR + 0x200, 4)])
    assert first.pool_pointers.tolist() == [[TARGET_ADDR, 0], [TARGET_ADDR + 0x200, 0]]
    again = extend_attention_op_pools(first.pool_pointers, mapping, [(1, TARGET_ADDR + 0x300, 6)],
                                      num_pools=1)
    assert again.pool_pointers.tolist() == [[TARGET_ADDR, 0], [TARGET_ADDR + 0x300, 0]]
    assert again.pool_mapping.tolist() == [[0, 0], [1, 0]]
    assert again.op_pools == [(1, 0)] and again.index_scales.tolist() == [6]
    assert again.num_pools == 1


def test_more_rows_to_copy_than_dst_holds_is_refused_before_any_write():
    host = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]], dtype=torch.int32).expand(3, 2, 2).contiguous()
    dst = torch.full((2, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match="3 rows to copy but dst holds 2"):
        copy_pool_block_offsets(dst, host, torch.tensor([0, 1, 2]), 2, 1)
    assert dst.eq(-7).all()

    calls = []
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0]]), torch.tensor([[0, 0], [0, 2]]), [(1, 0x1200, 4)])
    stacked_dst = torch.full((2, 2, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match="3 rows to copy but dst holds 2"):
        copy_block_offsets(stacked_dst, host.unsqueeze(0), torch.tensor([0, 1, 2]), pools,
                           base_index_scales=[4], base_kv_offsets=[1], copy_fn=lambda *a: calls.append(a))
    assert calls == [] and stacked_dst.eq(-7).all()


def test_an_index_scale_of_zero_is_refused_it_would_put_every_slot_on_page_zero():
    host = torch.tensor([[[3, 5], [3, 5]]], dtype=torch.int32)
    dst = torch.full((1, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match="index_scale must be >= 1"):
        copy_pool_block_offsets(dst, host, torch.tensor([0]), 0, 1)
    assert dst.eq(-7).all()
    copy_pool_block_offsets(dst, host, torch.tensor([0]), 1, 1)  # scale 1 is the smallest allowed
    assert dst[0].tolist() == [[3, 5], [4, 6]]


def test_a_replaced_copy_fn_gets_each_pools_own_kv_offset():
    calls = []
    pointers = torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64)
    mapping = torch.tensor([[0, 0], [1, 0], [1, 3]], dtype=torch.int32)
    pools = extend_attention_op_pools(pointers, mapping, [(2, 0x2300, 5)])
    host = torch.zeros((2, 1, 2, 3), dtype=torch.int32)
    dst = torch.zeros((3, 1, 2, 3), dtype=torch.int32)
    copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[7, 5],
                       base_kv_offsets=[0, 2], copy_fn=lambda d, h, i, s, kv, m: calls.append((s, kv, m)))
    assert calls == [(7, 0, None), (5, 2, None), (5, 1, None)]  # the virtual pool: its own kv offset 1


def test_a_non_contiguous_nvfp4_pointer_table_extends_like_its_contiguous_copy():
    """Same values, another memory layout (a [pools, 2, 2] table built transposed): the new row
    came from zeros_like, which kept the transposed strides, and view(-1) refused it."""
    pointers = torch.tensor([[[TARGET_ADDR, 0x6100_0000], [0, 0]]], dtype=torch.int64)
    strided = pointers.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous() and strided.tolist() == pointers.tolist()
    mapping = torch.tensor([[0, 0], [0, 2]], dtype=torch.int32)
    pools = extend_attention_op_pools(strided, mapping, [(1, DRAFT_K_ADDR, SCALE)])
    assert pools.pool_pointers.tolist() == [[[TARGET_ADDR, 0x6100_0000], [0, 0]], [[DRAFT_K_ADDR, 0], [0, 0]]]
    assert pools.pool_mapping.tolist() == [[0, 0], [1, 0]]


@pytest.mark.parametrize("scales, offsets", [([3, 1 << 64], [1, 1]), ([3, 2], [1, 1 << 64])])
def test_a_scale_or_offset_past_int64_is_refused_before_any_pool_is_written(scales, offsets):
    """Every slot unused, so no page is computed, yet the int64 write of pool 1 raised a bare OverflowError
    after pool 0 was written. At int64's last value the copy runs: unused entries are -1 in both fields,
    slot 0 gets K = 0 and V = kv_offset, as in Python ints."""
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64),
                                      torch.tensor([[0, 0], [1, 0]], dtype=torch.int32), [])
    host = torch.full((2, 1, 2, 2), -1, dtype=torch.int64)
    dst = torch.full((2, 1, 2, 2), -7, dtype=torch.int64)
    with pytest.raises(ValueError, match="index_scale and kv_offset must fit int64"):
        copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=scales, base_kv_offsets=offsets)
    assert dst.eq(-7).all()
    last = (1 << 63) - 1
    host[:, 0, :, 0] = 0
    copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[3, last], base_kv_offsets=[last, 1])
    assert dst[:, 0].tolist() == [[[0 * 3, -1], [0 * 3 + last, -1]], [[0 * last, -1], [0 * last + 1, -1]]]


def test_the_default_copy_feeds_a_virtual_pool_from_its_source_pools_host_row():
    """Two storage pools whose host rows differ (pool 0 slots [1, 2], pool 1 slots [4, -1]); draft layer 2
    sits in pool 1 at 5 sub-pages a slot, so its virtual pool is pool 1's slots x 5 (V one more, -1
    unused), computed here by hand; pool 0's slots would give [5, 10]."""
    pools = extend_attention_op_pools(torch.tensor([[0x1000, 0], [0x2000, 0]], dtype=torch.int64),
                                      torch.tensor([[0, 0], [1, 0], [1, 3]], dtype=torch.int32), [(2, 0x2300, 5)])
    host = torch.tensor([[[[1, 2], [1, 2]]], [[[4, -1], [4, -1]]]], dtype=torch.int32)
    dst = torch.full((3, 1, 2, 2), -7, dtype=torch.int32)
    copy_block_offsets(dst, host, torch.tensor([0]), pools, base_index_scales=[7, 5], base_kv_offsets=[1, 1])
    assert dst[:, 0].tolist() == [
        [[7, 14], [8, 15]],  # storage pool 0: its slots x 7
        [[20, -1], [21, -1]],  # storage pool 1: its slots x 5
        [[20, -1], [21, -1]],  # the virtual pool, from its source pool 1
    ]


def test_a_negative_max_blocks_is_refused_and_dst_is_left_as_it_was():
    """max_blocks counts columns: -1 as a slice end silently dropped the last column instead."""
    host = torch.tensor([[[2, 3], [2, 3]]], dtype=torch.int32)
    dst = torch.full((1, 2, 2), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_blocks must be >= 0, got -1"):
        copy_pool_block_offsets(dst, host, torch.tensor([0]), 3, 1, max_blocks=-1)
    assert dst.eq(-7).all()
