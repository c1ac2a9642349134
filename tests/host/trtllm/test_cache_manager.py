"""The plugin's M3 KV manager on the host double: upstream's shared-draft-layer cases re-expressed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host import trtllm as adapter

from .conftest import _activate, _deactivate
from .fakehost import CURRENT


def _classes():
    adapter.install()
    from tensorrt_llm._torch.pyexecutor import _util
    from tensorrt_llm.llmapi.llm_args import MiniMaxM3SparseAttentionConfig

    plugin = _util.get_sparse_attn_kv_cache_manager(MiniMaxM3SparseAttentionConfig())
    return plugin, plugin.__mro__[1]


def _spec(draft_layers=None):
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig

    spec = Eagle3DecodingConfig()
    spec._num_draft_hidden_layers = draft_layers
    return spec


def _kv_module():
    import sys

    from m3_eagle_plugin.host.trtllm.cache_manager import HostMiniMaxM3KVCacheManagerV2

    return sys.modules[HostMiniMaxM3KVCacheManagerV2.__mro__[1].__module__]


def _make(cls, **overrides):
    kwargs = dict(num_layers=60, num_kv_heads=4, tokens_per_block=128, max_seq_len=1024,
                  max_batch_size=4, spec_config=_spec())
    kwargs.update(overrides)
    return cls(None, None, **kwargs)


def test_virtual_pool_is_rooted_at_the_draft_k_page(host):
    plugin, host_cls = _classes()
    kv_module = _kv_module()
    manager = _make(plugin)
    reference = _make(host_cls)
    # 3 dense + 57 sparse (K, V, index-K) + 1 draft layer = 179 sub-pages per slot; layer 60 is
    # the draft layer and its K page follows the 3*2 + 57*3 = 177 target sub-pages.
    draft_k = kv_module.POOL_BASE_ADDRESS + 177 * kv_module.PAGE_BYTES
    assert manager.shared_draft_layer_ids == (60,) and manager.num_target_layers == 60
    assert manager.kv_cache_pool_pointers.tolist() == [[kv_module.POOL_BASE_ADDRESS, 0], [draft_k, 0]]
    assert manager.kv_cache_pool_mapping[60].tolist() == [1, 0]
    assert torch.equal(manager.kv_cache_pool_mapping[:60], reference.kv_cache_pool_mapping[:60])
    assert manager.virtual_pools.index_scales.tolist() == [179]
    assert manager.virtual_pools.kv_offsets.tolist() == [1]
    assert manager.virtual_pools.op_pools == [(1, 0)]
    assert manager.num_attention_op_pools == 2
    assert manager.trtllm_gen_extra_tokens_per_block == frozenset({128})
    assert manager.sparse_layer_ids == list(range(3, 60))


@pytest.mark.parametrize("overrides", [dict(spec_config=None), dict(layer_mask=[True] * 60),
                                       dict(is_draft=True)], ids=["no-spec", "layer-mask", "draft-manager"])
def test_no_draft_layers_leaves_the_tables_alone(current_host, overrides):
    plugin, host_cls = _classes()
    manager, reference = _make(plugin, **overrides), _make(host_cls, **overrides)
    assert torch.equal(manager.kv_cache_pool_pointers, reference.kv_cache_pool_pointers)
    assert torch.equal(manager.kv_cache_pool_mapping, reference.kv_cache_pool_mapping)
    assert manager.virtual_pools is None and manager.trtllm_gen_extra_tokens_per_block == frozenset()


def test_page_size_opt_in_only_at_128(current_host):
    plugin, _ = _classes()
    assert _make(plugin, tokens_per_block=64).trtllm_gen_extra_tokens_per_block == frozenset()
    assert plugin.trtllm_gen_extra_tokens_per_block == frozenset()  # class default, not widened


def test_block_offset_copy_feeds_the_virtual_pool_from_the_source_pool(host):
    from tensorrt_llm.bindings.internal.batch_manager import kv_cache_manager_v2_utils as native

    plugin, _ = _classes()
    manager = _make(plugin)
    manager.add_sequence(7, [3, 5])
    manager.add_sequence(9, [0, 2, 4])
    dst = torch.full((2, 2, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
    native.CALLS.clear()
    manager.copy_batch_block_offsets(dst, [9, 7], 1, 0, 2)
    # base copy (every storage pool) first, then one copy into op pool 1 from source pool 0
    assert [(src, dst_rows) for src, dst_rows, _ in native.CALLS] == [(1, 2), (1, 1)]
    pad = [-1] * (manager.max_blocks_per_seq - 3)
    for pool in (0, 1):
        assert dst[pool, 0, 0].tolist() == [0, 2 * 179, 4 * 179] + pad
        assert dst[pool, 0, 1].tolist() == [1, 2 * 179 + 1, 4 * 179 + 1] + pad
        assert dst[pool, 1, 0].tolist() == [3 * 179, 5 * 179, -1] + pad
        assert dst[pool, 1, 1].tolist() == [3 * 179 + 1, 5 * 179 + 1, -1] + pad


def test_a_block_offset_table_without_the_draft_pools_row_is_refused_before_any_copy(host):
    """A host that sizes the table by num_pools (older TrtllmAttentionMetadata) leaves no row for
    the draft layer's op pool: the native copy would get an empty slice and the op read past it."""
    from tensorrt_llm.bindings.internal.batch_manager import kv_cache_manager_v2_utils as native

    plugin, _ = _classes()
    manager = _make(plugin)
    manager.add_sequence(7, [3, 5])
    assert manager.num_attention_op_pools == 2 and manager.num_pools == 1
    dst = torch.full((1, 1, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
    native.CALLS.clear()
    with pytest.raises(RuntimeError, match=r"1 pool rows .*-op pool 1: .*num_attention_op_pools \(2\)"):
        manager.copy_batch_block_offsets(dst, [7], 1, 0, 1)
    assert native.CALLS == [] and (dst == -9).all()


def test_block_offset_copy_is_untouched_without_draft_layers(current_host):
    from tensorrt_llm.bindings.internal.batch_manager import kv_cache_manager_v2_utils as native

    plugin, _ = _classes()
    manager = _make(plugin, spec_config=None)
    manager.add_sequence(1, [2])
    native.CALLS.clear()
    manager.copy_batch_block_offsets(torch.zeros((1, 1, 2, 8), dtype=torch.int32), [1], 1, 0, 1)
    assert len(native.CALLS) == 1


def test_a_draft_layer_count_the_host_counts_differently_is_refused(current_host, monkeypatch):
    """Hosts whose get_num_spec_layers reads `num_eagle_layers` append 2 draft layers here while the
    layout reserves 1: layer 61 would keep a uniform-stride mapping into the mega-slot."""
    import sys

    import tensorrt_llm._torch.speculative.utils as spec_utils

    plugin, _ = _classes()

    def older_host_count(spec_config):
        layers = getattr(spec_config, "num_eagle_layers", None)
        return 1 if layers is None else layers

    monkeypatch.setattr(spec_utils, "get_num_spec_layers", older_host_count)
    monkeypatch.setattr(sys.modules[_kv_module().__name__], "get_num_spec_layers", older_host_count)
    spec = _spec()
    spec.num_eagle_layers = 2
    with pytest.raises(ValueError, match=r"gives the KV cache 2 Eagle3 draft layer\(s\).*reserves 1"):
        _make(plugin, spec_config=spec)
    spec._num_draft_hidden_layers = 2  # the two counts agree: both draft layers get a virtual pool
    manager = _make(plugin, spec_config=spec)
    assert manager.shared_draft_layer_ids == (60, 61) and manager.virtual_pools.op_pools == [(1, 0), (2, 0)]


def test_an_nvfp4_cache_gives_draft_layers_no_virtual_pool(current_host, monkeypatch):
    """NVFP4 pool pointers are [data, block-scale] pairs: a virtual draft pool would carry a 0 scale
    pointer, so the draft layer would read its block scales from address 0."""
    plugin, host_cls = _classes()
    base = host_cls.__mro__[1]
    original = base._prepare_page_table_tensor

    def nvfp4_tables(self, index_mapper_capacity):
        original(self, index_mapper_capacity)
        pointers = self.kv_cache_pool_pointers
        self.kv_cache_pool_pointers = torch.stack([pointers, pointers + 1], dim=-1)  # [pools, 2, 2]

    monkeypatch.setattr(base, "_prepare_page_table_tensor", nvfp4_tables)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        _make(plugin)
    assert _make(plugin, spec_config=None).virtual_pools is None  # no draft layers: nothing to refuse


def test_a_host_with_per_layer_page_tables_keeps_its_own_pools(current_host, monkeypatch):
    """A host whose manager already gives every layer its own pool (per-layer page tables) needs no
    virtual draft pool, so neither one is added nor an NVFP4 cache refused."""
    plugin, host_cls = _classes()
    base = host_cls.__mro__[1]
    original = base._prepare_page_table_tensor

    def per_layer_nvfp4_tables(self, index_mapper_capacity):
        original(self, index_mapper_capacity)
        self._use_per_layer_page_tables = True
        pointers = self.kv_cache_pool_pointers
        self.kv_cache_pool_pointers = torch.stack([pointers, pointers + 1], dim=-1)

    monkeypatch.setattr(base, "_prepare_page_table_tensor", per_layer_nvfp4_tables)
    manager = _make(plugin)
    assert manager.virtual_pools is None and manager.kv_cache_pool_pointers.dim() == 3


def test_update_resources_refuses_tree_acceptance(current_host):
    plugin, _ = _classes()
    manager = _make(plugin)
    linear = SimpleNamespace(context_requests=[], generation_requests=[
        SimpleNamespace(py_request_id=1, py_num_accepted_draft_tokens_indices=None)])
    manager.update_resources(linear)
    assert manager.update_calls == [linear]
    tree = SimpleNamespace(all_requests=lambda: [
        SimpleNamespace(py_request_id=4, py_num_accepted_draft_tokens_indices=[0, 2])])
    with pytest.raises(NotImplementedError, match="request 4"):
        manager.update_resources(tree)
    assert manager.update_calls == [linear]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(num_target=st.integers(1, 12), num_draft=st.integers(1, 2),
       page=st.sampled_from([16, 32, 64, 128]))
def test_every_draft_layer_gets_its_own_virtual_pool(fake_host_dirs, num_target, num_draft, page):
    root = fake_host_dirs[CURRENT]
    _activate(root)
    try:
        plugin, _ = _classes()
        kv_module = _kv_module()
        manager = _make(plugin, num_layers=num_target, tokens_per_block=page,
                        spec_config=_spec(num_draft))
        sparse = set(range(3, num_target))
        sub_pages = [3 if layer in sparse else 2 for layer in range(num_target + num_draft)]
        assert manager.shared_draft_layer_ids == tuple(range(num_target, num_target + num_draft))
        for i, layer in enumerate(manager.shared_draft_layer_ids):
            address = kv_module.POOL_BASE_ADDRESS + sum(sub_pages[:layer]) * kv_module.PAGE_BYTES
            assert manager.kv_cache_pool_pointers[1 + i].tolist() == [address, 0]
            assert manager.kv_cache_pool_mapping[layer].tolist() == [1 + i, 0]
        assert manager.virtual_pools.index_scales.tolist() == [sum(sub_pages)] * num_draft
        for layer in range(num_target):
            assert manager.kv_cache_pool_mapping[layer].tolist() == [0, sum(sub_pages[:layer])]
        assert manager.trtllm_gen_extra_tokens_per_block == (frozenset({128}) if page == 128 else frozenset())
    finally:
        _deactivate(root)


def test_sparse_range_stops_at_the_last_target_when_num_layers_counts_the_draft_tail(current_host):
    """A per-layer head list of 61 entries with num_layers=61 already counts the draft layer: the
    target is layers 0-59, so the sparse range is the dense-prefix convention 3..59, never layer 60
    (the draft layer holds K and V only)."""
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=61, num_kv_heads=[4] * 61)
    assert manager.shared_draft_layer_ids == (60,) and manager.num_target_layers == 60
    assert manager.sparse_layer_ids == list(range(3, 60))
    assert 60 not in manager.sparse_layer_ids and 2 not in manager.sparse_layer_ids


def test_a_layout_reserving_more_draft_layers_than_the_host_appends_is_refused(current_host, monkeypatch):
    """The other direction of the count check: the layout reserves 2 draft layers (target layers 60
    and 61 would get virtual pools) while the host appends 1, so layer 61 would be a phantom."""
    import sys

    import tensorrt_llm._torch.speculative.utils as spec_utils

    plugin, _ = _classes()

    def one_layer(spec_config):
        return 1

    monkeypatch.setattr(spec_utils, "get_num_spec_layers", one_layer)
    monkeypatch.setattr(sys.modules[_kv_module().__name__], "get_num_spec_layers", one_layer)
    with pytest.raises(ValueError, match=r"gives the KV cache 1 Eagle3 draft layer\(s\).*reserves 2"):
        _make(plugin, spec_config=_spec(2))


def test_no_page_size_opt_in_other_than_128(current_host):
    """Only P128 (MSA's page) is opted into trtllm-gen; a larger page is not."""
    plugin, _ = _classes()
    assert _make(plugin, tokens_per_block=256).trtllm_gen_extra_tokens_per_block == frozenset()
    assert _make(plugin, tokens_per_block=32).trtllm_gen_extra_tokens_per_block == frozenset()


def test_update_resources_refuses_tree_acceptance_among_generation_requests(current_host):
    """A batch without `all_requests` lists its requests as context + generation requests; a tree
    acceptance in the generation list is refused as well, before the host rewinds anything."""
    plugin, _ = _classes()
    manager = _make(plugin)
    tree = SimpleNamespace(context_requests=[SimpleNamespace(py_request_id=2)], generation_requests=[
        SimpleNamespace(py_request_id=3, py_num_accepted_draft_tokens_indices=None),
        SimpleNamespace(py_request_id=5, py_num_accepted_draft_tokens_indices=[1])])
    with pytest.raises(NotImplementedError, match="request 5"):
        manager.update_resources(tree)
    assert manager.update_calls == []


def test_update_resources_hands_the_hosts_arguments_on(current_host, monkeypatch):
    """`update_resources(scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None)` (the
    host's V2 signature): a linear batch reaches the host with every argument it was given."""
    plugin, host_cls = _classes()
    seen = []

    def host_update(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None):
        seen.append((scheduled_batch, attn_metadata, kv_cache_dtype_byte_size))

    monkeypatch.setattr(host_cls.__mro__[1], "update_resources", host_update)
    manager = _make(plugin)
    batch = SimpleNamespace(context_requests=[], generation_requests=[])
    manager.update_resources(batch, "attn-meta", 2)
    manager.update_resources(batch, attn_metadata="m", kv_cache_dtype_byte_size=1)
    assert seen == [(batch, "attn-meta", 2), (batch, "m", 1)]


def test_a_host_manager_that_appends_its_own_draft_pools_keeps_them(current_host, monkeypatch):
    """A forced #18872 host: its M3 manager appends the draft layers' op pools and fills them in its
    block-offset copy (upstream's `_prepare_page_table_tensor` / `copy_batch_block_offsets`). The
    plugin's manager must address the draft layer exactly as the host's own does, not add a second
    op pool whose source is the host's op pool (never filled: the draft layer would read garbage)."""
    from m3_eagle_plugin import kv as core_kv
    from tensorrt_llm.bindings.internal.batch_manager import kv_cache_manager_v2_utils as native

    plugin, host_cls = _classes()
    base = host_cls.__mro__[1]
    role = _kv_module().Role

    def upstream_tables(self, index_mapper_capacity):
        base._prepare_page_table_tensor(self, index_mapper_capacity)
        draft = self.num_local_layers - 1
        if self.is_draft or draft < 60:
            return
        geometry = [(draft, self.impl.get_mem_pool_base_address(draft, role.KEY),
                     self.impl.get_page_index_converter(draft, role.KEY).scale)]
        pools = core_kv.extend_attention_op_pools(self.kv_cache_pool_pointers, self.kv_cache_pool_mapping,
                                                  geometry, num_pools=self.num_pools)
        self.kv_cache_pool_pointers, self.kv_cache_pool_mapping = pools.pool_pointers, pools.pool_mapping
        self._host_draft = (pools.op_pools, pools.index_scales, pools.kv_offsets)
        self.num_attention_op_pools = pools.num_op_pools

    def upstream_copy(self, dst, request_ids, beam_width, num_contexts, num_seqs, max_blocks=None):
        base.copy_batch_block_offsets(self, dst, request_ids, beam_width, num_contexts, num_seqs)
        op_pools, scales, offsets = getattr(self, "_host_draft", ((), None, None))
        rows = self.index_mapper.get_copy_index(request_ids, num_contexts, beam_width)
        for i, (op_pool, source) in enumerate(op_pools):
            native.copy_batch_block_offsets_to_device(self.host_kv_cache_block_offsets[source: source + 1],
                                                      dst[op_pool: op_pool + 1], rows, scales[i: i + 1],
                                                      offsets[i: i + 1], 0)

    monkeypatch.setattr(host_cls, "_prepare_page_table_tensor", upstream_tables, raising=False)
    monkeypatch.setattr(host_cls, "copy_batch_block_offsets", upstream_copy, raising=False)
    manager = _make(plugin)
    manager.add_sequence(7, [3, 5])
    dst = torch.full((3, 1, 2, manager.max_blocks_per_seq), -9, dtype=torch.int32)
    manager.copy_batch_block_offsets(dst, [7], 1, 0, 1)
    draft_pool = int(manager.kv_cache_pool_mapping[60, 0])
    # 179 sub-pages per slot (see above): the draft layer's K pages of slots 3 and 5, from its own K page
    assert manager.kv_cache_pool_pointers[draft_pool, 0] == manager.impl.get_mem_pool_base_address(60, role.KEY)
    assert dst[draft_pool, 0, 0, :3].tolist() == [3 * 179, 5 * 179, -1]
    assert manager.num_attention_op_pools == 2 and manager.virtual_pools is None


def test_update_resources_checks_the_context_requests_of_a_batch_without_all_requests(current_host):
    """A batch without `all_requests` lists its requests as context + generation requests: a tree
    acceptance among the context requests is refused too, before the host rewinds anything."""
    plugin, _ = _classes()
    manager = _make(plugin)
    tree = SimpleNamespace(context_requests=[SimpleNamespace(py_request_id=8, py_num_accepted_draft_tokens_indices=[0])],
                           generation_requests=[SimpleNamespace(py_request_id=3, py_num_accepted_draft_tokens_indices=None)])
    with pytest.raises(NotImplementedError, match="request 8"):
        manager.update_resources(tree)
    assert manager.update_calls == []


def test_a_role_bound_only_in_the_v2_base_module_still_roots_the_draft_pool(current_host, monkeypatch):
    """The host's M3 manager module need not import `Role` itself (the V2 base module defines it):
    the draft layer's K page is found through the base module's name, at the same address."""
    import sys

    plugin, _ = _classes()
    kv_module = _kv_module()
    m3_module = sys.modules[plugin.__mro__[1].__module__]
    assert m3_module is not kv_module and m3_module.Role is kv_module.Role
    monkeypatch.delattr(m3_module, "Role")
    manager = _make(plugin)
    # 3 dense layers x 2 sub-pages + 57 sparse x 3 = 177 target sub-pages before the draft's K page
    draft_k = kv_module.POOL_BASE_ADDRESS + 177 * kv_module.PAGE_BYTES
    assert manager.kv_cache_pool_pointers.tolist() == [[kv_module.POOL_BASE_ADDRESS, 0], [draft_k, 0]]
