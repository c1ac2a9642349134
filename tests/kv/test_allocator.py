"""Block allocator: reserve/rewind/free, all-or-nothing out-of-blocks, block tables."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.kv import BlockAllocator, OutOfBlocksError, UnknownRequestError


def test_reserve_rewind_free_cycle():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    alloc.add_request("a")
    assert alloc.reserve("a", 5) == [0, 1]
    assert alloc.num_tokens("a") == 5
    assert alloc.reserve("a", 8) == []  # still two blocks
    alloc.add_request("b")
    assert alloc.reserve("b", 1) == [2]
    # a verify step of 1 + 4 draft tokens (8 -> 13) needs blocks three and four
    assert alloc.reserve("a", 13) == [3, 4]
    assert alloc.num_free_blocks == 1
    # two verify tokens are accepted: 10 tokens stay, the last block is freed
    assert alloc.rewind("a", 10) == [4]
    assert alloc.pages("a") == [0, 1, 3] and alloc.num_tokens("a") == 10
    assert alloc.num_free_blocks == 2
    alloc.free("a")
    assert alloc.num_free_blocks == 5 and "a" not in alloc
    alloc.add_request("c")
    assert alloc.reserve("c", 9) == [0, 1, 3]  # lowest free ids first


def test_block_table_pads_with_minus_one():
    alloc = BlockAllocator(8, 2)
    alloc.allocate(1, 5)
    alloc.allocate(2, 1)
    alloc.add_request(3)
    table = alloc.block_table([2, 1, 3])
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, -1, -1], [0, 1, 2], [-1, -1, -1]]
    assert alloc.block_table([2], width=4).tolist() == [[3, -1, -1, -1]]
    assert alloc.block_table([3]).shape == (1, 1)
    with pytest.raises(ValueError, match="width"):
        alloc.block_table([1], width=2)


def test_out_of_blocks_changes_nothing():
    alloc = BlockAllocator(4, 4)
    alloc.allocate("x", 9)
    alloc.allocate("y", 1)
    with pytest.raises(OutOfBlocksError, match="needs 2 more blocks"):
        alloc.reserve("y", 12)
    assert alloc.pages("y") == [3] and alloc.num_tokens("y") == 1
    assert alloc.pages("x") == [0, 1, 2] and alloc.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        alloc.allocate("z", 1)
    assert "z" not in alloc
    assert issubclass(OutOfBlocksError, RuntimeError)


def test_bad_calls_are_rejected():
    alloc = BlockAllocator(4, 4)
    alloc.allocate("x", 3)
    with pytest.raises(ValueError, match="already exists"):
        alloc.add_request("x")
    with pytest.raises(UnknownRequestError):
        alloc.reserve("nope", 1)
    with pytest.raises(ValueError, match="rewind"):
        alloc.rewind("x", 4)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.reserve("x", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.allocate("y", -5)
    assert "y" not in alloc and alloc.allocate("y", 4) == alloc.pages("y")  # nothing half-registered
    with pytest.raises(ValueError):
        BlockAllocator(0, 4)


op = st.tuples(st.sampled_from(["add", "reserve", "rewind", "free"]), st.integers(0, 3),
               st.integers(0, 40))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(ops=st.lists(op, max_size=40), num_blocks=st.integers(1, 12),
       block=st.sampled_from([1, 4, 8]))
def test_random_operations_match_a_naive_model(ops, num_blocks, block):
    alloc = BlockAllocator(num_blocks, block)
    tokens: dict[int, int] = {}
    for kind, rid, n in ops:
        if kind == "add" and rid not in tokens:
            alloc.add_request(rid)
            tokens[rid] = 0
        elif kind == "reserve" and rid in tokens:
            used = sum(-(-t // block) for t in tokens.values())
            extra = -(-n // block) - -(-tokens[rid] // block)
            if extra > num_blocks - used:
                before = {r: alloc.pages(r) for r in tokens}
                with pytest.raises(OutOfBlocksError):
                    alloc.reserve(rid, n)
                assert {r: alloc.pages(r) for r in tokens} == before
            else:
                alloc.reserve(rid, n)
                tokens[rid] = max(tokens[rid], n)
        elif kind == "rewind" and rid in tokens:
            target = min(n, tokens[rid])
            alloc.rewind(rid, target)
            tokens[rid] = target
        elif kind == "free" and rid in tokens:
            alloc.free(rid)
            del tokens[rid]
        held = {r: alloc.pages(r) for r in tokens}
        flat = [p for pages in held.values() for p in pages]
        assert len(flat) == len(set(flat)) and all(0 <= p < num_blocks for p in flat)
        assert all(len(held[r]) == -(-tokens[r] // block) for r in tokens)
        assert all(alloc.num_tokens(r) == tokens[r] for r in tokens)
        assert alloc.num_free_blocks == num_blocks - len(flat)
