"""The split-K merge (`merge.merge_splits`) vs a naive torch fold of the same partials.

Device-agnostic: on CUDA the checks run here; on CPU `tests._interpreter` runs them through
Triton's interpreter, so CI executes the kernel's indexing, the padded split lanes and the
graph-padding rows.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import needs_gpu


def naive_merge(partial, lse, live_tokens, v_scale):
    """fp64 `[T, Hq, D]`: per row, the splits' partials weighted by 2**lse (normalised); rows with
    no finite LSE and tokens at or past `live_tokens` are zero."""
    p, l = partial.double().cpu(), lse.double().cpu()
    out = torch.zeros(p.shape[0], p.shape[1], p.shape[3], dtype=torch.float64)
    for t in range(live_tokens):
        for h in range(p.shape[1]):
            finite = torch.isfinite(l[t, h])
            if finite.any():
                w = torch.exp2(l[t, h][finite] - l[t, h][finite].max())
                out[t, h] = (w[:, None] * p[t, h][finite]).sum(0) / w.sum() * v_scale
    return out


def random_partials(tokens, heads, splits, dim, device, seed, empty_frac=0.2):
    """Partials and LSEs as the attention kernels write them: some splits saw no key (LSE -inf,
    partial zero), and one row of token 0 saw none at all."""
    gen = torch.Generator().manual_seed(seed)
    partial = torch.randn(tokens, heads, splits, dim, generator=gen)
    lse = torch.randn(tokens, heads, splits, generator=gen) * 6
    empty = torch.rand(tokens, heads, splits, generator=gen) < empty_frac
    empty[0, 0] = True
    lse[empty] = float("-inf")
    partial[empty] = 0.0
    return partial.to(device), lse.to(device)


def check_merge_matches_naive(device, *, tokens=5, heads=6, splits=11, dim=16, live=4, num_warps=None,
                              v_scale=0.7, seed=0, dtype=torch.float16, partial_dtype=torch.float32):
    from m3_eagle_plugin.msa.kernels.merge import merge_splits

    partial, lse = random_partials(tokens, heads, splits, dim, device, seed)
    partial = partial.to(partial_dtype)  # the attentions write 16-bit partials for 16-bit queries
    cu = torch.tensor([0, 1, live], dtype=torch.int32, device=device)
    out = torch.full((tokens, heads, dim), float("nan"), dtype=dtype, device=device)
    merge_splits(partial, lse, out, cu, v_scale, num_warps=num_warps)
    expect = naive_merge(partial, lse, live, v_scale)
    assert torch.isfinite(out).all(), "unwritten or NaN rows"
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-3  # the output's own rounding
    torch.testing.assert_close(out.double().cpu(), expect, rtol=tol, atol=tol)
    assert (out[live:] == 0).all() and (out[0, 0] == 0).all()


def check_split_order_does_not_matter(device, *, splits=9, seed=3):
    """The fold is a weighted mean: permuting the splits (partials with their LSEs) keeps it."""
    from m3_eagle_plugin.msa.kernels.merge import merge_splits

    partial, lse = random_partials(3, 4, splits, 16, device, seed)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    perm = torch.randperm(splits, generator=torch.Generator().manual_seed(seed)).to(device)
    a = merge_splits(partial, lse, torch.empty(3, 4, 16, device=device), cu)
    b = merge_splits(partial[:, :, perm].contiguous(), lse[:, :, perm].contiguous(), torch.empty(3, 4, 16, device=device),
                     cu)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


#: The interpreter's share (CI has two cores): splits padded to a power of two (11 -> 16, 17 -> 32),
#: one split, an fp32 output.
INTERPRETER_CASES = [
    (check_merge_matches_naive, dict()),
    (check_merge_matches_naive, dict(splits=17, heads=5, seed=1, dtype=torch.float32)),
    (check_merge_matches_naive, dict(splits=1, seed=2)),
    (check_merge_matches_naive, dict(splits=6, seed=4, partial_dtype=torch.bfloat16, dtype=torch.bfloat16)),
    (check_split_order_does_not_matter, dict()),
]


def test_warps_follow_the_tile_size():
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.merge import merge_warps

    assert [merge_warps(sp, 128) for sp in (2, 8, 16, 32, 64, 128, 256, 1024)] == [1, 1, 1, 1, 2, 4, 4, 4]
    assert [merge_warps(sp, 128) for sp in (1, 9, 33, 65)] == [1, 1, 2, 4]  # split lanes 2, 16, 64, 128
    assert merge_warps(64, 64) == 1


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_gpu
@settings(max_examples=25, deadline=None, derandomize=True)
@given(tokens=st.integers(1, 40), heads=st.integers(1, 20), splits=st.integers(1, 40),
       dim=st.sampled_from([16, 64, 128]), num_warps=st.sampled_from([None, 1, 4]), seed=st.integers(0, 2**16),
       partial_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_property_random_shapes_on_gpu(tokens, heads, splits, dim, num_warps, seed, partial_dtype):
    check_merge_matches_naive("cuda", tokens=tokens, heads=heads, splits=splits, dim=dim, live=max(1, tokens - 2),
                              num_warps=num_warps, seed=seed, partial_dtype=partial_dtype)


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_merge")
