"""Programmatic dependent launch (PDL) for the step's back-to-back kernels.

Why: a verify step runs score -> top-k -> attention -> merge back to back, each a few to a few
tens of microseconds, so the gap between one kernel's last program and the next kernel's first
is a visible share of the step. On SM90+ a kernel launched with PDL is scheduled while its
predecessor still runs; its programs first let their own dependents launch, then block in
`griddepcontrol.wait` until the predecessor has finished and its writes are visible, so nothing
is read early and the chain stays transitive (every program of every PDL kernel waits; the one
exception, the hand-off top-k of `handoff`, waits for its own scores instead, and the scoring
that releases it does so only after its own wait; the early attention of `verify_step` behind
it waits for its selection rows, and for the top-k grid only before it stores).
Only small grids use it (`pdl_args`); the interpreter and pre-Hopper GPUs never do.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import SWITCHES, device_capability, device_sm_count, env_switch


ENV_VAR = "M3_EAGLE_PDL"
MODES = SWITCHES[ENV_VAR][1]  # off, small grids only (the default), every grid


def pdl_args(device: torch.device, grid: tuple[int, ...], every_grid: bool = False) -> dict:
    """Launch keywords for a kernel with a `PDL` constexpr (both on or both off).

    On for SM90+ grids of at most half as many programs as the device has SMs, where the step is
    launch-latency bound, or any grid with `every_grid` (a kernel that waits for its inputs
    itself, `handoff`); `M3_EAGLE_PDL=0` turns it off, `M3_EAGLE_PDL=all` on for every grid.
    (H200, `scripts/tune_verify_kernels.py --pdl`, 2026-11-29, the sparse step off / by this rule
    / on every kernel: B1/8K q1 12.4 / 11.0 / 10.9 us, B1/128K 25.7 / 24.0 / 26.5, B16/32K q4
    59.7 / 60.1 / 65.5, B64/32K q1 148.0 / 148.4 / 153.6.)
    """
    mode = env_switch(ENV_VAR)
    if mode == "0" or (device_capability(device) or (0, 0))[0] < 9:
        on = False
    else:
        on = every_grid or mode == "all" or math.prod(grid) <= device_sm_count(device) // 2
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """First statement of a PDL kernel: release the next kernel's launch, then wait for the
    previous kernel's completion (a no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """First statement of a kernel whose dependent reads what earlier kernels wrote before this
    kernel ends (the scoring before the hand-off top-k): wait for the previous kernel (under PDL)
    first, then release the next launch."""
    if PDL:
        gdc_wait()
    gdc_launch_dependents()


@triton.jit
def wait_for_prior_grid_only(PDL: tl.constexpr):
    """Wait for the previous kernel (under PDL) without releasing the next launch: for a kernel
    that computes early and must not write before its predecessor is done (`verify_step`)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents():
    """Let the next (PDL) launch be scheduled now, for a kernel that did not wait for its
    predecessor through `wait_for_prior_grid` (the hand-off top-k, once its scores are in)."""
    gdc_launch_dependents()
