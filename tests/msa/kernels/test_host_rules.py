"""Host-side rules of the kernel package checked against hand values and the documented rules
(docstrings, README): grid limits, metadata checks, step buffers, the kernel table's nearest row and
choice, the backend's refusals and report, replay signatures, the paired-V and split rules.
No kernel is launched."""
from __future__ import annotations

import types

import pytest
import torch

from m3_eagle_plugin.msa.kernels import _common
from m3_eagle_plugin.msa.kernels import kernel_table as kt
from m3_eagle_plugin.msa.kernels._common import (MAX_GRID_YZ, KernelInputError, KernelTooLargeError, check_grid,
                                                 check_meta, check_same_device, step_buffer)

CPU = torch.device("cpu")


class _Meta:
    """A metadata stand-in a recording can refer to weakly (a SimpleNamespace cannot be)."""


# --- _common: grid limit ----------------------------------------------------------------------------------

@pytest.mark.parametrize("grid", [(1, 65535, 1), (1, 1, 65535), (10**6, 65535, 65535)])
def test_grid_at_cudas_y_z_limit_is_taken(grid):
    assert MAX_GRID_YZ == 65535  # CUDA's documented gridDim.y / gridDim.z maximum
    check_grid("k", grid, "axes")


@pytest.mark.parametrize("grid", [(1, 65536, 1), (1, 1, 65536), (1, 65536)])
def test_grid_past_cudas_y_or_z_limit_is_refused_naming_the_axes(grid):
    with pytest.raises(KernelTooLargeError, match=r"\(requests, heads\)"):
        check_grid("k", grid, "requests, heads")


# --- _common: metadata and device checks ----------------------------------------------------------------

def _meta(requests=2, width=3, **over):
    meta = types.SimpleNamespace(block_tables=torch.zeros(requests, width, dtype=torch.int32),
                                 kv_lens=torch.ones(requests, dtype=torch.int32),
                                 cu_qo_lens=torch.arange(requests + 1, dtype=torch.int32),
                                 positions=torch.zeros(requests, dtype=torch.int32))
    for k, v in over.items():
        setattr(meta, k, v)
    return meta


def test_check_meta_takes_a_well_formed_step():
    check_meta(_meta(), CPU)
    # a one-column table may have any column stride (a column of a wider table)
    column = torch.zeros(4, 2, dtype=torch.int32).t()[:, :1]
    assert column.shape == (2, 1) and column.stride(1) == 2
    check_meta(_meta(block_tables=column), CPU)


def test_check_meta_refuses_metadata_without_a_block_table_naming_the_field():
    """A missing field is named (`KernelInputError`), the block table as any other: not an
    AttributeError from reading its dtype."""
    meta = _meta()
    del meta.block_tables
    with pytest.raises(KernelInputError, match="lacks field 'block_tables'"):
        check_meta(meta, CPU)


def test_check_meta_refuses_a_block_table_not_int32():
    with pytest.raises(KernelInputError, match="int32"):
        check_meta(_meta(block_tables=torch.zeros(2, 3, dtype=torch.int64)), CPU)


def test_check_meta_refuses_a_two_column_block_table_without_unit_column_stride():
    strided = torch.zeros(2, 4, dtype=torch.int32)[:, ::2]  # 2 columns, column stride 2
    assert strided.shape[1] == 2 and strided.stride(1) == 2
    with pytest.raises(KernelInputError, match="unit column stride"):
        check_meta(_meta(block_tables=strided), CPU)


def test_check_meta_refuses_cu_qo_lens_not_one_longer_than_kv_lens():
    with pytest.raises(KernelInputError, match="num_requests \\+ 1"):
        check_meta(_meta(cu_qo_lens=torch.arange(2, dtype=torch.int32)), CPU)
    with pytest.raises(KernelInputError, match="num_requests \\+ 1"):  # one too many: as wrong
        check_meta(_meta(cu_qo_lens=torch.arange(4, dtype=torch.int32)), CPU)
    check_meta(_meta(), CPU, dense_fields=("kv_lens",))  # not asked for: not checked


def test_check_meta_refuses_a_block_table_with_fewer_rows_than_requests():
    """The kernels read row r of the block table for every request r < len(kv_lens): a shorter table
    would be read past its end."""
    with pytest.raises(KernelInputError, match="block_tables has 1 rows? for 2 requests"):
        check_meta(_meta(block_tables=torch.zeros(1, 3, dtype=torch.int32)), CPU)
    check_meta(_meta(block_tables=torch.zeros(3, 3, dtype=torch.int32)), CPU)  # graph capacity rows: taken


def test_check_same_device_compares_the_device_index_too():
    """cuda:1 is not cuda:0 (a kernel there would read another device's address as its own)."""
    here = torch.device("cuda", 0)
    check_same_device(here, a=types.SimpleNamespace(device=torch.device("cuda", 0)), b=None)
    with pytest.raises(KernelInputError, match="b is on cuda:1"):
        check_same_device(here, a=types.SimpleNamespace(device=torch.device("cuda", 0)),
                          b=types.SimpleNamespace(device=torch.device("cuda", 1)))


@pytest.mark.parametrize("value", ["1", "0", "y", "Y", "yes", "ON", " 1", "1 ", "t", "2", ""])
def test_interpreter_switch_reads_as_triton_reads_it(monkeypatch, value):
    """`triton_interpreting` (inline PTX off, TMA descriptors off the GPU) must agree with whether
    Triton itself interprets: `y` interprets, ` 1` does not."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _common.triton_interpreting() == bool(triton.knobs.runtime.interpret)


# --- _common: step buffers --------------------------------------------------------------------------------

@pytest.mark.parametrize("numel, size", [(1, 1), (4, 4), (5, 8), (8, 8), (9, 16)])
def test_step_buffer_is_the_next_power_of_two(numel, size):
    store: dict = {}
    buf = step_buffer(store, "cpu", numel, fill=7, min_numel=1)
    assert buf.numel() == numel and store[CPU].numel() == size
    assert bool((store[CPU] == 7).all())


def test_step_buffers_lists_only_the_buffers_made_for_the_device_asked():
    """`step_buffers(store, device)` is "every buffer `step_buffer` made in `store` for `device`": a
    reset of one device's hand-off (`reset_handoff`) must not fill another device's board, whose
    step may be between its scoring and its top-k. The meta device stands in for a second GPU."""
    store: dict = {}
    made = {}
    for device in ("cpu", "meta"):
        first = step_buffer(store, device, 2, fill=0, min_numel=2)
        second = step_buffer(store, device, 3, fill=0, min_numel=2)  # replaces the first (kept, retired)
        made[device] = [first.untyped_storage().data_ptr(), second.untyped_storage().data_ptr()]
    for device in ("cpu", "meta"):
        got = _common.step_buffers(store, device)
        assert {t.device.type for t in got} == {device}
        assert len(got) == 2 and [t.untyped_storage().data_ptr() for t in got] == made[device]


# --- kernel_table: nearest row and the choice ---------------------------------------------------------------

def _row(kernel, batch, context, qo_len, ours, fi):
    return {"kernel": kernel, "batch": batch, "context": context, "qo_len": qo_len, "ours_us": ours,
            "flashinfer_us": fi}


def _table(rows, device="GPU X"):
    return kt.parse_table({"device": device, "date": "2026-12-01", "command": "m3-eagle bench", "rows": rows}, "t")


@pytest.fixture
def fresh_tables(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNEL_TABLE", raising=False)
    kt.clear_caches()
    yield
    kt.clear_caches()


def test_nearest_batch_is_by_ratio_not_difference(fresh_tables):
    """B10 between B4 and B16: |log2(16/10)| = 0.68 < |log2(10/4)| = 1.32, though 10 - 4 == 16 - 10."""
    table = _table([_row("sparse_attn", 4, 8192, 4, 10.0, 5.0), _row("sparse_attn", 16, 8192, 4, 10.0, 50.0)])
    assert table.nearest("sparse_attn", 10, 8192, 4).batch == 16


def test_choice_reads_the_nearest_of_several_measured_kernels(fresh_tables):
    """dense_attention is measured by dense_attn and dense_attn_peer: the nearer row of the two decides."""
    rows = [_row("dense_attn", 1, 8192, 4, 10.0, 50.0),        # far: ours faster
            _row("dense_attn_peer", 16, 8192, 4, 10.0, 5.0)]   # near: FlashInfer faster
    choice = kt.choose("dense_attention", batch=16, context=8192, q_len=4, device_name="GPU X",
                       eligible=(True, ""), table=_table(rows))
    assert choice.row.kernel == "dense_attn_peer" and choice.backend == "flashinfer"


def test_equal_times_are_ours(fresh_tables):
    """FlashInfer only where its time is lower (module docstring): a tie stays ours."""
    choice = kt.choose("sparse_attention", batch=16, context=8192, q_len=4, device_name="GPU X",
                       eligible=(True, ""), table=_table([_row("sparse_attn", 16, 8192, 4, 10.0, 10.0)]))
    assert choice.backend == "triton"


@pytest.mark.parametrize("field, value", [("batch", True), ("context", True), ("ours_us", 0), ("ours_us", 0.0),
                                          ("flashinfer_us", 0), ("ours_us", -1.0)])
def test_a_boolean_count_or_a_non_positive_time_is_refused(fresh_tables, field, value):
    """Counts are positive ints (JSON true is not one), times positive (module docstring)."""
    row = _row("sparse_attn", 16, 8192, 4, 10.0, 5.0)
    row[field] = value
    with pytest.raises(kt.KernelTableError, match=f"rows\\[0\\].{field}"):
        _table([row])


def test_bench_rows_without_our_graph_time_are_left_out(fresh_tables):
    """ours = graph_us: a bench row without a positive one measures nothing of ours."""
    rows = [{"kernel": "sparse_attn", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": None,
             "flashinfer_us": 3.0},
            {"kernel": "sparse_attn", "batch": 4, "context": 8192, "qo_len": 1, "graph_us": 0.0},
            {"kernel": "sparse_attn", "batch": 8, "context": 8192, "qo_len": 4, "graph_us": 5.0,
             "flashinfer_timing": "graph"}]
    data = kt.table_from_bench_rows(rows, device="GPU Z", date="d", command="c")
    assert [(r["batch"], r["qo_len"]) for r in data["rows"]] == [(8, 4)]
    assert "note" not in data["rows"][0]  # timed as ours is (graph): nothing to note


# --- backend: step shape, tile refusals, report, write_step_kv -----------------------------------------------

def test_step_shape_counts_requests_by_kv_lens_and_falls_back_to_the_table_width():
    from m3_eagle_plugin.msa.kernels.backend import _step_shape

    meta = types.SimpleNamespace(kv_lens=torch.ones(3, dtype=torch.int32),
                                 block_tables=torch.zeros(5, 8, dtype=torch.int32),  # 2 padding rows
                                 block_size=64, max_kv_len=1000)
    assert _step_shape(meta) == (3, 1000)
    meta.max_kv_len = 0  # not kept: the block table's width x block size
    assert _step_shape(meta) == (3, 8 * 64)


def test_tile_refusal_follows_the_documented_shape_rules():
    from m3_eagle_plugin.msa.kernels.backend import _tile_refusal

    q = torch.zeros(2, 8, 64)
    k = torch.zeros(4, 2, 16, 64)
    assert _tile_refusal(q, k, 16) is None
    assert "block 8" in _tile_refusal(q, k, 8)           # block under 16
    assert "block 48" in _tile_refusal(q, k, 48)         # block not a power of two
    q48 = torch.zeros(2, 48, 64)                         # a GQA group of 48 over one KV head
    k1 = torch.zeros(4, 1, 16, 64)
    assert "power of two" in _tile_refusal(q48, k1, 16)
    assert _tile_refusal(q48, k1, 16, padded_rows=48) is None  # "or at most padded_rows"
    assert "at most 32" in _tile_refusal(q48, k1, 16, padded_rows=32)


def test_tile_refusal_judges_the_group_per_kv_head_not_the_head_count():
    """"The group must be a power of two": 12 query heads over 3 KV heads are groups of 4 (taken),
    12 over 2 are groups of 6 (refused)."""
    from m3_eagle_plugin.msa.kernels.backend import _tile_refusal

    q12 = torch.zeros(2, 12, 16)
    assert _tile_refusal(q12, torch.zeros(4, 3, 16, 16), 16) is None
    assert "group must be a power of two" in _tile_refusal(q12, torch.zeros(4, 2, 16, 16), 16)


def test_cache_refusal_takes_exactly_the_cache_dtypes_the_kernels_read():
    """The kernels read float32, float16, bfloat16 and fp8 caches (`CACHE_DTYPES`); an integer cache
    (int8, uint8) is refused as float64 is, so the dispatchers run the references instead."""
    from m3_eagle_plugin.msa.kernels.backend import _cache_refusal

    for dtype in _common.CACHE_DTYPES:
        assert _cache_refusal(k_cache=torch.zeros(1, dtype=dtype)) is None, dtype
    for dtype in (torch.int8, torch.uint8, torch.float64):
        assert "v_cache in" in _cache_refusal(k_cache=torch.zeros(1), v_cache=torch.zeros(1, dtype=dtype)), dtype


def test_report_under_torch_mode_says_torch_even_where_triton_could_run(monkeypatch):
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.setattr(backend, "triton_available", lambda device=None: True)
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    report = backend.backend_report("cpu")
    assert report["backend"] == "torch" and report["reason"] == "M3_EAGLE_KERNELS=torch"
    assert set(report["kernels"].values()) == {"torch"}


def test_write_step_kv_refuses_index_k_without_its_cache(monkeypatch):
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    k_cache = torch.zeros(2, 1, 16, 16)
    v_cache = torch.zeros(2, 1, 16, 16)
    with pytest.raises(KernelInputError, match="together"):
        backend.write_step_kv(k_cache, v_cache, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, 16),
                              torch.zeros(1, 1, 16), None, torch.zeros(1, 16))
    assert not k_cache.any()  # nothing written


# --- handoff -----------------------------------------------------------------------------------------------

def test_reset_board_puts_the_sentinel_back():
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels import handoff

    board = handoff.score_board("cpu", 8)
    board.view(torch.int32).fill_(0)
    handoff.reset_board("cpu")
    assert bool((handoff._BOARDS[CPU] == handoff.SENTINEL).all())


def test_a_reset_that_fails_while_raising_is_noted_on_the_error_it_leaves():
    """`reset_while_raising`: the step's own error propagates, the reset's failure noted on it."""
    import sys

    from m3_eagle_plugin.msa.kernels.handoff import reset_while_raising

    error = RuntimeError("the step's own failure")

    def failing_reset():
        raise ValueError("sticky CUDA error")
    reset_while_raising(error, failing_reset)
    if sys.version_info >= (3, 11):
        assert error.__notes__ == ["resetting the hand-off failed too: ValueError: sticky CUDA error"]


# --- replay signatures -------------------------------------------------------------------------------------

def test_tensor_signature_tells_shape_strides_dtype_device_and_alignment_apart():
    from m3_eagle_plugin.msa.kernels.replay import tensor_signature

    base = torch.zeros(4, 4)
    sig = tensor_signature(base)
    assert tensor_signature(torch.zeros(4, 4)) == sig
    others = [torch.zeros(4, 4).t().contiguous().t(),             # same shape, other strides
              torch.zeros(4, 4, dtype=torch.float16),             # other dtype
              torch.zeros(4, 4, device="meta"),                   # other device
              torch.zeros(17)[1:].view(4, 4)]                     # 4 bytes past 16-byte alignment
    assert others[0].shape == base.shape and others[0].stride() != base.stride()
    for other in others:
        assert tensor_signature(other) != sig, other


def test_call_signature_holds_the_metadata_fields_layout_and_host_values():
    from m3_eagle_plugin.msa.kernels.replay import call_signature

    table = torch.zeros(4, 4, dtype=torch.int32)
    meta = types.SimpleNamespace(block_tables=table, kv_lens=torch.ones(4, dtype=torch.int32), max_qo_len=1)
    x = torch.zeros(2)
    first = call_signature((x,), meta, ())
    meta.block_tables = table.t()  # same address and shape, other strides
    assert call_signature((x,), meta, ()) != first
    meta.block_tables = table
    assert call_signature((x,), meta, ()) == first
    meta.max_qo_len = 4
    assert call_signature((x,), meta, ()) != first
    one, other = torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)  # both alive: two addresses
    meta.valid_blocks = one
    with_valid = call_signature((x,), meta, ())
    meta.valid_blocks = other  # the index top-k reads it: another tensor is another call
    assert call_signature((x,), meta, ()) != with_valid


def test_call_signature_holds_the_metadata_block_size_and_the_kernels_environment(monkeypatch):
    """The block size the block table is read with is a metadata host value the signature holds
    (`META_FIELDS`), and each variable of `ENV_KEYS` is read by the kernel paths: a change of either
    is another call, never a replay of the old one."""
    from m3_eagle_plugin.msa.kernels.replay import ENV_KEYS, call_signature

    meta = types.SimpleNamespace(block_tables=torch.zeros(2, 2, dtype=torch.int32), block_size=64)
    x = torch.zeros(2)
    for name in ENV_KEYS:
        monkeypatch.delenv(name, raising=False)
    first = call_signature((x,), meta, ())
    meta.block_size = 128
    assert call_signature((x,), meta, ()) != first
    meta.block_size = 64
    assert call_signature((x,), meta, ()) == first
    for name in ENV_KEYS:
        monkeypatch.setenv(name, "0")
        assert call_signature((x,), meta, ()) != first, name
        monkeypatch.delenv(name)


def test_an_unhashable_scalar_runs_the_ordinary_path(monkeypatch):
    """A signature holding an unhashable scalar (a list) cannot key a recording: the call runs."""
    replay, replayer = _recording_replayer(monkeypatch)
    signature = replay.call_signature((torch.zeros(2),), _Meta(), ([1, 2],))
    assert replayer.call(signature, (torch.zeros(2),), _Meta(), lambda: "ran") == "ran"
    assert replayer.recordings == {}


def _recording_replayer(monkeypatch):
    """(the replay module, a Replayer that records on CPU: recording allowed, direct launches possible)."""
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels import launch as launch_mod, replay

    monkeypatch.setattr(replay, "_recording_allowed", lambda meta: True)
    monkeypatch.setattr(launch_mod, "direct_launch_possible", lambda: True)
    monkeypatch.delenv("M3_EAGLE_REPLAY", raising=False)
    return replay, replay.Replayer()


def test_a_signature_refused_max_refusals_times_is_not_recorded_again(monkeypatch):
    replay, replayer = _recording_replayer(monkeypatch)
    meta = types.SimpleNamespace()
    for _ in range(replay.MAX_REFUSALS + 3):
        replayer.call(("sig",), (torch.zeros(2),), meta, lambda: torch.zeros(3))  # a fill: refused
    assert replayer.recordings[("sig",)] == replay.MAX_REFUSALS


# --- split and tile rules ----------------------------------------------------------------------------------

def test_dense_splits_search_up_to_16_while_each_keeps_16_pages():
    """200 (request, KV head) units, 128 pages, 264 slots: the most is min(16, 128 // 16) = 8 splits;
    waves x pages over 1..8 = 128, 128, 129, 128, 104, 110, 114, 112: 5 splits (26 pages each)."""
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.dense_verify import default_splits

    assert default_splits(200, 1, 128, 0, CPU) == 5


def test_dense_two_page_splits_start_past_one_and_a_half_programs_a_sm():
    """One request, 64-row tile, one-page splits: 198 programs are exactly 1.5 a SM (of 132) and keep
    one page; 199 are more and become two-page splits."""
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.dense_verify import default_splits

    assert default_splits(1, 1, 198, 0, CPU, tile_rows=64) == 198
    assert default_splits(1, 1, 199, 0, CPU, tile_rows=64) == 100


def test_paired_v_default_is_off_on_a_tile_it_would_miscompute():
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.sparse_verify import _paired_v_for_tile

    assert _paired_v_for_tile(None, True, 64, 64, 64) is False   # tall, narrow dim, wide keys
    assert _paired_v_for_tile(None, True, 32, 64, 64) is True
    assert _paired_v_for_tile(None, False, 32, 64, 64) is False
    assert _paired_v_for_tile(False, True, 32, 64, 64) is False


def test_union_splits_bound_work_by_about_twice_topk():
    """A verify chunk's union holds about 2 x topk blocks, a single token's topk (docstring)."""
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.sparse_verify import union_splits

    assert union_splits(1, 4, 16, CPU) == 32   # 264 programs wanted, 2 x 16 union entries at most
    assert union_splits(1, 1, 16, CPU) == 16
    assert union_splits(64, 4, 16, CPU) == 5   # ceil(264 / 64)


def test_recordings_per_entry_point_stay_at_most_max_recordings(monkeypatch):
    replay, replayer = _recording_replayer(monkeypatch)
    meta = _Meta()  # weakly referenced by a recording
    sizes = []
    for i in range(replay.MAX_RECORDINGS + 1):
        replayer.call(("sig", i), (torch.zeros(2),), meta, lambda: torch.empty(2))  # recorded: a fresh result
        sizes.append(len(replayer.recordings))
    assert sizes[replay.MAX_RECORDINGS - 1] == replay.MAX_RECORDINGS and max(sizes) == replay.MAX_RECORDINGS


# --- _common: tiles and per-call checks -----------------------------------------------------------------------

def test_a_bound_equal_to_the_tile_fits_one_tile():
    assert _common.fits_one_tile(4, 4) and _common.fits_one_tile(1, 4)
    assert not _common.fits_one_tile(5, 4) and not _common.fits_one_tile(None, 4)


def test_check_cache_block_refuses_pages_of_another_size_than_the_metadata():
    _common.check_cache_block("k_cache", 64, types.SimpleNamespace(block_size=64))
    _common.check_cache_block("k_cache", 64, types.SimpleNamespace())  # no host value: nothing to compare
    with pytest.raises(KernelInputError, match="k_cache has 64-token pages but the metadata's block_size is 32"):
        _common.check_cache_block("k_cache", 64, types.SimpleNamespace(block_size=32))


def test_check_step_rows_takes_graph_padding_rows_and_refuses_too_few():
    meta = types.SimpleNamespace(positions=torch.zeros(3, dtype=torch.int32))
    _common.check_step_rows("q", torch.zeros(3, 2), meta)
    _common.check_step_rows("q", torch.zeros(8, 2), meta)  # rows past the metadata's tokens: graph padding
    with pytest.raises(KernelInputError, match="q has 2 rows, fewer than the metadata's 3 tokens"):
        _common.check_step_rows("q", torch.zeros(2, 2), meta)
