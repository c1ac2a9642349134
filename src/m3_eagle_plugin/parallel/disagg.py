"""Disaggregated serving on the reference host: prefill on one engine, decode on another.

The context engine runs a request's prompt (and, with an Eagle3 head, its first draft round,
which writes the draft layer's KV), then exports the request: its KV pages (every pool, so
target K/V, index-K and the shared draft layer) and its decoding state (tokens so far, the
pending verify inputs = last token + drafts, the committed KV length). The generation engine
imports both and continues with verify steps exactly where an aggregated engine would be.

It drives the engine one step at a time through the engine's own launch/commit, so the steps
are the ones `Engine.generate` runs; overlap is refused (a handoff needs committed state), and so
is an engine on a tensor-parallel shard whose cache does not carry that shard (``shard=(rank, tp)``:
every rank's cache has one geometry, so only that tag keeps one rank's KV heads off another). Each
helper that steps an engine or changes its requests holds it (`Engine.exclusive`) like
`Engine.generate`: a call from another thread waits, one from inside a running call is refused.

On the wire (`send_handoff` / `recv_handoff`) a handoff is one header frame of kind 3 (see
`parallel.transfer` for frames, verdicts and the page messages) whose body is::

    [index, max_new_tokens, kv_len, pending_draft_len, n_prompt, n_output, n_pending,
     prompt (n_prompt ints), output (n_output ints), pending_inputs (n_pending ints),
     the KV payload header body (kind 2)]

then, once the receiver accepted it, the payload's pages and their checksums. The receiver
checks the header (and, given its engine, everything `import_handoff` would check) before
answering, so a malformed or unfitting handoff is refused by name on both sides, its pages never
move, and the receiving engine is untouched. A page damaged in transit is refused by the receiver
naming the request, pool and page.

Tensor-parallel engines hand off shard by shard: context rank r sends its shard's handoff to
generation rank r. The generation ranks must then hold the same requests, or their all-reduces
pair up different requests' sums, so they receive with ``recv_handoff(..., agree=tp_group)``:
each verdict (header, then pages) is settled over the TP group before it is answered, and one
rank's refusal is every rank's (see `parallel.transfer`, "Ranks that receive together").
"""
from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.host.reference.engine import Engine, GenerationResult, attach_partial_result
from m3_eagle_plugin.host.reference.request import Request, RequestError, RequestState
from m3_eagle_plugin.host.reference.scheduler import RowKind
from m3_eagle_plugin.kv.transfer import KVTransferPayload, export_request, import_request
from m3_eagle_plugin.parallel.process_group import comm_device
from m3_eagle_plugin.parallel.transfer import (KIND_HANDOFF, Agreement, PayloadHeader, TransferError, as_ints,
                                               check_fingerprint, check_sendable, page_checksums, recv_header,
                                               recv_pages, send_header, send_pages, stage_pages)

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
    # every rank's cache has one geometry: only the cache's shard tag (in the fingerprint) keeps
    # rank r's KV heads out of rank s's engine, where they decoded other tokens without a word
    for what, model in (("target", engine.target), ("draft head", engine.head)):
        shard = getattr(model, "tp_shard", None)
        if shard is not None and engine.cache.shard != tuple(shard):
            raise HandoffError(f"the engine's {what} is rank {shard[0]}'s shard of tensor-parallel size {shard[1]} "
                               f"but its cache says {engine.cache.shard}: build the cache with shard={tuple(shard)}, "
                               f"so a handoff's pages say whose KV heads they hold")


def _step(engine: Engine, rows, requests: list[Request], step_id: int) -> None:
    out = engine.launch(rows, step_id)
    engine.commit(out, requests, None)


@torch.no_grad()
def run_context_phase(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      first_index: int = 0) -> list[Request]:
    """Prefill ``prompts`` (request ``first_index + i`` = prompt ``i``), emitting each first token
    and first drafts.

    Only context rows run: returned requests are in the decode state with their pending verify
    inputs, or done (a request that ended on its first token, or failed validation). On any error
    the requests already registered are released before it propagates. A request keeps its id
    through the handoff, so a generation engine that holds requests of several batches at once
    needs each batch numbered past the others (``first_index``).
    """
    _check_engine(engine)
    first_index = as_int("first_index", first_index, 0, ValueError)
    with engine.exclusive("run_context_phase"):
        return _context_phase(engine, prompts, max_new_tokens, first_index)


def _context_phase(engine: Engine, prompts, max_new_tokens: int, first_index: int) -> list[Request]:
    requests: list[Request] = []
    step_id = 0
    started = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):  # registering can fail midway (an id still held)
            requests.append(engine.make_request(first_index + i, prompt, max_new_tokens))
        while True:
            # prefilled requests (decoding, waiting to be handed off) would take verify rows, hence
            # batch slots and step tokens the prompts still waiting need; they never verify here
            pending = [r for r in requests if r.state is not RequestState.DECODE]
            rows = [r for r in engine.scheduler.schedule(pending) if r.kind is RowKind.CONTEXT]
            if not rows:
                break
            _step(engine, rows, requests, step_id)
            step_id += 1
        stuck = [r.index for r in requests if r.state in (RequestState.WAITING, RequestState.PREFILL)]
        if stuck:
            raise HandoffError(f"requests {stuck} could not be prefilled (KV budget)")
        # inside: Ctrl-C while it waits for the device (or as its clock call returns) left every
        # prefilled request registered, and the caller never got them
        _count_call(engine, step_id, started)
    except BaseException:
        # the caller never sees these requests after an error, so nothing else could release them
        # (and their ids would collide with the next batch's)
        engine.stop_unfinished(requests, "the context phase stopped before every request was prefilled")
        _count_call(engine, step_id, started, failed=True)
        raise
    return requests


def _count_call(engine: Engine, steps: int, started: float, failed: bool = False) -> None:
    """Add a phase's steps and time to the engine's statistics: unlike `Engine.generate`'s, they
    run across the phases (its tokens are counted as its steps commit them). After a failure the
    device is not waited for: a device error would replace the one being raised."""
    if engine.device.type == "cuda" and not failed:
        torch.cuda.synchronize(engine.device)
    elapsed = time.perf_counter() - started  # first: cut off here, nothing is counted yet
    engine.stats.engine_steps += steps
    engine.stats.elapsed_s += elapsed


def export_handoff(engine: Engine, request: Request) -> ContextHandoff:
    """Copy a decoding request out of ``engine`` and release it there."""
    with engine.exclusive("export_handoff"):
        return _export(engine, request)


def _check_owned(engine: Engine, requests: Sequence[Request], what: str) -> None:
    """Refuse another engine's requests: their ids would name (export, step, free) pages of this
    engine's own requests."""
    foreign = [getattr(r, "index", r) for r in requests if not engine.owns(r)]
    if foreign:
        raise HandoffError(f"{what}: requests {foreign} are not this engine's (made by run_context_phase "
                           f"or import_handoff on another engine)")


def _export(engine: Engine, request: Request) -> ContextHandoff:
    _check_owned(engine, [request], "export_handoff")
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
    engine.finish(request)  # first: cut off there, the request is still decoding and can be exported again
    request.state, request.stop_reason = RequestState.FINISHED, HANDED_OFF
    return handoff


def _check_handoff(engine: Engine, handoff: ContextHandoff) -> None:
    """Refuse a handoff that contradicts itself or ``engine`` before anything is admitted: a bad
    token id would fail the whole batch's next step, and a ``kv_len`` the pages do not back would
    make verify attend to pages nobody wrote (silently wrong tokens)."""
    where = f"request {handoff.index}"
    # Python ints only (not `_ints.as_int`'s numpy ones), as for the token ids below: the handoff
    # is kept, not copied, so its fields become the request's id and lengths as they are.
    for name, low in (("index", 0), ("max_new_tokens", 1), ("kv_len", 0), ("pending_draft_len", 0)):
        value = getattr(handoff, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HandoffError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    if not isinstance(handoff.payload, KVTransferPayload):
        raise HandoffError(f"{where}: payload must be a KVTransferPayload, got {type(handoff.payload).__name__}")
    if handoff.index in engine.cache.allocator:  # two requests cannot share an index (its pages, its sampler)
        raise HandoffError(f"{where} is already live on this engine; number each batch past the others "
                           f"(run_context_phase's first_index)")
    if not handoff.pending_inputs:  # not "-1 pending drafts"
        raise HandoffError(f"{where}: no pending inputs, expected the last emitted token and {engine.k} drafts")
    if len(handoff.pending_inputs) != 1 + engine.k:
        raise HandoffError(f"{where}: {len(handoff.pending_inputs) - 1} pending drafts, "
                           f"this engine verifies {engine.k}")
    if not 0 <= handoff.pending_draft_len <= engine.k:
        raise HandoffError(f"{where}: pending_draft_len {handoff.pending_draft_len} not in [0, {engine.k}]")
    if not handoff.prompt or not 1 <= len(handoff.output) < handoff.max_new_tokens:
        raise HandoffError(f"{where}: a handoff needs a prompt and 1 to max_new_tokens - 1 = "
                           f"{handoff.max_new_tokens - 1} emitted tokens, got {len(handoff.prompt)} and "
                           f"{len(handoff.output)}")
    tokens = [*handoff.prompt, *handoff.output, *handoff.pending_inputs]
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < engine.vocab_size]
    if bad:
        raise HandoffError(f"{where}: token ids must be ints in [0, {engine.vocab_size}), got {bad[:5]}")
    if handoff.pending_inputs[0] != handoff.output[-1]:
        raise HandoffError(f"{where}: the first pending input {handoff.pending_inputs[0]} is not the last "
                           f"emitted token {handoff.output[-1]}")
    # a context engine without this engine's eos ids emits past them; here the request already ended
    ended = [t for t in handoff.output if t in engine.config.eos_ids]
    if ended:
        raise HandoffError(f"{where}: emitted token {ended[0]} is an eos id of this engine, so the request "
                           f"already ended there; nothing is left to generate")
    committed = len(handoff.prompt) + len(handoff.output) - 1  # the last token's KV is not written yet
    # exactly: pages past the committed positions would be allocated beyond the admitted budget
    if handoff.kv_len != committed or handoff.payload.num_tokens != committed:
        raise HandoffError(f"{where}: kv_len {handoff.kv_len} and {handoff.payload.num_tokens} transferred tokens "
                           f"must both be the {committed} committed positions (prompt + output - 1)")
    request = _request(handoff)
    try:  # a request this engine could never admit, even alone (its cache or max_seq_len is smaller)
        engine.scheduler.check_fits(request)
    except RequestError as error:
        raise HandoffError(str(error)) from None
    # and one it cannot admit now: `recv_handoff` refuses it before its pages cross, as `import_handoff` would
    if not engine.scheduler.fits_now(request):
        raise HandoffError(_no_budget(handoff))


def _no_budget(handoff: ContextHandoff) -> str:
    return f"request {handoff.index}: no KV budget left on the generation engine"


def _request(handoff: ContextHandoff, eos_ids=frozenset()) -> Request:
    return Request(index=handoff.index, prompt=list(handoff.prompt), max_new_tokens=handoff.max_new_tokens,
                   eos_ids=frozenset(eos_ids))


def import_handoff(engine: Engine, handoff: ContextHandoff) -> Request:
    """Admit ``handoff`` into ``engine``: import its pages and resume it in the decode state."""
    _check_engine(engine)
    with engine.exclusive("import_handoff"):
        _check_handoff(engine, handoff)  # under the lock: the index must still be free when the pages land
        try:  # before admission, naming the fields (the page import printed both fingerprints whole)
            check_fingerprint(handoff.payload.fingerprint, engine.cache, f"request {handoff.index}")
        except TransferError as error:
            raise HandoffError(str(error)) from None
        return _import(engine, handoff)


def _import(engine: Engine, handoff: ContextHandoff) -> Request:
    # made first: failing after the pages landed (a device error, Ctrl-C), it left them and the budget held
    pending = torch.tensor(handoff.pending_inputs, dtype=torch.long, device=engine.device)
    request = engine.adopt(_request(handoff, engine.config.eos_ids))
    if not engine.scheduler.admit(request):
        raise HandoffError(_no_budget(handoff))
    try:
        import_request(engine.cache, request.rid, handoff.payload)
        # inside: Ctrl-C raised here (CPython raises it as a call such as list() returns) left the
        # pages, the id and the budget held by a request the caller never got
        request.state = RequestState.DECODE
        request.num_prefilled = len(request.prompt)
        request.kv_len = handoff.kv_len
        request.output = list(handoff.output)
        request.pending_inputs = pending
        request.pending_draft_len = handoff.pending_draft_len
        return request
    except BaseException:  # an interrupt too: the budget would stay admitted with no request to release it
        if request.rid in engine.cache.allocator:  # the pages landed (`_check_handoff` found the id free)
            engine.cache.free(request.rid)
        engine.scheduler.release(request)
        raise


@torch.no_grad()
def continue_generation(engine: Engine, requests: list[Request]) -> GenerationResult:
    """Run imported requests to the end (verify steps only), as `Engine.generate` would; an
    exception carries what was done as ``partial_result``, as `Engine.generate`'s does."""
    _check_engine(engine)
    with engine.exclusive("continue_generation"):
        requests = list(requests)  # iterated once per step: a generator would be spent by the checks
        _check_owned(engine, requests, "continue_generation")
        counts = collections.Counter(map(id, requests))
        repeated = sorted({r.index for r in requests if counts[id(r)] > 1})
        if repeated:  # it would verify twice a step over one page table and emit the wrong tokens
            raise HandoffError(f"continue_generation: requests {repeated} are listed more than once")
        step_id = 0
        started = time.perf_counter()
        try:
            while True:
                rows = engine.scheduler.schedule(requests)
                if not rows:
                    break
                _step(engine, rows, requests, step_id)
                step_id += 1
        except BaseException as error:
            engine.stop_unfinished(requests)
            _count_call(engine, step_id, started, failed=True)
            attach_partial_result(error, engine.result(requests))
            raise
        _count_call(engine, step_id, started)
        engine.stop_unfinished(requests)  # none left once the loop ran dry; a guard against leaking pages
        return engine.result(requests)  # a copy of the running statistics: later calls leave it as it was


_STATE_INTS = 7  # index, max_new_tokens, kv_len, pending_draft_len, n_prompt, n_output, n_pending


def send_handoff(handoff: ContextHandoff, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``handoff`` to rank ``dst`` (format in the module docstring).

    Everything this side can check is checked before the first message; a handoff the receiver
    refuses raises `HandoffError` with its reason, and then no page was sent; a page that arrived
    damaged, a stream that broke (or a header too long for a frame) raises `TransferError`."""
    check_sendable(handoff.payload)
    lists = [as_ints(handoff.prompt), as_ints(handoff.output), as_ints(handoff.pending_inputs)]
    state = as_ints([handoff.index, handoff.max_new_tokens, handoff.kv_len, handoff.pending_draft_len,
                     *(len(x) for x in lists)])
    header = [*state, *(t for x in lists for t in x), *PayloadHeader.of(handoff.payload).to_ints()]
    staged = stage_pages(handoff.payload.pool_pages, group)
    checksums = page_checksums(handoff.payload.pool_pages)
    send_header(KIND_HANDOFF, header, dst, group, f"handoff of request {handoff.index}", error=HandoffError)
    send_pages(staged, checksums, dst, group, f"handoff of request {handoff.index}")


def _parse_handoff(values: list[int], where: str) -> tuple[ContextHandoff, PayloadHeader]:
    """The handoff a header announces (its pages as shape-only (meta) tensors) and its payload
    header; raises `HandoffError` naming the first field that no sender of ours could have written."""
    if len(values) < _STATE_INTS:
        raise HandoffError(f"{where}: the header has {len(values)} ints, the state alone needs {_STATE_INTS}")
    index, max_new, kv_len, draft_len, *counts = values[:_STATE_INTS]
    for name, value, low in (("index", index, 0), ("max_new_tokens", max_new, 1), ("kv_len", kv_len, 0),
                             ("pending_draft_len", draft_len, 0), ("prompt length", counts[0], 0),
                             ("output length", counts[1], 0), ("pending input count", counts[2], 0)):
        if value < low:
            raise HandoffError(f"{where}: {name} {value} is below {low}")
    tokens_end = _STATE_INTS + sum(counts)
    if tokens_end > len(values):
        raise HandoffError(f"{where}: the header announces {sum(counts)} tokens ({counts[0]} prompt, {counts[1]} "
                           f"output, {counts[2]} pending) but carries {len(values) - _STATE_INTS} ints after the state")
    tokens = values[_STATE_INTS:tokens_end]
    if any(t < 0 for t in tokens):
        raise HandoffError(f"{where}: negative token ids {[t for t in tokens if t < 0][:5]}")
    try:
        header = PayloadHeader.parse(values[tokens_end:], where)
    except TransferError as error:
        raise HandoffError(str(error)) from None
    pages = tuple(torch.empty(shape, dtype=torch.uint8, device="meta") for shape in header.shapes)
    a, b = counts[0], counts[0] + counts[1]
    handoff = ContextHandoff(index=index, prompt=tokens[:a], max_new_tokens=max_new, output=tokens[a:b],
                             kv_len=kv_len, pending_inputs=tokens[b:], pending_draft_len=draft_len,
                             payload=KVTransferPayload(header.fingerprint, header.num_tokens, pages))
    return handoff, header


def recv_handoff(src: int, group: dist.ProcessGroup | None = None, *, engine: Engine | None = None,
                 agree: dist.ProcessGroup | None = None) -> ContextHandoff:
    """Receive what `send_handoff` sent from rank ``src``.

    A malformed header raises `HandoffError` naming the field, before any page moves (the sender
    raises it too, and the next handoff on the stream arrives intact). With ``engine`` (the one
    that will import it), a handoff `import_handoff` would refuse there is refused the same way,
    so its pages never cross; ``engine`` itself is not touched. A frame that is not ours, a
    truncated one or a stream that broke raises `TransferError`.

    ``agree``: the process group of the ranks that receive this request together, each its own
    shard's handoff from its own sender (a tensor-parallel generation group; not ``group``, which
    holds the senders). Every rank of it calls `recv_handoff` at once and they accept or refuse
    together (`parallel.transfer.Agreement`): the header, then the pages. One rank's refusal
    (a page damaged in transit, an engine short of pages) or a different request index on
    another rank is raised on every rank, naming the ranks and their reasons, with `HandoffError`
    for the header and `TransferError` for the pages, and every sender hears it. Without it, one
    rank imported what another refused, and their all-reduces then summed other requests'
    partial sums (wrong tokens without a word) or tensors of other sizes (gloo aborts)."""
    where = f"handoff from rank {src}"
    votes = None if agree is None else Agreement(agree, where)  # checked before the first message
    stage, key = 1, -1

    def accept(values: list[int]):
        nonlocal key
        try:
            handoff, header = _parse_handoff(values, where)
            key = handoff.index
            if engine is not None:
                _check_engine(engine)
                _check_handoff(engine, handoff)
                try:
                    header.check_fits(engine.cache, f"{where}, request {handoff.index}")
                except TransferError as error:
                    raise HandoffError(str(error)) from None
            accepted = handoff, header.buffers(comm_device(group), where)
        except Exception as refusal:
            if votes is not None:
                votes.vote(1, key, refusal, HandoffError)
            raise
        if votes is not None:
            votes.vote(1, key, None, HandoffError)
        return accepted

    try:
        handoff, buffers = recv_header(KIND_HANDOFF, src, group, accept)
        stage = 2
        pages = recv_pages(buffers, src, group, f"{where}, request {handoff.index}",
                           None if votes is None else lambda refusal: votes.vote(2, key, refusal, TransferError))
    except Exception as error:
        if votes is not None:  # cut short before this rank voted (a broken stream): the others wait for it
            votes.vote_refusal(stage, key, error)
        raise
    return dataclasses.replace(handoff, payload=dataclasses.replace(handoff.payload, pool_pages=pages))
