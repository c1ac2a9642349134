"""The FlashInfer route of the dispatchers, on CPU against the naive fake FlashInfer
(tests/bench/_fake_flashinfer.py, written from FlashInfer's documented contracts): each eligibility
refusal names its cause, routed calls equal the torch references, `M3_EAGLE_KERNELS=flashinfer`
forces the route (or raises naming the cause), and `auto` follows the measured table.

The SM90 check is the one thing faked (`flashinfer_msa.device_capability` patched): the production
check itself is left as it is and tested on its own (`test_device_refusal_*`).
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from m3_eagle_plugin.bench.step_meta import build_step_meta
from m3_eagle_plugin.msa import MsaDecodeMetadata
from m3_eagle_plugin.msa import select_blocks_paged as ref_select
from m3_eagle_plugin.msa import sparse_attention as ref_sparse
from m3_eagle_plugin.msa.kernels import KernelBackendError, KernelInputError, select_blocks_paged, sparse_attention
from m3_eagle_plugin.msa.kernels import flashinfer_msa as fim
from m3_eagle_plugin.msa.kernels import kernel_table
from tests.bench import _fake_flashinfer

from .kernel_case_helpers import capture_after_warmup

FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="needs torch.float8_e4m3fn")
BLOCK = DIM = 128


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.delenv("M3_EAGLE_KERNEL_TABLE", raising=False)
    fim._import_status.cache_clear()
    kernel_table.clear_caches()
    yield
    fim._import_status.cache_clear()
    kernel_table.clear_caches()


@pytest.fixture
def fake_fi(monkeypatch):
    """The fake FlashInfer installed and an SM90 device pretended (CPU tensors throughout)."""
    fi, msa = _fake_flashinfer.make()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.msa_ops", msa)
    monkeypatch.setattr(fim, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(fim, "device_name", lambda device: "Fake H200")
    return fi


def _step(qo_lens, kv_lens, *, seed=0, q_heads=2, kv_heads=1, index_heads=1, device="cpu"):
    """A step on M3-shaped pages: K/V the halves of one interleaved fp8 cache (built by hand),
    a contiguous bf16 index-K cache, shuffled page tables, an MsaDecodeMetadata."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-kv // BLOCK) for kv in kv_lens]
    pages = sum(need) + 2
    perm = torch.randperm(pages, generator=gen).tolist()
    width = max(need) + 1
    tables = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        start += n
    meta = MsaDecodeMetadata(len(kv_lens), sum(qo_lens), width, BLOCK, device, max_draft_len=max(qo_lens) - 1)
    meta.prepare(list(qo_lens), list(kv_lens), tables)
    packed = (torch.randn(pages, kv_heads, BLOCK, 2 * DIM, generator=gen) * 2).to(FP8).to(device)
    tokens = sum(qo_lens)
    return {
        "meta": meta, "packed": packed, "k": packed[..., :DIM], "v": packed[..., DIM:],
        "index_k": torch.randn(pages, BLOCK, DIM, generator=gen).to(torch.bfloat16).to(device),
        "q": torch.randn(tokens, q_heads, DIM, generator=gen).to(torch.bfloat16).to(device),
        "index_q": torch.randn(tokens, index_heads, DIM, generator=gen).to(torch.bfloat16).to(device),
    }


def _selection(meta, kv_heads, seed=1, width=16, per_token=3):
    """Random ascending visible block ids per (head, token), -1 padded to `width`."""
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((kv_heads, meta.num_tokens, width), -1, dtype=torch.int32)
    for h in range(kv_heads):
        for t, n in enumerate(meta.valid_blocks.tolist()):
            ids = sorted(set(torch.randint(0, n, (per_token,), generator=gen).tolist()) | {n - 1})
            sel[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel


def _sparse_ok(st, sel, **kw):
    return fim.eligibility("sparse_attention", st["q"], st["k"], st["v"], st["meta"], sel, **kw)


def _index_ok(st, topk=16, **kw):
    return fim.eligibility("select_blocks_paged", st["index_q"], st["index_k"], st["meta"], topk=topk, **kw)


# --- eligibility ------------------------------------------------------------------------------------

def test_eligible_inputs_pass(fake_fi):
    st = _step([2, 2], [300, 260])
    ok, why = _sparse_ok(st, _selection(st["meta"], 1))
    assert ok, why
    ok, why = _index_ok(st)
    assert ok, why


def test_device_refusal_is_the_production_check():
    assert "SM90 (Hopper) CUDA device" in fim.device_refusal("cpu")
    st = _step([1], [130])
    ok, why = _sparse_ok(st, _selection(st["meta"], 1))
    assert not ok and "SM90" in why


def test_other_cuda_generations_are_refused(fake_fi, monkeypatch):
    monkeypatch.setattr(fim, "device_capability", lambda device: (10, 0))
    st = _step([1], [130])
    ok, why = _sparse_ok(st, _selection(st["meta"], 1))
    assert not ok and "compute capability 9.0" in why and "10.0" in why


def test_missing_flashinfer_is_named(fake_fi, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer.msa_ops", None)
    fim._import_status.cache_clear()
    st = _step([1], [130])
    ok, why = _index_ok(st)
    assert not ok and "flashinfer.msa_ops" in why and "does not import" in why


def _separate_kv(st):
    return {**st, "k": st["packed"][..., :DIM].contiguous(), "v": st["packed"][..., DIM:].contiguous()}


@pytest.mark.parametrize("change, expect", [
    (lambda st: ({**_separate_kv(st)}, {}), "halves of one interleaved"),
    (lambda st: ({**st, "k": st["k"].to(torch.bfloat16), "v": st["v"].to(torch.bfloat16)}, {}), "float8_e4m3fn"),
    (lambda st: ({**st, "q": st["q"].float()}, {}), "bf16"),
    (lambda st: ({**st, "q": st["q"].repeat(1, 9, 1)}, {}), "GQA group 18/1"),
    (lambda st: (st, {"k_scale": torch.tensor(0.5)}), "Python floats"),
    (lambda st: (st, {"v_scale": True}), "Python floats"),  # a bool is no scale
])
def test_sparse_refusals_name_their_cause(fake_fi, change, expect):
    st = _step([2, 2], [300, 260])
    st, kw = change(st)
    ok, why = _sparse_ok(st, _selection(st["meta"], 1), **kw)
    assert not ok and expect in why, why


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    """`t` on another device than the CPU step (torch's `meta` device: no data, no GPU needed)."""
    return t.to("meta")


@pytest.mark.parametrize("kernel, change, expect", [
    ("sparse", lambda st: {**st, "sel": _elsewhere(st["sel"])}, "than q (cpu): selection on meta"),
    ("sparse", lambda st: {**st, "k": _elsewhere(st["packed"])[..., :DIM], "v": _elsewhere(st["packed"])[..., DIM:]},
     "than q (cpu): k_cache on meta, v_cache on meta"),
    ("sparse", lambda st: {**st, "q": _elsewhere(st["q"])},
     "than q (meta): k_cache on cpu, v_cache on cpu, selection on cpu, meta.block_tables on cpu, meta.kv_lens on cpu"),
    ("index", lambda st: {**st, "index_k": _elsewhere(st["index_k"])}, "than index_q (cpu): index_k_cache on meta"),
    ("index", lambda st: {**st, "index_q": _elsewhere(st["index_q"])},
     "than index_q (meta): index_k_cache on cpu, meta.block_tables on cpu"),
], ids=["selection", "kv", "q", "index_k", "index_q"])
def test_operands_on_another_device_are_refused_naming_them(fake_fi, kernel, change, expect):
    """FlashInfer launches on the queries' device: an operand elsewhere (cuda:1 next to cuda:0, or a
    CPU tensor) would be read through an address of another device."""
    st = _step([2, 2], [300, 260])
    st = change({**st, "sel": _selection(st["meta"], 1)})
    if kernel == "sparse":
        ok, why = _sparse_ok(st, st["sel"])
    else:
        ok, why = _index_ok(st)
    assert not ok and expect in why, why


def test_forced_mode_names_an_operand_on_another_device_before_flashinfer_runs(fake_fi, monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([1], [300])
    with pytest.raises(KernelBackendError, match="select_blocks_paged.*index_k_cache on meta"):
        select_blocks_paged(st["index_q"], _elsewhere(st["index_k"]), st["meta"], topk=16)
    with pytest.raises(KernelBackendError, match="sparse_attention.*selection on meta"):
        sparse_attention(st["q"], st["k"], st["v"], st["meta"], _elsewhere(_selection(st["meta"], 1)), scale=0.1)
    assert fake_fi.calls == []


def test_sparse_refuses_other_topk_and_mixed_q_lens(fake_fi):
    st = _step([2, 2], [300, 260])
    ok, why = _sparse_ok(st, _selection(st["meta"], 1, width=8))
    assert not ok and "selection must be [Hkv=1" in why
    mixed = _step([1, 3], [300, 260])
    ok, why = _sparse_ok(mixed, _selection(mixed["meta"], 1))
    assert not ok and "different q_len [1, 3]" in why


def test_v_offset_must_be_exactly_one_head_dim(fake_fi):
    st = _step([1], [200])
    wide = torch.zeros(st["packed"].shape[:-1] + (3 * DIM,), dtype=FP8)  # K | gap | V: not the FlashInfer layout
    ok, why = _sparse_ok({**st, "k": wide[..., :DIM], "v": wide[..., 2 * DIM:]}, _selection(st["meta"], 1))
    assert not ok and "V must start 128 elements after K" in why


def test_v_must_start_exactly_one_head_dim_after_k_even_with_the_interleaved_strides(fake_fi):
    st = _step([1], [200])
    half = st["packed"][..., DIM // 2: DIM // 2 + DIM]  # K's strides, 64 elements after K: half K, half V
    assert half.stride() == st["v"].stride()
    ok, why = _sparse_ok({**st, "v": half}, _selection(st["meta"], 1))
    assert not ok and "V must start 128 elements after K" in why and "got offset 64" in why, why


@pytest.mark.parametrize("shape, expect", [((1, 64, 2 * DIM), "got [64, 128]"), ((1, BLOCK, DIM), "got [128, 64]")])
def test_cache_pages_must_be_128_tokens_of_128_dims(fake_fi, shape, expect):
    """The metadata may say 128-token pages while the cache holds others; q's head dim may not be the cache's."""
    st = _step([1], [200])
    packed = torch.zeros(st["packed"].shape[0], *shape, dtype=FP8)
    d = shape[-1] // 2
    ok, why = _sparse_ok({**st, "k": packed[..., :d], "v": packed[..., d:]}, _selection(st["meta"], 1))
    assert not ok and f"cache pages must be [{BLOCK}, {DIM}], {expect}" in why, why


def test_a_gqa_group_must_be_whole(fake_fi):
    st = _step([2, 2], [300, 260], q_heads=3, kv_heads=2)  # 3 query heads on 2 KV heads
    ok, why = _sparse_ok(st, _selection(st["meta"], 2))
    assert not ok and "GQA group 3/2 must be a whole number" in why, why


def test_an_empty_step_is_not_routed(fake_fi):
    class Empty:  # no requests, no tokens
        block_size = BLOCK
        kv_lens = torch.zeros(0, dtype=torch.int32)
        max_qo_len = 1
    index_q = torch.zeros(0, 1, DIM, dtype=torch.bfloat16)
    index_k = torch.zeros(2, BLOCK, DIM, dtype=torch.bfloat16)
    assert fim.eligibility("select_blocks_paged", index_q, index_k, Empty(), topk=16) == (False, "empty step")


def test_block_size_must_be_128(fake_fi):
    meta = MsaDecodeMetadata(1, 1, 4, 64, "cpu")
    meta.prepare([1], [100], torch.tensor([[0, 1]], dtype=torch.int32))
    packed = torch.zeros(2, 1, 64, 2 * DIM, dtype=FP8)
    q = torch.zeros(1, 2, DIM, dtype=torch.bfloat16)
    ok, why = fim.eligibility("sparse_attention", q, packed[..., :DIM], packed[..., DIM:], meta,
                              torch.zeros(1, 1, 16, dtype=torch.int32))
    assert not ok and "block size must be 128, got 64" in why


@pytest.mark.parametrize("change, expect", [
    (lambda st: {**st, "index_k": torch.randn(st["index_k"].shape[0], 2, BLOCK * DIM).to(torch.bfloat16)[:, 1]
                 .view(-1, BLOCK, DIM)}, "strided view"),
    (lambda st: {**st, "index_k": st["index_k"].float()}, "bf16 [P, 128, 128]"),
    (lambda st: {**st, "index_q": st["index_q"].float()}, "index_q must be bf16"),
])
def test_index_refusals_name_their_cause(fake_fi, change, expect):
    st = change(_step([2, 2], [300, 260]))
    ok, why = _index_ok(st)
    assert not ok and expect in why, why


@pytest.mark.parametrize("change, expect", [
    (lambda st: {**st, "index_q": st["index_q"][..., :64]}, "index_q must be bf16 [T, Hi, 128]"),
    (lambda st: {**st, "index_q": st["index_q"][:, 0]}, "index_q must be bf16 [T, Hi, 128]"),
    (lambda st: {**st, "index_k": st["index_k"].view(-1, 64, DIM)}, "index-K cache must be bf16 [P, 128, 128]"),
], ids=["index-dim", "2-d", "64-token-pages"])
def test_index_shapes_flashinfer_does_not_take_are_refused(fake_fi, change, expect):
    st = change(_step([2, 2], [300, 260]))
    ok, why = _index_ok(st)
    assert not ok and expect in why, why


def test_index_refuses_topk_and_long_q(fake_fi):
    st = _step([2, 2], [300, 260])
    ok, why = _index_ok(st, topk=8)
    assert not ok and "topk 16 only, got 8" in why
    ok, why = _index_ok(_step([4, 4], [300, 260]))  # q_len 4: the decode regime's longest
    assert ok, why
    long = _step([5, 5], [300, 260])
    ok, why = _index_ok(long)
    assert not ok and "q_len <= 4, got 5" in why


def test_host_q_len_without_host_lengths(fake_fi):
    """Without qo_lens_host there is no route: a token count cannot tell graph-padding rows from
    requests (q_lens 1 and 3 plus 2 padding rows fill 2 x 3 like two requests of 3)."""
    class Bare:  # a metadata without qo_lens_host
        block_size = BLOCK
        kv_lens = torch.tensor([300, 260], dtype=torch.int32)
    for bound in (None, 2, 3):
        q_len, why = fim.host_q_len(Bare(), 6 if bound == 3 else 4, bound)
        assert q_len is None and "no qo_lens_host" in why and "graph-padding" in why
    padded = build_step_meta([1, 3], [300, 260], torch.arange(8, dtype=torch.int32).view(2, 4), BLOCK, pad_tokens=2)
    assert padded.positions.shape[0] == 2 * 3 and fim.host_q_len(padded, 6, 3)[0] is None
    even = build_step_meta([2, 2], [300, 260], torch.arange(8, dtype=torch.int32).view(2, 4), BLOCK)
    assert fim.host_q_len(even, 4, None) == (2, "") and fim.host_q_len(even, 4, 2) == (2, "")
    assert fim.host_q_len(even, 4, 1)[0] is None  # a bound below the host lengths
    q_len, why = fim.host_q_len(even, 3, None)  # 3 tokens cannot be 2 requests x 2
    assert q_len is None and "3 tokens are not 2 requests x one q_len 2" in why


# --- routed calls vs the torch references --------------------------------------------------------------

@pytest.mark.parametrize("qo_lens, kv_lens", [([1, 1, 1], [700, 129, 390]), ([3, 3], [640, 385])])
def test_forced_sparse_attention_equals_the_reference(fake_fi, monkeypatch, qo_lens, kv_lens):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step(qo_lens, kv_lens, q_heads=4, kv_heads=2, seed=5)
    meta, sel = st["meta"], _selection(st["meta"], 2, seed=6)
    got = sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.09)
    assert "msa_sparse_decode_attention" in fake_fi.calls
    expect = ref_sparse(st["q"], st["k"], st["v"], meta, sel, scale=0.09)
    assert got.shape == (sum(qo_lens), 4, DIM) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


def test_forced_sparse_attention_applies_fp8_scales(fake_fi, monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([2, 2], [500, 300], seed=7)
    meta, sel = st["meta"], _selection(st["meta"], 1, seed=8)
    got = sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.09, k_scale=0.5, v_scale=0.25)
    k32, v32 = st["k"].float() * 0.5, st["v"].float() * 0.25  # dequantised by hand
    expect = ref_sparse(st["q"], k32, v32, meta, sel, scale=0.09)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


def test_forced_sparse_attention_takes_numpy_scales_as_our_kernels_do(fake_fi, monkeypatch):
    """A NumPy scalar scale is a number to our kernels (`_common.scale_value`); FlashInfer's route
    took it for a scale tensor and refused it."""
    np = pytest.importorskip("numpy")
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([2, 2], [500, 300], seed=7)
    meta, sel = st["meta"], _selection(st["meta"], 1, seed=8)
    got = sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.09, k_scale=np.float32(0.5),
                           v_scale=np.float32(0.25))
    k32, v32 = st["k"].float() * 0.5, st["v"].float() * 0.25  # dequantised by hand
    expect = ref_sparse(st["q"], k32, v32, meta, sel, scale=0.09)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kw", [{"scale": float("nan")}, {"scale": 0.0}, {"scale": torch.tensor(0.09)},
                                {"scale": 0.09, "k_scale": float("inf")}, {"scale": 0.09, "v_scale": -0.5}], ids=repr)
def test_routed_sparse_attention_refuses_scales_the_kernels_refuse(fake_fi, monkeypatch, kw):
    """FlashInfer's route takes the scales the Triton kernels and the reference take, no others: a NaN,
    zero or negative scale is an error, not a NaN or sign-flipped output; a tensor would sync."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([2, 2], [500, 300], seed=7)
    meta, sel = st["meta"], _selection(st["meta"], 1, seed=8)
    with pytest.raises(ValueError, match="scale"):
        sparse_attention(st["q"], st["k"], st["v"], meta, sel, **kw)
    assert fake_fi.calls == []


@pytest.mark.parametrize("local_blocks, init_blocks", [(1, 0), (2, 1)])
def test_forced_selection_equals_the_reference(fake_fi, monkeypatch, local_blocks, init_blocks):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    # 2433 tokens: 20 blocks, the 3 verify tokens 2430..2432 straddle blocks 18 and 19, so each
    # token's own local block differs (per-token num_valid_pages); the other request sees < 16 blocks.
    st = _step([3, 3], [2433, 1100], seed=11)
    meta = st["meta"]
    st["index_k"][int(meta.block_tables[0, 0])] = 0  # block 0 of request 0 scores 0, below every other block
    got = select_blocks_paged(st["index_q"], st["index_k"], meta, topk=16, local_blocks=local_blocks,
                              init_blocks=init_blocks)
    assert {"msa_proxy_score", "msa_topk_select"} <= set(fake_fi.calls)
    expect = ref_select(st["index_q"], st["index_k"], meta, topk=16, local_blocks=local_blocks,
                        init_blocks=init_blocks)
    assert got.dtype == torch.int32 and got.shape == (1, 6, 16) and got.is_contiguous()
    assert torch.equal(got, expect)
    assert int((got[0, 0] >= 0).sum()) == 16 and int(got[0, 0].max()) == 18 and int(got[0, 2].max()) == 19
    assert (got[0, :3] == 0).any(dim=-1).tolist() == [init_blocks == 1] * 3  # request 0's block 0: only if forced


def test_forced_blocks_filling_topk_exactly_are_taken(fake_fi, monkeypatch):
    """local_blocks + init_blocks == topk fits (the reference takes it): as the reference selects."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([3, 3], [2433, 1100], seed=11)
    kw = dict(topk=16, local_blocks=8, init_blocks=8)
    got = select_blocks_paged(st["index_q"], st["index_k"], st["meta"], **kw)
    assert "msa_topk_select" in fake_fi.calls
    assert torch.equal(got, ref_select(st["index_q"], st["index_k"], st["meta"], **kw))


def test_forced_mode_raises_naming_the_cause(fake_fi, monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _separate_kv(_step([1], [300]))
    with pytest.raises(KernelBackendError, match="M3_EAGLE_KERNELS=flashinfer.*sparse_attention.*interleaved"):
        sparse_attention(st["q"], st["k"], st["v"], st["meta"], _selection(st["meta"], 1), scale=0.1)
    strided = {**st, "index_k": torch.randn(4, 2, BLOCK * DIM).to(torch.bfloat16)[:, 1].view(4, BLOCK, DIM)}
    with pytest.raises(KernelBackendError, match="select_blocks_paged.*strided view"):
        select_blocks_paged(strided["index_q"], strided["index_k"], st["meta"], topk=16)
    assert fake_fi.calls == []


def _write_table(path, device, rows):
    path.write_text(json.dumps({"device": device, "date": "2026-12-01", "command": "test", "rows": rows}))
    return str(path)


def _row(kernel, batch, context, qo_len, ours, fi):
    return {"kernel": kernel, "batch": batch, "context": context, "qo_len": qo_len, "ours_us": ours,
            "flashinfer_us": fi}


@pytest.mark.parametrize("fi_us, device, routed", [(5.0, "Fake H200", True), (50.0, "Fake H200", False),
                                                  (5.0, "Other GPU", False)])
def test_auto_follows_the_table(fake_fi, monkeypatch, tmp_path, fi_us, device, routed):
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", device, [
        _row("sparse_attn", 2, 512, 2, 10.0, fi_us), _row("index_select", 2, 512, 2, 10.0, fi_us)]))
    st = _step([2, 2], [500, 300], seed=3)
    meta, sel = st["meta"], _selection(st["meta"], 1, seed=4)
    got = sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.1)
    chosen = select_blocks_paged(st["index_q"], st["index_k"], meta, topk=16)
    calls = set(fake_fi.calls)
    assert ({"msa_sparse_decode_attention", "msa_proxy_score", "msa_topk_select"} <= calls) is routed
    assert bool(calls) is routed  # not routed: the torch references ran (CPU)
    torch.testing.assert_close(got.float(), ref_sparse(st["q"], st["k"], st["v"], meta, sel, scale=0.1).float(),
                               atol=1e-2, rtol=1e-2)
    assert torch.equal(chosen, ref_select(st["index_q"], st["index_k"], meta, topk=16))


@pytest.mark.parametrize("step_row, whole", [((9.0, 12.0), True), ((12.0, 9.0), False), (None, False),
                                             ((9.0, None), False)])
def test_layer_follows_the_whole_step_row(fake_fi, monkeypatch, tmp_path, step_row, whole):
    """Both halves' rows say FlashInfer is faster; the layer dispatcher runs our whole step
    (`verify_step`, recorded here: Triton does not run on CPU) only where the nearest `sparse_step`
    row measured ours at or below FlashInfer's whole step, else FlashInfer's halves."""
    from m3_eagle_plugin.msa.kernels import backend, sparse_layer_attention, verify_step

    rows = [_row("sparse_attn", 2, 512, 2, 10.0, 5.0), _row("index_select", 2, 512, 2, 10.0, 5.0)]
    if step_row is not None:
        rows.append(_row("sparse_step", 2, 512, 2, *step_row))
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", rows))
    st = _step([2, 2], [500, 300], seed=3)
    meta = st["meta"]
    expect = ref_sparse(st["q"], st["k"], st["v"], meta, ref_select(st["index_q"], st["index_k"], meta, topk=16),
                        scale=0.1)
    ran = []

    def ours_whole(index_q, index_k, q, k, v, meta, **kw):
        ran.append(kw["topk"])
        return None, expect
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(verify_step, "sparse_verify_step", ours_whole)
    got = sparse_layer_attention(st["q"], st["k"], st["v"], st["index_q"], st["index_k"], meta, topk=16, scale=0.1)
    assert (ran == [16]) is whole
    assert ({"msa_sparse_decode_attention", "msa_proxy_score", "msa_topk_select"} <= set(fake_fi.calls)) is not whole
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


def test_forced_flashinfer_layer_runs_flashinfers_halves_whatever_the_whole_step_row_says(fake_fi, monkeypatch,
                                                                                          tmp_path):
    """`M3_EAGLE_KERNELS=flashinfer` sends `select_blocks_paged` and `sparse_attention` to FlashInfer
    (backend docstring); the whole-step row is the `auto` choice only (`_whole_step_backend`): one that
    measured our step faster does not run it under the forced mode."""
    from m3_eagle_plugin.msa.kernels import backend, sparse_layer_attention, verify_step

    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", [
        _row("sparse_attn", 2, 512, 2, 10.0, 5.0), _row("index_select", 2, 512, 2, 10.0, 5.0),
        _row("sparse_step", 2, 512, 2, 9.0, 12.0)]))
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(verify_step, "sparse_verify_step", lambda *a, **kw: pytest.fail("our whole step ran"))
    st = _step([2, 2], [500, 300], seed=3)
    meta = st["meta"]
    got = sparse_layer_attention(st["q"], st["k"], st["v"], st["index_q"], st["index_k"], meta, topk=16, scale=0.1)
    assert {"msa_sparse_decode_attention", "msa_proxy_score", "msa_topk_select"} <= set(fake_fi.calls)
    expect = ref_sparse(st["q"], st["k"], st["v"], meta, ref_select(st["index_q"], st["index_k"], meta, topk=16),
                        scale=0.1)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


def test_layer_refuses_a_bad_scale_before_flashinfers_whole_step_selects(fake_fi, monkeypatch, tmp_path):
    """Where the whole-step row sends the layer to FlashInfer, a scale the attention refuses is refused
    before the scoring and top-k run, not after."""
    from m3_eagle_plugin.msa.kernels import backend, sparse_layer_attention

    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", [
        _row("sparse_attn", 2, 512, 2, 10.0, 5.0), _row("index_select", 2, 512, 2, 10.0, 5.0),
        _row("sparse_step", 2, 512, 2, 12.0, 9.0)]))
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    st = _step([2, 2], [500, 300], seed=3)
    with pytest.raises(ValueError, match="scale"):
        sparse_layer_attention(st["q"], st["k"], st["v"], st["index_q"], st["index_k"], st["meta"], topk=16,
                               scale=float("nan"))
    assert fake_fi.calls == []


@pytest.mark.parametrize("index_flashinfer_us, attn_flashinfer_us", [(12.0, 5.0), (12.0, 12.0)],
                         ids=["halves-mixed", "halves-ours"])
def test_layer_runs_flashinfers_whole_step_where_its_row_says(fake_fi, monkeypatch, tmp_path, index_flashinfer_us,
                                                               attn_flashinfer_us):
    """The whole-step row says FlashInfer, the halves' rows say ours for the index and FlashInfer or
    ours for the attention: the layer runs FlashInfer's scoring, top-k and attention (the step that
    row measured), not a mix no run measured, and the halves' rows do not decide first (README and
    `m3-eagle doctor`: "where both halves could run on FlashInfer, the whole step it says is faster")."""
    from m3_eagle_plugin.msa.kernels import backend, backend_report, sparse_layer_attention, verify_step

    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", [
        _row("index_select", 2, 512, 2, 10.0, index_flashinfer_us),
        _row("sparse_attn", 2, 512, 2, 10.0, attn_flashinfer_us),
        _row("sparse_step", 2, 512, 2, 20.0, 17.0)]))
    decision = backend_report("cpu")["table_verdicts"]["sparse_step"]
    assert decision[0] == "B2/512 q2 -> flashinfer (ours 20 / FlashInfer 17 us)"
    st = _step([2, 2], [500, 300], seed=5)
    meta = st["meta"]
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(verify_step, "sparse_verify_step", lambda *a, **k: pytest.fail("ran our whole step"))
    got = sparse_layer_attention(st["q"], st["k"], st["v"], st["index_q"], st["index_k"], meta, topk=16, scale=0.1)
    assert {"msa_sparse_decode_attention", "msa_proxy_score", "msa_topk_select"} <= set(fake_fi.calls)
    expect = ref_sparse(st["q"], st["k"], st["v"], meta, ref_select(st["index_q"], st["index_k"], meta, topk=16),
                        scale=0.1)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


def _faster_table(monkeypatch, tmp_path):
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", [
        _row("sparse_attn", 2, 512, 2, 10.0, 5.0), _row("index_select", 2, 512, 2, 10.0, 5.0)]))


@pytest.mark.parametrize("mode", ["auto", "flashinfer"])
def test_float_selection_is_not_truncated_into_block_ids(fake_fi, monkeypatch, tmp_path, mode):
    """The reference refuses a floating-point selection (1.9 is no block id); the routed call
    must not cast it to int32 and attend blocks 1 instead."""
    _faster_table(monkeypatch, tmp_path)
    monkeypatch.setenv("M3_EAGLE_KERNELS", mode)
    st = _step([2, 2], [500, 300], seed=3)
    meta, sel = st["meta"], _selection(st["meta"], 1, seed=4).float()
    sel[sel >= 0] += 0.9
    with pytest.raises(ValueError, match="integer"):
        ref_sparse(st["q"], st["k"], st["v"], meta, sel, scale=0.1)
    with pytest.raises((ValueError, KernelBackendError), match="integer"):
        sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.1)
    assert fake_fi.calls == []


@pytest.mark.parametrize("local_blocks, init_blocks", [(9, 8), (-1, 0), (1, -2)])
@pytest.mark.parametrize("mode", ["auto", "flashinfer"])
def test_routed_selection_refuses_forced_blocks_the_reference_refuses(fake_fi, monkeypatch, tmp_path, mode,
                                                                     local_blocks, init_blocks):
    """17 forced blocks cannot fit in 16 (nor can -1 be forced): the reference raises, so must
    the routed call, before FlashInfer runs."""
    _faster_table(monkeypatch, tmp_path)
    monkeypatch.setenv("M3_EAGLE_KERNELS", mode)
    st = _step([2, 2], [2433, 1100], seed=3)
    kw = dict(topk=16, local_blocks=local_blocks, init_blocks=init_blocks)
    with pytest.raises(ValueError, match="(local|init)_blocks"):
        ref_select(st["index_q"], st["index_k"], st["meta"], **kw)
    with pytest.raises(ValueError, match="(local|init)_blocks"):
        select_blocks_paged(st["index_q"], st["index_k"], st["meta"], **kw)
    assert fake_fi.calls == []


def test_report_names_flashinfer_for_the_kernels_forced_onto_it(fake_fi, monkeypatch):
    """Under `M3_EAGLE_KERNELS=flashinfer` the report's per-kernel backend is what a call runs:
    FlashInfer for the two routed kernels, the torch reference (CPU) for the rest."""
    from m3_eagle_plugin.msa.kernels import backend_report, dense_attention

    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    kernels = backend_report("cpu")["kernels"]
    st = _step([2, 2], [500, 300], seed=3)
    meta, sel = st["meta"], _selection(st["meta"], 1, seed=4)
    sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.1)
    assert fake_fi.calls == ["msa_sparse_decode_attention"]
    select_blocks_paged(st["index_q"], st["index_k"], meta, topk=16)
    assert fake_fi.calls[1:] == ["msa_proxy_score", "msa_topk_select"]
    dense_attention(st["q"], st["k"].float(), st["v"].float(), meta, scale=0.1)
    assert len(fake_fi.calls) == 3  # dense: no FlashInfer route
    assert kernels["sparse_attention"] == kernels["select_blocks_paged"] == "flashinfer"
    assert kernels["dense_attention"] == "torch"


def test_layer_whole_step_needs_a_selection_per_kv_head(fake_fi, monkeypatch, tmp_path):
    """One index head, two KV heads: the selection the layer makes ([1, T, 16]) is not the
    [Hkv, T, 16] one `sparse_attention` takes (the reference refuses it), so FlashInfer's whole
    step must not run it (it would broadcast one head's blocks to both KV heads)."""
    from m3_eagle_plugin.msa import MsaInputError
    from m3_eagle_plugin.msa.kernels import backend, sparse_layer_attention, verify_step

    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", [
        _row("index_select", 2, 512, 2, 10.0, 5.0), _row("sparse_attn", 2, 512, 2, 10.0, 5.0),
        _row("sparse_step", 2, 512, 2, 20.0, 17.0)]))
    st = _step([2, 2], [500, 300], q_heads=4, kv_heads=2, index_heads=1, seed=5)
    meta = st["meta"]
    sel = ref_select(st["index_q"], st["index_k"], meta, topk=16)
    with pytest.raises(MsaInputError, match="selection must be"):
        ref_sparse(st["q"], st["k"], st["v"], meta, sel, scale=0.1)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(verify_step, "sparse_verify_step", lambda *a, **k: pytest.fail("ran our whole step"))
    with pytest.raises(ValueError, match="selection"):  # as the reference: ours refuses it before launching
        sparse_layer_attention(st["q"], st["k"], st["v"], st["index_q"], st["index_k"], meta, topk=16, scale=0.1)
    assert "msa_sparse_decode_attention" not in fake_fi.calls


def test_auto_without_a_row_for_the_q_len_keeps_ours(fake_fi, monkeypatch, tmp_path):
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", _write_table(tmp_path / "t.json", "Fake H200", [
        _row("sparse_attn", 2, 512, 4, 10.0, 1.0)]))
    st = _step([2, 2], [500, 300])
    sparse_attention(st["q"], st["k"], st["v"], st["meta"], _selection(st["meta"], 1), scale=0.1)
    assert fake_fi.calls == []


def test_triton_and_torch_modes_never_route_to_flashinfer(fake_fi, monkeypatch):
    st = _step([2, 2], [500, 300])
    sel = _selection(st["meta"], 1)
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    out = sparse_attention(st["q"], st["k"], st["v"], st["meta"], sel, scale=0.1)
    assert torch.equal(out, ref_sparse(st["q"], st["k"], st["v"], st["meta"], sel, scale=0.1))
    monkeypatch.setenv("M3_EAGLE_KERNELS", "triton")
    with pytest.raises(KernelBackendError, match="triton"):  # Triton cannot run on CPU; FlashInfer is not tried
        sparse_attention(st["q"], st["k"], st["v"], st["meta"], sel, scale=0.1)
    assert fake_fi.calls == []


# --- the real FlashInfer on an SM90 GPU (skipped elsewhere) -------------------------------------------------

def _sm90_with_flashinfer() -> bool:
    ok = (FP8 is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
          and fim.flashinfer_available())
    fim._import_status.cache_clear()
    return ok


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_with_flashinfer(), reason="needs an SM90 GPU with flashinfer.msa_ops")
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_routed_calls_match_the_references_and_capture(monkeypatch, q_len):
    """The real ops through the dispatchers (forced), on an interleaved fp8 cache: selections
    as ours (rows may differ only on near-ties), attention within fp8/bf16 error, and the routed
    pair captured in a CUDA graph replays to the eager result."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([q_len] * 3, [4096 + 37, 2050, 130], q_heads=16, kv_heads=1, seed=21, device="cuda")
    meta, scale = st["meta"], DIM ** -0.5

    def run():
        sel = select_blocks_paged(st["index_q"], st["index_k"], meta, topk=16)
        return sel, sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=scale, k_scale=0.5, v_scale=0.25)

    sel, out = run()
    expect_sel = ref_select(st["index_q"], st["index_k"], meta, topk=16)
    differing = float((sel != expect_sel).any(dim=-1).float().mean())
    assert differing <= 0.05, differing
    expect = ref_sparse(st["q"], st["k"].float() * 0.5, st["v"].float() * 0.25, meta, sel, scale=scale)
    err = float((out.double() - expect.double()).norm() / expect.double().norm())
    assert err < 2e-2, err

    graph, captured = capture_after_warmup(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], sel)
    torch.testing.assert_close(captured[1], out, atol=1e-3, rtol=1e-3)  # split-K order may differ


@pytest.mark.parametrize("scales, expected", [
    ((0.5, None, None), (0.5, None)),
    ((0.5, 2.0, 1.0), (1.0, None)),  # a V scale of 1.0 is no V scale: FlashInfer's fast path
    ((0.5, None, 0.25), (0.5, 0.25)),
])
def test_decode_scales_fold_k_into_the_softmax_scale_and_drop_a_unit_v_scale(scales, expected):
    assert fim.decode_scales(*scales) == expected


def test_check_backend_refuses_forced_flashinfer_where_msa_ops_do_not_import(fake_fi, monkeypatch):
    """An SM90 device is not enough: `M3_EAGLE_KERNELS=flashinfer` also needs `flashinfer.msa_ops`."""
    from m3_eagle_plugin.msa.kernels import check_backend

    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    assert check_backend("cpu") == "flashinfer"
    monkeypatch.setitem(sys.modules, "flashinfer.msa_ops", None)
    fim._import_status.cache_clear()
    with pytest.raises(KernelBackendError, match="FlashInfer cannot run here: .*msa_ops does not import"):
        check_backend("cpu")


class _WideTable:
    """`meta` with a block table of more rows than requests (`check_meta` and the references take
    that: they read row r for request r only)."""

    def __init__(self, meta, extra_rows: int):
        self._meta = meta
        pad = torch.full((extra_rows, meta.block_tables.shape[1]), -1, dtype=torch.int32)
        self.block_tables = torch.cat([meta.block_tables, pad])

    def __getattr__(self, name):
        return getattr(self._meta, name)


def test_routed_sparse_attention_passes_one_page_table_row_per_request(fake_fi, monkeypatch):
    """FlashInfer 0.7.4's `msa_sparse_decode_attention` (sparse_decode.py, SM90 branch) raises
    "page_table batch dimension must match q batch_size" for a table of more rows than requests;
    the route must hand it the requests' rows only, not crash where our kernels and the reference run."""
    msa = sys.modules["flashinfer.msa_ops"]
    decode = msa.msa_sparse_decode_attention

    def strict_decode(q, k, v, q2k_indices, *, page_table, seqused_k, seqlen_q=1, **kw):
        batch = q.shape[0] // seqlen_q
        if seqused_k.numel() != batch:
            raise ValueError(f"seqused_k must have batch_size ({batch}) entries")
        if page_table.shape[0] != batch:
            raise ValueError("page_table batch dimension must match q batch_size")
        return decode(q, k, v, q2k_indices, page_table=page_table, seqused_k=seqused_k, seqlen_q=seqlen_q, **kw)

    monkeypatch.setattr(msa, "msa_sparse_decode_attention", strict_decode)
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    st = _step([2, 2], [500, 300], seed=7)
    meta = _WideTable(st["meta"], extra_rows=3)
    sel = _selection(st["meta"], 1, seed=8)
    got = sparse_attention(st["q"], st["k"], st["v"], meta, sel, scale=0.09)
    assert "msa_sparse_decode_attention" in fake_fi.calls
    expect = ref_sparse(st["q"], st["k"], st["v"], meta, sel, scale=0.09)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


def test_page_table_keeps_the_requests_rows():
    import types

    tables = torch.tensor([[3, 7, -1], [5, -1, -1], [9, 9, 9]], dtype=torch.int32)
    meta = types.SimpleNamespace(block_tables=tables, kv_lens=torch.tensor([200, 100], dtype=torch.int32))
    assert fim.page_table(meta).tolist() == [[3, 7, 0], [5, 0, 0]]


def test_page_table_turns_padding_into_page_zero():
    """Our -1 padding must not reach FlashInfer as an out-of-pool page id (docstring: it becomes page 0)."""
    import types

    tables = torch.tensor([[3, 7, -1], [-1, -1, -1]], dtype=torch.int32)
    got = fim.page_table(types.SimpleNamespace(block_tables=tables.t().contiguous().t(),  # a strided view in
                                               kv_lens=torch.tensor([6, 0], dtype=torch.int32)))
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [[3, 7, 0], [0, 0, 0]]


def test_a_gqa_group_of_sixteen_is_the_largest_taken(fake_fi):
    """The SM90 decode kernel's GQA limit is 16 (module docstring): 16 query heads on one KV head pass."""
    st = _step([2, 2], [300, 260], q_heads=16)
    ok, why = _sparse_ok(st, _selection(st["meta"], 1))
    assert ok and "group 16" in why, why


def test_v_must_have_the_interleaved_strides_not_only_the_offset(fake_fi):
    st = _step([1], [200])
    packed = st["packed"]
    pages, heads = packed.shape[:2]
    # V starts D elements after K but steps D (not 2D) a token: it would read K's rows
    v = packed.as_strided(st["k"].shape, (heads * BLOCK * 2 * DIM, BLOCK * 2 * DIM, DIM, 1), DIM)
    ok, why = _sparse_ok({**st, "v": v}, _selection(st["meta"], 1))
    assert not ok and "not the two halves of one interleaved" in why, why


def test_valid_blocks_on_another_device_is_refused_naming_it(fake_fi):
    """FlashInfer's top-k reads meta.valid_blocks (num_valid_pages) too."""
    import types

    st = _step([2, 2], [300, 260])
    m = st["meta"]
    meta = types.SimpleNamespace(block_tables=m.block_tables, kv_lens=m.kv_lens, cu_qo_lens=m.cu_qo_lens,
                                 valid_blocks=_elsewhere(m.valid_blocks))
    why = fim.operands_elsewhere("index_q", st["index_q"], meta, index_k_cache=st["index_k"])
    assert why == "operands on another device than index_q (cpu): meta.valid_blocks on meta"


def test_host_q_len_does_not_guess_from_a_metadata_bound(fake_fi):
    """A metadata's max_qo_len (no qo_lens_host) is a bound, not the lengths: 4 tokens of 2 requests
    under a bound of 2 may be 1 + 1 plus 2 graph-padding rows, so there is no route."""
    class Meta:
        kv_lens = torch.tensor([300, 260], dtype=torch.int32)
        max_qo_len = 2
    for bound in (None, 2, 4):
        q_len, why = fim.host_q_len(Meta(), 4, bound)
        assert q_len is None and "no qo_lens_host" in why


def test_interleave_kv_packs_k_then_v_and_split_interleaved_undoes_it():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 4, 8, generator=gen), torch.randn(3, 2, 4, 8, generator=gen)
    packed = fim.interleave_kv(k, v)
    assert packed.shape == (3, 2, 4, 16) and packed.is_contiguous()
    assert torch.equal(packed[1, 0, 2], torch.cat([k[1, 0, 2], v[1, 0, 2]]))  # one token: its K row, then its V row
    k2, v2 = fim.split_interleaved(packed)
    assert torch.equal(k2, k) and torch.equal(v2, v) and v2.data_ptr() - k2.data_ptr() == 8 * 4
    with pytest.raises(ValueError, match="k/v differ"):
        fim.interleave_kv(k, v.half())  # a copy would silently cast V to K's dtype
    with pytest.raises(ValueError, match="k/v differ"):
        fim.interleave_kv(k, v[:, :1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interleaved_refusal_measures_the_v_offset_in_elements(dtype):
    """"V must start D elements after K": the halves of an interleaved cache of 2-byte (or 4-byte)
    elements are taken, halves one element off are refused."""
    packed = torch.zeros(3, 2, 4, 16, dtype=dtype)
    assert fim.interleaved_refusal(*fim.split_interleaved(packed)) is None
    wide = torch.zeros(3, 2, 4, 17, dtype=dtype)
    off = wide[..., :16].as_strided(packed.shape, packed.stride(), 9)  # V one element late
    assert "not the two halves" in fim.interleaved_refusal(wide[..., :16].as_strided(packed.shape, packed.stride()),
                                                           off)


def test_q2k_indices_shares_one_index_head_and_refuses_another_head_count():
    sel = torch.tensor([[[0, 2, -1]], [[1, -1, -1]]], dtype=torch.int64)  # 2 heads, 1 token
    assert fim.q2k_indices(sel, 2).dtype == torch.int32 and fim.q2k_indices(sel, 2).tolist() == sel.tolist()
    assert fim.q2k_indices(sel[:1], 3).tolist() == [[[0, 2, -1]]] * 3
    assert fim.q2k_indices(sel[:1], 2).tolist() == [[[0, 2, -1]]] * 2  # any count of KV heads past one
    with pytest.raises(ValueError, match="selection has 2 heads for 4 KV heads"):
        fim.q2k_indices(sel, 4)


@pytest.mark.parametrize("kw, name", [(dict(local_blocks=1.5), "local_blocks"), (dict(init_blocks=True), "init_blocks"),
                                      (dict(topk=2.5), "topk")])
def test_flashinfer_selection_refuses_counts_the_reference_refuses_before_calling_flashinfer(monkeypatch, kw, name):
    """As the reference and our top-k (`_common.selection_counts`): 1.5 local blocks is no count."""
    monkeypatch.setattr(fim, "_msa", lambda: pytest.fail("FlashInfer was called"))
    args = dict(topk=4, q_len=1, local_blocks=1, init_blocks=0) | kw
    with pytest.raises(KernelInputError, match=name):
        fim.select_blocks(torch.zeros(1, 1, 16), torch.zeros(1, 4, 16), None, **args)
