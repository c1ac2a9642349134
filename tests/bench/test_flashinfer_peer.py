"""The FlashInfer peer: its layout conversions vs naive element-by-element constructions (CPU),
the bench integration against a naive fake FlashInfer (CPU), and the real FlashInfer ops vs the
torch reference (GPU with flashinfer installed; skipped otherwise)."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench import flashinfer_peer as fp
from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry, make_step, shuffled_block_tables
from m3_eagle_plugin.bench.kernel_suite import StepSet, flashinfer_fields, run_kernel_suite, selection_mismatch
from m3_eagle_plugin.bench.step_meta import build_step_meta
from m3_eagle_plugin.bench.table import format_table
from m3_eagle_plugin.cli import main as m3_main

from . import _fake_flashinfer

FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.fixture
def fresh_import_status():
    fp._import_status.cache_clear()
    yield
    fp._import_status.cache_clear()


def _meta(qo_lens, kv_lens, block, seed, width=None):
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-kv // block) for kv in kv_lens) + 3
    tables = shuffled_block_tables(kv_lens, block, pages, gen, width=width)
    return build_step_meta(qo_lens, kv_lens, tables, block)


# --- conversions ---------------------------------------------------------------------------------

def _naive_interleaved(k, v):
    p, h, b, d = k.shape
    out = torch.empty(p, h, b, 2 * d, dtype=k.dtype)
    for i in range(p):
        for j in range(h):
            for t in range(b):
                for e in range(d):
                    out[i, j, t, e] = k[i, j, t, e]
                    out[i, j, t, d + e] = v[i, j, t, e]
    return out


@pytest.mark.parametrize("dtype", [torch.float32] + ([FP8] if FP8 is not None else []))
def test_interleave_kv_matches_element_by_element_and_sm90_contract(dtype):
    geo = Geometry(q_heads=4, kv_heads=2, head_dim=3, index_heads=1, index_dim=4, block=2, topk=2)
    step = make_step(2, 3, 1, geo, kv_dtype=dtype, index_dtype=torch.float32, q_dtype=torch.float32,
                     device="cpu", seed=4)
    cache = step["cache"]  # K/V are strided views into a 3-sub-page pool, like production
    assert not cache.k.is_contiguous()
    packed = fp.interleave_kv(cache.k, cache.v)
    expect = _naive_interleaved(cache.k, cache.v)
    assert packed.is_contiguous() and packed.dtype == dtype
    assert torch.equal(packed.view(torch.uint8), expect.view(torch.uint8))
    k, v = fp.split_interleaved(packed)
    assert torch.equal(k.view(torch.uint8), cache.k.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), cache.v.view(torch.uint8))
    _fake_flashinfer._check_interleaved(k, v)  # the SM90 rule: halves of one dense allocation


@settings(max_examples=25, deadline=None, derandomize=True)
@given(p=st.integers(1, 5), h=st.integers(1, 3), b=st.integers(1, 4), d=st.integers(1, 5), seed=st.integers(0, 99))
def test_property_interleave_round_trips(p, h, b, d, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(p, 3, h * b * d, generator=gen)
    k, v = pool[:, 0].view(p, h, b, d), pool[:, 1].view(p, h, b, d)
    packed = fp.interleave_kv(k, v)
    assert torch.equal(packed, _naive_interleaved(k, v))
    assert torch.equal(packed.reshape(-1, 2 * d)[:, :d], k.reshape(-1, d))
    assert torch.equal(packed.reshape(-1, 2 * d)[:, d:], v.reshape(-1, d))


def test_interleave_rejects_mismatched_kv():
    with pytest.raises(ValueError, match="differ"):
        fp.interleave_kv(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 4))


def test_page_table_replaces_padding_only():
    meta = _meta([2, 1], [5, 9], 4, 0, width=4)
    table = fp.page_table(meta)
    assert table.dtype == torch.int32 and table.is_contiguous()
    for r in range(2):
        for c in range(4):
            want = int(meta.block_tables[r, c])
            assert int(table[r, c]) == (want if want >= 0 else 0)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data(), block=st.integers(1, 6), seed=st.integers(0, 999))
def test_property_paged_kv_layout_addresses_every_token_like_our_tables(data, block, seed):
    n = data.draw(st.integers(1, 4))
    kv_lens = data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    qo_lens = [data.draw(st.integers(1, kv)) for kv in kv_lens]
    meta = _meta(qo_lens, kv_lens, block, seed)
    lay = fp.paged_kv_layout(meta)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in lay.values())
    indptr, indices = lay["paged_kv_indptr"].tolist(), lay["paged_kv_indices"].tolist()
    last = lay["paged_kv_last_page_len"].tolist()
    assert lay["qo_indptr"].tolist() == [sum(qo_lens[:i]) for i in range(n + 1)]
    assert len(indices) == indptr[-1]
    for r, kv in enumerate(kv_lens):
        pages = indices[indptr[r]:indptr[r + 1]]
        assert 1 <= last[r] <= block and (len(pages) - 1) * block + last[r] == kv
        for pos in range(kv):  # FlashInfer's address of every token == our table's
            assert pages[pos // block] == int(meta.block_tables[r, pos // block])
    for t, slot in enumerate(meta.cache_slots.tolist()):  # and the verify tokens land on our slots
        r, pos = int(meta.token_request[t]), int(meta.positions[t])
        pages = indices[indptr[r]:indptr[r + 1]]
        assert pages[pos // block] * block + pos % block == slot


def test_q2k_indices_and_topk_layouts():
    sel = torch.tensor([[[0, 2, -1], [1, 2, 3]]], dtype=torch.int64)  # [H=1, T=2, topk=3]
    same = fp.q2k_indices(sel, 1)
    assert same.dtype == torch.int32 and same.is_contiguous() and same.tolist() == sel.tolist()
    shared = fp.q2k_indices(sel, 3)
    assert shared.shape == (3, 2, 3) and shared.is_contiguous()
    assert all(shared[h].tolist() == sel[0].tolist() for h in range(3))
    with pytest.raises(ValueError, match="KV heads"):
        fp.q2k_indices(torch.zeros(2, 2, 3, dtype=torch.int32), 3)
    out = torch.arange(2 * 3 * 4, dtype=torch.int32).view(2, 3, 4)  # FlashInfer's [T, H, topk]
    ours = fp.selection_from_topk(out)
    assert ours.shape == (3, 2, 4)
    assert all(ours[h, t].tolist() == out[t, h].tolist() for t in range(2) for h in range(3))
    # one index head: the permuted view is already the contiguous [1, T, topk] FlashInfer reads
    one = fp.selection_from_topk(torch.zeros(5, 1, 16, dtype=torch.int32))
    assert one.is_contiguous() and fp.q2k_indices(one, 1).data_ptr() == one.data_ptr()


def test_index_cache_is_a_one_head_contiguous_copy():
    pool = torch.randn(3, 2, 4 * 5)
    index_k = pool[:, 1].view(3, 4, 5)
    got = fp.index_cache(index_k)
    assert got.shape == (3, 1, 4, 5) and got.is_contiguous()
    assert all(got[p, 0, b, d] == index_k[p, b, d] for p in range(3) for b in range(4) for d in range(5))


def test_local_block_is_last_column():
    assert fp.local_block_is_last_column(_meta([4, 4], [16, 16], 8, 0))       # tokens 12..15: block 1 of 2
    assert not fp.local_block_is_last_column(_meta([4, 4], [18, 18], 8, 0))  # tokens 14..17 straddle
    assert not fp.local_block_is_last_column(_meta([1, 1], [8, 20], 8, 0))    # request 0 ends early
    assert fp.max_k_tiles(_meta([1, 1], [8, 20], 8, 0)) == 3
    assert fp.uniform_q_len(_meta([3, 3], [8, 20], 8, 0)) == 3
    with pytest.raises(ValueError, match="one q_len"):
        fp.uniform_q_len(_meta([1, 2], [8, 20], 8, 0))


def test_graph_padding_tokens_do_not_hide_a_last_column_local_block():
    tables = shuffled_block_tables([16, 16], 8, 4, torch.Generator().manual_seed(0))
    padded = build_step_meta([4, 4], [16, 16], tables, 8, pad_tokens=2)  # live tokens 12..15: block 1 of 2
    assert fp.local_block_is_last_column(padded)


def test_parse_probe_output_marks_the_case_the_child_died_in():
    lines = [json.dumps({"case": [1, 8192, 4], "started": True}),
             json.dumps({"case": [1, 8192, 4], "flashinfer_nvp_us": 7.5, "flashinfer_nvp_check": 0.0}),
             "some warning the child printed",
             json.dumps({"case": [1, 8192, 1], "started": True})]
    cases = [(1, 8192, 4), (1, 8192, 1), (2, 8192, 4)]
    got = fp.parse_probe_output("\n".join(lines), "exit code -6: illegal memory access", cases)
    assert got[(1, 8192, 4)] == {"flashinfer_nvp_us": 7.5, "flashinfer_nvp_check": 0.0}
    assert got[(1, 8192, 1)]["flashinfer_nvp_error"].startswith("child process died in this case")
    assert got[(2, 8192, 4)]["flashinfer_nvp_error"].startswith("not run")
    assert all("illegal memory access" in got[c]["flashinfer_nvp_error"] for c in cases[1:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the child's failure path on a CPU machine")
def test_nvp_probe_child_runs_as_a_module_and_reports_per_case():
    got = fp.nvp_probe([(1, 256)], [4, 1], timeout_s=120)
    assert set(got) == {(1, 256, 4), (1, 256, 1)}
    assert all("flashinfer_nvp_error" in f and "not run" not in f["flashinfer_nvp_error"] for f in got.values()), got


def test_nvp_probe_child_measures_on_the_bench_device(monkeypatch):
    """`--device cuda:1`: the bench timed on cuda:1, but the num_valid_pages child, a fresh process,
    built its inputs and timed on its default cuda:0 (another GPU, perhaps busy or too small)."""
    import subprocess

    from m3_eagle_plugin.bench import kernel_suite

    commands = []
    monkeypatch.setattr(fp.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, "", ""))
    fp.nvp_probe([(1, 256)], [1], device=torch.device("cuda:1"))
    assert commands[0][-3:] == ["1x256", "1", "cuda:1"]
    made, current = [], []

    def step_set(*args, **kwargs):
        made.append(kwargs["device"])
        raise RuntimeError("inputs stop here")

    monkeypatch.setattr(kernel_suite, "StepSet", step_set)
    monkeypatch.setattr(fp.torch.cuda, "set_device", current.append)  # events and captures use the current one
    fp._probe_child([(1, 256)], [1], "cuda:1")
    assert made == [torch.device("cuda:1")] and current == [torch.device("cuda:1")]


# --- availability and the CPU path ---------------------------------------------------------------

def test_unavailable_flashinfer_is_reported_not_raised(monkeypatch, fresh_import_status):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import of flashinfer fails
    assert fp.flashinfer_available() is False and fp.flashinfer_importable() is False
    assert fp.flashinfer_status().startswith("unavailable")


def test_flashinfer_without_msa_ops_still_serves_the_prefill_peer(monkeypatch, fresh_import_status):
    fi, _ = _fake_flashinfer.make()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.msa_ops", None)
    assert fp.flashinfer_importable() and not fp.flashinfer_available()
    assert "msa_ops does not import" in fp.flashinfer_status()
    steps = _steps(9)
    assert _fields("dense_attn", steps, 2)["flashinfer_check"] < 1e-5
    assert "ModuleNotFoundError" in _fields("sparse_attn", steps, 2)["flashinfer_error"]


def test_cli_flashinfer_auto_without_flashinfer_adds_nothing(tmp_path, capsys, monkeypatch, fresh_import_status):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--qo-lens", "1", "--flashinfer", "auto",
                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and not any("flashinfer" in k for r in rows for k in r)
    assert "flashinfer" not in capsys.readouterr().out


def test_run_kernel_suite_rejects_unknown_kernels_before_any_work():
    with pytest.raises(ValueError, match="unknown kernel"):
        run_kernel_suite([(1, 128)], [1], ["bogus"], Geometry(), kv_dtype=torch.float32, index_dtype=torch.float32,
                         q_dtype=torch.float32, device=torch.device("cpu"), ceiling_gbps=1.0)


def test_table_shows_flashinfer_columns_and_cuts_long_errors():
    rows = [{"kernel": "sparse_attn", "graph_us": 10.0, "flashinfer_us": 25.0, "vs_flashinfer": 2.5,
             "flashinfer_api": "msa_sparse_decode_attention", "flashinfer_error": "x" * 200}]
    header, _, line = format_table(rows).splitlines()
    assert header.split() == ["kernel", "graph_us", "flashinfer_us", "vs_flashinfer", "flashinfer_error"]
    assert "msa_sparse" not in line and line.rstrip().endswith("...") and len(line) < 140


# --- the integration against a naive fake FlashInfer (CPU) ------------------------------------------

GEO = Geometry(q_heads=4, kv_heads=2, head_dim=8, index_heads=1, index_dim=8, block=4, topk=3)


def _install_fake(monkeypatch, **kw):
    fi, msa = _fake_flashinfer.make(**kw)
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.msa_ops", msa)
    fp._import_status.cache_clear()
    return fi


def _steps(context, kv_dtype=torch.float32):
    return StepSet(2, context, GEO, kv_dtype=kv_dtype, index_dtype=torch.float32, q_dtype=torch.float32,
                   device=torch.device("cpu"), num_sets=2, seed=3)


def _fields(name, steps, qo, **kw):
    return flashinfer_fields(name, steps, qo, fp.FlashInferPeer(), graph_us=2.0, **kw)


@pytest.mark.parametrize("qo", [1, 3])
def test_fake_flashinfer_sparse_and_dense_match_the_reference(monkeypatch, fresh_import_status, qo):
    _install_fake(monkeypatch)
    assert fp.flashinfer_available() and fp.flashinfer_status() == "0.7.4-fake"
    steps = _steps(22)
    for name in ("sparse_attn", "dense_attn"):
        got = _fields(name, steps, qo)
        assert "flashinfer_error" not in got, got
        assert got["flashinfer_timing"] == "cpu" and "flashinfer_note" not in got
        assert got["vs_flashinfer"] == pytest.approx(got["flashinfer_us"] / 2.0)
        assert got["flashinfer_check"] < 1e-5, (name, got)


def test_fake_flashinfer_dense_rows_time_both_wrapper_forms(monkeypatch, fresh_import_status):
    """The dense peer is the wrapper planned once for the row's lengths; its CUDA-graph form
    (fixed index buffers) is timed beside it, on the same inputs."""
    fi = _install_fake(monkeypatch)
    got = _fields("dense_attn", _steps(9), 2)
    assert "flashinfer_error" not in got, got
    assert "use_cuda_graph" not in got["flashinfer_api"] and "plan once" in got["flashinfer_api"]
    assert got["flashinfer_graph_wrapper_us"] > 0
    assert got["vs_flashinfer_graph_wrapper"] == pytest.approx(got["flashinfer_graph_wrapper_us"] / 2.0)
    assert {"prefill(use_cuda_graph=False)", "prefill(use_cuda_graph=True)"} <= set(fi.calls)


def test_fake_flashinfer_plan_run_plans_on_every_call(monkeypatch, fresh_import_status):
    fi = _install_fake(monkeypatch)
    step = _steps(9).step(0, 2)
    op = fp.FlashInferPeer().op("dense_attn_plan_run", step)
    assert op.api.startswith("plan + ")
    before = fi.calls.count("prefill.plan")
    outs = [op.run().clone() for _ in range(2)]
    assert fi.calls.count("prefill.plan") == before + 2
    cache = step["cache"]
    expect = ref.dense_attention(step["q"], cache.k, cache.v, step["meta"], scale=1 / math.sqrt(GEO.head_dim))
    for out in outs:
        assert float((out.double() - expect.double()).abs().max()) < 1e-5


def test_fake_flashinfer_eager_time_only_with_ours(monkeypatch, fresh_import_status):
    _install_fake(monkeypatch)
    steps = _steps(9)
    assert "flashinfer_eager_us" not in _fields("dense_attn", steps, 2)
    got = _fields("dense_attn", steps, 2, ours_eager=lambda: 3.0)
    assert got["flashinfer_eager_us"] > 0 and "flashinfer_error" not in got
    assert got["eager_us"] == 3.0
    assert got["vs_flashinfer_eager"] == pytest.approx(got["flashinfer_eager_us"] / 3.0)


def test_fake_flashinfer_eager_times_alternate_with_ours(monkeypatch, fresh_import_status):
    """Eager pairs run ours then FlashInfer, `rounds` times; the fields are the pairs' medians."""
    from m3_eagle_plugin.bench import kernel_suite

    _install_fake(monkeypatch)
    order, ours_times, theirs_times = [], iter([5.0, 1.0, 3.0]), iter([8.0, 6.0, 2.0])

    def ours_eager():
        order.append("ours")
        return next(ours_times)

    def fake_eager(thunks, **kw):
        order.append("flashinfer")
        return next(theirs_times)

    monkeypatch.setattr(kernel_suite, "time_eager_us", fake_eager)
    got = _fields("dense_attn", _steps(9), 2, rounds=3, ours=lambda: 1.0, ours_eager=ours_eager)
    assert order == ["ours", "flashinfer"] * 3
    assert got["eager_us"] == 3.0 and got["flashinfer_eager_us"] == 6.0
    assert got["vs_flashinfer_eager"] == pytest.approx(2.0)


def test_fake_flashinfer_fp8_scales_reach_the_ops(monkeypatch, fresh_import_status):
    if FP8 is None:
        pytest.skip("no float8 in this torch")
    _install_fake(monkeypatch)
    steps = _steps(13, kv_dtype=FP8)  # k_scale / v_scale 0.05 / 0.04
    for name in ("sparse_attn", "dense_attn"):
        got = _fields(name, steps, 2)
        assert got["flashinfer_check"] < 1e-4, (name, got)


def test_fake_flashinfer_selection_with_forced_local_block_matches_ours(monkeypatch, fresh_import_status):
    _install_fake(monkeypatch)
    steps = _steps(16)  # q_len 3: tokens 13..15 all in the last block, so force_end_blocks=1 is our rule
    got = _fields("index_select", steps, 3)
    assert "flashinfer_error" not in got, got
    assert got["flashinfer_api"].endswith("msa_topk_select(force_end_blocks=1)")
    assert got["flashinfer_check"] == 0.0
    assert {"flashinfer_score_us", "flashinfer_topk_us", "flashinfer_us"} <= set(got)
    step_fields = _fields("sparse_step", steps, 3)
    assert step_fields["flashinfer_sel_mismatch"] == 0.0 and step_fields["flashinfer_check"] < 1e-5


def test_fake_flashinfer_other_selection_rule_is_reported_not_failed(monkeypatch, fresh_import_status):
    _install_fake(monkeypatch)
    steps = _steps(14)  # q_len 4: tokens 10..13 straddle blocks 2 and 3
    got = _fields("index_select", steps, 4)
    assert "force_end_blocks=0" in got["flashinfer_api"] and "not forced" in got["flashinfer_note"]
    assert 0.0 <= got["flashinfer_check"] <= 1.0 and "flashinfer_error" not in got
    # the step is still checked on FlashInfer's own selection
    assert _fields("sparse_step", steps, 4)["flashinfer_check"] < 1e-5


def test_fake_flashinfer_decode_refusal_falls_back_to_the_prefill_form(monkeypatch, fresh_import_status):
    _install_fake(monkeypatch, refuse_decode=True)
    got = _fields("sparse_attn", _steps(9), 2)
    assert got["flashinfer_api"] == "msa_sparse_attention" and "group size" in got["flashinfer_note"]
    assert got["flashinfer_check"] < 1e-5


@pytest.mark.parametrize("broken, name, expect", [
    (("msa_sparse_decode_attention", "msa_sparse_attention"), "sparse_attn", "msa_sparse_attention"),
    (("msa_topk_select",), "index_select", "topk_select: RuntimeError: fake msa_topk_select failure"),
    (("prefill.run",), "dense_attn", "fake prefill.run failure"),
])
def test_failures_become_flashinfer_error_strings(monkeypatch, fresh_import_status, broken, name, expect):
    _install_fake(monkeypatch, broken=broken)
    got = _fields(name, _steps(9), 1)
    assert expect in got["flashinfer_error"] and "flashinfer_us" not in got and "vs_flashinfer" not in got
    if name == "index_select":  # the stage that works is still timed
        assert got["flashinfer_score_us"] > 0


def test_broken_peer_skips_everything(monkeypatch, fresh_import_status):
    fi = _install_fake(monkeypatch)
    peer = fp.FlashInferPeer()
    peer.broken = "CUDA unusable after FlashInfer topk_select: illegal memory access"
    got = flashinfer_fields("dense_attn", _steps(9), 1, peer, graph_us=1.0)
    assert got == {"flashinfer_error": f"skipped: {peer.broken}"} and fi.calls == []


def test_a_failure_that_leaves_cuda_unusable_stops_the_row_at_once(monkeypatch, fresh_import_status):
    """index_select times three ops; once the first left CUDA unusable, no later one is called."""
    fi = _install_fake(monkeypatch, broken=("msa_proxy_score",))
    monkeypatch.setattr(fp, "cuda_poisoned", lambda: "illegal memory access")
    peer = fp.FlashInferPeer()
    got = flashinfer_fields("index_select", _steps(9), 1, peer, graph_us=2.0)
    assert fi.calls == ["msa_proxy_score"] and "fake msa_proxy_score failure" in got["flashinfer_error"]
    assert peer.broken == "CUDA unusable after FlashInfer proxy_score: illegal memory access"


def test_time_peer_falls_back_to_eager_when_capture_fails(monkeypatch):
    from m3_eagle_plugin.bench import timing

    def refuse(thunks):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(timing, "time_graph_us", refuse)
    monkeypatch.setattr(timing, "time_eager_us", lambda thunks: 12.5)
    monkeypatch.setattr(fp, "cuda_poisoned", lambda: None)
    us, how, why = fp.time_peer_us([lambda: None], torch.device("cuda"))
    assert (us, how) == (12.5, "eager") and "not permitted" in why
    monkeypatch.setattr(fp, "cuda_poisoned", lambda: "CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fp.time_peer_us([lambda: None], torch.device("cuda"))


def test_unknown_peer_op():
    with pytest.raises(ValueError, match="unknown FlashInfer op"):
        fp.FlashInferPeer().op("bogus", {})


# --- real FlashInfer on a GPU ----------------------------------------------------------------------

def _gpu_ready() -> bool:
    return torch.cuda.is_available() and FP8 is not None and fp.flashinfer_available()


needs_flashinfer = pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and flashinfer.msa_ops")


def _gpu_step(qo, geo=Geometry(), kv_dtype=FP8, batch=2, context=4096, seed=0):
    return make_step(batch, context, qo, geo, kv_dtype=kv_dtype, index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                     device="cuda", seed=seed)


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("qo", [1, 4])
def test_gpu_flashinfer_sparse_attention_matches_reference(qo):
    step = _gpu_step(qo)
    cache, meta, scale = step["cache"], step["meta"], 1 / math.sqrt(128)
    out = fp.FlashInferPeer().op("sparse_attn", step).run()
    expect = ref.sparse_attention(step["q"], cache.k, cache.v, meta, step["selection"], scale=scale,
                                  k_scale=cache.k_scale, v_scale=cache.v_scale)
    err = float((out.double() - expect.double()).norm() / expect.double().norm())
    assert err < 2e-2, err


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("qo", [1, 4])
def test_gpu_flashinfer_selection_format_and_step(qo):
    step = _gpu_step(qo, context=4096 + 128 * 3)
    meta, cache = step["meta"], step["cache"]
    op = fp.FlashInferPeer().op("sparse_step", step)
    out = op.run()
    sel = op.selection().cpu()
    assert sel.shape == (1, meta.positions.numel(), 16)
    valid = meta.valid_blocks.cpu()
    for t in range(sel.shape[1]):
        row = sel[0, t].tolist()
        ids = [i for i in row if i >= 0]
        assert row[: len(ids)] == sorted(set(ids)) and all(i < valid[t] for i in ids)  # ascending, -1 at the tail
    expect_sel = ref.select_blocks(step["index_q"], cache.index_k, meta, topk=16)
    print(f"q_len {qo}: FlashInfer vs our selection rows differing: {selection_mismatch(sel, expect_sel):.3f}")
    expect = ref.sparse_attention(step["q"], cache.k, cache.v, meta, fp.q2k_indices(op.selection(), 1),
                                  scale=1 / math.sqrt(128), k_scale=cache.k_scale, v_scale=cache.v_scale)
    err = float((out.double() - expect.double()).norm() / expect.double().norm())
    assert err < 2e-2, err


@needs_flashinfer
@pytest.mark.gpu
def test_gpu_flashinfer_dense_prefill_matches_reference():
    geo = Geometry(q_heads=64, kv_heads=4)
    step = _gpu_step(4, geo=geo, kv_dtype=torch.bfloat16, context=1024 + 37)
    cache = step["cache"]
    expect = ref.dense_attention(step["q"], cache.k, cache.v, step["meta"], scale=1 / math.sqrt(128))
    peer = fp.FlashInferPeer()
    for form in ("dense_attn", "dense_attn_graph", "dense_attn_plan_run"):
        out = peer.op(form, step).run()
        err = float((out.double() - expect.double()).norm() / expect.double().norm())
        assert err < 1e-2, (form, err)


@needs_flashinfer
@pytest.mark.gpu
def test_gpu_dense_peer_row():
    from m3_eagle_plugin.msa.kernels import triton_available

    if not triton_available(torch.device("cuda")):
        pytest.skip("our kernels need Triton")
    rows = run_kernel_suite([], [4], ["dense_peer"], Geometry(), kv_dtype=FP8, index_dtype=torch.bfloat16,
                            q_dtype=torch.bfloat16, device=torch.device("cuda"), ceiling_gbps=4000.0, num_sets=2,
                            time_reference=False, flashinfer="auto", log=lambda _: None)
    (row,) = rows
    assert row["kernel"] == "dense_attn_peer" and (row["batch"], row["context"], row["qo_len"]) == (8, 4096, 4)
    assert "flashinfer_us" in row or "flashinfer_error" in row
    if "flashinfer_us" in row:
        assert row["vs_flashinfer"] == pytest.approx(row["flashinfer_us"] / row["graph_us"])
        assert row["flashinfer_check"] < 1e-2
        assert row["vs_flashinfer_plan_run"] == pytest.approx(row["flashinfer_plan_run_eager_us"] / row["eager_us"])


def test_run_kernel_suite_wires_flashinfer_into_rows(monkeypatch, fresh_import_status):
    """The suite's plumbing on CPU: our kernels replaced by the torch reference, timing by constants."""
    from m3_eagle_plugin.bench import kernel_suite as ks

    fi = _install_fake(monkeypatch)
    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, geo: (lambda: _reference(name, step, geo),) * 2)
    monkeypatch.setattr(ks, "_bytes", lambda *a: (1000, 0))
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 4.0)
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: 2.0)
    monkeypatch.setattr(ks, "DENSE_PEER", {**ks.DENSE_PEER, "batch": 2, "context": 9, "qo_len": 2,
                                           "geo": Geometry(q_heads=4, kv_heads=2, head_dim=8, block=4)})
    probed = []
    monkeypatch.setattr(fp, "nvp_probe", lambda configs, qo_lens, device: probed.append((configs, qo_lens, device)) or {
        (2, 16, 3): {"flashinfer_nvp_us": 1.5}})
    kernels = ["index_select", "sparse_attn", "sparse_step", "dense_attn", "dense_peer"]
    rows = run_kernel_suite([(2, 16)], [3, 1], kernels, GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                            q_dtype=torch.float32, device=torch.device("cpu"), ceiling_gbps=1.0, num_sets=2,
                            time_reference=False, flashinfer="auto", log=lambda _: None)
    by = {(r["kernel"], r["qo_len"]): r for r in rows}
    for name in ("index_select", "sparse_attn", "sparse_step", "dense_attn"):
        for qo in (3, 1):
            row = by[(name, qo)]
            assert "flashinfer_error" not in row, row
            assert row["vs_flashinfer"] == pytest.approx(row["flashinfer_us"] / 2.0)
            assert (row["flashinfer_eager_us"], row["vs_flashinfer_eager"]) == (4.0, 1.0)  # ours eager 4.0 too
            assert row["flashinfer_check"] < 1e-5 or name == "index_select"
    assert by[("index_select", 3)]["flashinfer_check"] == 0.0  # forced local block == our rule here
    assert by[("index_select", 3)]["flashinfer_nvp_us"] == 1.5 and probed == [([(2, 16)], [3, 1], torch.device("cpu"))]
    peer_row = by[("dense_attn_peer", 2)]
    assert peer_row["goal"] == "vs_flashinfer >= 5" and isinstance(peer_row["meets_goal"], bool)
    assert peer_row["vs_flashinfer_eager"] == 1.0
    assert (peer_row["flashinfer_plan_run_eager_us"], peer_row["vs_flashinfer_plan_run"]) == (4.0, 1.0)
    assert by[("dense_attn", 3)]["vs_flashinfer_graph_wrapper"] == pytest.approx(
        by[("dense_attn", 3)]["flashinfer_graph_wrapper_us"] / 2.0)
    first_topk = fi.calls.index("msa_topk_select")
    assert all(c != "msa_topk_select" for c in fi.calls[:first_topk])
    assert "prefill.run" in fi.calls[:first_topk] and "msa_sparse_decode_attention" in fi.calls[:first_topk]
    assert "flashinfer_us" in format_table(rows).splitlines()[0]


def test_run_kernel_suite_with_flashinfer_off_never_calls_it(monkeypatch, fresh_import_status):
    """`--flashinfer off`: FlashInfer imports here, yet no row gains its fields and none of it runs;
    the dense rows run on `dense_kv_dtype`'s inputs, the sparse ones on `kv_dtype`'s."""
    from m3_eagle_plugin.bench import kernel_suite as ks

    fi = _install_fake(monkeypatch)
    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, geo: (lambda: _reference(name, step, geo),) * 2)
    monkeypatch.setattr(ks, "_bytes", lambda *a: (1000, 0))
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 4.0)
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: 2.0)
    rows = run_kernel_suite([(2, 16)], [1], ["sparse_attn", "dense_attn"], GEO, kv_dtype=torch.float32,
                            index_dtype=torch.float32, q_dtype=torch.float32, device=torch.device("cpu"),
                            ceiling_gbps=1.0, num_sets=1, dense_kv_dtype=torch.float16, time_reference=False,
                            flashinfer="off", log=lambda _: None)
    assert fi.calls == [] and not any(k.startswith("flashinfer") for r in rows for k in r)
    assert [(r["kernel"], r["kv_dtype"]) for r in rows] == [("sparse_attn", "float32"), ("dense_attn", "float16")]


def _reference(name, step, geo):
    meta, cache, q = step["meta"], step["cache"], step["q"]
    scale = 1 / math.sqrt(geo.head_dim)
    if name == "index_select":
        return ref.select_blocks(step["index_q"], cache.index_k, meta, topk=geo.topk)
    if name == "sparse_attn":
        return ref.sparse_attention(q, cache.k, cache.v, meta, step["selection"], scale=scale)
    if name == "sparse_step":
        sel = ref.select_blocks(step["index_q"], cache.index_k, meta, topk=geo.topk)
        return ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale)
    return ref.dense_attention(q, cache.k, cache.v, meta, scale=scale)


def test_rounds_alternate_ours_and_flashinfer_and_report_medians(monkeypatch, fresh_import_status):
    """`--rounds`: pairs taken ours-then-theirs, medians reported, the derived fields follow them."""
    from m3_eagle_plugin.bench import kernel_suite as ks

    _install_fake(monkeypatch)
    order = []
    mine, theirs = iter([3.0, 4.0, 9.0]), iter([6.0, 2.0, 7.0, 9.5])

    def time_ours(*a):
        order.append("ours")
        return next(mine)

    def time_theirs(thunks, device):
        order.append("theirs")
        return next(theirs), "cpu", None
    monkeypatch.setattr(fp, "time_peer_us", time_theirs)
    got = _fields("sparse_attn", _steps(22), 2, rounds=3, ours=time_ours)
    assert order == ["theirs"] + ["ours", "theirs"] * 3  # the row's first timing, then the pairs
    assert got["ours_rounds_us"] == [3.0, 4.0, 9.0] and got["flashinfer_rounds_us"] == [2.0, 7.0, 9.5]
    assert got["graph_us"] == 4.0 and got["flashinfer_us"] == 7.0
    assert got["vs_flashinfer"] == pytest.approx(7.0 / 4.0) and got["faster_every_round"] is False
    assert got["flashinfer_check"] < 1e-5
    theirs = iter([8.0])
    one = _fields("sparse_attn", _steps(22), 2, rounds=1, ours=time_ours)  # rounds=1: ours is not re-timed
    assert "ours_rounds_us" not in one and "graph_us" not in one and one["vs_flashinfer"] == 8.0 / 2.0

    row = {"graph_us": 4.0, "torch_us": 40.0, "floor_us": 3.0}
    ks._derive(row)
    assert row["vs_torch"] == 10.0 and row["pct_of_floor"] == 75.0


def test_run_kernel_suite_rounds_rewrite_rows_and_vs_q1(monkeypatch, fresh_import_status):
    from m3_eagle_plugin.bench import kernel_suite as ks

    _install_fake(monkeypatch)
    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, geo: (lambda: _reference(name, step, geo),) * 2)
    monkeypatch.setattr(ks, "_bytes", lambda *a: (1000, 0))
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 4.0)
    times = iter([10.0, 20.0] + [1.0, 2.0, 3.0] + [4.0, 6.0, 8.0])  # run_case q3, q1; then rounds q3, q1
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: next(times))
    monkeypatch.setattr(fp, "time_peer_us", lambda thunks, device: (5.0, "cpu", None))
    rows = run_kernel_suite([(2, 16)], [3, 1], ["sparse_attn"], GEO, kv_dtype=torch.float32,
                            index_dtype=torch.float32, q_dtype=torch.float32, device=torch.device("cpu"),
                            ceiling_gbps=1.0, num_sets=2, time_reference=False, flashinfer="auto", rounds=3,
                            log=lambda _: None)
    by = {r["qo_len"]: r for r in rows}
    assert by[3]["ours_rounds_us"] == [1.0, 2.0, 3.0] and by[3]["graph_us"] == 2.0
    assert by[1]["ours_rounds_us"] == [4.0, 6.0, 8.0] and by[1]["graph_us"] == 6.0
    assert by[3]["faster_every_round"] is True and by[1]["faster_every_round"] is False
    assert by[3]["vs_q1"] == pytest.approx(2.0 / 6.0) and by[1]["vs_q1"] == 1.0
    assert by[3]["pct_of_floor"] == pytest.approx(100.0 * by[3]["floor_us"] / 2.0)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        run_kernel_suite([(2, 16)], [1], ["sparse_attn"], GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                         q_dtype=torch.float32, device=torch.device("cpu"), ceiling_gbps=1.0, rounds=0)


def test_peer_is_broken_only_by_a_failure_that_left_cuda_unusable(monkeypatch):
    peer = fp.FlashInferPeer()
    monkeypatch.setattr(fp, "cuda_poisoned", lambda: None)
    assert peer.broken_by("topk_select") is False and peer.broken is None
    monkeypatch.setattr(fp, "cuda_poisoned", lambda: "illegal memory access")
    assert peer.broken_by("plan + run") is True
    assert peer.broken == "CUDA unusable after FlashInfer plan + run: illegal memory access"


def test_run_kernel_suite_rounds_reach_the_dense_peer_row(monkeypatch, fresh_import_status):
    """`--rounds N` makes every FlashInfer row the medians of N alternating pairs, the issue's dense
    peer case (kernel `dense_peer`) too: its graph_us, vs_flashinfer and pct_of_floor follow them."""
    from m3_eagle_plugin.bench import kernel_suite as ks

    _install_fake(monkeypatch)
    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, geo: (lambda: _reference(name, step, geo),) * 2)
    monkeypatch.setattr(ks, "_bytes", lambda *a: (2000, 0))  # 2000 B at 1 GB/s: a 2 us floor
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 4.0)
    times = iter([10.0] + [1.0, 5.0, 3.0])  # run_case's timing, then the three rounds of ours
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: next(times))
    monkeypatch.setattr(fp, "time_peer_us", lambda thunks, device: (6.0, "cpu", None))
    monkeypatch.setattr(ks, "DENSE_PEER", {**ks.DENSE_PEER, "batch": 2, "context": 9, "qo_len": 2,
                                           "geo": Geometry(q_heads=4, kv_heads=2, head_dim=8, block=4)})
    rows = run_kernel_suite([], [2], ["dense_peer"], GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                            q_dtype=torch.float32, device=torch.device("cpu"), ceiling_gbps=1.0, num_sets=2,
                            time_reference=False, flashinfer="auto", rounds=3, log=lambda _: None)
    (row,) = rows
    assert row["kernel"] == "dense_attn_peer" and "flashinfer_error" not in row, row
    assert row["ours_rounds_us"] == [1.0, 5.0, 3.0] and row["graph_us"] == 3.0
    assert row["vs_flashinfer"] == pytest.approx(6.0 / 3.0) and row["meets_goal"] is False
    assert row["pct_of_floor"] == pytest.approx(100.0 * 2.0 / 3.0)


def test_a_flashinfer_call_timed_eagerly_is_compared_with_our_eager_time(monkeypatch, fresh_import_status):
    """FlashInfer's call not graph-capturable (`time_peer_us` falls back to eager): its eager time
    over our graph-replayed time (30 / 1 here) says nothing but host overhead. The ratio pairs one
    mode: its eager time over ours, the pair timed side by side (8 / 5), and --rounds does not
    pair our graph timings with its eager ones."""
    from m3_eagle_plugin.bench import kernel_suite as ks

    _install_fake(monkeypatch)

    def ours_kernel():
        return None

    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, geo: (ours_kernel, lambda: None))
    monkeypatch.setattr(ks, "_bytes", lambda *a: (1000, 0))
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 5.0 if thunks[0] is ours_kernel else 8.0)
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: 1.0)
    monkeypatch.setattr(fp, "time_peer_us", lambda thunks, device: (30.0, "eager", "not graph-capturable (x)"))
    rows = run_kernel_suite([(2, 16)], [3], ["sparse_attn"], GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                            q_dtype=torch.float32, device=torch.device("cpu"), ceiling_gbps=1.0, num_sets=2,
                            check=False, time_reference=False, flashinfer="auto", rounds=3, log=lambda _: None)
    (row,) = rows
    assert row["flashinfer_timing"] == "eager" and row["graph_us"] == 1.0 and "ours_rounds_us" not in row
    assert (row["eager_us"], row["flashinfer_us"]) == (5.0, 8.0)
    assert row["vs_flashinfer"] == pytest.approx(8.0 / 5.0) == row["vs_flashinfer_eager"]

    monkeypatch.setattr(fp, "time_peer_us", lambda thunks, device: (30.0, "eager", None))
    alone = flashinfer_fields("sparse_attn", _steps(22), 2, fp.FlashInferPeer(), graph_us=1.0, eager_us=20.0)
    assert alone["vs_flashinfer"] == pytest.approx(30.0 / 20.0)  # no eager pairs: the row's eager time


def test_a_tied_round_is_not_a_win_and_the_dense_goal_is_met_at_exactly_5x(monkeypatch, fresh_import_status):
    """`faster_every_round` says whether ours won every pair: a pair of equal times is no win. The
    dense peer's goal reads `vs_flashinfer >= 5`: met at exactly 5x (15 us / 3 us)."""
    from m3_eagle_plugin.bench import kernel_suite as ks

    _install_fake(monkeypatch)
    ours = iter([2.0, 3.0, 3.0])
    monkeypatch.setattr(fp, "time_peer_us", lambda thunks, device: (3.0, "cpu", None))
    tied = _fields("sparse_attn", _steps(22), 2, rounds=3, ours=lambda: next(ours))
    assert tied["ours_rounds_us"] == [2.0, 3.0, 3.0] and tied["flashinfer_rounds_us"] == [3.0, 3.0, 3.0]
    assert tied["faster_every_round"] is False

    monkeypatch.setattr(ks, "_kernel_thunks", lambda name, step, geo: (lambda: _reference(name, step, geo),) * 2)
    monkeypatch.setattr(ks, "_bytes", lambda *a: (2000, 0))
    monkeypatch.setattr(ks, "time_eager_us", lambda thunks, **kw: 4.0)
    monkeypatch.setattr(ks, "time_graph_us", lambda thunks, **kw: 3.0)
    monkeypatch.setattr(fp, "time_peer_us", lambda thunks, device: (15.0, "cpu", None))
    monkeypatch.setattr(ks, "DENSE_PEER", {**ks.DENSE_PEER, "batch": 2, "context": 9, "qo_len": 2,
                                           "geo": Geometry(q_heads=4, kv_heads=2, head_dim=8, block=4)})
    (row,) = run_kernel_suite([], [2], ["dense_peer"], GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                              q_dtype=torch.float32, device=torch.device("cpu"), ceiling_gbps=1.0, num_sets=2,
                              time_reference=False, flashinfer="auto", log=lambda _: None)
    assert row["vs_flashinfer"] == 5.0 and row["meets_goal"] is True
