"""The plugin's MSA metadata on the host double: device-side kv corrections, sizing read from the
host's fields, and the publish guards, each against values written out from the per-token rule
(token t of a row sits at position kv_len - qo_len + t) or from the host objects themselves."""
from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.msa import MsaInputError

from .conftest import _activate, _deactivate
from .fakehost import CURRENT
from .test_cache_manager import _classes, _make, _spec
from .test_contract import _signature_files
from .test_msa_backend import _backend, _metadata


def _host_sparse_metadata_params(**values):
    """The host's MiniMaxM3SparseMetadataParams with the fields its source declares (common.py in the
    recorded host signatures), unset ones None: a field name the host lacks is a TypeError."""
    cls = next(c for f in _signature_files() for c in f.get("classes", ())
               if c["name"] == "MiniMaxM3SparseMetadataParams")
    fields = [(f["name"], object, None) for f in cls["fields"]]
    return dataclasses.make_dataclass(cls["name"], fields, frozen=True)(**values)


def naive_step_fields(tables, page, qo, kv):
    """Per token, from first principles: (slot, valid-block count, kv segment length, request row).
    A token whose position falls before the row's first key (a correction below qo_len, a CUDA-graph
    padding row) sees nothing and, as in the host's on_update_kv_lens, writes its row's own first
    slot (the host's cache writers do not skip -1) and publishes one valid block (the host's
    clamp_min(1): 0 masks every block in its GQA and NaNs the row)."""
    slots, valid, seg, rows = [], [], [], []
    for r, (q, k) in enumerate(zip(qo, kv)):
        for t in range(q):
            pos = k - q + t
            if pos < 0:
                slots.append(tables[r][0] * page), valid.append(1), seg.append(0)
            else:
                slots.append(tables[r][pos // page] * page + pos % page)
                valid.append(math.ceil((pos + 1) / page))
                seg.append(pos + 1)
            rows.append(r)
    return slots, valid, seg, rows


@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data())
def test_kv_corrections_rederive_the_published_fields_per_token(fake_host_dirs, data):
    """Random verify rows (1..4 tokens, max_draft_len 3), speculative extra slots, and a device
    correction per row anywhere in [0, staged + 3]: corrections past the staged length are clamped
    to it, and the published slots / counts / plan rows follow the per-token rule."""
    page = 4
    num_requests = data.draw(st.integers(1, 3))
    qo = data.draw(st.lists(st.integers(1, 4), min_size=num_requests, max_size=num_requests))
    cached = data.draw(st.lists(st.integers(0, 20), min_size=num_requests, max_size=num_requests))
    extra = data.draw(st.integers(0, 3))
    staged = [c + q for c, q in zip(cached, qo)]
    corrected = [data.draw(st.integers(0, s + 3)) for s in staged]
    root = fake_host_dirs[CURRENT]
    _activate(root)
    try:
        backend = _backend()
        plugin, _ = _classes()
        manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64)
        tables = []
        for rid in range(num_requests):
            tables.append([7 * (rid + 1) + 2 * b for b in range(math.ceil(staged[rid] / page))])
            manager.add_sequence(rid, tables[-1])
        meta = _metadata(backend.Metadata, manager, qo, cached, max_num_tokens=16, max_num_requests=3, extra=extra)
        meta.prepare()
        meta.kv_lens_cuda[:num_requests] = torch.tensor(corrected, dtype=torch.int32)
        meta.on_update_kv_lens()
        kv = [min(c, s) for c, s in zip(corrected, staged)]
        slots, valid, seg, rows = naive_step_fields(tables, page, qo, kv)
        total = sum(qo)
        assert meta.m3_eagle_step.kv_lens.tolist() == kv
        assert meta.msa_out_cache_loc[:total].tolist() == slots
        assert meta.msa_out_cache_loc[total:].eq(-1).all()
        assert meta.msa_n_valid_blocks[:total].tolist() == valid
        plan_rows, plan_lens = meta.m3_eagle_plan_rows()
        assert plan_rows.tolist() == rows and plan_lens.tolist() == seg
    finally:
        _deactivate(root)


def test_step_metadata_is_sized_from_the_host_fields(current_host):
    """Rows from `max_num_sequences` (over `max_num_requests`), index heads from the sparse params,
    draft length from the manager's spec config: the host's decode scratch holds max_num_sequences x
    (1 + max_draft_len) tokens, and the step metadata keeps no proxy scratch of its own beside it."""
    backend = _backend()
    plugin, _ = _classes()
    spec = _spec()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64, spec_config=spec)
    meta = backend.Metadata(max_num_requests=2, max_num_sequences=3, max_num_tokens=16, kv_cache_manager=manager,
                            sparse_metadata_params=SimpleNamespace(num_index_heads=4))
    step = meta.m3_eagle_step
    assert step.max_num_requests == 3 and step.max_draft_len == spec.max_draft_len
    assert step.block_size == 4 and step.max_blocks_per_seq == 16  # 64 tokens / 4 a page
    assert step.proxy_scores is None and step.scratch_decode_tokens == 3 * (1 + spec.max_draft_len)  # the host's
    assert meta.msa_n_valid_blocks.numel() == 3 * (1 + spec.max_draft_len)
    plain = backend.Metadata(max_num_requests=2, max_num_tokens=16, kv_cache_manager=manager,
                             sparse_metadata_params=SimpleNamespace(num_index_heads=None))
    assert plain.m3_eagle_step.max_num_requests == 2 and plain.m3_eagle_step.num_index_heads == 1


def test_index_heads_are_read_from_the_hosts_sparse_metadata_params(current_host):
    """`sparse_num_index_heads` is the YAML config's field; the metadata carries the host's
    MiniMaxM3SparseMetadataParams, whose field is `num_index_heads`."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64, spec_config=_spec())
    params = _host_sparse_metadata_params(global_num_q_heads=64, global_num_kv_heads=4, num_index_heads=3, topk=16)
    meta = backend.Metadata(max_num_requests=2, max_num_tokens=16, kv_cache_manager=manager,
                            sparse_metadata_params=params)
    assert meta.m3_eagle_step.num_index_heads == 3


@pytest.mark.parametrize("own,manager_len,spec_len,expect", [
    (None, None, 2, 2),     # only the manager's spec config says
    (None, 5, 2, 5),        # the manager's own field wins over its spec config
    (1, 5, 2, 1),           # the metadata's own field wins over both
    (None, None, None, 0),  # nobody says: no drafts
])
def test_draft_length_is_read_in_order_of_precedence(current_host, own, manager_len, spec_len, expect):
    backend = _backend()
    manager = SimpleNamespace(max_blocks_per_seq=8, tokens_per_block=4,
                              spec_config=None if spec_len is None else SimpleNamespace(max_draft_len=spec_len))
    if manager_len is not None:
        manager.max_draft_len = manager_len
    cls = backend.Metadata if own is None else type("WithDraft", (backend.Metadata,), {"max_draft_len": own})
    meta = cls(max_num_requests=2, max_num_tokens=16, kv_cache_manager=manager)
    assert meta.m3_eagle_step.max_draft_len == expect
    assert meta.m3_eagle_step.scratch_decode_tokens == 2 * (1 + expect)


@pytest.mark.parametrize("seq_lens, host_rows, slots", [
    ([6, 2], [2, 3], [0, 1, 2, 3, 4, 5, 16, 17]),  # host rows: last positions 5 and 9
    # a context row of 2 tokens (a prompt's last chunk) fits a verify row's length, but the step is not
    # decode-only: the host's rule is `num_contexts == 0` (msa_backend.py at 57ea1cdf, `_build_step_plans`)
    ([2, 2], [1, 3], [0, 1, 16, 17]),  # host rows: last positions 1 and 9
])
def test_a_mixed_step_leaves_the_decode_scratch_to_the_host(current_host, seq_lens, host_rows, slots):
    """A context row beside a verify row: the host's own per-row writes stay, the plugin writes no
    per-token count into the decode scratch (its entries past the host's rows keep their value)."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)
    manager.add_sequence(0, [0, 1])
    manager.add_sequence(1, [2, 3, 4])
    meta = _metadata(backend.Metadata, manager, seq_lens=seq_lens, cached=[0, 8])
    meta.num_contexts = 1
    meta.msa_n_valid_blocks.fill_(77)
    meta.prepare()
    assert not meta.m3_eagle_step.is_decode_only
    assert meta.msa_n_valid_blocks[:2].tolist() == host_rows
    assert meta.msa_n_valid_blocks[2:].eq(77).all()
    assert meta.msa_out_cache_loc[:len(slots)].tolist() == slots


@pytest.mark.parametrize("buffer,match", [("msa_out_cache_loc", "msa_out_cache_loc holds 3 entries"),
                                          ("msa_n_valid_blocks", "sized it by batch")])
def test_a_host_buffer_too_small_for_the_step_is_refused(current_host, buffer, match):
    """Publishing 5 verify tokens into a 3-entry host buffer must not truncate silently."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)
    manager.add_sequence(0, [0, 1, 2])
    manager.add_sequence(1, [5, 6, 27])
    meta = _metadata(backend.Metadata, manager, seq_lens=[2, 3], cached=[7, 9])
    setattr(meta, buffer, torch.full((3,), -1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=match):
        meta.prepare()


def test_a_step_filling_max_num_tokens_is_published(current_host):
    """`msa_out_cache_loc` holds max_num_tokens entries; a verify step of exactly that many tokens
    (2 + 3 here) fits and is published whole, with no -1 tail."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64)
    manager.add_sequence(0, [0, 1, 2])
    manager.add_sequence(1, [5, 6, 27])
    meta = _metadata(backend.Metadata, manager, seq_lens=[2, 3], cached=[7, 9], max_num_tokens=5)
    meta.prepare()
    # request 0: positions 7, 8 -> page 1 slot 3, page 2 slot 0; request 1: positions 9..11 in page 27
    assert meta.msa_out_cache_loc.tolist() == [7, 8, 27 * 4 + 1, 27 * 4 + 2, 27 * 4 + 3]
    assert meta.msa_n_valid_blocks[:5].tolist() == [2, 3, 3, 3, 3]


def _cuda_graph_metadata(eager, batch_size, draft_len):
    """As the host's create_cuda_graph_metadata (AttentionMetadata's, then TrtllmAttentionMetadata's):
    a shallow copy with seq_lens of the batch size, __post_init__ re-run, then max_num_requests and
    max_num_tokens set to the batch and __post_init__ run again. max_num_sequences stays the eager one."""
    graph = copy.copy(eager)
    graph.is_cuda_graph = True
    graph.seq_lens = torch.full((batch_size,), 1 + draft_len, dtype=torch.int32)
    graph.num_contexts = 0
    graph.__post_init__()
    graph.max_num_requests = batch_size
    graph.max_num_tokens = batch_size * (1 + draft_len)
    graph.__post_init__()
    return graph


def test_a_cuda_graph_copy_stages_its_batch_size_not_the_eager_sequences(current_host):
    """A graph copy for batch size 2 serves exactly 2 rows (padded with the host's dummy request), yet
    keeps the eager max_num_sequences (6 here; 256 x 8192 blocks at 1M context is 8 MiB pinned plus
    8 MiB device per graph): its step stages 2 rows, publishes a padded step as the per-token rule
    says, refuses a third row, and shares nothing with the eager step."""
    backend = _backend()
    plugin, _ = _classes()
    page = 4
    manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64, spec_config=_spec())
    draft = manager.max_draft_len
    tables = {7: [3, 9, 4], 1 << 40: [12, 12]}  # a live request and the padding dummy
    for rid, table in tables.items():
        manager.add_sequence(rid, table)
    eager = _metadata(backend.Metadata, manager, seq_lens=[1], cached=[0], max_num_tokens=32, max_num_requests=6)
    graph = _cuda_graph_metadata(eager, 2, draft)
    step = graph.m3_eagle_step
    assert step is not eager.m3_eagle_step and eager.m3_eagle_step.max_num_requests == 6
    assert step.max_num_requests == 2 and step.max_num_tokens == 2 * (1 + draft)
    assert step.cache_slots_buffer.data_ptr() != eager.m3_eagle_step.cache_slots_buffer.data_ptr()
    graph.request_ids = [7, 1 << 40]
    graph.seq_lens = torch.full((2,), 1 + draft, dtype=torch.int32)
    graph.kv_cache_params.num_cached_tokens_per_seq = [6, 1]
    graph.prepare()
    # request 7 accepted one draft of three
    graph.kv_lens_cuda[:2] -= torch.tensor([2, 0], dtype=torch.int32, device=graph.kv_lens_cuda.device)
    graph.on_update_kv_lens()
    rows = [tables[rid] for rid in graph.request_ids]
    slots, valid, _, _ = naive_step_fields(rows, page, [1 + draft] * 2, [6 + 1 + draft - 2, 1 + 1 + draft])
    assert graph.msa_out_cache_loc[: len(slots)].tolist() == slots
    assert graph.msa_n_valid_blocks[: len(valid)].tolist() == valid
    graph.request_ids = [7, 1 << 40, 1 << 40]
    graph.seq_lens = torch.full((3,), 1 + draft, dtype=torch.int32)
    graph.kv_cache_params.num_cached_tokens_per_seq = [6, 1, 1]
    with pytest.raises(MsaInputError, match="num_requests 3 exceeds max_num_requests 2"):
        graph.prepare()


def test_a_padding_row_corrected_below_its_query_writes_its_own_first_slot(current_host):
    """A verify row of 4 tokens whose kv length is corrected to 2 (a CUDA-graph padding row): its
    first two tokens sit before any key. The host's on_update_kv_lens (NVIDIA/TensorRT-LLM
    msa_backend.py at 57ea1cdf and 12b1dd65) gives them the row's own first slot, block_table[row, 0]
    * page; -1 would reach the host's write_kv_slots as page -1, the pool's last page."""
    backend = _backend()
    plugin, _ = _classes()
    page = 4
    manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64)
    tables = {0: [3, 9, 4], 1: [12, 6]}
    for rid, table in tables.items():
        manager.add_sequence(rid, table)
    meta = _metadata(backend.Metadata, manager, seq_lens=[4, 4], cached=[6, 1], max_num_tokens=8)
    meta.prepare()
    meta.kv_lens_cuda[:2] = torch.tensor([10, 2], dtype=torch.int32)
    meta.on_update_kv_lens()
    # row 0: positions 6..9 -> pages 9, 9, 4, 4; row 1: positions -2, -1, 0, 1 -> page 12's slots 0, 0, 0, 1
    assert meta.msa_out_cache_loc.tolist() == [38, 39, 16, 17, 48, 48, 48, 49]
    assert meta.m3_eagle_step.cache_slots.tolist() == [38, 39, 16, 17, -1, -1, 48, 49]  # the step's own: no slot
    assert meta.msa_n_valid_blocks[:8].tolist() == [2, 2, 3, 3, 1, 1, 1, 1]


def test_a_padding_row_corrected_below_its_query_publishes_one_valid_block(current_host):
    """The same padding row's counts: the pre-#18872 host's on_update_kv_lens (NVIDIA/TensorRT-LLM
    msa_backend.py at 57ea1cdf, the hosts this plugin serves) publishes ceil(max(position + 1, 1) /
    page), at least 1, "which keeps degenerate (graph-padding) rows from -inf-masking every block,
    which would NaN the fully-masked GQA row" (12b1dd65's kernels accept 0; 1 costs a discarded
    row nothing there). The step keeps its own 0 (it sees no block); only the host's buffer is clamped."""
    backend = _backend()
    plugin, _ = _classes()
    page = 4
    manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64, spec_config=_spec())
    manager.add_sequence(0, [3, 9, 4])
    manager.add_sequence(1, [12, 6])
    meta = _metadata(backend.Metadata, manager, seq_lens=[4, 4], cached=[6, 1], max_num_tokens=8)
    meta.prepare()
    meta.kv_lens_cuda[:2] -= torch.tensor([0, 3], dtype=torch.int32, device=meta.kv_lens_cuda.device)
    meta.on_update_kv_lens()
    host_rule = [-(-max(k - 4 + t + 1, 1) // page) for k in (10, 2) for t in range(4)]
    assert meta.msa_n_valid_blocks[:8].tolist() == host_rule == [2, 2, 3, 3, 1, 1, 1, 1]
    assert meta.m3_eagle_step.valid_blocks.tolist() == [2, 2, 3, 3, 0, 0, 1, 1]


def test_the_decode_scratch_is_no_larger_than_max_num_tokens(current_host):
    """4 sequences with max_draft_len 3 would be 16 decode tokens, but no step carries more than
    max_num_tokens (6): the host's own _msa_max_decode_tokens (NVIDIA/TensorRT-LLM msa_backend.py at
    12b1dd65) is min(max_num_sequences x (1 + draft_len), max_num_tokens, 16384), at least
    max_num_sequences. A full 6-token verify step still publishes every count."""
    backend = _backend()
    plugin, _ = _classes()
    manager = _make(plugin, num_layers=4, tokens_per_block=4, max_seq_len=64, spec_config=_spec())
    assert manager.max_draft_len == 3
    manager.add_sequence(0, [0, 1, 2])
    manager.add_sequence(1, [5, 6, 27])
    meta = _metadata(backend.Metadata, manager, seq_lens=[3, 3], cached=[6, 8], max_num_tokens=6, max_num_requests=4)
    assert meta.msa_n_valid_blocks.numel() == max(4, min(4 * (1 + 3), 6, 16384))
    meta.prepare()
    assert meta.msa_n_valid_blocks.tolist() == [2, 2, 3, 3, 3, 3]  # positions 6, 7, 8 and 8, 9, 10


def test_request_ids_past_the_steps_rows_are_not_read(current_host):
    """`request_ids` may name more requests than the step has rows (num_seqs, the length of seq_lens):
    as the host's own prepare (`request_ids[: num_seqs]`), only the first num_seqs tables are read,
    and the slots follow the per-token rule (position = cached + t)."""
    backend = _backend()
    plugin, _ = _classes()
    page = 4
    manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64)
    tables = {0: [0, 1, 2], 1: [5, 6, 27], 2: [3]}
    for rid, table in tables.items():
        manager.add_sequence(rid, table)
    meta = _metadata(backend.Metadata, manager, seq_lens=[2, 3], cached=[7, 9])
    meta.request_ids = [0, 1, 2]  # a third id with no row in this step
    meta.prepare()
    slots, valid, _, _ = naive_step_fields([tables[0], tables[1]], page, [2, 3], [9, 12])
    assert meta.msa_out_cache_loc[:5].tolist() == slots
    assert meta.msa_n_valid_blocks[:5].tolist() == valid


def _two_request_step(**meta_kwargs):
    """Verify rows of 2 and 3 tokens after 7 and 9 cached ones, pages of 4: (metadata, tables, page)."""
    backend = _backend()
    plugin, _ = _classes()
    page = 4
    manager = _make(plugin, num_layers=4, tokens_per_block=page, max_seq_len=64)
    tables = {0: [0, 1, 2], 1: [5, 6, 27]}
    for rid, table in tables.items():
        manager.add_sequence(rid, table)
    meta = _metadata(backend.Metadata, manager, seq_lens=[2, 3], cached=[7, 9], **meta_kwargs)
    return meta, list(tables.values()), page


def test_a_host_slot_buffer_longer_than_the_step_is_reset_past_its_tokens(current_host):
    """`msa_out_cache_loc` takes every token's slot and -1 past them (the publish contract), also
    when the host's buffer holds more entries than the step's max_num_tokens: a stale slot left
    there would be written by a kernel that reads past the live tokens."""
    meta, tables, page = _two_request_step(max_num_tokens=16)
    meta.msa_out_cache_loc = torch.full((24,), 5, dtype=torch.int32)  # 8 entries past the step's 16
    meta.prepare()
    slots, _, _, _ = naive_step_fields(tables, page, [2, 3], [9, 12])
    assert meta.msa_out_cache_loc[:5].tolist() == slots
    assert meta.msa_out_cache_loc[5:].tolist() == [-1] * 19


def test_the_per_token_fields_stand_after_the_hosts_own_kv_update(current_host, monkeypatch):
    """A host whose on_update_kv_lens republishes its own one-token-per-row fields (the last
    position of each row, as the double's prepare writes them): the plugin publishes after it, so
    the kernels read the per-token slots and counts of the corrected lengths, not the host's rows."""
    from m3_eagle_plugin.host.trtllm.msa_backend import HostMsaMetadata

    def host_update(self):
        page = self.kv_cache_manager.tokens_per_block
        rows = self.kv_cache_manager.get_block_ids_per_seq(self.request_ids[: self.num_seqs]).tolist()
        for i in range(self.num_seqs):
            pos = int(self.kv_lens_cuda[i]) - 1
            self.msa_out_cache_loc[i] = rows[i][pos // page] * page + pos % page
            self.msa_n_valid_blocks[i] = pos // page + 1

    monkeypatch.setattr(HostMsaMetadata, "on_update_kv_lens", host_update)
    meta, tables, page = _two_request_step()
    meta.prepare()
    meta.kv_lens_cuda[:2] = torch.tensor([8, 12], dtype=torch.int32)  # request 0 rejected its draft
    meta.on_update_kv_lens()
    slots, valid, _, _ = naive_step_fields(tables, page, [2, 3], [8, 12])
    assert meta.msa_out_cache_loc[:5].tolist() == slots == [6, 7, 109, 110, 111]
    assert meta.msa_n_valid_blocks[:5].tolist() == valid == [2, 2, 3, 3, 3]


def test_the_hosts_own_kv_update_runs_under_the_plugins(current_host):
    """The host's on_update_kv_lens re-derives state the plugin never publishes (at 57ea1cdf the
    decode plans' kv segment lengths and qo offsets; the double's `msa_plan_kv_lens` stands for
    them): the plugin's override must run it, or the host's plans keep the optimistic lengths."""
    meta, _, _ = _two_request_step()
    meta.prepare()
    assert meta.msa_plan_kv_lens.tolist() == [9, 12]
    meta.kv_lens_cuda[:2] = torch.tensor([8, 10], dtype=torch.int32)
    meta.on_update_kv_lens()
    assert meta.msa_plan_kv_lens.tolist() == [8, 10]
