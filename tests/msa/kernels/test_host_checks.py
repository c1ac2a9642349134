"""The kernel launchers refuse, before any launch, operands their kernels would misread: metadata
fields read densely but given as strided views, operands on another device than the rest, index
queries in a dtype the scoring does not compute in; and `auto` sends a query dtype the kernels
refuse to the torch reference. Host checks only: `launch` is stubbed to fail the test if reached."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

import m3_eagle_plugin.msa as msa  # noqa: E402
from m3_eagle_plugin.msa import MsaDecodeMetadata  # noqa: E402
from m3_eagle_plugin.msa.kernels import (KernelInputError, backend, dense_verify, index_select,  # noqa: E402
                                         kv_lens_update, kv_write, sparse_verify, verify_step)

BLOCK, DIM, KV_HEADS, GROUP, TOPK = 16, 32, 2, 2, 3
QO_LENS, KV_LENS = [4, 1], [37, 66]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def launched(*args, **kwargs):
        pytest.fail("launched: the input should have been refused on the host")

    for module in (dense_verify, index_select, sparse_verify, kv_write, kv_lens_update):
        monkeypatch.setattr(module, "launch", launched)


def _step():
    """(meta, k_cache, v_cache, index_k_cache, q, index_q) on the CPU, every request's pages in order."""
    width = max(-(-kv // BLOCK) for kv in KV_LENS)
    tables = torch.full((len(KV_LENS), width), -1, dtype=torch.int32)
    first = 0
    for r, kv in enumerate(KV_LENS):
        pages = -(-kv // BLOCK)
        tables[r, :pages] = torch.arange(first, first + pages, dtype=torch.int32)
        first += pages
    meta = MsaDecodeMetadata(2, 8, width, BLOCK, "cpu", max_draft_len=3, num_index_heads=KV_HEADS)
    meta.prepare(QO_LENS, KV_LENS, tables)
    gen = torch.Generator().manual_seed(0)
    tokens = sum(QO_LENS)
    k_cache, v_cache = (torch.randn(first, KV_HEADS, BLOCK, DIM, generator=gen) for _ in range(2))
    index_k_cache = torch.randn(first, BLOCK, DIM, generator=gen)
    q = torch.randn(tokens, KV_HEADS * GROUP, DIM, generator=gen)
    index_q = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    return meta, k_cache, v_cache, index_k_cache, q, index_q


def _strided(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view of stride 2 (a field of a wider record)."""
    wide = torch.full((t.shape[0], 2), 7, dtype=t.dtype)
    wide[:, 0] = t
    return wide[:, 0]


def _meta_with_strided(meta, field: str):
    names = ("block_tables", "kv_lens", "cu_qo_lens", "positions", "valid_blocks", "block_size", "max_qo_len")
    fields = {name: getattr(meta, name) for name in names}
    fields[field] = _strided(fields[field])
    return types.SimpleNamespace(**fields)


@pytest.mark.parametrize("field", ["kv_lens", "cu_qo_lens", "positions"])
def test_attention_and_scoring_refuse_a_strided_metadata_field(field):
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    strided = _meta_with_strided(meta, field)
    with pytest.raises(KernelInputError, match=f"meta.{field} must be 1-D with unit stride"):
        dense_verify.dense_verify_attention(q, k_cache, v_cache, strided, scale=0.25)
    selection = msa.select_blocks_paged(index_q, index_k_cache, meta, topk=TOPK)
    with pytest.raises(KernelInputError, match=f"meta.{field} must be 1-D with unit stride"):
        sparse_verify.sparse_verify_attention(q, k_cache, v_cache, strided, selection, scale=0.25)
    with pytest.raises(KernelInputError, match=f"meta.{field} must be 1-D with unit stride"):
        index_select.index_block_scores(index_q, index_k_cache, strided)


@pytest.mark.parametrize("field", ["kv_lens", "cu_qo_lens", "valid_blocks"])
def test_top_k_refuses_a_strided_metadata_field(field):
    meta = _step()[0]
    scores = torch.zeros(KV_HEADS, meta.num_tokens, meta.block_tables.shape[1])
    with pytest.raises(KernelInputError, match=f"meta.{field} must be 1-D with unit stride"):
        index_select.topk_from_block_scores(scores, _meta_with_strided(meta, field), topk=TOPK)


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    """`t` on another device than the CPU operands (torch's `meta` device: no data, no GPU needed)."""
    return t.to("meta")


def test_operands_on_another_device_are_refused_naming_them():
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    selection = msa.select_blocks_paged(index_q, index_k_cache, meta, topk=TOPK)
    calls = {
        "k_cache": lambda: dense_verify.dense_verify_attention(q, _elsewhere(k_cache), v_cache, meta, scale=0.25),
        "v_cache": lambda: dense_verify.dense_verify_attention(q, k_cache, _elsewhere(v_cache), meta, scale=0.25),
        "selection": lambda: sparse_verify.sparse_verify_attention(q, k_cache, v_cache, meta, _elsewhere(selection),
                                                                   scale=0.25),
        "index_k_cache": lambda: index_select.index_block_scores(index_q, _elsewhere(index_k_cache), meta),
        "index_q": lambda: verify_step._step(_elsewhere(index_q), index_k_cache, q, k_cache, v_cache, meta, topk=TOPK,
                                             scale=0.25, local_blocks=1, init_blocks=0, k_scale=None, v_scale=None,
                                             max_qo_len=None, early=None, splits=None),
        "slots": lambda: kv_write.write_step_kv_fused(k_cache, v_cache, _elsewhere(meta.cache_slots),
                                                      q[:, :KV_HEADS], q[:, :KV_HEADS]),
        "kv_lens": lambda: kv_lens_update.on_update_kv_lens_fused(meta, _elsewhere(meta.kv_lens)),
    }
    for name, call in calls.items():
        with pytest.raises(KernelInputError, match=f"{name} is on meta, the kernel's other operands on cpu"):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_fused_writers_refuse_slots_and_lengths_that_are_not_integers(dtype):
    """A float slot or length would be truncated, a complex one lose its imaginary part, a bool one
    read as 0 / 1 (`msa.blocks.is_integer_dtype`, the rule of the torch paths)."""
    meta, k_cache, v_cache, _, q, _ = _step()
    with pytest.raises(KernelInputError, match=f"slots must be a 1-d integer tensor, got {dtype}"):
        kv_write.write_step_kv_fused(k_cache, v_cache, meta.cache_slots.to(dtype), q[:, :KV_HEADS], q[:, :KV_HEADS])
    with pytest.raises(KernelInputError, match="kv_lens must be integer"):
        kv_lens_update.on_update_kv_lens_fused(meta, meta.kv_lens.to(dtype))


def test_metadata_on_another_device_than_the_queries_is_refused():
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    with pytest.raises(KernelInputError, match="meta.block_tables is on cpu, the kernel's other operands on meta"):
        dense_verify.dense_verify_attention(_elsewhere(q), _elsewhere(k_cache), _elsewhere(v_cache), meta, scale=0.25)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.float64])
def test_index_queries_the_scoring_does_not_compute_in_are_refused(dtype):
    """fp8 queries would round the keys to fp8 (they are cast to the query dtype), integers fail in Triton."""
    meta, _, _, index_k_cache, _, index_q = _step()
    with pytest.raises(KernelInputError, match=f"index_q must be float32, float16 or bfloat16, got {dtype}"):
        index_select.index_block_scores(index_q.to(dtype), index_k_cache, meta)


def test_auto_runs_the_reference_for_query_dtypes_the_kernels_refuse(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    fp8_index_q = index_q.to(torch.float8_e4m3fn)
    expect = msa.select_blocks_paged(fp8_index_q, index_k_cache, meta, topk=TOPK)
    assert torch.equal(backend.select_blocks_paged(fp8_index_q, index_k_cache, meta, topk=TOPK), expect)
    q64, k64, v64 = q.double(), k_cache.double(), v_cache.double()
    assert torch.equal(backend.dense_attention(q64, k64, v64, meta, scale=0.25),
                       msa.dense_attention(q64, k64, v64, meta, scale=0.25))


@pytest.mark.parametrize("mode", ["auto", "triton"])
def test_cache_dtypes_the_kernels_refuse_run_the_reference(monkeypatch, mode):
    """float64 K/V or index-K (the reference reads any float cache) is, like a query dtype the
    kernels refuse, a call they do not take: on CUDA it runs the reference (the CUDA decision is
    faked here; `launch` is stubbed to fail), as the shapes they cannot tile do whatever the mode."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", mode)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    ik64, k64, v64 = index_k_cache.double(), k_cache.double(), v_cache.double()
    selection = msa.select_blocks_paged(index_q, ik64, meta, topk=TOPK)
    assert torch.equal(backend.select_blocks_paged(index_q, ik64, meta, topk=TOPK), selection)
    assert torch.equal(backend.dense_attention(q, k64, v64, meta, scale=0.25),
                       msa.dense_attention(q, k64, v64, meta, scale=0.25))
    assert torch.equal(backend.dense_attention(q, k_cache, v64, meta, scale=0.25),
                       msa.dense_attention(q, k_cache, v64, meta, scale=0.25))
    expect = msa.sparse_attention(q, k64, v64, meta, selection, scale=0.25)
    assert torch.equal(backend.sparse_attention(q, k64, v64, meta, selection, scale=0.25), expect)
    assert torch.equal(backend.sparse_layer_attention(q, k64, v64, index_q, ik64, meta, topk=TOPK, scale=0.25), expect)


def test_fp8_scales_on_a_cache_dtype_the_kernels_refuse_say_why(monkeypatch):
    """Only the kernels take fp8 scales: the error names the cache they could not read."""
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    meta, k_cache, v_cache, _, q, _ = _step()
    with pytest.raises(backend.KernelBackendError, match="v_cache in torch.float64: the kernels read"):
        backend.dense_attention(q, k_cache, v_cache.double(), meta, scale=0.25, v_scale=0.5)


# --- scalars: refused as the torch references refuse them, before anything is launched ----------------

BAD_SCALES = [float("nan"), float("inf"), 0.0, -0.25, True, torch.tensor(0.25)]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_attention_refuses_a_softmax_scale_the_reference_refuses(scale):
    """`msa`'s references refuse a non-finite, non-positive, boolean or tensor scale (reading a device
    tensor would sync inside a graph capture); the kernels must not launch with it."""
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    with pytest.raises((TypeError, ValueError)):
        msa.dense_attention(q, k_cache, v_cache, meta, scale=scale)
    selection = msa.select_blocks_paged(index_q, index_k_cache, meta, topk=TOPK)
    calls = {
        "dense": lambda: dense_verify.dense_verify_attention(q, k_cache, v_cache, meta, scale=scale),
        "sparse": lambda: sparse_verify.sparse_verify_attention(q, k_cache, v_cache, meta, selection, scale=scale),
        "step": lambda: verify_step._step(index_q, index_k_cache, q, k_cache, v_cache, meta, topk=TOPK, scale=scale,
                                          local_blocks=1, init_blocks=0, k_scale=None, v_scale=None,
                                          max_qo_len=None, early=None, splits=None),
    }
    for name, call in calls.items():
        with pytest.raises(KernelInputError, match="scale"):
            call()


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("-inf"), 0.0, -1.0, False], ids=repr)
def test_attention_refuses_an_fp8_scale_that_is_not_a_positive_finite_number(name, value):
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    selection = msa.select_blocks_paged(index_q, index_k_cache, meta, topk=TOPK)
    with pytest.raises(KernelInputError, match=name.replace("_", ".")):
        dense_verify.dense_verify_attention(q, k_cache, v_cache, meta, scale=0.25, **{name: value})
    with pytest.raises(KernelInputError, match=name.replace("_", ".")):
        sparse_verify.sparse_verify_attention(q, k_cache, v_cache, meta, selection, scale=0.25, **{name: value})


def test_step_refuses_index_heads_other_than_kv_heads_before_the_selection_launches():
    """The step's attention reads one selection row per KV head (`[Hkv, T, topk]`); index queries with
    another head count are refused before the scoring and the top-k run, as the reference refuses them."""
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    one_head = index_q[:, :1].contiguous()
    with pytest.raises(ValueError):
        msa.sparse_attention(q, k_cache, v_cache, meta, msa.select_blocks_paged(one_head, index_k_cache, meta,
                                                                                topk=TOPK), scale=0.25)
    with pytest.raises(KernelInputError, match="index_q has 1 heads, k_cache 2 KV heads"):
        verify_step._step(one_head, index_k_cache, q, k_cache, v_cache, meta, topk=TOPK, scale=0.25, local_blocks=1,
                          init_blocks=0, k_scale=None, v_scale=None, max_qo_len=None, early=None, splits=None)


def test_a_tensor_softmax_scale_is_refused_as_a_host_sync_not_only_as_a_non_number():
    """The tensor is refused for what it would cost (a device read inside a graph capture), by name."""
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    with pytest.raises(KernelInputError, match="softmax scale as a Python float"):
        dense_verify.dense_verify_attention(q, k_cache, v_cache, meta, scale=torch.tensor(0.25))


def test_step_refuses_index_queries_that_are_not_three_dimensional():
    """`[T, Hkv * Di]` has the right token count and, at Di = 1, the right second dim: still refused by
    shape before anything is selected."""
    meta, k_cache, v_cache, index_k_cache, q, index_q = _step()
    flat = index_q[:, :, 0].contiguous()  # [T, Hkv]
    assert flat.shape[1] == k_cache.shape[1]
    with pytest.raises(KernelInputError, match=r"index_q must be \[T, Hi, Di\]"):
        verify_step._step(flat, index_k_cache, q, k_cache, v_cache, meta, topk=TOPK, scale=0.25, local_blocks=1,
                          init_blocks=0, k_scale=None, v_scale=None, max_qo_len=None, early=None, splits=None)
