"""A sparse step cut off between its launches (CPython raises a pending Ctrl-C as a call returns)
leaves the hand-off idle: every score board holding the sentinel, every ready flag zero, as the
next step's top-k and early attention trust (`handoff`). Before, scores the cut-off top-k never took
back, or flags it set for an attention never launched, passed the next step's polls before its own
rows were written. Run through Triton's interpreter by `test_handoff.py`, and on a GPU there.
"""
from __future__ import annotations

import contextlib

import torch

from m3_eagle_plugin.bench.inputs import Geometry

from .kernel_case_helpers import random_step

GEO = Geometry(q_heads=16, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)


class Cut(KeyboardInterrupt):
    """The injected interrupt."""


def _step_inputs(device):
    return random_step(GEO, [4, 1, 3], [150, 16, 97], kv_dtype=torch.float16, index_dtype=torch.float16,
                       q_dtype=torch.float16, device=device)


def _assert_idle(device):
    """The device's board holds only the sentinel and its ready flags (where made) only zeros."""
    from m3_eagle_plugin.msa.kernels import handoff

    device = torch.device(device)
    board = handoff._BOARDS[device]
    dirty = (board.view(torch.int32) != handoff.SENTINEL).sum().item()
    assert dirty == 0, f"{dirty} board entries left written (of {board.numel()})"
    flags = handoff._READY.get(device)
    assert flags is None or (flags == 0).all(), f"ready flags left set: {flags.nonzero().flatten()[:8].tolist()}"


@contextlib.contextmanager
def _cut_as_it_returns(module, name):
    real = getattr(module, name)

    def cut(*args, **kwargs):
        real(*args, **kwargs)
        raise Cut(f"as {name} returned")

    setattr(module, name, cut)
    try:
        yield
    finally:
        setattr(module, name, real)


def check_selection_cut_as_its_scoring_returns(device):
    """The scoring has written its scores on the board; no top-k took them back."""
    from m3_eagle_plugin.msa.kernels import index_select

    meta, cache, _, index_q = _step_inputs(device)
    with _cut_as_it_returns(index_select, "index_block_scores"):
        try:
            index_select.select_blocks_verify(index_q, cache.index_k, meta, topk=GEO.topk, handoff=True)
        except Cut:
            pass
        else:
            raise AssertionError("the cut did not reach the caller")
    _assert_idle(device)


def check_step_cut_as_its_selection_returns(device):
    """The top-k has set its rows' flags for an early attention that was never launched."""
    from m3_eagle_plugin.msa.kernels import verify_step

    meta, cache, q, index_q = _step_inputs(device)
    with _cut_as_it_returns(verify_step, "select_announcing"):
        try:
            verify_step.sparse_verify_step(index_q, cache.index_k, q, cache.k, cache.v, meta, topk=GEO.topk,
                                           scale=0.2, early=True, splits=2)
        except Cut:
            pass
        else:
            raise AssertionError("the cut did not reach the caller")
    _assert_idle(device)


INTERPRETER_CASES = [
    (check_selection_cut_as_its_scoring_returns, dict()),
    (check_step_cut_as_its_selection_returns, dict()),
]
