"""The plugin's M3 KV manager on the host double: the per-step block-offset copy into the virtual
draft pools (against offsets written out from the slot ids and the mega-slot's sub-page count),
and the setup paths of pipeline ranks, SWA scratch reuse and older V2 storage."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import _activate, _deactivate
from .fakehost import CURRENT
from .test_cache_manager import _classes, _kv_module, _make, _spec


def sub_pages_per_slot(num_target: int, num_draft: int) -> int:
    """Mega-slot sub-pages: K, V (+ index-K on sparse layers 3..num_target-1); draft layers K, V."""
    return sum(3 if 3 <= layer < num_target else 2 for layer in range(num_target)) + 2 * num_draft


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_pool_gets_each_scheduled_requests_offsets(fake_host_dirs, data):
    """Random requests (slot lists), a random scheduled subset in random order: every attention-op
    pool (the target's and each draft layer's virtual one) gets, per batch row, K = slot x
    sub-pages-per-slot and V = K + 1, -1 past the request's slots; rows past the batch stay."""
    num_target = data.draw(st.integers(1, 8))
    num_draft = data.draw(st.integers(1, 2))
    num_requests = data.draw(st.integers(1, 4))
    slots = {rid: data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=5, unique=True))
             for rid in range(10, 10 + num_requests)}
    batch = data.draw(st.permutations(list(slots)))[: data.draw(st.integers(1, num_requests))]
    root = fake_host_dirs[CURRENT]
    _activate(root)
    try:
        plugin, _ = _classes()
        manager = _make(plugin, num_layers=num_target, tokens_per_block=16, max_seq_len=128,
                        spec_config=_spec(num_draft))
        for rid, ids in slots.items():
            manager.add_sequence(rid, ids)
        width = manager.max_blocks_per_seq
        dst = torch.full((1 + num_draft, 4, 2, width), -9, dtype=torch.int32)
        manager.copy_batch_block_offsets(dst, batch, 1, 0, len(batch))
        scale = sub_pages_per_slot(num_target, num_draft)
        for pool in range(1 + num_draft):
            for row, rid in enumerate(batch):
                k = [s * scale for s in slots[rid]] + [-1] * (width - len(slots[rid]))
                v = [s * scale + 1 for s in slots[rid]] + [-1] * (width - len(slots[rid]))
                assert dst[pool, row, 0].tolist() == k, (pool, row)
                assert dst[pool, row, 1].tolist() == v, (pool, row)
            assert dst[pool, len(batch):].eq(-9).all()
    finally:
        _deactivate(root)


_UNSET = object()


def test_max_blocks_reaches_the_host_copy_only_when_given(current_host, monkeypatch):
    """A host M3 manager whose copy takes `max_blocks` gets it when the caller gives one, and a call
    without it (older base signatures) passes none; the draft pool is fed either way."""
    plugin, host_cls = _classes()
    seen = []
    base_copy = host_cls.__mro__[1].copy_batch_block_offsets

    def host_copy(self, dst, request_ids, beam_width, num_contexts, num_seqs, max_blocks=_UNSET):
        seen.append(max_blocks)
        base_copy(self, dst, request_ids, beam_width, num_contexts, num_seqs)

    monkeypatch.setattr(host_cls, "copy_batch_block_offsets", host_copy, raising=False)
    manager = _make(plugin)
    manager.add_sequence(3, [4, 1])
    for kw in ({"max_blocks": 2}, {}):
        dst = torch.full((2, 1, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
        manager.copy_batch_block_offsets(dst, [3], 1, 0, 1, **kw)
        assert dst[1, 0, 0, :2].tolist() == [4 * 179, 179]  # 179 sub-pages a slot (60 target + 1 draft)
    assert seen == [2, _UNSET]


def _with_layer_offsets(monkeypatch, host_cls, offsets):
    """Make the base manager report `offsets` (global -> local layer) after building its tables, as
    a pipeline rank's manager does."""
    base = host_cls.__mro__[1]
    original = base._prepare_page_table_tensor

    def tables(self, index_mapper_capacity):
        original(self, index_mapper_capacity)
        self.layer_offsets = offsets

    monkeypatch.setattr(base, "_prepare_page_table_tensor", tables)


def test_a_pipeline_rank_without_the_draft_tail_adds_no_pool(current_host, monkeypatch):
    plugin, host_cls = _classes()
    _with_layer_offsets(monkeypatch, host_cls, {layer: layer for layer in range(30)})  # layers 0-29 only
    manager, reference = _make(plugin), _make(host_cls)
    assert manager.virtual_pools is None and manager.trtllm_gen_extra_tokens_per_block == frozenset()
    assert torch.equal(manager.kv_cache_pool_pointers, reference.kv_cache_pool_pointers)


def test_a_pipeline_rank_roots_the_draft_pool_at_its_local_layer(current_host, monkeypatch):
    """Global draft layer 60 is local layer 30 on a rank owning layers 30-60: its pool is rooted at
    the K page of the storage's layer 30 (30 sub-page runs in: 3 dense x 2 + 27 sparse x 3)."""
    plugin, host_cls = _classes()
    kv_module = _kv_module()
    _with_layer_offsets(monkeypatch, host_cls, {30 + i: i for i in range(31)})
    manager = _make(plugin)
    assert manager.kv_cache_pool_pointers[1].tolist() == [kv_module.POOL_BASE_ADDRESS + (3 * 2 + 27 * 3)
                                                          * kv_module.PAGE_BYTES, 0]


def test_swa_scratch_reuse_with_draft_layers_is_refused(current_host, monkeypatch):
    plugin, host_cls = _classes()
    base = host_cls.__mro__[1]
    monkeypatch.setattr(base, "enable_swa_scratch_reuse", True, raising=False)
    with pytest.raises(NotImplementedError, match="SWA scratch reuse"):
        _make(plugin)
    assert _make(plugin, spec_config=None).virtual_pools is None  # no draft layers: nothing to refuse


@pytest.mark.parametrize("per_layer_flag", [False, True], ids=["v2-swa-tables", "per-layer-page-tables"])
def test_swa_scratch_reuse_is_refused_with_the_hosts_per_layer_swa_tables(current_host, monkeypatch,
                                                                         per_layer_flag):
    """Under SWA scratch reuse the real V2 base builds one PER_LAYER pointer per local layer (layer i ->
    [i, 0]; more rows than pools), and a later host also sets `_use_per_layer_page_tables`. Either
    must still be refused, as upstream's test_per_layer_page_tables_get_no_virtual_pools expects; it
    passed for a host's own draft pools and the manager was built with nothing refused."""
    plugin, host_cls = _classes()
    base = host_cls.__mro__[1]
    original = base._prepare_page_table_tensor

    def swa_tables(self, index_mapper_capacity):
        original(self, index_mapper_capacity)
        layers = self.num_local_layers
        self.kv_cache_pool_pointers = torch.tensor([[1 << 32, 0]] * layers, dtype=torch.int64)
        self.kv_cache_pool_mapping = torch.tensor([[i, 0] for i in range(layers)], dtype=torch.int32)
        self.num_attention_op_pools = layers
        if per_layer_flag:
            self._use_per_layer_page_tables = True

    monkeypatch.setattr(base, "_prepare_page_table_tensor", swa_tables)
    monkeypatch.setattr(base, "enable_swa_scratch_reuse", True, raising=False)
    with pytest.raises(NotImplementedError, match="SWA scratch reuse"):
        _make(plugin)


def test_older_v2_storage_without_page_index_modes(current_host, monkeypatch):
    """Storage whose base address takes (layer, role) only, in a host that binds no PageIndexMode:
    the draft pool is rooted at the same K page (177 sub-pages in, as in the current storage)."""
    plugin, _ = _classes()
    kv_module = _kv_module()
    storage = type(_make(plugin, spec_config=None).impl)

    def two_arguments(self, layer, role):
        sub_page = self.offsets[layer] + (role == kv_module.Role.VALUE)
        return kv_module.POOL_BASE_ADDRESS + sub_page * kv_module.PAGE_BYTES

    monkeypatch.delattr(kv_module, "PageIndexMode")
    monkeypatch.setattr(storage, "get_mem_pool_base_address", two_arguments)
    manager = _make(plugin)
    assert manager.kv_cache_pool_pointers[1].tolist() == [kv_module.POOL_BASE_ADDRESS + 177 * kv_module.PAGE_BYTES, 0]


def test_draft_pool_root_is_the_default_shared_address_not_the_per_layer_base(current_host):
    """The host's two-argument call (index_mode None, as its own `_kv_slot_geometry` makes it)
    means SHARED: the layer's K page in slot 0. The virtual pool's offsets carry no layer offset,
    so that is its root; PER_LAYER (the pool-group base) would root it at the first layer's pages."""
    plugin, _ = _classes()
    kv_module = _kv_module()
    manager = _make(plugin)
    default = manager.impl.get_mem_pool_base_address(60, kv_module.Role.KEY)
    shared = manager.impl.get_mem_pool_base_address(60, kv_module.Role.KEY,
                                                    kv_module.PageIndexMode.SHARED)
    per_layer = manager.impl.get_mem_pool_base_address(60, kv_module.Role.KEY,
                                                       kv_module.PageIndexMode.PER_LAYER)
    assert default == shared != per_layer
    assert manager.kv_cache_pool_pointers[1].tolist() == [shared, 0]


@pytest.mark.parametrize("order, num_contexts", [([6, 4], 0), ([4, 6], 1)])  # 1: request 4 is a context request
def test_draft_copy_uses_the_hosts_copy_index_and_stream(current_host, order, num_contexts):
    """Each virtual-pool copy takes `index_mapper.get_copy_index(request_ids, num_contexts, beam_width)`
    and the manager's stream, as the base copy does (the host's argument order), so its rows are the
    base's, with or without context requests in the step."""
    from tensorrt_llm.bindings.internal.batch_manager import kv_cache_manager_v2_utils as native

    plugin, _ = _classes()
    manager = _make(plugin)
    manager.add_sequence(4, [1])
    manager.add_sequence(6, [2])
    asked = []
    mapper_copy_index = manager.index_mapper.get_copy_index

    def get_copy_index(request_ids, num_contexts, beam_width):
        asked.append((list(request_ids), num_contexts, beam_width))
        return mapper_copy_index(request_ids, num_contexts, beam_width)

    manager.index_mapper.get_copy_index = get_copy_index
    manager._stream.cuda_stream = 77
    native.CALLS.clear()
    dst = torch.full((2, 2, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
    manager.copy_batch_block_offsets(dst, order, 1, num_contexts, 2)  # beam_width 1
    assert asked == [(order, num_contexts, 1)] * 2  # the base copy's, then the draft pool's
    assert [stream for _, _, stream in native.CALLS] == [77, 77]
    row = {request: i for i, request in enumerate(order)}
    assert dst[1, row[6], 0, :1].tolist() == [2 * 179] and dst[1, row[4], 1, :1].tolist() == [179 + 1]


def test_each_virtual_pool_is_copied_with_its_own_scale_and_offset(current_host):
    """Two draft layers, two virtual pools: pool 1 + i is written with index_scales[i] / kv_offsets[i]
    (slot s -> K = s * scale_i, V = K + offset_i), here given different values per pool."""
    import dataclasses

    plugin, _ = _classes()
    manager = _make(plugin, spec_config=_spec(2))
    assert manager.virtual_pools.op_pools == [(1, 0), (2, 0)]
    manager.virtual_pools = dataclasses.replace(
        manager.virtual_pools, index_scales=torch.tensor([181, 7], dtype=torch.int32),
        kv_offsets=torch.tensor([1, 3], dtype=torch.int32))
    manager.add_sequence(2, [5, 0])
    dst = torch.full((3, 1, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
    manager.copy_batch_block_offsets(dst, [2], 1, 0, 1)
    assert dst[1, 0, :, :2].tolist() == [[5 * 181, 0], [5 * 181 + 1, 1]]
    assert dst[2, 0, :, :2].tolist() == [[5 * 7, 0], [5 * 7 + 3, 3]]


def test_the_draft_copys_scales_and_offsets_are_pinned_as_the_hosts_own_tables(current_host, monkeypatch):
    """The host's device copy (copyBatchBlockOffsetsToDeviceKernel, cpp/tensorrt_llm/batch_manager/
    kvCacheManagerV2Utils.cu @ 060c2fe6) reads `indexScales[poolIdx]` and `kvOffset[poolIdx]` inside the
    kernel: the host pins its own tables (`pin_memory=prefer_pinned()`, device-addressable under UVA), as
    upstream's M3 manager (5d7aadeb) pins `_draft_index_scales` / `_draft_kv_offsets`. Ours were pageable,
    a host address the kernel cannot read. No CUDA here: pinning is simulated by marking storages."""
    from tensorrt_llm.bindings.internal.batch_manager import kv_cache_manager_v2_utils as native

    pinned: list = []

    def pin_memory(self, *args, **kwargs):
        out = self.clone()
        pinned.append(out)  # kept alive, so no unpinned tensor reuses its address
        return out

    def is_pinned(self, *args, **kwargs):
        return any(t.untyped_storage().data_ptr() == self.untyped_storage().data_ptr() for t in pinned)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    plugin, host_cls = _classes()
    base = host_cls.__mro__[1]
    original = base._prepare_page_table_tensor

    def pinned_tables(self, index_mapper_capacity):  # as the real host allocates them
        original(self, index_mapper_capacity)
        for name in ("kv_cache_pool_pointers", "kv_cache_pool_mapping", "index_scales", "kv_offset"):
            setattr(self, name, getattr(self, name).pin_memory())

    monkeypatch.setattr(base, "_prepare_page_table_tensor", pinned_tables)
    copied = []
    host_copy = native.copy_batch_block_offsets_to_device

    def recording_copy(src, dst, copy_idx, index_scales, kv_offset, stream):
        copied.append((index_scales.is_pinned(), kv_offset.is_pinned()))
        return host_copy(src, dst, copy_idx, index_scales, kv_offset, stream)

    monkeypatch.setattr(native, "copy_batch_block_offsets_to_device", recording_copy)
    manager = _make(plugin, spec_config=_spec(2))
    assert manager.index_scales.is_pinned() and manager.kv_offset.is_pinned()
    assert manager.kv_cache_pool_pointers.is_pinned() and manager.kv_cache_pool_mapping.is_pinned()
    manager.add_sequence(3, [1, 2])
    dst = torch.full((3, 1, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
    manager.copy_batch_block_offsets(dst, [3], 1, 0, 1)
    assert copied == [(True, True), (True, True)]  # one copy per virtual pool
    assert dst[2, 0, :, :2].tolist() == [[181, 2 * 181], [182, 2 * 181 + 1]]  # 3*2 + 57*3 + 2*2 sub-pages
