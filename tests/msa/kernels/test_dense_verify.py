"""Triton dense verify attention (causal ladder) vs the naive torch reference.

The `check_*` functions are device-agnostic: on CUDA they run here (`test_on_gpu`); on CPU
`tests._interpreter` runs `INTERPRETER_CASES` through Triton's interpreter, so CI executes the
kernel's causal mask, its splits and the graph-padding rows. The interpreter's `tl.dot` is wrong
for bf16 operands (Triton 3.6), so those cases use fp32 or fp16 queries.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench import torch_reference as ref
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import (M3, SMALL, assert_close_rel, msa_metadata, needs_gpu, one_request_step,
                                  poison_allocator_like, random_step, seeded_draws, seeded_requests)


def _run(q, cache, meta, **kw):
    from m3_eagle_plugin.msa.kernels.dense_verify import dense_verify_attention

    return dense_verify_attention(q, cache.k, cache.v, meta, **kw)


def check_matches_reference(device, *, splits=None, qo_lens=(4, 2, 1), kv_lens=(70, 33, 5), kv_dtype=torch.float32,
                            q_dtype=torch.float32, pad_tokens=0, max_qo_len=None, scale=0.25, seed=0):
    """Live rows vs `torch_reference.dense_attention` (with the fp8 scales); graph-padding rows zero."""
    meta, cache, q, _ = random_step(SMALL, list(qo_lens), list(kv_lens), kv_dtype=kv_dtype, q_dtype=q_dtype,
                                    seed=seed, pad_tokens=pad_tokens, device=device)
    kw = dict(scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = _run(q, cache, meta, splits=splits, max_qo_len=max_qo_len, **kw)
    live = sum(qo_lens)
    expect = ref.dense_attention(q, cache.k, cache.v, meta, **kw)
    assert_close_rel(out[:live], expect[:live], 1e-4 if q_dtype == torch.float32 else 2e-2)
    assert (out[live:] == 0).all(), "graph-padding rows are not zero"


#: The interpreter's share (CI has two cores): several splits (more than some requests have pages)
#: and one (the kernel zeroes the padding rows itself), fp8 K/V with scales and fp16 partials.
def check_seeded_random_step(device, *, seed):
    """`check_matches_reference` on a seeded random step: requests, lengths, splits, graph padding
    and the q_len hint drawn from `seed` (the property test's, for CI)."""
    draw = seeded_draws(seed)
    qo_lens, kv_lens = seeded_requests(draw, max_requests=3, max_qo=6, max_extra=100)
    check_matches_reference(device, splits=(None, 1, 2, 3)[draw(0, 3)], qo_lens=qo_lens, kv_lens=kv_lens,
                            pad_tokens=draw(0, 2), max_qo_len=(None, max(qo_lens))[draw(0, 1)], seed=seed)


INTERPRETER_CASES = [
    (check_matches_reference, dict(splits=3)),
    (check_matches_reference, dict(splits=1, pad_tokens=2, seed=1)),
    (check_matches_reference, dict(qo_lens=(3, 4), kv_lens=(40, 21), pad_tokens=1, kv_dtype=torch.float8_e4m3fn,
                                   q_dtype=torch.float16, max_qo_len=4, scale=2.0, seed=2)),
    (check_seeded_random_step, dict(seed=41)),
]


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_dense_verify")


@needs_gpu
@pytest.mark.parametrize("splits", [1, 4, 40, None])
def test_matches_reference_fp32(splits):
    meta, cache, q, _ = random_step(SMALL, [4, 2, 1], [170, 33, 5], kv_dtype=torch.float32, q_dtype=torch.float32)
    out = _run(q, cache, meta, scale=0.25, splits=splits)
    assert_close_rel(out, ref.dense_attention(q, cache.k, cache.v, meta, scale=0.25), 1e-4)


@needs_gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_m3_geometry(kv_dtype):
    meta, cache, q, _ = random_step(M3, [4, 4, 4], [3000, 129, 700], kv_dtype=kv_dtype, pad_tokens=1)
    scale = 1 / math.sqrt(M3.head_dim)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = _run(q, cache, meta, scale=scale, max_qo_len=4, **kw)
    assert_close_rel(out, ref.dense_attention(q, cache.k, cache.v, meta, scale=scale, **kw), 2e-2)
    assert (out[12:] == 0).all()


@needs_gpu
def test_one_split_zeroes_graph_padding_rows_itself():
    meta, cache, q, _ = random_step(M3, [4, 3], [700, 129], kv_dtype=torch.float8_e4m3fn, pad_tokens=5)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    poison_allocator_like(q)
    out = _run(q, cache, meta, scale=0.1, max_qo_len=4, splits=1, **kw)
    assert_close_rel(out[:7], ref.dense_attention(q, cache.k, cache.v, meta, scale=0.1, **kw)[:7], 2e-2)
    assert (out[7:] == 0).all()


@needs_gpu
@pytest.mark.parametrize("kv_dtype,gain", [(torch.bfloat16, 4e5), (torch.float8_e5m2, 4096.0)])
def test_16_bit_partials_keep_the_largest_values_of_v(kv_dtype, gain):
    # split partials are 16-bit for bf16 queries (`attention_io.partial_dtype`): bf16 V past fp16's
    # 65504 goes through bf16 partials, e5m2 V at its largest (57344) through fp16 ones
    meta, cache, q, _ = random_step(M3, [4, 2], [900, 300], kv_dtype=kv_dtype)
    top = min(torch.finfo(kv_dtype).max, 2.0 ** 20)
    cache.v.copy_((cache.v.float() * gain).clamp(-top, top).to(kv_dtype))
    assert cache.v.float().abs().max() == top
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = _run(q, cache, meta, scale=0.088, max_qo_len=4, splits=5, **kw)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref.dense_attention(q, cache.k, cache.v, meta, scale=0.088, **kw), 2e-2)


@needs_gpu
@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 7), st.integers(0, 300)), min_size=1, max_size=4),
    splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_property_random_steps(reqs, splits, seed):
    qo_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    meta, cache, q, _ = random_step(SMALL, qo_lens, kv_lens, kv_dtype=torch.float32, q_dtype=torch.float32, seed=seed)
    out = _run(q, cache, meta, scale=0.2, splits=splits)
    assert_close_rel(out, ref.dense_attention(q, cache.k, cache.v, meta, scale=0.2), 1e-4)


@needs_gpu
def test_matches_package_reference_on_msa_metadata():
    from m3_eagle_plugin.msa import dense_attention

    step, cache, q, _ = random_step(M3, [4, 1, 4], [2500, 300, 129], kv_dtype=torch.bfloat16)
    meta = msa_metadata(step)
    out = _run(q, cache, meta, scale=0.088, max_qo_len=4)
    assert_close_rel(out, dense_attention(q, cache.k, cache.v, meta, scale=0.088), 1e-2)


@needs_gpu
def test_long_prefill_chunk_bounds_its_splits():
    # 4096 tokens x 16 heads x 128 dims: with a split per SM pair the partials would pass 2**31
    # elements (an illegal address on the H200 before the bound); the bound keeps them <= 2**27.
    meta, cache, q, _ = random_step(M3, [4096], [4096], kv_dtype=torch.bfloat16)
    scale = 1 / math.sqrt(M3.head_dim)
    out = _run(q, cache, meta, scale=scale)
    assert_close_rel(out, ref.dense_attention(q, cache.k, cache.v, meta, scale=scale), 2e-2)


@needs_gpu
def test_verify_rows_of_64_take_two_page_splits(monkeypatch):
    """B4/8K q4 at GQA group 16: one tile of 64 rows a request, so two-page splits (32, not 64);
    the output still matches the reference."""
    from m3_eagle_plugin.msa.kernels import dense_verify

    seen = []
    real = dense_verify.default_splits
    monkeypatch.setattr(dense_verify, "default_splits", lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw))
    meta, cache, q, _ = random_step(M3, [4] * 4, [8192] * 4, kv_dtype=torch.bfloat16)
    scale = 1 / math.sqrt(M3.head_dim)
    out = _run(q, cache, meta, scale=scale, max_qo_len=4)
    (args, kw), = seen
    assert kw == {"tile_rows": 64} and real(*args, **kw) == -(-args[2] // 2)
    assert_close_rel(out, ref.dense_attention(q, cache.k, cache.v, meta, scale=scale), 2e-2)


def test_a_grid_past_cudas_z_limit_is_refused_before_launch(monkeypatch):
    """The dense grid's z is the split count: past CUDA's 65535 programs it is refused as too large
    before any launch or allocation (`auto` then runs the torch reference), not failed by CUDA."""
    from m3_eagle_plugin.msa.kernels import KernelTooLargeError, dense_verify

    monkeypatch.setattr(dense_verify, "launch", lambda *a, **k: pytest.fail("launched"))
    q, kc, meta, _ = one_request_step(4)
    with pytest.raises(KernelTooLargeError, match=r"dense verify attention: its grid \(1, 1, 65536\) \(requests, "
                                                  r"KV heads, splits\) is past CUDA's 65535"):
        dense_verify.dense_verify_attention(q, kc, kc, meta, scale=0.25, splits=65536)


@pytest.mark.parametrize("key_tile", [0, 12, -16, 8])
def test_a_key_tile_the_mmas_cannot_take_is_refused_by_name_before_launch(monkeypatch, key_tile):
    """As in the sparse attention: a key tile that is not a power of two >= 16 was Triton's
    unnamed compile error."""
    from m3_eagle_plugin.msa.kernels import KernelInputError, dense_verify

    monkeypatch.setattr(dense_verify, "launch", lambda *a, **k: pytest.fail("launched"))
    meta, cache, q, _ = random_step(SMALL, [2, 1], [40, 17], kv_dtype=torch.float32, q_dtype=torch.float32,
                                    device="cpu")
    with pytest.raises(KernelInputError, match="key_tile must be a power of two >= 16"):
        _run(q, cache, meta, scale=0.3, splits=1, key_tile=key_tile)
