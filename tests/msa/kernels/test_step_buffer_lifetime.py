"""Step buffers (`_common.step_buffer`: the hand-off board, the ready flags, the split arrival
counters) outlive their replacement by a bigger one.

Why: a CUDA graph captured while a buffer was current bakes its address into the graph, and every
replay writes it (scores) and relies on it holding its idle value between steps (the sentinel,
zeros). A later eager step with more tokens grows the buffer; if the old one were freed, the
caching allocator would hand its memory to other tensors, which every graph replay would then
overwrite, and the graph's top-k or attention would stop waiting for rows it must wait for.
On CPU the property is checked directly: the replaced buffer is still alive, at its address,
holding its fill value.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from m3_eagle_plugin.msa.kernels._common import step_buffer

CPU = torch.device("cpu")


def test_a_grown_buffer_keeps_the_one_it_replaced_alive():
    store: dict = {}
    first = step_buffer(store, "cpu", 8, fill=7, min_numel=8)  # what a captured graph would hold
    address = first.data_ptr()
    old = weakref.ref(store[CPU])
    del first
    grown = step_buffer(store, "cpu", 9, fill=7, min_numel=8)  # a later, larger eager step
    assert grown.numel() == 9 and store[CPU].numel() == 16
    gc.collect()
    kept = old()
    assert kept is not None, "the replaced buffer was freed while a captured graph may still use it"
    assert kept.data_ptr() == address and (kept == 7).all()


@pytest.mark.parametrize("getter", ["board", "ready", "arrivals"])
def test_the_kernels_buffers_survive_growth(monkeypatch, getter):
    pytest.importorskip("triton")
    from m3_eagle_plugin.msa.kernels import handoff, merge

    monkeypatch.setattr(handoff, "_BOARDS", {})
    monkeypatch.setattr(handoff, "_READY", {})
    monkeypatch.setattr(merge, "_ARRIVALS", {})
    get, store, idle = {
        "board": (handoff.score_board, handoff._BOARDS, handoff.SENTINEL),
        "ready": (handoff.ready_flags, handoff._READY, 0),
        "arrivals": (merge.split_arrivals, merge._ARRIVALS, 0),
    }[getter]
    get(CPU, 16)
    old = weakref.ref(store[CPU])
    size = store[CPU].numel()
    get(CPU, size + 1)
    assert store[CPU].numel() > size
    gc.collect()
    assert old() is not None and (old() == idle).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_captured_before_the_board_grew_still_replays_right(monkeypatch):
    """End to end on the GPU: a graph captured for a small step, then an eager step big enough to
    grow the score board, then memory handed out again and filled with non-sentinel values: the
    graph's replays must still select and attend as its eager call did, and write none of that memory."""
    from m3_eagle_plugin.bench.inputs import Geometry
    from m3_eagle_plugin.msa.kernels import handoff, merge
    from m3_eagle_plugin.msa.kernels.replay import clear_all
    from m3_eagle_plugin.msa.kernels.verify_step import sparse_verify_step

    from .kernel_case_helpers import capture_after_warmup, random_step

    for module, name in ((handoff, "_BOARDS"), (handoff, "_READY"), (merge, "_ARRIVALS")):
        monkeypatch.setattr(module, name, {})
    geo = Geometry(q_heads=16, kv_heads=2, head_dim=32, index_heads=2, index_dim=32, block=16, topk=4)

    def step(meta, cache, q, index_q):
        return sparse_verify_step(index_q, cache.index_k, q, cache.k, cache.v, meta, topk=geo.topk,
                                  scale=geo.head_dim ** -0.5, max_qo_len=4, early=True, splits=2)

    small = random_step(geo, [4, 2, 4, 1], [300, 45, 1000, 16], pad_tokens=2)
    eager_sel, eager = step(*small)
    graph, (sel, out) = capture_after_warmup(lambda: step(*small))
    device = torch.device("cuda", torch.cuda.current_device())
    small_board = (handoff._BOARDS[device].data_ptr(), handoff._BOARDS[device].numel())

    big = random_step(geo, [4] * 64, [40_000] * 64, seed=1)  # 2 heads x 256 tokens x 2501 blocks > 2^20
    step(*big)
    assert handoff._BOARDS[device].numel() > small_board[1], "the big step did not grow the board"
    del big
    clear_all()  # the launch recordings that also held the old board go, as at MAX_RECORDINGS
    torch.cuda.synchronize()
    # what the caching allocator hands out now (many blocks of the old board's size: a freed board
    # would be among them) is filled with values that are not the sentinel
    junk = [torch.full((small_board[1],), 7, dtype=torch.int32, device=device) for _ in range(64)]
    expect_junk = [j.clone() for j in junk]
    ptr, size = small_board[0], 4 * small_board[1]
    assert not [j for j in junk if j.data_ptr() < ptr + size and ptr < j.data_ptr() + size], \
        "the board the graph was captured with was freed and handed out again"
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(sel, eager_sel) and torch.equal(out, eager)
    assert all(torch.equal(a, b) for a, b in zip(junk, expect_junk)), "a replay wrote memory it no longer owns"
