"""The attention wrappers' shared input checks and split partials (`attention_io`)."""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("triton")

from m3_eagle_plugin.msa.kernels import KernelInputError  # noqa: E402
from m3_eagle_plugin.msa.kernels.attention_io import (  # noqa: E402
    MAX_PARTIAL_ELEMENTS, check_attention_inputs, check_splits, max_partial_splits, partial_dtype, split_outputs)


def _meta():
    z = torch.zeros(1, dtype=torch.int32)
    return types.SimpleNamespace(block_tables=z.view(1, 1), kv_lens=z, cu_qo_lens=torch.zeros(2, dtype=torch.int32),
                                 positions=z)


def _good():
    return torch.zeros(4, 8, 32), torch.zeros(3, 2, 16, 32), torch.zeros(3, 2, 16, 32)


@pytest.mark.parametrize("change, cause", [
    (lambda q, k, v, m: (q[0], k, v, m), "q must be"),
    (lambda q, k, v, m: (q[..., :16], k, v, m), "unit last stride|head dim of q"),
    (lambda q, k, v, m: (torch.zeros(4, 8, 64), k, v, m), "head dim of q"),
    (lambda q, k, v, m: (torch.zeros(4, 6, 32), torch.zeros(3, 4, 16, 32), torch.zeros(3, 4, 16, 32), m),
     "not a multiple of KV heads"),
    (lambda q, k, v, m: (q, torch.zeros(3, 0, 16, 32), torch.zeros(3, 0, 16, 32), m), "no KV head"),
    (lambda q, k, v, m: (q, k, torch.zeros(3, 2, 16, 32)[:2], m), "k/v cache shapes differ"),
    (lambda q, k, v, m: (q, torch.zeros(3, 2, 24, 32), torch.zeros(3, 2, 24, 32), m), "powers of two"),
    (lambda q, k, v, m: (q, torch.zeros(3, 2, 8, 32), torch.zeros(3, 2, 8, 32), m), "powers of two >= 16"),
    (lambda q, k, v, m: (torch.zeros(4, 8, 8), torch.zeros(3, 2, 16, 8), torch.zeros(3, 2, 16, 8), m),
     "powers of two >= 16"),
    (lambda q, k, v, m: (q, k.int(), v.int(), m), "unsupported k_cache dtype torch.int32"),
    (lambda q, k, v, m: (q, k, v.double(), m), "unsupported v_cache dtype torch.float64"),
    (lambda q, k, v, m: (q, k, v, types.SimpleNamespace(kv_lens=m.kv_lens)), "lacks field"),
    (lambda q, k, v, m: (q[:1], k, v, types.SimpleNamespace(**{**vars(m), "positions": torch.zeros(4)})),
     "q has 1 rows, fewer than the metadata's 4 tokens"),
    (lambda q, k, v, m: (q, k, v, types.SimpleNamespace(**vars(m), block_size=32)),
     "k_cache has 16-token pages but the metadata's block_size is 32"),
    (lambda q, k, v, m: (q, k, v, types.SimpleNamespace(
        **{**vars(m), "block_tables": torch.zeros(3, 2, dtype=torch.int32).t()})), "unit column stride"),
])
def test_bad_inputs_are_refused_with_their_cause(change, cause):
    q, k, v = _good()
    check_attention_inputs(q, k, v, _meta())  # the good case passes
    with pytest.raises(KernelInputError, match=cause):
        check_attention_inputs(*change(q, k, v, _meta()))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(splits=st.integers(0, 1 << 12), row=st.integers(0, 1 << 24))
@example(splits=2, row=(1 << 27) // 2)  # exactly MAX_PARTIAL_ELEMENTS: taken
@example(splits=2, row=(1 << 27) // 2 + 1)
def test_split_bound_accepts_exactly_what_fits(splits, row):
    fits = splits >= 1 and (splits == 1 or splits * row <= MAX_PARTIAL_ELEMENTS)
    if fits:
        check_splits(splits, row)
    else:
        with pytest.raises(KernelInputError):
            check_splits(splits, row)
    most = max_partial_splits(row)
    assert most * max(row, 1) <= MAX_PARTIAL_ELEMENTS < (most + 1) * max(row, 1)


def test_split_count_must_be_an_integer():
    """A split count sizes the partials and the grid: 2.5 failed in torch's allocation naming no option
    and True ran as one split; any integer (NumPy's too) is taken as its int."""
    import numpy as np

    for bad, shown in ((2.5, "float 2.5"), (True, "bool"), ("2", "str '2'")):
        with pytest.raises(KernelInputError, match=f"splits must be an int >= 1, got {shown}"):
            check_splits(bad, 16)
    taken = check_splits(np.int64(3), 16)
    assert taken == 3 and type(taken) is int


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _cache(dtype, dim=16):
    return torch.zeros(1, 1, 16, dim, dtype=dtype)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(tokens=st.integers(0, 9), heads=st.integers(1, 8), dim=st.sampled_from([16, 32]), splits=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), kv_dtype=st.sampled_from(KV_DTYPES))
def test_split_outputs_shapes(tokens, heads, dim, splits, dtype, kv_dtype):
    q = torch.zeros(tokens, heads, dim, dtype=dtype)
    v_cache = _cache(kv_dtype, dim)
    out, part, lse = split_outputs(q, v_cache, splits)
    assert out.shape == q.shape and out.dtype == dtype
    if splits == 1:  # the kernel writes the output itself: no partials, no LSE
        assert part is out and lse is out
    else:
        assert part.shape == (tokens, heads, splits, dim) and part.dtype == partial_dtype(q, v_cache)
        assert lse.shape == (tokens, heads, splits) and lse.dtype == torch.float32
        assert len({out.data_ptr(), part.data_ptr(), lse.data_ptr()} - {0}) == (3 if tokens else 0)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_partials_hold_every_value_of_v(q_dtype, kv_dtype):
    """A partial is a probability-weighted mean of unscaled V rows, so it is at most the largest
    |V|: the partial dtype must hold the V dtype's largest finite value (an fp32 cache's up to bf16's
    range); 16 bits unless q is fp32, fp16 wherever it holds it (finer than bf16)."""
    dt = partial_dtype(torch.zeros(1, dtype=q_dtype), _cache(kv_dtype))
    assert torch.finfo(dt).max >= min(torch.finfo(kv_dtype).max, torch.finfo(torch.bfloat16).max)
    if q_dtype == torch.float32:
        assert dt == torch.float32
    else:
        assert dt.itemsize == 2
        assert (dt == torch.float16) == (torch.finfo(kv_dtype).max <= torch.finfo(torch.float16).max)
