"""Launch-geometry helpers: properties the kernels rely on."""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from m3_eagle_plugin.msa.kernels._common import (MAX_TILE_ROWS, KernelInputError, fits_one_tile, is_pow2, next_pow2,
                                                 qo_len_hint, tokens_per_tile)


def test_reference_values():
    assert tokens_per_tile(256, 64, 16, 4) == 4     # verify rows of the M3 geometry: 64-row MMA tiles
    assert tokens_per_tile(64, 64, 16, 1) == 1      # plain decode
    assert tokens_per_tile(256, 64, 1, 4) == 16     # index scoring: 16 rows minimum for tl.dot
    assert tokens_per_tile(8000, 1, 16, None) == 4   # long prefill chunk: 64 rows at most, the kernels loop
    assert tokens_per_tile(8000, 1, 2, None) == 16   # small groups: 16 tokens at most
    assert [next_pow2(n) for n in (0, 1, 2, 3, 17)] == [1, 1, 2, 4, 32]
    # no bound: 5 tokens of 2 requests put at least 3 in one of them, whose pages a 4-token chunk reads once
    assert tokens_per_tile(5, 2, 16, None) == 4


@settings(max_examples=25, deadline=None, derandomize=True)
@given(tokens=st.integers(0, 5000), requests=st.integers(1, 300), rows=st.integers(1, 64),
       hint=st.one_of(st.none(), st.integers(1, 64)))
@example(tokens=10, requests=2, rows=8, hint=5)  # a verify row: the draws never gave a hint that fits one tile
def test_tile_is_pow2_fills_mma_and_covers_verify_rows(tokens, requests, rows, hint):
    qp = tokens_per_tile(tokens, requests, rows, hint)
    assert is_pow2(qp) and qp <= max(16, next_pow2(-(-16 // rows)))
    assert qp * rows >= 16
    assert qp * rows <= max(MAX_TILE_ROWS, rows * next_pow2(-(-16 // rows)))  # fits an SM's shared memory
    if hint is not None and hint <= 16 and hint * rows <= MAX_TILE_ROWS:
        assert qp >= hint and fits_one_tile(hint, qp)  # a decode / verify row: one tile
    if hint is None or hint > 16:
        assert not fits_one_tile(hint, qp)  # no bound, or one past any tile: the kernels loop


def test_qo_len_hint_prefers_caller_then_metadata():
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=4), None) == 4
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=4), 7) == 7
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=0), None) is None
    for bad in (2.9, True, "4", 0):  # 2.9 sized the grids for 2 tokens when no metadata value caught it
        with pytest.raises(KernelInputError, match="max_qo_len must be an int >= 1"):
            qo_len_hint(types.SimpleNamespace(), bad)
    assert qo_len_hint(object(), None) is None
    with pytest.raises(KernelInputError, match="max_qo_len"):
        qo_len_hint(object(), 0)
    # a bound below the step's own longest request would size the verify grids too small
    with pytest.raises(KernelInputError, match="max_qo_len 1 is below the step's longest request"):
        qo_len_hint(types.SimpleNamespace(max_qo_len=4), 1)
    assert qo_len_hint(types.SimpleNamespace(max_qo_len=4), 4) == 4  # a bound equal to it holds every request


def test_split_partials_stay_bounded_and_explicit_overflow_is_refused():
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.dense_verify import default_splits
    from m3_eagle_plugin.msa.kernels.attention_io import MAX_PARTIAL_ELEMENTS, check_splits
    from m3_eagle_plugin.msa.kernels.sparse_verify import choose_splits

    row = 4096 * 16 * 128  # one long prefill chunk's T x Hq x D
    splits = choose_splits(1, 1, 576, torch.device("cpu"), partial_row=row)
    assert splits * row <= MAX_PARTIAL_ELEMENTS and splits >= 1
    assert choose_splits(64, 1, 256, torch.device("cpu"), partial_row=256 * 16 * 128) == 5  # verify: unchanged
    check_splits(1, 10 * MAX_PARTIAL_ELEMENTS)  # one split writes no partials
    cpu = torch.device("cpu")  # 132 SMs assumed: the H200 sweep's shapes give its measured best
    # 32K (width 256): the fewest waves of 264 programs x pages a split, ties to fewer splits
    assert [default_splits(r, 1, 256, r * 4 * 16 * 128, cpu) for r in (64, 48, 40, 32, 24, 16)] == [4, 11, 13, 8, 11, 16]
    assert [default_splits(r, 1, 64, r * 4 * 16 * 128, cpu) for r in (256, 128, 64, 48, 32, 16)] == [1, 2, 4, 5, 8, 16]
    assert default_splits(64, 1, 128, 0, cpu) == 4 and default_splits(8, 4, 32, 0, cpu) == 8  # the dense peer
    assert default_splits(1, 1, 64, 0, cpu) == 64 and default_splits(1, 1, 1024, 0, cpu) == 256  # one wave
    # a 64-row verify tile: one-page splits past 1.5 programs a SM become two-page splits (the H200 A/B's shapes)
    wide = dict(tile_rows=64)
    assert [default_splits(r, 1, w, 0, cpu, **wide) for r, w in ((1, 256), (2, 128), (4, 64), (8, 32), (16, 16))] \
        == [128, 64, 32, 16, 8]
    assert [default_splits(r, 1, w, 0, cpu) for r, w in ((1, 256), (4, 64), (16, 16))] == [256, 64, 16]  # 16 rows
    assert [default_splits(r, 1, w, 0, cpu, **wide) for r, w in ((3, 64), (6, 32), (12, 16))] == [64, 32, 16]
    assert default_splits(1, 1, 64, 0, cpu, **wide) == 64 and default_splits(1, 1, 1024, 0, cpu, **wide) == 256
    assert default_splits(1, 1, 576, 0, cpu) >= 1  # an empty step still gets a valid launch
    assert default_splits(1, 1, 576, row, cpu) * row <= MAX_PARTIAL_ELEMENTS
    with pytest.raises(KernelInputError, match="partial elements"):
        check_splits(264, row)


def test_token_splits_reference_values_and_bounds():
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.attention_io import MAX_PARTIAL_ELEMENTS
    from m3_eagle_plugin.msa.kernels.sparse_verify import token_splits

    cpu = torch.device("cpu")  # 132 SMs assumed: the H200 sweep's best at B64 q4/q1, B16 q4, B1
    assert [token_splits(u, 16, cpu) for u in (256, 64, 64, 4, 1)] == [1, 2, 2, 16, 16]
    assert token_splits(10**6, 16, cpu) == 1 and token_splits(3, 1, cpu) == 1
    row = 4096 * 16 * 128
    assert token_splits(1, 64, cpu, partial_row=row) * row <= MAX_PARTIAL_ELEMENTS


def test_step_buffer_is_filled_shared_per_device_and_grows_to_a_power_of_two():
    from m3_eagle_plugin.msa.kernels._common import step_buffer

    store: dict = {}
    a = step_buffer(store, "cpu", 5, fill=-3, min_numel=8)
    assert a.shape == (5,) and a.dtype == torch.int32 and (a == -3).all()
    assert store[torch.device("cpu")].numel() == 8
    assert step_buffer(store, "cpu", 8, fill=-3, min_numel=8).data_ptr() == a.data_ptr()
    big = step_buffer(store, "cpu", 9, fill=-3, min_numel=8)
    assert store[torch.device("cpu")].numel() == 16 and (big == -3).all() and big.data_ptr() != a.data_ptr()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(requests=st.integers(1, 256), kv_heads=st.integers(1, 8), width=st.integers(1, 2048),
       row=st.sampled_from([0, 4 * 16 * 128, 4096 * 16 * 128]), tile_rows=st.sampled_from([0, 16, 64, 128]))
@example(requests=2, kv_heads=1, width=101, row=0, tile_rows=64)  # the draws never reached the wide-tile rule
def test_dense_splits_leave_no_split_without_pages(requests, kv_heads, width, row, tile_rows):
    """Split s takes pages [s * per, (s + 1) * per) with per = ceil(width / splits): every split
    gets at least one page of the widest request, and the split count stays within bounds. A wide
    tile changes the count only from one page a split, past 1.5 programs a SM, to two pages."""
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels.dense_verify import default_splits
    from m3_eagle_plugin.msa.kernels.attention_io import MAX_PARTIAL_ELEMENTS, max_partial_splits

    narrow = default_splits(requests, kv_heads, width, requests * row, torch.device("cpu"))
    splits = default_splits(requests, kv_heads, width, requests * row, torch.device("cpu"), tile_rows=tile_rows)
    units = requests * kv_heads
    if tile_rows >= 64 and narrow == width > 1 and units * narrow * 2 > 3 * 132:
        assert splits == -(-width // 2) and -(-width // splits) == 2
        return
    assert splits == narrow
    per = -(-width // splits)
    assert 1 <= splits <= width and (splits - 1) * per < width
    assert splits == 1 or splits * requests * row <= MAX_PARTIAL_ELEMENTS
    # never more waves (two programs a SM, 132 SMs) x pages a split than the former rule's split count
    units, slots = requests * kv_heads, 264
    former = max(1, min(max(slots // units, min(16, width // 16)), width, max_partial_splits(requests * row)))
    def cost(s):
        return -(-units * s // slots) * -(-width // s)
    assert cost(splits) <= cost(former)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(value=st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF,
                                                                     exclude_characters="\x00"), max_size=12)),
       default=st.one_of(st.none(), st.just("1")))
def test_env_value_agrees_with_os_environ(value, default):
    """`env_value` reads what `os.environ.get` reads: unset, empty, non-ASCII, after a change."""
    import os

    from m3_eagle_plugin.msa.kernels._common import env_value

    name = "M3_EAGLE_TEST_ENV_VALUE"
    with pytest.MonkeyPatch.context() as mp:
        if value is None:
            mp.delenv(name, raising=False)
        else:
            mp.setenv(name, value)
        assert env_value(name, default) == os.environ.get(name, default)
        mp.setenv(name, "changed")
        assert env_value(name, default) == "changed"
    assert env_value(name, default) == os.environ.get(name, default)


def test_env_value_follows_a_replaced_environ(monkeypatch):
    """A test or embedder that swaps `os.environ` for a plain mapping is still read."""
    import os

    from m3_eagle_plugin.msa.kernels._common import env_value

    monkeypatch.setattr(os, "environ", {"M3_EAGLE_TEST_ENV_VALUE": "swapped"})
    assert env_value("M3_EAGLE_TEST_ENV_VALUE") == "swapped"
    assert env_value("M3_EAGLE_TEST_ENV_UNSET", "d") == "d"


def test_scales_past_the_float_range_are_refused_naming_them():
    """An int too large for a float raised a bare OverflowError; two finite scales whose product is
    past the float range reached the kernels as an infinite softmax scale (and FlashInfer's too)."""
    from m3_eagle_plugin.msa.kernels import flashinfer_msa
    from m3_eagle_plugin.msa.kernels._common import attention_scales

    with pytest.raises(KernelInputError, match="scale must be a positive finite number"):
        attention_scales(10**400)
    with pytest.raises(KernelInputError, match="k_scale must be a positive finite number"):
        attention_scales(0.5, k_scale=10**400)
    for call in (attention_scales, flashinfer_msa.decode_scales):
        with pytest.raises(KernelInputError, match=r"scale x k_scale \(1e\+300 x 1e\+300\) is past the float range"):
            call(1e300, 1e300)
    assert attention_scales(10**3, 2, 0.5) == (2000.0, 0.5)  # ints in range are numbers like any other


def test_is_pow2_reference_values():
    from m3_eagle_plugin.msa.kernels._common import is_pow2

    assert [n for n in range(-4, 70) if is_pow2(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_triton_runs_from_compute_capability_8_0(monkeypatch):
    from m3_eagle_plugin.msa.kernels import _common

    monkeypatch.setattr(_common, "triton_importable", lambda: True)
    for capability, runs in ((None, False), ((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(_common, "device_capability", lambda device: capability)
        assert _common.triton_available("cuda") is runs, capability


def test_device_capability_is_none_off_cuda_even_with_a_gpu_present(monkeypatch):
    from m3_eagle_plugin.msa.kernels import _common

    monkeypatch.setattr(_common, "cuda_present", lambda: True)
    monkeypatch.setattr(_common, "_cuda_capability", lambda index: (9, 0))
    assert _common.device_capability("cpu") is None and _common.device_capability(torch.device("meta")) is None
    assert _common.device_capability(torch.device("cuda", 0)) == (9, 0)


def test_entries_apart_ignores_dims_of_one_entry():
    from m3_eagle_plugin.msa.kernels._common import entries_apart

    assert entries_apart(torch.zeros(3).as_strided((1, 3), (0, 1)))  # a size-1 dim's stride reaches nothing
    assert entries_apart(torch.zeros(6).as_strided((2, 1, 3), (3, 0, 1)))
    assert not entries_apart(torch.zeros(3).expand(2, 3))  # two rows on one address
    assert not entries_apart(torch.zeros(6).as_strided((2, 3), (2, 1)))  # row 1 starts inside row 0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
       strides=st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 3)))
@example(shape=(2, 3, 2), strides=(6, 4, 1))  # interleaved dims, every entry its own address
def test_entries_apart_is_exact_against_every_offset(shape, strides):
    """Its contract is "no two entries share an address": judged by enumerating every entry's
    offset, an interleaved layout whose entries are apart (offsets 0 2 4 / 6 8 10 and 1 3 5 / 7 9 11)
    is not refused as overlapping (`check_scores_out` named such an `out` "two entries one address")."""
    import itertools

    from m3_eagle_plugin.msa.kernels._common import entries_apart

    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    t = torch.zeros(span).as_strided(shape, strides)
    offsets = [sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]
    assert entries_apart(t) == (len(set(offsets)) == len(offsets))


def test_byte_aligned_ignores_the_last_stride():
    from m3_eagle_plugin.msa.kernels._common import byte_aligned

    rows = torch.zeros(4, 8, dtype=torch.float16)  # 16-byte rows of 2-byte entries
    assert rows.data_ptr() % 16 == 0 and byte_aligned(rows, 16)
    assert not byte_aligned(torch.zeros(4, 12, dtype=torch.float16)[:, :8], 16)  # 24-byte rows
    assert not byte_aligned(torch.zeros(33, dtype=torch.float16)[1:].view(4, 8), 16)  # base 2 bytes off


def test_check_cache_view_refuses_a_last_dim_with_a_stride():
    from m3_eagle_plugin.msa.kernels._common import check_cache_view

    cache = torch.zeros(2, 1, 16, 32)
    check_cache_view("k_cache", cache[..., :16], 4)  # a narrower view keeps a unit last stride
    with pytest.raises(KernelInputError, match="k_cache must be contiguous in its last dim"):
        check_cache_view("k_cache", cache[..., ::2], 4)
    with pytest.raises(KernelInputError, match="k_cache must have 4 dims"):
        check_cache_view("k_cache", cache[0], 4)
