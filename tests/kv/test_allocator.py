"""Block allocator: reserve/rewind/free, all-or-nothing out-of-blocks, block tables."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from m3_eagle_plugin.kv import BlockAllocator, OutOfBlocksError, UnknownRequestError
from tests.kv._cut import cut_before_opcode


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


def test_rewind_to_zero_tokens_frees_every_page_but_keeps_the_request():
    """rewind accepts 0 <= num_tokens <= held: rewinding to 0 (every token rejected) drops all
    pages, yet the request stays known (unlike free) and can grow again from nothing."""
    alloc = BlockAllocator(num_blocks=5, block_size=4)
    alloc.allocate("keep", 3)                        # page 0
    alloc.allocate("a", 9)                           # pages 1, 2, 3
    assert alloc.rewind("a", 0) == [1, 2, 3]
    assert "a" in alloc and alloc.pages("a") == [] and alloc.num_tokens("a") == 0
    assert alloc.num_free_blocks == 4 and alloc.pages("keep") == [0]
    assert alloc.block_table(["a", "keep"]).tolist() == [[-1], [0]]
    assert alloc.rewind("a", 0) == []                # already empty: still allowed, frees nothing
    alloc.add_request("fresh")
    assert alloc.rewind("fresh", 0) == [] and alloc.num_tokens("fresh") == 0
    assert alloc.reserve("a", 5) == [1, 2]           # lowest free ids first, as for a new request
    with pytest.raises(ValueError, match="cannot rewind request 'a' to -1 tokens"):
        alloc.rewind("a", -1)
    assert alloc.pages("a") == [1, 2] and alloc.num_tokens("a") == 5


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



def test_reserve_one_block_short_is_refused_and_changes_nothing():
    """The boundary of the out-of-blocks check: one block free, two needed. The reserve must fail as
    OutOfBlocksError before it pops any page (not lose the one free page halfway)."""
    alloc = BlockAllocator(4, 4)
    alloc.allocate("x", 9)                           # pages 0, 1, 2; page 3 free
    alloc.add_request("y")
    with pytest.raises(OutOfBlocksError, match="needs 2 more blocks"):
        alloc.reserve("y", 5)                        # ceil(5 / 4) = 2 pages
    assert alloc.pages("y") == [] and alloc.num_tokens("y") == 0
    assert alloc.num_free_blocks == 1 and alloc.pages("x") == [0, 1, 2]
    assert alloc.reserve("y", 4) == [3]              # exactly the free block: granted
    assert alloc.num_free_blocks == 0


def test_reserving_fewer_tokens_than_held_keeps_them():
    """reserve makes a request hold *at least* num_tokens: a smaller count (a shorter verify row
    after a longer one) neither frees pages nor forgets tokens; only rewind shrinks."""
    alloc = BlockAllocator(6, 4)
    alloc.allocate("a", 10)                          # pages 0, 1, 2
    assert alloc.reserve("a", 3) == []
    assert alloc.num_tokens("a") == 10 and alloc.pages("a") == [0, 1, 2] and alloc.num_free_blocks == 3
    with pytest.raises(ValueError, match="rewind"):  # 10 tokens are still held: rewinding past 3 is fine, to 11 not
        alloc.rewind("a", 11)
    assert alloc.rewind("a", 9) == [] and alloc.num_tokens("a") == 9

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


@pytest.mark.parametrize("bad", [5.5, 4.0, "8", True])
def test_token_counts_that_are_not_ints_are_refused_not_truncated(bad):
    """5.5 tokens used to hold 5 (int() truncates): the block count then disagreed with any
    ceil() a caller made; a string or a bool was read as a number."""
    alloc = BlockAllocator(4, 4)
    alloc.allocate("x", 3)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        alloc.allocate("y", bad)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        alloc.reserve("x", bad)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        alloc.rewind("x", bad)
    with pytest.raises(TypeError, match="width must be an int"):
        alloc.block_table(["x"], width=bad)
    assert "y" not in alloc and alloc.pages("x") == [0] and alloc.num_tokens("x") == 3
    assert alloc.num_free_blocks == 3


def test_integer_likes_are_counts():
    alloc = BlockAllocator(4, 4)
    assert alloc.allocate("x", torch.tensor(5)) == [0, 1]
    assert alloc.num_tokens("x") == 5 and type(alloc.num_tokens("x")) is int


op = st.tuples(st.sampled_from(["add", "reserve", "rewind", "free"]), st.integers(0, 3),
               st.integers(0, 40))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(ops=st.lists(op, max_size=40), num_blocks=st.integers(1, 12),
       block=st.sampled_from([1, 4, 8]))
@example(ops=[("add", 0, 0), ("add", 1, 0), ("reserve", 0, 9), ("reserve", 1, 5), ("rewind", 0, 2),
              ("reserve", 1, 13), ("rewind", 1, 0), ("reserve", 0, 20), ("free", 0, 0), ("reserve", 1, 30)],
         num_blocks=12, block=4)  # the drawn lists (4-6 operations) never rewound a request holding pages
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


class NaiveAllocator:
    """Sets and sorted lists: a request holds ceil(tokens / B) pages taken lowest free id first."""

    def __init__(self, num_blocks, block):
        self.free, self.block, self.pages, self.tokens = set(range(num_blocks)), block, {}, {}

    def grow(self, rid, n):
        need = -(-n // self.block) - len(self.pages[rid])
        if need > len(self.free):
            return None
        added = sorted(self.free)[: max(need, 0)]
        self.free -= set(added)
        self.pages[rid] += added
        self.tokens[rid] = max(self.tokens[rid], n)
        return added


step = st.tuples(st.sampled_from(["add", "allocate", "reserve", "rewind", "free", "table"]),
                 st.integers(0, 4), st.integers(-2, 30))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=st.lists(step, max_size=50), num_blocks=st.integers(1, 10), block=st.sampled_from([1, 2, 4, 8]))
@example(ops=[("allocate", 0, 9), ("add", 1, 0), ("reserve", 1, 5), ("rewind", 0, 2), ("reserve", 1, 13),
              ("table", 0, 4), ("rewind", 0, 3), ("rewind", 1, 0), ("reserve", 0, 20), ("free", 0, 0),
              ("allocate", 2, 7), ("table", 0, 1)],
         num_blocks=10, block=4)  # the drawn lists never rewound a request holding pages
def test_every_call_matches_a_lowest_free_first_model(ops, num_blocks, block):
    """Exact page ids of allocate/reserve/rewind/free (also unknown ids, negative counts, out of
    blocks), block tables, and after every call: no page held twice, none lost, nothing half-done."""
    alloc, model = BlockAllocator(num_blocks, block), NaiveAllocator(num_blocks, block)
    for kind, rid, n in ops:
        known = rid in model.pages
        before = ({r: alloc.pages(r) for r in model.pages}, alloc.num_free_blocks)
        if kind == "add":
            if known:
                with pytest.raises(ValueError, match="already exists"):
                    alloc.add_request(rid)
            else:
                alloc.add_request(rid)
                model.pages[rid], model.tokens[rid] = [], 0
        elif kind == "allocate":
            fits = n >= 0 and -(-n // block) <= len(model.free)
            if known or not fits:
                with pytest.raises(ValueError if known or n < 0 else OutOfBlocksError):
                    alloc.allocate(rid, n)
                assert ({r: alloc.pages(r) for r in model.pages}, alloc.num_free_blocks) == before
                assert (rid in alloc) == known
            else:
                model.pages[rid], model.tokens[rid] = [], 0
                assert alloc.allocate(rid, n) == model.grow(rid, n)
        elif kind == "reserve":
            if not known:
                with pytest.raises(UnknownRequestError):
                    alloc.reserve(rid, max(n, 0))
            elif n < 0:
                with pytest.raises(ValueError, match="num_tokens"):
                    alloc.reserve(rid, n)
            else:
                expected = model.grow(rid, n)
                if expected is None:
                    with pytest.raises(OutOfBlocksError):
                        alloc.reserve(rid, n)
                else:
                    assert alloc.reserve(rid, n) == expected
        elif kind == "rewind":
            if not known:
                with pytest.raises(UnknownRequestError):
                    alloc.rewind(rid, 0)
            elif not 0 <= n <= model.tokens[rid]:
                with pytest.raises(ValueError, match="rewind"):
                    alloc.rewind(rid, n)
            else:
                keep = -(-n // block)
                freed = model.pages[rid][keep:]
                model.pages[rid] = model.pages[rid][:keep]
                model.free |= set(freed)
                model.tokens[rid] = n
                assert alloc.rewind(rid, n) == freed
        elif kind == "free":
            if not known:
                with pytest.raises(UnknownRequestError):
                    alloc.free(rid)
            else:
                alloc.free(rid)
                model.free |= set(model.pages.pop(rid))
                del model.tokens[rid]
        else:
            rids = sorted(model.pages)
            width = max([len(model.pages[r]) for r in rids] + [1]) + (n % 3 if n > 0 else 0)
            table = alloc.block_table(rids, width)
            assert table.dtype == torch.int32
            assert table.tolist() == [model.pages[r] + [-1] * (width - len(model.pages[r])) for r in rids]
        held = [p for r in model.pages for p in alloc.pages(r)]
        assert {r: alloc.pages(r) for r in model.pages} == model.pages
        assert {r: alloc.num_tokens(r) for r in model.pages} == model.tokens
        assert sorted(held + sorted(model.free)) == list(range(num_blocks))  # none shared, none lost
        assert alloc.num_free_blocks == len(model.free) and sorted(alloc.request_ids, key=str) == sorted(model.pages)
        assert sorted(alloc.used_blocks()) == sorted(held)


def test_a_freed_request_id_is_not_retained():
    """free forgets a request entirely: a long-running server must not keep every finished request
    id (nor its token count) alive."""
    import gc
    import weakref

    class Rid:  # hashable by identity, weakly referenceable
        pass

    alloc = BlockAllocator(4, 4)
    rid = Rid()
    alloc.allocate(rid, 6)
    alloc.rewind(rid, 2)
    ref = weakref.ref(rid)
    alloc.free(rid)
    del rid
    gc.collect()
    assert ref() is None
    assert alloc.num_free_blocks == 4 and alloc.request_ids == []



@pytest.mark.parametrize("name, call", [
    ("reserve", lambda alloc: alloc.reserve("b", 13)),
    ("allocate", lambda alloc: alloc.allocate("c", 12)),
    ("rewind", lambda alloc: alloc.rewind("a", 5)),
    ("free", lambda alloc: alloc.free("a")),
], ids=["reserve", "allocate", "rewind", "free"])
def test_a_call_cut_off_between_any_two_of_its_instructions_is_undone_or_complete(name, call):
    """A pending Ctrl-C is raised as a call returns (on CPython 3.10 any call, Python functions too)
    and at a loop's back edge. Cut so: reserve, as ``pages.extend`` or ``max`` returned, left the new
    pages held for the old token count (a real SIGALRM landed there in a quarter of its cuts), and at
    its loop's back edge on 3.13 (outside the try there) lost the pages taken; allocate, as add_request
    returned, left the id registered with no pages; rewind and free, as the give-back returned, left
    the pages given back and the old token count. Cut before each instruction of the call in turn, the
    allocator is as before it or as after it (free may leave the request empty at 0 tokens, and runs
    again), and the call then runs again to the uncut call's result."""
    def state(alloc):
        return ({r: alloc.pages(r) for r in alloc.request_ids}, {r: alloc.num_tokens(r) for r in alloc.request_ids},
                alloc.num_free_blocks)

    def fresh():
        alloc = BlockAllocator(10, 4)
        alloc.allocate("a", 9)                       # pages 0-2
        alloc.allocate("b", 2)                       # page 3
        return alloc

    done = fresh()
    call(done)
    before, after = state(fresh()), state(done)
    allowed = [before, after]
    if name == "free":
        allowed.append(({"a": [], "b": [3]}, {"a": 0, "b": 2}, 9))
    cuts = 0
    for k in range(1, 1000):
        alloc = fresh()
        if not cut_before_opcode(getattr(BlockAllocator, name).__code__, k, lambda: call(alloc)):
            assert state(alloc) == after
            if cuts:
                break
            continue  # CPython 3.12 gives no opcode event in the first traced call
        cuts += 1
        assert state(alloc) in allowed, k
        if state(alloc) != after:
            call(alloc)                              # run again, as the engine's next step or clean-up does
        assert state(alloc) == after, k
        assert sorted([*alloc.used_blocks(), *alloc._free]) == list(range(10)), k
    assert cuts > 10  # every instruction of the call was cut once


@pytest.mark.parametrize("held", [0, 5])
def test_a_negative_block_table_width_is_refused_as_negative(held):
    """width=-1 was refused as "width -1 < 0 pages held by a request", blaming requests holding no
    pages; a width is a column count, so it must be >= 0 (0 is an empty table, nothing held)."""
    alloc = BlockAllocator(4, 4)
    alloc.allocate("x", held)
    with pytest.raises(ValueError, match="width must be an int >= 0, got -1"):
        alloc.block_table(["x"], width=-1)
    with pytest.raises(ValueError, match="width must be an int >= 0, got -1"):
        alloc.block_table([], width=-1)
    assert alloc.block_table([], width=0).shape == (0, 0)
