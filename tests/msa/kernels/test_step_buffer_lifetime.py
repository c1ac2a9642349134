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
