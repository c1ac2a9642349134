"""Launch-geometry helpers: properties the kernels rely on."""
from __future__ import annotations

import types

import pytest
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.msa.kernels._common import KernelInputError, is_pow2, next_pow2, qo_len_hint, tokens_per_tile


def test_reference_values():
    assert tokens_per_tile(256, 64, 16, 4) == 4     # verify rows of the M3 geometry: 64-row MMA tiles
    assert tokens_per_tile(64, 64, 16, 1) == 1      # plain decode
    assert tokens_per_tile(256, 64, 1, 4) == 16     # index scoring: 16 rows minimum for tl.dot
    assert tokens_per_tile(8000, 1, 16, None) == 16  # long prefill chunk: capped, the kernels loop
    assert [next_pow2(n) for n in (0, 1, 2, 3, 17)] == [1, 1, 2, 4, 32]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(tokens=st.integers(0, 5000), requests=st.integers(1, 300), rows=st.integers(1, 64),
       hint=st.one_of(st.none(), st.integers(1, 64)))
def test_tile_is_pow2_fills_mma_and_covers_verify_rows(tokens, requests, rows, hint):
    qp = tokens_per_tile(tokens, requests, rows, hint)
    assert is_pow2(qp) and qp <= max(16, next_pow2(-(-16 // rows)))
    assert qp * rows >= 16
    if hint is not None and hint <= 16:
        assert qp >= hint


def test_qo_len_hint_prefers_caller_then_metadata():
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=4), None) == 4
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=4), 7) == 7
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=0), None) is None
    assert qo_len_hint(object(), None) is None
    with pytest.raises(KernelInputError, match="max_qo_len"):
        qo_len_hint(object(), 0)
