"""The byte floor of the kernel rows (GPU) and the CPU smoke table: one function, checked by hand and
against a per-request, per-block tally on random steps."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench.inputs import Geometry, selected_tokens, union_blocks
from m3_eagle_plugin.bench.kernel_suite import byte_floor, relative_error, selection_mismatch
from m3_eagle_plugin.bench.step_meta import build_step_meta

# block 4, head dim 4, 2 q heads / 1 KV head, index dim 3; q fp32 (4 bytes), index bf16 (2), K/V fp16 (2)
GEO = Geometry(q_heads=2, kv_heads=1, head_dim=4, index_heads=1, index_dim=3, block=4, topk=2)


@pytest.fixture
def step():
    # request 0: 6 tokens on pages [0, 1] (page 1 holds 2); request 1: 9 tokens on [2, 3, 4] (page 4 holds 1)
    tables = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    meta = build_step_meta([2, 2], [6, 9], tables, GEO.block, device="cpu")  # positions 4, 5 and 7, 8
    q = torch.zeros(4, 2, 4, dtype=torch.float32)
    index_q = torch.zeros(4, 1, 3, dtype=torch.bfloat16)
    # token 0: blocks 0, 1; token 1: 1; token 2: 1; token 3: 1, 2 -> unions {0, 1} (4 + 2 tokens), {1, 2} (4 + 1)
    selection = torch.tensor([[[0, 1], [1, -1], [1, -1], [1, 2]]], dtype=torch.int32)
    return meta, q, index_q, selection


def floor(name, step, **kw):
    meta, q, index_q, selection = step
    return byte_floor(name, meta, GEO, q=q, index_q=index_q, kv_dtype=torch.float16, index_dtype=torch.bfloat16,
                      selection=kw.get("selection", selection))


def test_byte_floor_by_hand_with_partial_last_pages(step):
    q_read = out_written = 4 * 2 * 4 * 4      # 4 tokens x 2 heads x dim 4 x fp32 = 128
    index_q_read = 4 * 1 * 3 * 2              # 24
    index_k = (6 + 9) * 3 * 2                 # valid tokens only: 90 (5 whole pages would be 120)
    dense_kv = (6 + 9) * 2 * 4 * 2            # K and V of 15 tokens: 240
    sparse_kv = (4 + 2 + 4 + 1) * 2 * 4 * 2   # 11 selected valid tokens: 176 (4 whole pages: 256)
    selection = 1 * 4 * 2 * 4                 # int32 [1, 4, 2]: 32
    assert floor("index_select", step) == (index_q_read + index_k + selection, 0)
    assert floor("sparse_attn", step) == (q_read + selection + sparse_kv + out_written, 4)
    assert floor("sparse_step", step) == (index_q_read + index_k + q_read + sparse_kv + out_written, 4)
    assert floor("dense_attn", step) == (q_read + dense_kv + out_written, 0)
    assert floor("kv_lens_update", step) == (0, 0)


def test_selected_tokens_counts_each_union_block_once(step):
    meta, _, _, selection = step
    assert union_blocks(selection, meta) == 4 and selected_tokens(selection, meta) == 11
    two_heads = torch.cat([selection, torch.full_like(selection, -1)])  # the second head selects nothing
    assert union_blocks(two_heads, meta) == 4 and selected_tokens(two_heads, meta) == 11


def test_selection_mismatch_is_the_fraction_of_rows_that_differ_anywhere():
    ours = torch.tensor([[[0, 1], [1, 2], [3, -1]]], dtype=torch.int32)
    other = torch.tensor([[[0, 1], [1, 3], [4, -1]]], dtype=torch.int32)  # rows 1 and 2 differ in one id each
    assert selection_mismatch(ours, other) == pytest.approx(2 / 3)
    assert selection_mismatch(ours, ours) == 0.0


def test_sparse_rows_need_the_selection(step):
    with pytest.raises(ValueError, match="needs the selection"):
        floor("sparse_attn", step, selection=None)


ELEM = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}


def tally_bytes(name, qo_lens, kv_lens, selection, geo, *, q_elem, kv_elem, index_elem):
    """The byte floor tallied request by request and block by block: each (KV head, request) reads
    each distinct selected block once, `min(block, kv_len - b * block)` of its tokens (0 for a block
    past the request's keys); queries, index queries and outputs of live tokens only."""
    live = sum(qo_lens)
    q_rw = 2 * live * geo.q_heads * geo.head_dim * q_elem
    index = live * geo.index_heads * geo.index_dim * index_elem
    for kv in kv_lens:  # index-K: every page of the request, the last one partly
        tokens = sum(min(geo.block, kv - b * geo.block) for b in range(-(-kv // geo.block)))
        index += tokens * geo.index_dim * index_elem
    if name == "index_select":
        return index + geo.index_heads * live * geo.topk * 4, 0
    if name == "dense_attn":
        return q_rw + geo.kv_heads * sum(kv_lens) * 2 * geo.head_dim * kv_elem, 0
    kv_bytes, union = 0, 0
    start = 0
    for kv, qo in zip(kv_lens, qo_lens):
        for h in range(selection.shape[0]):
            blocks = set()
            for t in range(start, start + qo):
                blocks |= {b for b in selection[h, t].tolist() if b >= 0}
            union += len(blocks)
            kv_bytes += sum(max(0, min(geo.block, kv - b * geo.block)) for b in blocks) * 2 * geo.head_dim * kv_elem
        start += qo
    if name == "sparse_attn":
        return q_rw + kv_bytes + selection.shape[0] * live * selection.shape[2] * 4, union
    return q_rw + kv_bytes + index, union


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_byte_floor_equals_a_per_request_per_block_tally(data):
    """Random geometry, requests (partial last pages, q_len mixes), graph padding, dtypes and a raw
    selection (any block id, invisible ones included, repeats across tokens, -1 anywhere)."""
    block = data.draw(st.sampled_from([4, 16]))
    kv_heads = data.draw(st.integers(1, 3))
    geo = Geometry(q_heads=kv_heads * data.draw(st.integers(1, 3)), kv_heads=kv_heads,
                   head_dim=data.draw(st.sampled_from([4, 8])), index_heads=data.draw(st.integers(1, 2)),
                   index_dim=data.draw(st.sampled_from([3, 8])), block=block, topk=data.draw(st.integers(1, 4)))
    qo_lens = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    kv_lens = [q + data.draw(st.integers(0, 3 * block)) for q in qo_lens]
    pad = data.draw(st.integers(0, 3))
    width = max(-(-kv // block) for kv in kv_lens)
    tables = torch.arange(len(kv_lens) * width, dtype=torch.int32).reshape(len(kv_lens), width)
    meta = build_step_meta(qo_lens, kv_lens, tables, block, device="cpu", pad_tokens=pad)
    total = sum(qo_lens) + pad
    q_dtype, kv_dtype, index_dtype = (data.draw(st.sampled_from(list(ELEM))) for _ in range(3))
    q = torch.zeros(total, geo.q_heads, geo.head_dim, dtype=q_dtype)
    index_q = torch.zeros(total, geo.index_heads, geo.index_dim, dtype=index_dtype)
    ids = st.integers(-1, width + 1)
    selection = torch.tensor(data.draw(st.lists(st.lists(st.lists(ids, min_size=geo.topk, max_size=geo.topk),
                                                          min_size=total, max_size=total),
                                                 min_size=kv_heads, max_size=kv_heads)), dtype=torch.int32)
    for name in ("index_select", "sparse_attn", "sparse_step", "dense_attn"):
        got = byte_floor(name, meta, geo, q=q, index_q=index_q, kv_dtype=kv_dtype, index_dtype=index_dtype,
                         selection=selection)
        expect = tally_bytes(name, qo_lens, kv_lens, selection, geo, q_elem=ELEM[q_dtype], kv_elem=ELEM[kv_dtype],
                             index_elem=ELEM[index_dtype])
        assert got == expect, name


def test_relative_error_is_infinite_where_either_side_is_not_finite():
    """NaN compares false with every tolerance, so a NaN error would pass `error < tol` checks
    written as `not error >= tol`, and reads as "unverified" in the table: inf names the failure."""
    good = torch.ones(4)
    bad = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    assert relative_error(bad, good) == math.inf
    assert relative_error(good, bad) == math.inf
    assert relative_error(good * 1.5, good) == pytest.approx(0.5)


# kv_lens_update rows: B2, context 10, q_len 3, block 4; the row corrects every kv_len 10 -> 9
KV_GEO = Geometry(q_heads=2, kv_heads=1, head_dim=8, index_heads=1, index_dim=8, block=4, topk=2)


def _kv_update_step():
    from m3_eagle_plugin.bench.kernel_suite import StepSet

    steps = StepSet(2, 10, KV_GEO, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                    device=torch.device("cpu"), num_sets=1)
    return steps, steps.step(0, 3)


def test_kv_lens_update_reference_runs_the_torch_ops_not_the_fused_kernel(monkeypatch):
    """On CUDA with Triton, `MsaDecodeMetadata.on_update_kv_lens` dispatches to the fused kernel:
    the row's reference must not, else it checks and times the kernel against itself."""
    from m3_eagle_plugin.bench.kernel_suite import _kernel_thunks
    from m3_eagle_plugin.msa import MsaDecodeMetadata

    dispatched = []
    monkeypatch.setattr(MsaDecodeMetadata, "_fused_kv_lens_update",
                        lambda self: lambda meta, kv: dispatched.append(kv))  # as on a CUDA device
    _, step = _kv_update_step()
    _, reference = _kernel_thunks("kv_lens_update", step, KV_GEO)
    reference()
    meta, table = step["msa_meta"], step["meta"].block_tables
    assert dispatched == []
    assert meta.kv_lens.tolist() == [9, 9] and meta.qo_offsets.tolist() == [6, 6]
    assert meta.positions.tolist() == [6, 7, 8] * 2 and meta.token_kv_lens.tolist() == [7, 8, 9] * 2
    assert meta.valid_blocks.tolist() == [2, 2, 3] * 2
    slots = [int(table[r, p // 4]) * 4 + p % 4 for r in range(2) for p in (6, 7, 8)]
    assert meta.cache_slots.tolist() == slots


@pytest.mark.parametrize("field", ["kv_lens", "qo_offsets", "positions", "token_kv_lens", "valid_blocks",
                                   "cache_slots"])
def test_kv_lens_update_check_catches_a_kernel_that_skips_any_field(monkeypatch, field):
    """The reference writes the same buffers first: a field the kernel leaves alone must still count."""
    from m3_eagle_plugin.bench import kernel_suite as ks
    from m3_eagle_plugin.msa.kernels import kv_lens_update

    def fused_skipping_field(meta, kv):
        kept = getattr(meta, "_" + field).clone()
        n = meta.num_requests
        meta._kv_lens[:n].copy_(torch.minimum(kv, meta._kv_lens_staged[:n]).clamp(min=0))
        meta._derive_token_fields()
        getattr(meta, "_" + field).copy_(kept)

    monkeypatch.setattr(kv_lens_update, "on_update_kv_lens_fused", fused_skipping_field)
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 1.0)
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: 1.0)
    steps, _ = _kv_update_step()
    row = ks.run_case("kv_lens_update", steps, 3, ceiling_gbps=1.0, time_reference=False)
    assert row["error"] == 1.0


def test_a_suite_failing_part_way_carries_the_rows_it_finished(monkeypatch):
    """The rows measured before an error (out of memory at the next, larger shape) ride on it as
    `kernel_rows`; the CLI prints and writes them."""
    from m3_eagle_plugin.bench import kernel_suite

    class Steps:
        def __init__(self, batch, context, *args, **kwargs):
            self.batch, self.context = batch, context

    def run_case(name, steps, qo_len, **kwargs):
        if steps.batch == 64:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"kernel": name, "batch": steps.batch, "context": steps.context, "qo_len": qo_len, "graph_us": 1.0,
                "eager_us": 2.0}

    monkeypatch.setattr(kernel_suite, "StepSet", Steps)
    monkeypatch.setattr(kernel_suite, "run_case", run_case)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        kernel_suite.run_kernel_suite([(16, 4096), (64, 4096)], [4, 1], ["sparse_step", "dense_attn"], Geometry(),
                                      kv_dtype=torch.bfloat16, index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                                      device=torch.device("cpu"), ceiling_gbps=1.0, log=lambda msg: None)
    assert [(r["kernel"], r["batch"], r["qo_len"]) for r in caught.value.kernel_rows] == [
        ("sparse_step", 16, 4), ("sparse_step", 16, 1), ("dense_attn", 16, 4), ("dense_attn", 16, 1)]
    assert all(r["vs_q1"] == 1.0 for r in caught.value.kernel_rows)


def test_a_host_memory_error_part_way_carries_the_rows_too(monkeypatch):
    """`MemoryError` (host memory: building the next shape's inputs) is no RuntimeError; the CLI catches
    it as out of memory, so the finished rows must ride on it as well."""
    from m3_eagle_plugin.bench import kernel_suite

    class Steps:
        def __init__(self, batch, context, *args, **kwargs):
            if batch == 64:
                raise MemoryError()
            self.batch, self.context = batch, context

    def run_case(name, steps, qo_len, **kwargs):
        return {"kernel": name, "batch": steps.batch, "context": steps.context, "qo_len": qo_len, "graph_us": 1.0,
                "eager_us": 2.0}

    monkeypatch.setattr(kernel_suite, "StepSet", Steps)
    monkeypatch.setattr(kernel_suite, "run_case", run_case)
    with pytest.raises(MemoryError) as caught:
        kernel_suite.run_kernel_suite([(16, 4096), (64, 4096)], [4], ["sparse_step"], Geometry(),
                                      kv_dtype=torch.bfloat16, index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                                      device=torch.device("cpu"), ceiling_gbps=1.0, log=lambda msg: None)
    assert [(r["kernel"], r["batch"], r["qo_len"]) for r in caught.value.kernel_rows] == [("sparse_step", 16, 4)]


def test_the_dense_peer_alone_builds_no_config_inputs(monkeypatch):
    """`--kernels dense_peer` measures one row of its own shape (B8/4K, 64/4 heads), yet every
    `--configs` shape's input sets were built first (at the default 64x131072: three sets of 64K
    pages each, K/V and index-K), for no row, and could run out of memory naming `--configs`."""
    from m3_eagle_plugin.bench import kernel_suite

    built = []

    class Steps:
        def __init__(self, batch, context, *args, **kwargs):
            built.append((batch, context))

    peer_row = {"kernel": "dense_attn_peer", "batch": 8, "context": 4096, "qo_len": 4, "graph_us": 1.0}
    monkeypatch.setattr(kernel_suite, "StepSet", Steps)
    monkeypatch.setattr(kernel_suite, "run_dense_peer", lambda **kwargs: dict(peer_row))
    rows = kernel_suite.run_kernel_suite([(64, 131072), (16, 32768)], [4, 1], ["dense_peer"], Geometry(),
                                         kv_dtype=torch.bfloat16, index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                                         device=torch.device("cpu"), ceiling_gbps=1.0, log=lambda msg: None)
    assert rows == [peer_row] and built == []


def test_a_rows_byte_floor_is_the_mean_over_the_input_sets_it_times(monkeypatch):
    """graph_us is the time per call of calls rotating through every input set, and a step's own
    top-k selects unions of another size in each set: the row's floor must be the sets' mean
    (per-set hand tally here: 4992, 4480, 4992 bytes), not set 0's alone (4992)."""
    from m3_eagle_plugin.bench import kernel_suite as ks, torch_reference as ref
    from m3_eagle_plugin.msa.kernels import index_select

    geo = Geometry(q_heads=2, kv_heads=1, head_dim=8, index_heads=1, index_dim=8, block=4, topk=2)
    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, g: (lambda: None, lambda: None))
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 1.0)
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: 1.0)
    monkeypatch.setattr(index_select, "select_blocks_verify",  # the kernel's twin, on CPU
                        lambda iq, ik, meta, *, topk, **kw: ref.select_blocks(iq, ik, meta, topk=topk))
    steps = ks.StepSet(2, 37, geo, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                       device=torch.device("cpu"), num_sets=3, seed=0)
    row = ks.run_case("sparse_step", steps, 3, ceiling_gbps=1.0, check=False, time_reference=False)
    tallies = []
    for s in range(3):
        st = steps.step(s, 3)
        sel = ref.select_blocks(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk)
        tallies.append(tally_bytes("sparse_step", [3, 3], [37, 37], sel, geo, q_elem=4, kv_elem=4, index_elem=4))
    assert len(set(tallies)) > 1  # the sets really differ here
    assert row["bytes"] == pytest.approx(sum(b for b, _ in tallies) / 3)
    assert row["union_blocks"] == pytest.approx(sum(u for _, u in tallies) / 3)
    assert row["floor_us"] == pytest.approx(row["bytes"] / 1e3)


def test_relative_error_of_two_zero_outputs_is_zero_not_nan():
    """||out - expect|| / ||expect|| with both zero (every token of a row seeing no key gives zeros):
    the outputs agree, error 0; 0 / 0 gave NaN, which the table reads as unverified. A non-zero
    output against zeros stays a large finite error."""
    zeros = torch.zeros(3, 2)
    assert relative_error(zeros, zeros) == 0.0
    assert math.isfinite(relative_error(torch.ones(3, 2), zeros)) and relative_error(torch.ones(3, 2), zeros) > 1e20


def test_kv_lens_update_row_at_a_context_equal_to_its_q_len_stays_a_valid_step():
    """The CLI accepts a context equal to the longest q_len (test_cli_defaults); the row's corrected
    kv_len must still hold the step's q_len tokens (1 <= q_len <= kv_len, as build_step_meta and
    MsaDecodeMetadata.prepare demand): 3 - 1 = 2 left token 0 at position -1 and slot -1."""
    from m3_eagle_plugin.bench.kernel_suite import StepSet, _kernel_thunks

    steps = StepSet(2, 3, KV_GEO, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                    device=torch.device("cpu"), num_sets=1)
    step = steps.step(0, 3)
    _, reference = _kernel_thunks("kv_lens_update", step, KV_GEO)
    reference()
    meta, table = step["msa_meta"], step["meta"].block_tables
    assert meta.kv_lens.tolist() == [3, 3] and meta.positions.tolist() == [0, 1, 2] * 2
    assert meta.cache_slots.tolist() == [int(table[r, 0]) * 4 + p for r in range(2) for p in range(3)]
