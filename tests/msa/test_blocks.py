"""Tests for msa.blocks: block-size validation and per-token visible-block counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.msa import MsaInputError, per_token_valid_blocks, valid_blocks_from_positions, validate_block_size


def naive_valid_blocks(qo_lens: list[int], kv_lens: list[int], block_size: int) -> list[int]:
    out = []
    for qo, kv in zip(qo_lens, kv_lens):
        for t in range(qo):
            seen = min(kv - qo + t + 1, kv)
            out.append(max(0, math.ceil(seen / block_size)))
    return out


def test_worked_example_counts() -> None:
    # Host worked example: page 4, qo (2, 3), corrected kv (8, 12).
    got = per_token_valid_blocks(torch.tensor([2, 3]), torch.tensor([8, 12]), 4)
    assert got.dtype == torch.int32
    assert got.tolist() == [2, 2, 3, 3, 3]


def test_lists_are_accepted_and_empty_rows_contribute_nothing() -> None:
    assert per_token_valid_blocks([0, 1, 0, 2], [5, 5, 0, 129], 128).tolist() == [1, 1, 2]


def test_a_kv_len_below_qo_len_clamps_early_tokens_to_zero() -> None:
    assert per_token_valid_blocks([5], [2], 4).tolist() == naive_valid_blocks([5], [2], 4) == [0, 0, 0, 1, 1]


def test_num_tokens_hint_gives_same_result() -> None:
    qo, kv = torch.tensor([3, 1]), torch.tensor([7, 1])
    expected = naive_valid_blocks([3, 1], [7, 1], 2)
    assert per_token_valid_blocks(qo, kv, 2, num_tokens=4).tolist() == expected == [3, 3, 4, 1]
    assert per_token_valid_blocks(qo, kv, 2).tolist() == expected


@pytest.mark.parametrize("bad", [0, -4, 3, 12, 100])
def test_block_size_must_be_power_of_two(bad: int) -> None:
    with pytest.raises(MsaInputError, match="power of two"):
        per_token_valid_blocks([1], [1], bad)


@pytest.mark.parametrize("bad", [0, -4, 3])
def test_valid_blocks_from_positions_checks_the_block_size_too(bad: int) -> None:
    # It computed with any divisor: -4 gave negative counts, 3 counts its siblings refuse, 0 a ZeroDivisionError.
    with pytest.raises(MsaInputError, match="power of two"):
        valid_blocks_from_positions(torch.tensor([0, 5, 9]), bad)


def test_counts_past_int32_are_refused_not_wrapped() -> None:
    # ceil((2**32 + 5) / 1) came back as int32 5; the metadata refuses such a kv_len by name too.
    with pytest.raises(MsaInputError, match=f"request 1: kv_len {2**32 + 5} does not fit int32"):
        per_token_valid_blocks([1, 1], [3, 2**32 + 5], 1)
    assert per_token_valid_blocks([1], [2**31 - 1], 2**20).tolist() == [2048]


def test_block_size_type_is_checked() -> None:
    with pytest.raises(TypeError):
        validate_block_size(4.0)
    with pytest.raises(TypeError):
        validate_block_size(True)
    assert validate_block_size(128) == 128


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(MsaInputError, match="differ"):
        per_token_valid_blocks([1, 2], [3], 4)


@pytest.mark.parametrize("qo, kv, num_tokens, match", [
    ([-1, 3], [4, 4], None, "request 0: lengths must be >= 0"),
    ([1, 2], [2, -3], None, "request 1: lengths must be >= 0"),
    ([1, 3], [4, 4], 3, "sum to 4"),           # a num_tokens that is not the sum
    ([1, 3], [4, 4], 6, "sum to 4"),
])
def test_bad_host_lengths_raise_naming_the_cause(qo, kv, num_tokens, match) -> None:
    with pytest.raises(MsaInputError, match=match):
        per_token_valid_blocks(qo, kv, 4, num_tokens=num_tokens)
    with pytest.raises(MsaInputError, match=match):
        per_token_valid_blocks(torch.tensor(qo), torch.tensor(kv), 4, num_tokens=num_tokens)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    rows=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), min_size=0, max_size=6),
    log_block=st.integers(0, 5),
)
def test_matches_naive_loop(rows: list[tuple[int, int]], log_block: int) -> None:
    block_size = 1 << log_block
    qo = [q for q, _ in rows]
    kv = [q + extra for q, extra in rows]  # kv counts the step's tokens
    got = per_token_valid_blocks(torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), block_size)
    assert got.tolist() == naive_valid_blocks(qo, kv, block_size)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_inputs_stay_on_device_without_sync() -> None:
    qo = torch.tensor([2, 3], device="cuda")
    kv = torch.tensor([8, 12], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = per_token_valid_blocks(qo, kv, 4, num_tokens=5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda"
    assert got.cpu().tolist() == [2, 2, 3, 3, 3]


@pytest.mark.parametrize("qo, kv", [([1.5], [3]), ([1], [2.9]), ([True], [3]), ([1], ["3"])])
def test_non_integer_host_lengths_are_refused(qo, kv) -> None:
    # A float length was truncated (1.5 -> 1 token) and a bool read as 1; integer tensors are required already.
    with pytest.raises(TypeError, match="entries must be an int"):
        per_token_valid_blocks(qo, kv, 4)


def test_valid_blocks_from_int32_positions_near_the_limit_do_not_wrap() -> None:
    # (p + 1 + B - 1) // B overflowed int32 positions: p = 2**31 - 2 at B = 2**20 gave a negative count.
    positions = torch.tensor([-1, 0, 2**20 - 1, 2**20, 2**31 - 2], dtype=torch.int32)
    got = valid_blocks_from_positions(positions, 2**20)
    assert got.dtype == torch.int32
    expected = [0 if p < 0 else math.ceil((p + 1) / 2**20) for p in positions.tolist()]
    assert got.tolist() == expected == [0, 1, 1, 2, 2048]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    rows=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 30)), min_size=0, max_size=6),
    log_block=st.integers(0, 5),
    dtype=st.sampled_from([torch.int32, torch.int64, None]),
    hint=st.booleans(),
)
def test_matches_naive_loop_also_when_kv_is_below_qo(rows, log_block, dtype, hint) -> None:
    """Shrinking corrections leave kv_len below qo_len (even 0 with tokens): early tokens see nothing,
    never a negative count; lists and int32/int64 tensors, with or without the num_tokens hint, agree."""
    block_size = 1 << log_block
    qo, kv = [q for q, _ in rows], [k for _, k in rows]
    args = (qo, kv) if dtype is None else (torch.tensor(qo, dtype=dtype), torch.tensor(kv, dtype=dtype))
    got = per_token_valid_blocks(*args, block_size, num_tokens=sum(qo) if hint else None)
    assert got.dtype == torch.int32
    assert got.tolist() == naive_valid_blocks(qo, kv, block_size)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    positions=st.lists(st.integers(-(2**31), 2**31 - 2), max_size=12),
    log_block=st.integers(0, 20),
    wide=st.booleans(),
)
def test_valid_blocks_from_positions_matches_python_ceil(positions, log_block, wide) -> None:
    """Any int32 position (the metadata's shifted positions go far below -1 after a shrink): Python's
    exact ceil((p + 1) / B) for p >= 0, 0 for every negative position."""
    block = 1 << log_block
    got = valid_blocks_from_positions(torch.tensor(positions, dtype=torch.int64 if wide else torch.int32), block)
    assert got.dtype == torch.int32
    assert got.tolist() == [-(-(p + 1) // block) if p >= 0 else 0 for p in positions]


def test_a_count_of_exactly_int32_max_is_returned_not_refused() -> None:
    # B = 1: position 2**31 - 2 sees 2**31 - 1 blocks, the largest int32; only counts past it are refused.
    got = valid_blocks_from_positions(torch.tensor([2**31 - 2, 0], dtype=torch.int64), 1)
    assert got.dtype == torch.int32 and got.tolist() == [2**31 - 1, 1]


def test_an_int32_position_at_int32_max_does_not_wrap() -> None:
    # p + 1 taken in int32 wraps to -2**31 at p = 2**31 - 1: the token would see 0 blocks.
    positions = torch.tensor([2**31 - 1], dtype=torch.int32)
    assert valid_blocks_from_positions(positions, 2).tolist() == [2**30]  # ceil(2**31 / 2)
    assert valid_blocks_from_positions(positions, 2**20).tolist() == [2**11]
    with pytest.raises(MsaInputError, match="past int32"):  # B = 1: 2**31 blocks, one past int32
        valid_blocks_from_positions(positions, 1)


@pytest.mark.parametrize("block", [1, 4, 2**62])
def test_the_last_int64_position_is_counted_or_refused_not_read_as_zero_blocks(block) -> None:
    # p + 1 wraps to -2**63 at p = 2**63 - 1, which read as 0 blocks. Python's exact ceil((p + 1) / B):
    # 2 blocks at B = 2**62; past int32 (refused) at B = 1 and 4.
    p = 2**63 - 1
    positions = torch.tensor([p, 0], dtype=torch.int64)
    if -(-(p + 1) // block) <= 2**31 - 1:
        assert valid_blocks_from_positions(positions, block).tolist() == [-(-(p + 1) // block), 1]
    else:
        with pytest.raises(MsaInputError, match="past int32"):
            valid_blocks_from_positions(positions, block)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1])
def test_host_lengths_past_int64_are_refused_by_name(bad) -> None:
    # The last int64 values are the boundary: one past either end is named, not a torch overflow error.
    with pytest.raises(MsaInputError, match=f"request 1: kv_lens entry {bad} does not fit int64"):
        per_token_valid_blocks([1, 1], [1, bad], 4)
    with pytest.raises(MsaInputError, match=f"request 0: qo_lens entry {bad} does not fit int64"):
        per_token_valid_blocks([bad], [1], 4)


def test_host_qo_lens_beside_device_kv_lens_are_summed_on_the_host() -> None:
    # DESIGN: device in = device out, no host sync. A meta tensor cannot be read back: the total of a
    # host qo_lens list was read from the device copy of it (Tensor.item() on meta raised).
    kv = torch.tensor([8, 12], device="meta")
    got = per_token_valid_blocks([2, 3], kv, 4)
    assert got.device.type == "meta" and got.dtype == torch.int32 and tuple(got.shape) == (5,)
    with pytest.raises(MsaInputError, match="request 0: lengths must be >= 0, got qo_len=-1"):
        per_token_valid_blocks([-1, 3], kv, 4)
    with pytest.raises(MsaInputError, match="sum to 5"):
        per_token_valid_blocks([2, 3], kv, 4, num_tokens=4)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_host_qo_lens_summing_past_int64_are_refused_naming_the_sum(as_tensor) -> None:
    """The token count is summed in Python ints: int64 wrapped 2 x 2**62 to -2**63 (blamed on a num_tokens
    nobody passed), and 4 x 2**62 to 0, after which the token gather wrote past its output (a segfault)."""
    qo, kv = [2**62, 2**62], [1, 1]
    if as_tensor:
        qo, kv = torch.tensor(qo), torch.tensor(kv)
    with pytest.raises(MsaInputError, match=f"qo_lens sum to {2**63} tokens, past int64"):
        per_token_valid_blocks(qo, kv, 4)
    with pytest.raises(MsaInputError, match=f"qo_lens sum to {2**63} tokens, past int64"):
        per_token_valid_blocks(qo, kv, 4, num_tokens=0)
    # a sum that fits is the count, as Python's
    small = torch.tensor([3, 2]) if as_tensor else [3, 2]
    assert per_token_valid_blocks(small, [5, 2], 4, num_tokens=5).tolist() == naive_valid_blocks([3, 2], [5, 2], 4)


def test_unsigned_positions_and_lengths_are_counted_as_python_or_refused_by_value() -> None:
    """uint64 2**63 cast to int64 is -2**63: 0 blocks (a skipped token) and a kv_len named as negative.
    uint32 past int32's counts is refused naming the position, not torch's missing uint32 max."""
    with pytest.raises(MsaInputError, match=f"positions has an entry past int64: {2**63}"):
        valid_blocks_from_positions(torch.tensor([3, 2**63], dtype=torch.uint64), 4)
    with pytest.raises(MsaInputError, match=f"kv_lens has an entry past int64: {2**63}"):
        per_token_valid_blocks(torch.tensor([1]), torch.tensor([2**63], dtype=torch.uint64), 4)
    with pytest.raises(MsaInputError, match=f"positions up to {2**31 + 5} give block counts past int32"):
        valid_blocks_from_positions(torch.tensor([2**31 + 5], dtype=torch.uint32), 1)
    # inside the range: p // B + 1 in Python ints
    positions = [2**31 - 2, 7, 0]
    got = valid_blocks_from_positions(torch.tensor(positions, dtype=torch.uint32), 1)
    assert got.tolist() == [p // 1 + 1 for p in positions]
    got = valid_blocks_from_positions(torch.tensor([2**63 - 1, 3], dtype=torch.uint64), 2**40)
    assert got.tolist() == [(2**63 - 1) // 2**40 + 1, 1]


def test_a_block_size_past_2_62_is_refused_and_2_62_counts_as_python() -> None:
    """2**63 is no int64: torch took it as -2**63 and positions 5 and 2**40 saw 0 blocks (Python: 1);
    2**64 raised a bare OverflowError."""
    positions, qo, kv = [0, 5, 2**40], [2, 1], [2, 2**31 - 1]
    for bad in (1 << 63, 1 << 64):
        with pytest.raises(MsaInputError, match=rf"block_size {bad} is past 2\*\*62"):
            valid_blocks_from_positions(torch.tensor(positions), bad)
        with pytest.raises(MsaInputError, match=rf"block_size {bad} is past 2\*\*62"):
            per_token_valid_blocks(qo, kv, bad)
    block = 1 << 62
    assert valid_blocks_from_positions(torch.tensor(positions), block).tolist() == [p // block + 1 for p in positions]
    assert per_token_valid_blocks(qo, kv, block).tolist() == naive_valid_blocks(qo, kv, block) == [1, 1, 1]


def test_a_kv_len_one_past_int32_max_is_refused_or_counted_as_python() -> None:
    # 2**31 tokens at block 1 are 2**31 blocks (Python's ceil), one past int32: an int32 count wraps to -2**31
    for block in (1, 2):
        expected = -(-(2**31) // block)
        try:
            got = per_token_valid_blocks([1], [2**31], block).tolist()
        except MsaInputError as error:
            assert f"kv_len {2**31} does not fit int32" in str(error)
        else:
            assert got == [expected]


@pytest.mark.parametrize("shape", [(), (1, 2)])
def test_length_tensors_that_are_not_1d_are_refused_by_name(shape) -> None:
    qo = torch.ones(shape, dtype=torch.int64)
    with pytest.raises(MsaInputError, match=r"qo_lens must be 1-D, got shape"):
        per_token_valid_blocks(qo, qo + 2, 4)
    with pytest.raises(MsaInputError, match=r"kv_lens must be 1-D, got shape"):
        per_token_valid_blocks([1], qo.reshape(shape) + 2, 4)


_DEVICES = ["meta", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_host_kv_lens_beside_device_qo_lens_are_checked_like_host_qo_lens(device) -> None:
    """A kv_lens list beside a device qo_lens went to the device unchecked: a negative kv_len read as 0
    blocks and 2**32 + 5 at block size 1 came back as int32 5, where the all-host call refuses both."""
    qo = torch.tensor([1, 2], device=device)
    got = per_token_valid_blocks(qo, [3, 5], 4, num_tokens=3)
    assert got.device.type == device and got.dtype == torch.int32 and tuple(got.shape) == (3,)
    if device != "meta":
        assert got.cpu().tolist() == naive_valid_blocks([1, 2], [3, 5], 4)
    for kv, match in (([3, -4], "request 1: lengths must be >= 0, got .*kv_len=-4"),
                      ([3, 2**32 + 5], f"request 1: kv_len {2**32 + 5} does not fit int32")):
        with pytest.raises(MsaInputError, match=match):
            per_token_valid_blocks([1, 2], kv, 1)  # the all-host call: the same refusal
        with pytest.raises(MsaInputError, match=match):
            per_token_valid_blocks(qo, kv, 1, num_tokens=3)


@pytest.mark.parametrize("device", _DEVICES)
def test_length_tensors_on_different_devices_are_refused_naming_both(device) -> None:
    """Either way round: a CPU tensor beside a device one is refused, naming each argument's device."""
    host, dev = torch.tensor([1, 2]), torch.tensor([3, 5], device=device)
    with pytest.raises(MsaInputError, match=rf"qo_lens is on cpu but kv_lens is on {device}"):
        per_token_valid_blocks(host, dev, 4, num_tokens=3)
    with pytest.raises(MsaInputError, match=rf"qo_lens is on {device}\S* but kv_lens is on cpu"):
        per_token_valid_blocks(dev, host, 4, num_tokens=3)
