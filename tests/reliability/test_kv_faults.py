"""The KV allocator and page import cut off part-way (Ctrl-C, an allocation failing): nothing lost or half-done.

A fault is injected at one internal call (the k-th page taken from or given back to the free
heap, the import's last tensor). After it: no request id is left registered by a call that
raised, and an independent recount (one request taking the whole cache once the others are gone)
gets every page exactly once, none lost and none handed out twice. A call cut off part-way changes
nothing, so it can run again (the engine's clean-up frees a request whose free was cut off).
"""
from __future__ import annotations

import heapq

import pytest
import torch

from m3_eagle_plugin.kv import BlockAllocator, PagedKVCache
from m3_eagle_plugin.kv.transfer import export_request, import_request

BLOCK = 4


def fail_at(monkeypatch, name: str, k: int, error=KeyboardInterrupt, after: bool = False) -> list:
    """``heapq.<name>`` raising ``error`` on its ``k``-th call (once), before it acts or, with ``after``,
    once it has acted (CPython raises a pending Ctrl-C as a call returns); the list counts the calls."""
    original, calls = getattr(heapq, name), []

    def wrapped(*args):
        calls.append(1)
        if len(calls) == k and not after:
            raise error(f"injected at call {k} of heapq.{name}")
        out = original(*args)
        if len(calls) == k:
            raise error(f"injected as call {k} of heapq.{name} returned")
        return out

    monkeypatch.setattr(heapq, name, wrapped)
    return calls


def every_page_once(allocator: BlockAllocator) -> list[int]:
    """Free every request left, then take the whole cache as one request: its pages, sorted."""
    for rid in allocator.request_ids:
        allocator.free(rid)
    pages = allocator.allocate("recount", allocator.num_blocks * allocator.block_size)
    return sorted(pages)


def two_requests() -> BlockAllocator:
    """Pages 0-2 to "a" (9 tokens), 3 to "b", 4-9 free."""
    allocator = BlockAllocator(10, BLOCK)
    allocator.allocate("a", 9)
    allocator.allocate("b", 2)
    return allocator


@pytest.mark.parametrize("after", [False, True], ids=["before", "as-it-returns"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_allocate_cut_off_while_taking_its_pages_registers_nothing_and_loses_no_page(monkeypatch, k, after):
    """Its id was registered before its pages were taken, and a cut there left it registered (the same
    import was then refused as already held) and the pages taken so far in neither list; a cut as a
    page left the heap lost that page."""
    allocator = two_requests()
    fail_at(monkeypatch, "heappop", k, after=after)
    with pytest.raises(KeyboardInterrupt):
        allocator.allocate("c", 3 * BLOCK)
    monkeypatch.undo()
    assert "c" not in allocator and allocator.num_free_blocks == 6
    assert allocator.allocate("c", 3 * BLOCK) == [4, 5, 6]  # lowest free first, as if never tried
    assert every_page_once(allocator) == list(range(10))


@pytest.mark.parametrize("after", [False, True], ids=["before", "as-it-returns"])
def test_reserve_cut_off_part_way_changes_nothing(monkeypatch, after):
    allocator = two_requests()
    fail_at(monkeypatch, "heappop", 2, MemoryError, after=after)
    with pytest.raises(MemoryError):
        allocator.reserve("b", 4 * BLOCK)
    monkeypatch.undo()
    assert (allocator.pages("b"), allocator.num_tokens("b"), allocator.num_free_blocks) == ([3], 2, 6)
    assert every_page_once(allocator) == list(range(10))


@pytest.mark.parametrize("after", [False, True], ids=["before", "as-it-returns"])
@pytest.mark.parametrize("call", ["rewind", "free"])
def test_a_give_back_cut_off_part_way_loses_no_page_and_finishes_when_run_again(monkeypatch, call, after):
    """Nothing changes: rewind dropped its pages from the request before giving them back (a cut lost
    them), free gave some back while the request still listed them (running it again gave them back
    twice, and two requests later shared a page); a cut as a push returned left that page both held
    and free."""
    allocator = two_requests()
    fail_at(monkeypatch, "heappush", 2, after=after)
    run = (lambda: allocator.rewind("a", 1)) if call == "rewind" else (lambda: allocator.free("a"))
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()
    assert (allocator.pages("a"), allocator.num_tokens("a"), allocator.num_free_blocks) == ([0, 1, 2], 9, 6)
    run()  # as the engine's clean-up does
    if call == "rewind":
        assert (allocator.pages("a"), allocator.num_tokens("a")) == ([0], 1)
    else:
        assert "a" not in allocator
    assert every_page_once(allocator) == list(range(10))


def test_an_import_whose_page_table_cannot_be_made_leaves_no_request(monkeypatch):
    """The int32 page table it returns was made after the clean-up guard: failing there (Ctrl-C, out of
    memory) raised to the caller with the request registered over its pages, so nobody could free them and
    the same payload was refused as already held."""
    source = PagedKVCache.for_minimax_m3(2, [1], 1, 8, 8, BLOCK, 6, num_draft_layers=1, dtype=torch.float32)
    source.allocator.allocate("r", 7)
    for pool in source.geometry.pools:
        source.storage(pool.pool_id).copy_(torch.randn(source.storage(pool.pool_id).shape))
    payload = export_request(source, "r")
    cache = PagedKVCache.for_minimax_m3(2, [1], 1, 8, 8, BLOCK, 6, num_draft_layers=1, dtype=torch.float32)
    make = torch.tensor

    def no_int32_table(data, *args, dtype=None, **kwargs):
        if dtype is torch.int32:
            raise KeyboardInterrupt
        return make(data, *args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "tensor", no_int32_table)
    with pytest.raises(KeyboardInterrupt):
        import_request(cache, "r", payload)
    monkeypatch.undo()
    assert "r" not in cache.allocator and cache.num_free_blocks == 6
    assert import_request(cache, "r", payload).tolist() == [0, 1]
    for pool in cache.geometry.pools:
        assert torch.equal(cache.storage(pool.pool_id)[:2], source.storage(pool.pool_id)[:2])
