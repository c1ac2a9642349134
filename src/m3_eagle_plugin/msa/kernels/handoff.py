"""Per-request hand-off from the index scoring to the top-k, through scores that announce themselves.

Why: a top-k that waits for the whole scoring grid (stream order, or PDL's
`griddepcontrol.wait`) waits for the slowest request of the batch. The scoring programs run
request by request, so most requests are scored long before the grid ends; a top-k program
launched early (PDL) that waits only for its own request's scores runs in the scoring's tail.

How: the scores live in a board (`score_board`) whose every entry holds `SENTINEL`, a NaN bit
pattern no arithmetic produces, between steps. A top-k program polls its rows (volatile loads,
from L2) until no entry it needs is the sentinel, selects, and writes the sentinel back over
every entry the scoring wrote for its rows. Each entry is one 32-bit store, so a value is
either the sentinel or final: no counter, no fence in the scoring programs. (Arrival counters,
with a barrier and a release add closing each scoring program, were measured first: the scoring
took 4-6 us longer at B16/B64 32K.)

Deadlock-free because a PDL consumer is only scheduled once every scoring program has started
(each releases its dependents first); launched without PDL it finds every score written.
Launches sharing a device's board must not run concurrently on two streams. The same module
keeps the per-row ready flags through which the top-k hands its selection on to an attention
launched early (`verify_step`).
"""
from __future__ import annotations

from typing import Callable

import torch

from ._common import env_switch, step_buffer, step_buffers

#: The board's idle value: a negative signalling NaN (0xFFBBB7AD). GPU arithmetic only makes
#: the canonical quiet NaN, so no score equals it.
SENTINEL = -4474963

#: Entries allocated at least (4 MB), so growing batches rarely need a new board.
MIN_ENTRIES = 1 << 20

_BOARDS: dict[torch.device, torch.Tensor] = {}  # int32 words, viewed as fp32 scores
_READY: dict[torch.device, torch.Tensor] = {}

ENV_VAR = "M3_EAGLE_HANDOFF"


def handoff_enabled() -> bool:
    """The hand-off is on unless `M3_EAGLE_HANDOFF=0` (then the top-k waits for the scoring grid)."""
    return env_switch(ENV_VAR) == "1"


def score_board(device: torch.device | str, numel: int) -> torch.Tensor | None:
    """`numel` fp32 entries of `device`'s board, each holding `SENTINEL` (shared by every launch
    there), or None while a CUDA graph is being captured and the board is too small (a captured
    graph must not own it: the caller then takes the plain two-launch path)."""
    board = step_buffer(_BOARDS, device, numel, fill=SENTINEL, min_numel=MIN_ENTRIES)
    return None if board is None else board.view(torch.float32)


def ready_flags(device: torch.device | str, numel: int) -> torch.Tensor | None:
    """`numel` int32 per-row flags of `device`, zero between steps, for the hand-off from the
    top-k to an attention launched early (`verify_step`): the top-k sets a row's flag to the
    number of attention programs that read the row, each of those takes one off at its end.
    None while capturing a graph and there are too few (the caller then waits for the grid)."""
    return step_buffer(_READY, device, numel, fill=0, min_numel=1 << 16)


def reset_board(device: torch.device | str) -> None:
    """Put the sentinel back everywhere, on every board `device` had (after a launch failed between
    scoring and top-k; a recorded launch, `replay`, may use a board replaced since)."""
    for board in step_buffers(_BOARDS, device):
        board.fill_(SENTINEL)


def reset_handoff(device: torch.device | str) -> None:
    """The idle state back on `device`, in stream order after whatever was launched (or captured:
    then after it at every replay): every board holding the sentinel, every ready flag zero. For a
    step cut off between its launches (a Ctrl-C raised as a launch returns): scores no top-k took
    back, or flags a top-k set for an attention never launched, would pass the next step's polls
    before its own rows are written."""
    reset_board(device)
    for flags in step_buffers(_READY, device):
        flags.zero_()


def reset_while_raising(error: BaseException, reset: Callable[[], object]) -> None:
    """Run `reset` (`reset_handoff`, a flag buffer's zero_) while `error` propagates. A reset that fails
    too does not replace `error`, whose type and message name the cause: after a sticky CUDA error, or
    a sync that invalidated a graph capture, every later launch on the stream fails (and a capture ran
    nothing to reset); the reset's failure is noted on `error` (Python 3.11+; 3.10 has no notes)."""
    try:
        reset()
    except Exception as failure:  # noqa: BLE001 - `error` is the one that names the cause
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"resetting the hand-off failed too: {type(failure).__name__}: {failure}")
