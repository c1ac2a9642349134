"""Disaggregated serving on the reference host: prefill on one engine, decode on another.

The context engine runs a request's prompt (and, with an Eagle3 head, its first draft round,
which writes the draft layer's KV), then exports the request: its KV pages (every pool, so
target K/V, index-K and the shared draft layer) and its decoding state (tokens so far, the
pending verify inputs = last token + drafts, the committed KV length). The generation engine
imports both and continues with verify steps exactly where an aggregated engine would be.

It drives the engine one step at a time through the engine's own launch/commit, so the steps
are the ones `Engine.generate` runs; overlap is refused (a handoff needs committed state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from m3_eagle_plugin.host.reference.engine import Engine, GenerationResult
from m3_eagle_plugin.host.reference.request import Request, RequestState
from m3_eagle_plugin.host.reference.scheduler import RowKind
from m3_eagle_plugin.kv.transfer import KVTransferPayload, export_request, import_request
from m3_eagle_plugin.parallel.transfer import recv_ints, recv_payload, send_ints, send_payload

__all__ = ["ContextHandoff", "HandoffError", "run_context_phase", "export_handoff", "import_handoff",
           "continue_generation", "send_handoff", "recv_handoff"]

HANDED_OFF = "handed_off"


class HandoffError(ValueError):
    """A request cannot be handed off, or a handoff does not fit the receiving engine."""


@dataclass(frozen=True, eq=False)
class ContextHandoff:
    """Everything a generation engine needs to continue one request."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int]
    kv_len: int
    pending_inputs: list[int]  # last emitted token, then the drafts
    pending_draft_len: int
    payload: KVTransferPayload


def _check_engine(engine: Engine) -> None:
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a reference-host Engine, got {type(engine).__name__}")
    if engine.overlap:
        raise HandoffError("disaggregated handoff needs an engine without overlap (committed state)")
    if not engine.config.sampling.greedy:
        raise HandoffError("disaggregated handoff supports greedy sampling only (draft probabilities "
                           "and per-request generators are not transferred)")


def _step(engine: Engine, rows, requests: list[Request], step_id: int) -> None:
    out = engine.launch(rows, step_id)
    engine.commit(out, requests, None)


@torch.no_grad()
def run_context_phase(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Request]:
    """Prefill ``prompts`` (request ``i`` = prompt ``i``), emitting each first token and first drafts.

    Only context rows run: returned requests are in the decode state with their pending verify
    inputs, or done (a request that ended on its first token, or failed validation).
    """
    _check_engine(engine)
    requests = [engine.make_request(i, p, max_new_tokens) for i, p in enumerate(prompts)]
    step_id = 0
    while True:
        rows = [r for r in engine.scheduler.schedule(requests) if r.kind is RowKind.CONTEXT]
        if not rows:
            break
        _step(engine, rows, requests, step_id)
        step_id += 1
    engine.stats.engine_steps += step_id
    stuck = [r.index for r in requests if r.state in (RequestState.WAITING, RequestState.PREFILL)]
    if stuck:
        raise HandoffError(f"requests {stuck} could not be prefilled (KV budget)")
    return requests


def export_handoff(engine: Engine, request: Request) -> ContextHandoff:
    """Copy a decoding request out of ``engine`` and release it there."""
    if request.state is not RequestState.DECODE or request.pending_inputs is None or request.inflight_steps:
        raise HandoffError(f"request {request.index} is {request.state.value} with "
                           f"{request.inflight_steps} steps in flight; only a committed decoding request "
                           f"can be handed off{': ' + request.error if request.error else ''}")
    payload = export_request(engine.cache, request.rid)
    handoff = ContextHandoff(
        index=request.index, prompt=list(request.prompt), max_new_tokens=request.max_new_tokens,
        output=list(request.output), kv_len=request.kv_len,
        pending_inputs=[int(t) for t in request.pending_inputs.cpu().tolist()],
        pending_draft_len=request.pending_draft_len, payload=payload,
    )
    request.state, request.stop_reason = RequestState.FINISHED, HANDED_OFF
    engine.finish(request)
    return handoff


def import_handoff(engine: Engine, handoff: ContextHandoff) -> Request:
    """Admit ``handoff`` into ``engine``: import its pages and resume it in the decode state."""
    _check_engine(engine)
    if len(handoff.pending_inputs) != 1 + engine.k:
        raise HandoffError(f"request {handoff.index}: {len(handoff.pending_inputs) - 1} pending drafts, "
                           f"this engine verifies {engine.k}")
    request = Request(index=handoff.index, prompt=list(handoff.prompt), max_new_tokens=handoff.max_new_tokens,
                      eos_ids=frozenset(engine.config.eos_ids))
    engine.scheduler.check_fits(request)
    if not engine.scheduler.admit(request):
        raise HandoffError(f"request {handoff.index}: no KV budget left on the generation engine")
    try:
        import_request(engine.cache, request.rid, handoff.payload)
    except Exception:
        engine.scheduler.release(request)
        raise
    request.state = RequestState.DECODE
    request.num_prefilled = len(request.prompt)
    request.kv_len = handoff.kv_len
    request.output = list(handoff.output)
    request.pending_inputs = torch.tensor(handoff.pending_inputs, dtype=torch.long, device=engine.device)
    request.pending_draft_len = handoff.pending_draft_len
    return request


@torch.no_grad()
def continue_generation(engine: Engine, requests: list[Request]) -> GenerationResult:
    """Run imported requests to the end (verify steps only), as `Engine.generate` would."""
    _check_engine(engine)
    step_id = 0
    try:
        while True:
            rows = engine.scheduler.schedule(requests)
            if not rows:
                break
            _step(engine, rows, requests, step_id)
            step_id += 1
    finally:
        for request in requests:
            if not request.done:
                request.fail("engine stopped before the request finished")
                engine.finish(request)
    engine.stats.engine_steps += step_id
    return GenerationResult(
        outputs=[list(r.output) if r.state is RequestState.FINISHED else [] for r in requests],
        errors=[r.error for r in requests], stop_reasons=[r.stop_reason for r in requests],
        stats=engine.stats, draft_source=engine.draft_source,
    )


def send_handoff(handoff: ContextHandoff, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``handoff`` (state as int64 tensors, pages via `send_payload`) to rank ``dst``."""
    send_ints([handoff.index, handoff.max_new_tokens, handoff.kv_len, handoff.pending_draft_len,
               len(handoff.prompt), len(handoff.output), len(handoff.pending_inputs),
               *handoff.prompt, *handoff.output, *handoff.pending_inputs], dst, group)
    send_payload(handoff.payload, dst, group)


def recv_handoff(src: int, group: dist.ProcessGroup | None = None) -> ContextHandoff:
    """Receive what `send_handoff` sent from rank ``src``."""
    ints = recv_ints(src, group)
    if len(ints) < 7:
        raise HandoffError(f"handoff header from rank {src} is too short: {ints}")
    index, max_new, kv_len, draft_len, n_prompt, n_output, n_pending = ints[:7]
    body = ints[7:]
    if len(body) != n_prompt + n_output + n_pending:
        raise HandoffError(f"handoff from rank {src} announces {n_prompt + n_output + n_pending} tokens, "
                           f"carries {len(body)}")
    return ContextHandoff(
        index=index, prompt=body[:n_prompt], max_new_tokens=max_new, output=body[n_prompt:n_prompt + n_output],
        kv_len=kv_len, pending_inputs=body[n_prompt + n_output:], pending_draft_len=draft_len,
        payload=recv_payload(src, group),
    )
