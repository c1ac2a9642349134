"""The per-token sparse attention with two-page key tiles (`pages_per_tile=2`: each MMA tile is
two of a token's pages) vs the torch reference and vs one-page tiles, on hostile e4m3 caches
(NaN tails, a selected page past the request) and on 16-bit K/V; odd page counts per split leave a
tile's second half unmapped. Also the programs' request-major numbering (`request_major`).

Device-agnostic: on CUDA the checks run here; on CPU `tests._interpreter` runs them through
Triton's interpreter in a subprocess, so CI executes the kernel's two-page indexing.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import assert_close_rel, random_step
from .test_sparse_verify_paired_v import E4M3, GEO, _hostile_step


def _attend(q, k, v, meta, sel, qo_lens, **kw):
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    return sparse_verify_attention(q, k, v, meta, sel, max_qo_len=max(qo_lens), layout="token", **kw)


def _assert_matches_reference(out, q, meta, cache, clean, sel, scale):
    """`out` against the torch reference on the hostile step's clean K/V (`_hostile_step`)."""
    assert_close_rel(out, ref.sparse_attention(q, clean[0], clean[1], meta, sel, scale=scale,
                                               k_scale=cache.k_scale, v_scale=cache.v_scale), 2e-2)


def check_two_page_tiles_match_reference(device, *, splits=1, qo_lens=(4, 1, 3), kv_lens=(70, 9, 40), seed=0,
                                         paired_v=True, stages=2):
    """Hostile e4m3 step: finite, the reference on the clean cache, one-page tiles up to the order
    of summation (the same keys, folded two pages at a time)."""
    meta, cache, clean, q, sel = _hostile_step(device, list(qo_lens), list(kv_lens), seed)
    kw = dict(scale=GEO.head_dim ** -0.5, k_scale=cache.k_scale, v_scale=cache.v_scale, splits=splits,
              paired_v=paired_v)
    out = _attend(q, cache.k, cache.v, meta, sel, qo_lens, pages_per_tile=2, num_stages=stages, **kw)
    assert torch.isfinite(out).all(), "an e4m3 NaN tail or an unmapped page reached the output"
    _assert_matches_reference(out, q, meta, cache, clean, sel, kw["scale"])
    one = _attend(q, cache.k, cache.v, meta, sel, qo_lens, key_tile=GEO.block, **kw)
    assert_close_rel(out, one, 2e-3)


def check_two_page_tiles_16bit(device, *, dtype="float16", splits=2, seed=5):
    """16-bit K/V and q (no paired read), ragged requests and graph-padding rows. (Triton's
    interpreter computes bf16 dots wrongly, in either tiling: bf16 runs on a GPU only.)"""
    qo_lens, kv_lens = [3, 4, 1], [100, 37, 16]
    meta, cache, q, _ = random_step(GEO, qo_lens, kv_lens, kv_dtype=getattr(torch, dtype),
                                    q_dtype=getattr(torch, dtype), pad_tokens=2, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((GEO.kv_heads, q.shape[0], GEO.topk), -1, dtype=torch.int32)
    for t, pos in enumerate(meta.positions.tolist()[: sum(qo_lens)]):
        local = pos // GEO.block
        ids = sorted(set(torch.randperm(local + 1, generator=gen)[: GEO.topk - 1].tolist() + [local]))
        sel[:, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    sel = sel.to(device)
    out = _attend(q, cache.k, cache.v, meta, sel, qo_lens, scale=0.2, splits=splits, pages_per_tile=2)
    assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.2), 2e-2)
    assert not out[sum(qo_lens):].any(), "graph-padding rows must be zero"


def check_request_major_changes_nothing(device, *, splits=2, qo_lens=(4, 1, 3), kv_lens=(70, 9, 40), seed=6,
                                        pages_per_tile=2):
    """Programs numbered request by request (`request_major`, the early attention's order for fp8
    K/V) compute the same rows as the grid's own order, bit for bit, and the reference's values:
    every (request, token, split) is one program's, and no other's."""
    meta, cache, clean, q, sel = _hostile_step(device, list(qo_lens), list(kv_lens), seed)
    kw = dict(scale=GEO.head_dim ** -0.5, k_scale=cache.k_scale, v_scale=cache.v_scale, splits=splits,
              pages_per_tile=pages_per_tile)
    grid_order = _attend(q, cache.k, cache.v, meta, sel, qo_lens, **kw)
    out = _attend(q, cache.k, cache.v, meta, sel, qo_lens, request_major=True, **kw)
    assert torch.equal(out, grid_order), "request-major programs wrote different rows"
    _assert_matches_reference(out, q, meta, cache, clean, sel, kw["scale"])


def check_bad_tilings_are_refused(device):
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    meta, cache, clean, q, sel = _hostile_step(device, [2], [20], 1)
    for kw, match in ((dict(pages_per_tile=3), "pages_per_tile must be 1 or 2"),
                      (dict(pages_per_tile=2, layout="union"), "needs layout 'token'"),
                      (dict(pages_per_tile=2, prefetch=False), "with prefetch"),
                      (dict(request_major=True, layout="union"), "request_major needs layout 'token'")):
        with pytest.raises(KernelInputError, match=match):
            sparse_verify_attention(q, cache.k, cache.v, meta, sel, scale=0.2, **kw)
    # 16-bit pages of 128 x 128: a two-page tile's two stages would not fit shared memory (the H200
    # asked for 274 KB of its 227) -- refused by name, not left to Triton's OutOfResources
    wide = Geometry(q_heads=16, kv_heads=1, head_dim=128, index_heads=1, index_dim=128, block=128, topk=4)
    meta, cache, q, _ = random_step(wide, [2], [300], kv_dtype=torch.bfloat16, device=device)
    sel = torch.tensor([[[0, 1, 2, -1]] * q.shape[0]], dtype=torch.int32, device=device)
    with pytest.raises(KernelInputError, match="two-page K and V tile of 128 KB"):
        sparse_verify_attention(q, cache.k, cache.v, meta, sel, scale=0.2, pages_per_tile=2)


#: The interpreter's share (small launches: CI has two cores). Top-4 selections: one split gives
#: a program 3-4 pages (a half-empty last tile at 3), two splits 1-2, three splits 1-2.
INTERPRETER_CASES = [
    (check_two_page_tiles_match_reference, dict(splits=1)),
    (check_two_page_tiles_match_reference, dict(splits=3, seed=1)),
    (check_two_page_tiles_16bit, dict()),
    (check_bad_tilings_are_refused, dict()),
    (check_request_major_changes_nothing, dict()),
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES + [
    (check_two_page_tiles_match_reference, dict(splits=2, qo_lens=(4, 4, 4, 4), kv_lens=(300, 17, 129, 64), seed=3,
                                                stages=3)),
    (check_two_page_tiles_match_reference, dict(splits=1, paired_v=False, seed=4)),
    (check_two_page_tiles_16bit, dict(dtype="bfloat16", splits=1)),
    (check_request_major_changes_nothing, dict(splits=1, qo_lens=(4,) * 6, kv_lens=(300, 17, 129, 64, 90, 33))),
    (check_request_major_changes_nothing, dict(splits=3, pages_per_tile=1, seed=7)),
])
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_cuda
@settings(max_examples=12, deadline=None)
@given(qo_lens=st.lists(st.integers(1, 4), min_size=1, max_size=5), extra=st.integers(0, 200),
       splits=st.integers(1, 4), seed=st.integers(0, 1000))
def test_property_two_page_tiles_equal_one_page_tiles(qo_lens, extra, splits, seed):
    """Any batch and split count: two-page tiles give the one-page result up to summation order."""
    kv_lens = [q + extra + 7 * i for i, q in enumerate(qo_lens)]
    check_two_page_tiles_match_reference("cuda", splits=splits, qo_lens=tuple(qo_lens), kv_lens=tuple(kv_lens),
                                         seed=seed)


@needs_cuda
@settings(max_examples=8, deadline=None)
@given(qo_lens=st.lists(st.integers(1, 4), min_size=1, max_size=6), extra=st.integers(0, 200),
       splits=st.integers(1, 5), pages=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_property_request_major_equals_grid_order(qo_lens, extra, splits, pages, seed):
    """Any batch, split count and tiling: request-major programs write what the grid's order does."""
    kv_lens = [q + extra + 5 * i for i, q in enumerate(qo_lens)]
    check_request_major_changes_nothing("cuda", splits=splits, qo_lens=tuple(qo_lens), kv_lens=tuple(kv_lens),
                                        seed=seed, pages_per_tile=pages)


@needs_interpreter
@pytest.mark.skipif(E4M3 is None, reason="torch lacks float8_e4m3fn")
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_sparse_verify_two_pages")
