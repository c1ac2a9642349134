"""Triton sparse verify attention (both layouts: union-loading and per-token) vs the naive torch reference.

The `check_*` functions are device-agnostic: on CUDA they run here (`test_on_gpu`); on CPU
`tests._interpreter` runs `INTERPRETER_CASES` through Triton's interpreter, so CI executes both
layouts, the split merge and the graph-padding rows of the kernel itself. The interpreter's
`tl.dot` is wrong for bf16 operands (Triton 3.6), so those cases use fp32 or fp16 queries.
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


def _run(q, cache, meta, sel, **kw):
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    return sparse_verify_attention(q, cache.k, cache.v, meta, sel, **kw)


def _random_selection(meta, hkv, topk, block, seed):
    """Each token: its own local block plus random earlier blocks (ascending, -1 padded)."""
    gen = torch.Generator().manual_seed(seed)
    pos = meta.positions.tolist()
    live = int(meta.cu_qo_lens[-1])
    sel = torch.full((hkv, len(pos), topk), -1, dtype=torch.int32)
    for h in range(hkv):
        for t in range(live):
            local = pos[t] // block
            others = torch.randperm(local, generator=gen)[: topk - 1].tolist() if local else []
            ids = sorted(set(others + [local]))
            sel[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel.to(meta.positions.device)


LAYOUTS = ["union", "token"]


def check_matches_reference(device, *, layout, splits=None, qo_lens=(4, 1, 3), kv_lens=(70, 20, 40), topk=3,
                            kv_dtype=torch.float32, q_dtype=torch.float32, pad_tokens=0, max_qo_len=None, scale=0.3,
                            seed=1):
    """Live rows vs `torch_reference.sparse_attention` on a random selection (with the fp8 scales);
    graph-padding rows zero. `topk` is below most requests' block counts, so the selection matters."""
    meta, cache, q, _ = random_step(SMALL, list(qo_lens), list(kv_lens), kv_dtype=kv_dtype, q_dtype=q_dtype,
                                    seed=seed, pad_tokens=pad_tokens, device=device)
    sel = _random_selection(meta, SMALL.kv_heads, topk, SMALL.block, seed)
    kw = dict(scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = _run(q, cache, meta, sel, splits=splits, layout=layout, max_qo_len=max_qo_len, **kw)
    live = sum(qo_lens)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, **kw)
    assert_close_rel(out[:live], expect[:live], 1e-4 if q_dtype == torch.float32 else 2e-2)
    assert (out[live:] == 0).all(), "graph-padding rows are not zero"


def check_fused_union_matches_reference(device, *, splits=None, seed=2):
    """The union lists written by the fused top-k (`select_blocks_verify(union_group=...)`) drive the
    union layout (named: the default layout at this group is 'token', which ignores `union`): the
    output is the reference's on that top-k's selection."""
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    meta, cache, q, index_q = random_step(SMALL, [4, 2, 1], [50, 37, 16], kv_dtype=torch.float32,
                                          q_dtype=torch.float32, index_dtype=torch.float32, seed=seed, device=device)
    sel, union = select_blocks_verify(index_q, cache.index_k, meta, topk=2, max_qo_len=4, union_group=4)
    out = _run(q, cache, meta, sel, union=union, layout="union", scale=0.3, max_qo_len=4, splits=splits)
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.3), 1e-4)


#: The interpreter's share (CI has two cores): both layouts, several splits (the merge) and one
#: (the kernel zeroes the padding rows itself), fp8 K/V with scales, decode rows beside verify rows.
def check_seeded_random_step(device, *, seed):
    """`check_matches_reference` on a seeded random step: requests, lengths, top-k, layout, splits,
    graph padding and the q_len hint drawn from `seed` (the property test's, for CI)."""
    draw = seeded_draws(seed)
    qo_lens, kv_lens = seeded_requests(draw, max_requests=3, max_qo=5, max_extra=120)
    check_matches_reference(device, layout=LAYOUTS[draw(0, 1)], splits=(None, 1, 2, 3)[draw(0, 3)], qo_lens=qo_lens,
                            kv_lens=kv_lens, topk=draw(1, 5), pad_tokens=draw(0, 2),
                            max_qo_len=(None, max(qo_lens))[draw(0, 1)], seed=seed)


INTERPRETER_CASES = [
    (check_matches_reference, dict(layout="union", splits=2)),
    (check_matches_reference, dict(layout="token", splits=1, pad_tokens=2, seed=2)),
    (check_matches_reference, dict(layout="union", splits=1, qo_lens=(2, 4), kv_lens=(70, 50), pad_tokens=1,
                                   kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16, max_qo_len=4, scale=2.0,
                                   seed=3)),
    (check_matches_reference, dict(layout="token", splits=2, qo_lens=(1, 3), kv_lens=(49, 30), topk=2,
                                   kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16, scale=2.0, seed=4)),
    (check_fused_union_matches_reference, dict(splits=2)),
    (check_seeded_random_step, dict(seed=31)),
]


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_sparse_verify")


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_matches_reference_fp32(splits, layout):
    meta, cache, q, _ = random_step(SMALL, [4, 1, 3], [150, 20, 64], kv_dtype=torch.float32, q_dtype=torch.float32)
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 1)
    out = _run(q, cache, meta, sel, scale=0.3, splits=splits, layout=layout)
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.3), 1e-4)


@needs_gpu
@pytest.mark.parametrize("layout,compute_f16,prefetch", [("union", None, False), ("union", False, False),
                                                        ("token", None, False), ("token", True, True)])
def test_m3_geometry_fp8_with_scales_and_padding(layout, compute_f16, prefetch):
    meta, cache, q, _ = random_step(M3, [4, 4, 4, 4], [5000, 300, 2048, 4], kv_dtype=torch.float8_e4m3fn,
                                    pad_tokens=2)
    sel = _random_selection(meta, M3.kv_heads, M3.topk, M3.block, 2)
    scale = 1 / math.sqrt(M3.head_dim)
    out = _run(q, cache, meta, sel, scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale, max_qo_len=4,
               layout=layout, compute_f16=compute_f16, prefetch=prefetch)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale, k_scale=cache.k_scale,
                                  v_scale=cache.v_scale)
    assert_close_rel(out, expect, 2e-2)
    assert (out[16:] == 0).all()


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_split_zeroes_graph_padding_rows_itself(layout):
    """One split writes `out` with no memset: the kernel zeroes the rows past the last request."""
    meta, cache, q, _ = random_step(M3, [4, 2, 4], [900, 300, 129], kv_dtype=torch.float8_e4m3fn, pad_tokens=7)
    sel = _random_selection(meta, M3.kv_heads, M3.topk, M3.block, 3)
    scale = 1 / math.sqrt(M3.head_dim)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    poison_allocator_like(q)
    out = _run(q, cache, meta, sel, scale=scale, max_qo_len=4, splits=1, layout=layout, **kw)
    assert_close_rel(out[:10], ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale, **kw)[:10], 2e-2)
    assert (out[10:] == 0).all()


@needs_gpu
@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 300)), min_size=1, max_size=4),
    topk=st.integers(1, 6),
    splits=st.sampled_from([None, 1, 2, 5]),
    hint=st.sampled_from([None, 2, 9]),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_property_random_steps(reqs, topk, splits, hint, layout, seed):
    qo_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    meta, cache, q, _ = random_step(SMALL, qo_lens, kv_lens, kv_dtype=torch.float32, q_dtype=torch.float32, seed=seed)
    sel = _random_selection(meta, SMALL.kv_heads, topk, SMALL.block, seed)
    out = _run(q, cache, meta, sel, scale=0.2, splits=splits, layout=layout,
               max_qo_len=None if hint is None else max(hint, max(qo_lens)))
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.2), 1e-4)


@needs_gpu
def test_fused_union_from_topk_gives_same_output():
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    meta, cache, q, index_q = random_step(M3, [4, 4, 1], [3000, 700, 129], kv_dtype=torch.float8_e4m3fn,
                                          correlation=0.9)
    sel, union = select_blocks_verify(index_q, cache.index_k, meta, topk=M3.topk, max_qo_len=4, union_group=16)
    kw = dict(scale=0.088, k_scale=cache.k_scale, v_scale=cache.v_scale, max_qo_len=4)
    fused = _run(q, cache, meta, sel, union=union, layout="union", **kw)  # the default ('token') ignores union
    assert_close_rel(fused, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.088, k_scale=cache.k_scale,
                                                 v_scale=cache.v_scale), 2e-2)
    # Same blocks, possibly another order (ascending vs first-seen): equal up to summation order.
    assert_close_rel(fused, _run(q, cache, meta, sel, **kw), 2e-3)


@needs_gpu
@pytest.mark.parametrize("key_tile", [16, 64])
def test_main_loop_variants_agree_with_reference(key_tile):
    meta, cache, q, _ = random_step(M3, [4, 1, 4], [900, 300, 4000], kv_dtype=torch.float8_e4m3fn)
    sel = _random_selection(meta, M3.kv_heads, M3.topk, M3.block, 5)
    kw = dict(scale=0.088, k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = _run(q, cache, meta, sel, max_qo_len=4, key_tile=key_tile, splits=3, **kw)
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, **kw), 2e-2)


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_selected_page_propagates(layout):
    meta, cache, q, _ = random_step(SMALL, [2], [40], kv_dtype=torch.float32, q_dtype=torch.float32)
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 3)
    page = int(meta.block_tables[0, 2])  # the local block of both tokens: always selected
    cache.v[page, 0, 0, 0] = float("nan")
    out = _run(q, cache, meta, sel, scale=0.2, layout=layout)
    assert torch.isnan(out[:, : SMALL.q_heads // SMALL.kv_heads]).any()


@needs_gpu
def test_matches_package_reference_on_msa_metadata():
    from m3_eagle_plugin.msa import sparse_attention

    step, cache, q, _ = random_step(M3, [4, 4, 1, 4], [3000, 129, 700, 6000], kv_dtype=torch.bfloat16)
    meta = msa_metadata(step)
    sel = _random_selection(step, M3.kv_heads, M3.topk, M3.block, 9)
    out = _run(q, cache, meta, sel, scale=0.088, max_qo_len=4)
    assert_close_rel(out, sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.088), 1e-2)


@needs_gpu
@pytest.mark.parametrize("kw,match", [({"layout": "ragged"}, "layout"), ({"layout": ""}, "layout"),
                                      ({"compute_f16": True}, "16-bit")])
def test_bad_options_are_refused(kw, match):
    from m3_eagle_plugin.msa.kernels import KernelInputError

    meta, cache, q, _ = random_step(SMALL, [1], [20], kv_dtype=torch.float32, q_dtype=torch.float32)
    sel = _random_selection(meta, SMALL.kv_heads, SMALL.topk, SMALL.block, 4)
    with pytest.raises(KernelInputError, match=match):
        _run(q, cache, meta, sel, scale=0.2, **kw)


@pytest.mark.parametrize("tokens,hint,kw,programs", [
    (65536, True, {}, "65536 tokens a request x 1 splits"),                # a 64K-token prefill chunk
    (65536, False, {}, "65536 tokens a request x 1 splits; without max_qo_len"),
    (4, True, {"splits": 20000}, "4 tokens a request x 20000 splits"),
    (8192, True, {"layout": "union", "splits": 200}, "512 chunks of 16 tokens a request x 200 splits"),
])
def test_a_grid_past_cudas_z_limit_is_refused_before_launch(monkeypatch, tokens, hint, kw, programs):
    """CUDA launches at most 65535 programs on a grid's y and z axes (past it `cuLaunchKernel` only
    says "invalid argument"); the attention's z is a request's tokens (or token chunks) x splits.
    Refused as too large, naming the count, before anything is launched (`auto` then runs the
    torch reference: tests/msa/kernels/test_backend.py)."""
    from m3_eagle_plugin.msa.kernels import KernelTooLargeError
    from m3_eagle_plugin.msa.kernels import block_union, sparse_verify

    launched = []
    for module in (sparse_verify, block_union):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *a, **k: launched.append(grid))
    q, kc, meta, sel = one_request_step(tokens, hint=hint)
    with pytest.raises(KernelTooLargeError, match=r"\(1, 1, \d+\) \(requests, KV heads, " + programs.replace("(", r"\(")):
        sparse_verify.sparse_verify_attention(q, kc, kc, meta, sel, scale=0.25, **kw)
    assert not launched


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("key_tile", [0, 12, -16, 8, 16.0])
def test_a_key_tile_the_mmas_cannot_take_is_refused_by_name_before_launch(monkeypatch, layout, key_tile):
    """A key tile that is not a power of two >= 16 (tl.dot's smallest) was handed to Triton, whose
    compile error (or the interpreter's arange error) named no option."""
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels import block_union, sparse_verify

    launched = []
    for module in (sparse_verify, block_union):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *a, **k: launched.append(grid))
    meta, cache, q, _ = random_step(SMALL, [2, 1], [40, 17], kv_dtype=torch.float32, q_dtype=torch.float32,
                                    device="cpu")
    sel = _random_selection(meta, SMALL.kv_heads, 2, SMALL.block, 5)
    with pytest.raises(KernelInputError, match="key_tile must be a power of two >= 16"):
        _run(q, cache, meta, sel, scale=0.3, splits=1, layout=layout, key_tile=key_tile)
    assert not launched
