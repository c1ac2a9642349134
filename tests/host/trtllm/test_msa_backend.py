"""The plugin's MSA metadata on the host double: upstream's verify-row cases re-expressed."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.contract import import_first, symbol
from m3_eagle_plugin.msa import MsaInputError

from .conftest import _activate, _deactivate
from .fakehost import CURRENT
from .test_cache_manager import _classes, _make


def _backend(implementation="msa"):
    adapter.install()
    dispatch = import_first(symbol("m3_backend_resolver").modules)
    params = type("P", (), {"algorithm": "minimax_m3", "implementation": implementation})()
    return dispatch.get_trtllm_sparse_attn_attention_backend(params)


def _metadata(meta_cls, manager, seq_lens, cached, max_num_tokens=16, max_num_requests=2, extra=0):
    from m3_eagle_plugin.host.trtllm.msa_backend import HostMsaMetadata

    interface = __import__(HostMsaMetadata.__mro__[2].__module__.rsplit(".", 1)[0] + ".interface",
                           fromlist=["KVCacheParams"])
    return meta_cls(max_num_requests=max_num_requests, max_num_tokens=max_num_tokens,
                    kv_cache_manager=manager, request_ids=list(range(len(seq_lens))),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_contexts=0,
                    kv_cache_params=interface.KVCacheParams(num_cached_tokens_per_seq=list(cached),
                                                            num_extra_kv_tokens=extra))


def _worked_case(extra=0):
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)
    manager.add_sequence(0, [0, 1, 2])
    manager.add_sequence(1, [5, 6, 27])
    meta = _metadata(backend.Metadata, manager, seq_lens=[2, 3], cached=[7, 9], extra=extra)
    meta.prepare()  # staged (optimistic) kv lens: 9 and 12
    return meta


def test_backend_resolution_routes_msa_only(host):
    assert _backend("msa").__name__ == "M3EagleMsaSparseAttention"
    assert _backend("msa").Metadata.__name__ == "M3EagleMsaMetadata"
    assert _backend("triton").__name__ == "MiniMaxM3SparseRuntimeBackend"


def test_on_update_kv_lens_rederives_slots_counts_and_plan_lengths(host):
    meta = _worked_case()
    meta.kv_lens_cuda[:2] = torch.tensor([8, 12], dtype=torch.int32)  # request 0 rejected a token
    meta.on_update_kv_lens()
    step = meta.m3_eagle_step
    assert step.cache_slots.tolist() == [6, 7, 109, 110, 111]
    assert step.valid_blocks.tolist() == [2, 2, 3, 3, 3]
    assert step.kv_lens.tolist() == [8, 12]  # proxy kv_segment_lens
    assert step.qo_offsets.tolist() == [6, 9]  # proxy qo_offset
    rows, seqused_k = meta.m3_eagle_plan_rows()
    assert rows.tolist() == [0, 0, 1, 1, 1] and seqused_k.tolist() == [7, 8, 10, 11, 12]
    assert meta.msa_out_cache_loc[:5].tolist() == [6, 7, 109, 110, 111]
    assert meta.msa_out_cache_loc[5:].eq(-1).all()
    assert meta.msa_n_valid_blocks[:5].tolist() == [2, 2, 3, 3, 3]
    meta.on_update_kv_lens()  # idempotent
    assert step.cache_slots.tolist() == [6, 7, 109, 110, 111]


def test_speculative_extra_slots_never_count_as_kv(current_host):
    meta = _worked_case(extra=3)  # host kv_lens carry +3 extra slots, kv_lens_cuda does not
    assert meta.kv_lens[:2].tolist() == [12, 15]
    assert meta.m3_eagle_step.kv_lens_staged.tolist() == [9, 12]
    meta.kv_lens_cuda[:2] = torch.tensor([8, 12], dtype=torch.int32)
    meta.on_update_kv_lens()
    assert meta.msa_out_cache_loc[:5].tolist() == [6, 7, 109, 110, 111]
    assert meta.m3_eagle_step.token_kv_lens.tolist() == [7, 8, 10, 11, 12]


def test_on_update_kv_lens_clamps_to_the_staged_lens(current_host):
    meta = _worked_case()
    meta.kv_lens_cuda[:2] = torch.tensor([10, 13], dtype=torch.int32)
    meta.on_update_kv_lens()
    assert meta.m3_eagle_step.kv_lens.tolist() == [9, 12]
    assert meta.msa_out_cache_loc[:5].tolist() == [7, 8, 109, 110, 111]
    assert meta.msa_n_valid_blocks[:5].tolist() == [2, 3, 3, 3, 3]


def test_scratch_is_sized_by_verify_tokens_not_batch(current_host):
    backend = _backend()
    plugin, _ = _classes()
    host_meta_cls = backend.Metadata.__mro__[1]
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)  # max_draft_len 3
    for rid in range(2):
        manager.add_sequence(rid, [2 * rid, 2 * rid + 1, 9])
    host_meta = _metadata(host_meta_cls, manager, seq_lens=[4, 4], cached=[3, 5])
    assert host_meta.msa_n_valid_blocks.numel() == 2  # batch-sized: cannot hold 2 x 4 verify tokens
    meta = _metadata(backend.Metadata, manager, seq_lens=[4, 4], cached=[3, 5])
    meta.prepare()
    assert meta.msa_n_valid_blocks.numel() == 8
    assert meta.msa_n_valid_blocks.tolist() == [1, 2, 2, 2, 2, 2, 2, 3]
    too_long = _metadata(backend.Metadata, manager, seq_lens=[5, 5], cached=[0, 2])
    with pytest.raises(MsaInputError, match="max_draft_len is 3"):  # 2 x 5 tokens > 2 x (1 + 3)
        too_long.prepare()


def test_a_generation_row_past_the_draft_max_is_refused(current_host):
    """A verify row of 1 + 5 tokens with max_draft_len 3 (a tree's total draft tokens, say) fits
    the scratch beside a 1-token row, but would be laid out as a chain: refused at prepare."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)  # max_draft_len 3
    manager.add_sequence(0, [0, 1])
    manager.add_sequence(1, [2, 3, 4])
    meta = _metadata(backend.Metadata, manager, seq_lens=[1, 6], cached=[4, 3])
    with pytest.raises(MsaInputError, match=r"seq_lens\[1\] is 6: generation row 1 carries 5 draft "
                                            r"tokens but max_draft_len is 3"):
        meta.prepare()
    context_first = _metadata(backend.Metadata, manager, seq_lens=[6, 1], cached=[0, 8])
    context_first.num_contexts = 1  # a context row may be longer
    context_first.prepare()
    assert context_first.msa_out_cache_loc[:7].tolist() == [0, 1, 2, 3, 4, 5, 16]


def test_a_prefill_longer_than_the_decode_scratch_publishes_its_slots(current_host):
    """A context step has more tokens than the decode scratch (`msa_n_valid_blocks`, decode rows
    only): its slots are published, the scratch is left to the decode steps."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)
    manager.add_sequence(0, list(range(10)))
    meta = _metadata(backend.Metadata, manager, seq_lens=[40], cached=[0], max_num_tokens=64)
    meta.num_contexts = 1
    meta.prepare()
    assert meta.msa_n_valid_blocks.numel() < 40 and not meta.m3_eagle_step.is_decode_only
    assert meta.msa_out_cache_loc[:40].tolist() == list(range(40))  # pages 0..9, 4 slots each
    assert meta.msa_out_cache_loc[40:].eq(-1).all()


def test_a_shorter_step_leaves_no_slots_of_the_longer_one(current_host):
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)
    manager.add_sequence(0, [0, 1, 2])
    manager.add_sequence(1, [5, 6, 27])
    meta = _metadata(backend.Metadata, manager, seq_lens=[2, 3], cached=[7, 9])
    meta.prepare()
    assert meta.msa_out_cache_loc[:5].tolist() == [7, 8, 109, 110, 111]
    meta.seq_lens = torch.tensor([1, 1], dtype=torch.int32)
    meta.kv_cache_params.num_cached_tokens_per_seq = [9, 11]
    meta.prepare()
    assert meta.msa_out_cache_loc[:2].tolist() == [9, 111] and meta.msa_out_cache_loc[2:].eq(-1).all()


@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_published_fields_follow_the_per_token_formulas(fake_host_dirs, data):
    page = 4
    num_requests = data.draw(st.integers(1, 3))
    qo = data.draw(st.lists(st.integers(1, 4), min_size=num_requests, max_size=num_requests))
    cached = data.draw(st.lists(st.integers(0, 20), min_size=num_requests, max_size=num_requests))
    root = fake_host_dirs[CURRENT]
    _activate(root)
    try:
        backend = _backend()
        plugin, _ = _classes()
        manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64)
        tables = []
        for rid in range(num_requests):
            blocks = math.ceil((cached[rid] + qo[rid]) / page)
            tables.append([100 * (rid + 1) + 3 * b for b in range(blocks)])
            manager.add_sequence(rid, tables[-1])
        meta = _metadata(backend.Metadata, manager, qo, cached, max_num_tokens=16, max_num_requests=3)
        meta.prepare()
        slots, valid = [], []
        for rid in range(num_requests):
            for t in range(qo[rid]):
                pos = cached[rid] + t
                slots.append(tables[rid][pos // page] * page + pos % page)
                valid.append(math.ceil((pos + 1) / page))
        total = sum(qo)
        assert meta.msa_out_cache_loc[:total].tolist() == slots
        assert meta.msa_n_valid_blocks[:total].tolist() == valid
    finally:
        _deactivate(root)
