"""The reference host's engine: request lifecycle, the step loop (plain or overlapped), statistics.

Requests are validated on arrival (a bad one fails alone with a message), admitted when their
worst-case KV fits, scheduled row by row, and freed when they end. With ``overlap`` the loop
launches step N+1 before committing step N: N+1's metadata is prepared from optimistic lengths
and corrected on the device, so the host never waits between the two. Draft proposals come from
an explicit proposer, else the `m3_eagle_propose_drafts` plugin hook, else the Eagle3 head;
host-side proposers need committed tokens, so they turn overlap off.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from m3_eagle_plugin.eagle3.accept import forced_ratio
from m3_eagle_plugin.host.reference.request import Request, RequestError, RequestState
from m3_eagle_plugin.host.reference.runner import RunnerConfig, StepOutput, StepRunner
from m3_eagle_plugin.host.reference.sampler import SamplingParams, request_generator
from m3_eagle_plugin.host.reference.scheduler import RowKind, Scheduler
from m3_eagle_plugin.host.reference.stats import SpecStats
from m3_eagle_plugin._ints import as_int, exact_index

__all__ = ["EngineConfig", "GenerationResult", "Engine", "Proposer"]

Proposer = Callable[[object], "list[list[int]] | None"]  # DraftContext -> drafts per request or None


@dataclass(frozen=True)
class EngineConfig:
    draft_len: int = 3
    max_batch_size: int = 8
    max_tokens_per_step: int = 256
    overlap: bool = False
    cuda_graphs: bool = False
    sampling: SamplingParams = SamplingParams()
    force_accepted: float | None = None  # fractional: that mean per verify step (2.5 -> 2, 3, 2, ...)
    eos_ids: tuple[int, ...] = ()
    # Longest request (prompt + new tokens + draft headroom), as the host's max_seq_len: sizes the
    # block-table width, which bounds what a CUDA-graph step reads (None: the whole cache).
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        # Types too, not only ranges: a bool draft_len runs as 0 or 1, a float max_seq_len or an
        # int eos_ids fails deep inside the first step, with no word of which field was wrong.
        for name, minimum in (("draft_len", 0), ("max_batch_size", 1), ("max_tokens_per_step", 1)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum))
        for name in ("overlap", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if self.max_seq_len is not None:
            object.__setattr__(self, "max_seq_len", check_int("max_seq_len", self.max_seq_len, 1))
        if isinstance(self.eos_ids, (str, bytes)) or not isinstance(self.eos_ids, (tuple, list, set, frozenset)):
            raise ValueError(f"eos_ids must be a tuple of token ids, got {self.eos_ids!r}")
        # A tuple of ints: stays hashable, like the default.
        object.__setattr__(self, "eos_ids", tuple(check_int("eos_ids", token, 0) for token in self.eos_ids))
        if self.force_accepted is not None:
            try:  # the schedule's own rule, so a mean it cannot schedule fails here, not mid-run
                forced_ratio(self.force_accepted)
            except ValueError as error:
                raise ValueError(f"force_accepted: {error}") from None


def hook_drafts(proposer, plugin_manager) -> bool:
    """Whether the drafts come from a proposer or a plugin implementing `m3_eagle_propose_drafts`
    instead of an Eagle3 head."""
    if proposer is not None:
        return True
    if plugin_manager is None:
        return False
    return bool(plugin_manager.hook.m3_eagle_propose_drafts.get_hookimpls())


def effective_draft_len(config: EngineConfig, *, has_head: bool, hook_drafts: bool) -> int:
    """Drafts per verify step: the configured length, or 0 where nothing drafts."""
    return config.draft_len if has_head or hook_drafts else 0


def check_engine_settings(config: EngineConfig, *, vocab_size: int, draft_len: int, device: torch.device,
                          has_head: bool) -> None:
    """Everything an `Engine` refuses of its config, given the vocabulary, the draft length it runs
    with, its device and whether it has an Eagle3 head (`build_engine` runs this before reading any weight)."""
    if config.cuda_graphs and device.type != "cuda":
        raise ValueError("--cuda-graphs needs a CUDA device (got device %r)" % str(device))
    if config.cuda_graphs and (not has_head or draft_len < 1):  # what `GenerationGraphs` refuses
        raise ValueError("CUDA graphs capture the Eagle3 generation step: they need a draft head and K >= 1")
    if config.cuda_graphs and not config.sampling.greedy:
        raise ValueError("CUDA graphs support greedy decoding only (sampling uses host-held generators)")
    outside = sorted(t for t in config.eos_ids if t >= vocab_size)
    if outside:
        raise ValueError(f"eos_ids {outside} are outside the vocabulary [0, {vocab_size}): no generated token "
                         "could ever end a request with them")
    if config.force_accepted is not None and forced_ratio(config.force_accepted) > draft_len:
        if config.draft_len and not draft_len:  # the configured K is not the cause
            raise ValueError(f"force_accepted ({config.force_accepted}) needs drafts, but nothing drafts here: "
                             "no Eagle3 head, proposer or drafter plugin")
        raise ValueError(f"force_accepted ({config.force_accepted}) exceeds the draft length ({draft_len})")
    if config.force_accepted is not None and not config.sampling.greedy:  # it took the argmax and said nothing
        raise ValueError(f"force_accepted ({config.force_accepted}) is a greedy benchmark mode: each verify step's "
                         f"bonus token is the target's argmax, so it cannot sample (temperature "
                         f"{config.sampling.temperature}); use temperature 0")
    Scheduler.check_limits(max_batch_size=config.max_batch_size, max_tokens_per_step=config.max_tokens_per_step,
                           draft_len=draft_len)


def runner_config(config: EngineConfig, *, draft_len: int, block_size: int, total_blocks: int, device,
                  num_index_heads: int) -> RunnerConfig:
    """What an `Engine` with `config` gives its runner (and, as `max_blocks_per_seq`, its scheduler):
    `build_engine` sizes the step buffers from it before any weight is read."""
    seq_blocks = total_blocks if config.max_seq_len is None else min(-(-config.max_seq_len // block_size),
                                                                     total_blocks)
    return RunnerConfig(
        draft_len=draft_len, max_batch_size=config.max_batch_size, max_tokens_per_step=config.max_tokens_per_step,
        max_blocks_per_seq=seq_blocks, block_size=block_size, device=device, sampling=config.sampling,
        force_accepted=config.force_accepted, num_index_heads=num_index_heads, cuda_graphs=config.cuda_graphs,
        num_pages=total_blocks,
    )


def check_int(name: str, value, minimum: int, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= ``minimum`` (numpy integers too), else ``error`` naming ``name``."""
    return as_int(name, value, minimum, error)


@dataclass
class GenerationResult:
    outputs: list[list[int]]
    errors: list[str | None]
    stop_reasons: list[str | None]
    stats: SpecStats
    overlap: bool = False
    forced_acceptance: float | None = None
    draft_source: str = "none"
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {"outputs": self.outputs, "errors": self.errors, "stop_reasons": self.stop_reasons}
        out.update(self.stats.as_dict())
        out.update({
            "draft_len": self.stats.draft_len, "draft_source": self.draft_source, "overlap": self.overlap,
            "forced_acceptance": self.forced_acceptance,
        })
        out.update(self.extra)
        return out


class Engine:
    def __init__(
        self,
        target,
        cache,
        config: EngineConfig,
        *,
        vocab_size: int,
        head=None,
        capture=None,
        proposer: Proposer | None = None,
        plugin_manager=None,
        device: torch.device | str = "cpu",
        metadata_factory=None,
        num_index_heads: int = 1,
        max_position_embeddings: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.target, self.cache, self.config = target, cache, config
        self.vocab_size = int(vocab_size)
        # The target's trained positions: a prompt that fills them fails, generation stops at them (None: no limit).
        self.max_positions = (None if max_position_embeddings is None
                              else check_int("max_position_embeddings", max_position_embeddings, 1))
        self.head = head
        self.proposer = proposer
        self.plugin_manager = plugin_manager
        self._hook_drafts = hook_drafts(proposer, plugin_manager)
        self.k = effective_draft_len(config, has_head=head is not None, hook_drafts=self._hook_drafts)
        check_engine_settings(config, vocab_size=self.vocab_size, draft_len=self.k, device=self.device,
                              has_head=head is not None)
        block_size = int(cache.block_size)
        run = runner_config(config, draft_len=self.k, block_size=block_size, total_blocks=int(cache.num_blocks),
                            device=self.device, num_index_heads=num_index_heads)
        self.scheduler = Scheduler(
            max_batch_size=config.max_batch_size, max_tokens_per_step=config.max_tokens_per_step,
            draft_len=self.k, block_size=block_size, total_blocks=int(cache.num_blocks),
            max_blocks_per_seq=run.max_blocks_per_seq,
        )
        self.runner = StepRunner(target, cache, run, head=head, capture=capture, metadata_factory=metadata_factory)
        self.overlap = config.overlap and not self._hook_drafts
        self.stats = SpecStats(draft_len=self.k)
        self._lock = threading.Lock()  # see `exclusive`
        self._mark = object()  # on every request this engine made or adopted (`owns`)
        self._holder: tuple[int, str] | None = None  # (thread id, what it runs) while held

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Hold the engine for one call that steps it or changes its requests (``generate``, the
        disaggregation helpers): the scheduler, the cache's request ids (the request index) and the
        step metadata are the engine's own. Calls from other threads wait; a call from the thread
        holding it (a progress callback, a proposer) is refused, since waiting would hang."""
        holder = self._holder  # one read: another thread may release it meanwhile
        if holder is not None and holder[0] == threading.get_ident():
            raise RuntimeError(f"{what} cannot run while {holder[1]} is already running on this thread "
                               "(called from its progress callback or proposer?): an engine runs one call at a time")
        with self._lock:
            self._holder = (threading.get_ident(), what)
            try:
                yield
            finally:
                self._holder = None

    @property
    def draft_source(self) -> str:
        if self.proposer is not None:
            return "proposer"
        if self._hook_drafts:
            return "plugin" if self.head is None else "plugin+eagle3"
        return "eagle3" if self.head is not None else "none"

    # ----- requests ------------------------------------------------------------------------
    def make_request(self, index: int, prompt, max_new_tokens: int) -> Request:
        """Validate a prompt and register its KV; a bad prompt yields a FAILED request, not an exception."""
        request = Request(index=index, prompt=[], max_new_tokens=max_new_tokens,
                          eos_ids=frozenset(self.config.eos_ids), owner=self._mark)
        try:
            if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # a 1-D tensor or array
                prompt = prompt.tolist()
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
                raise RequestError(f"request {index}: prompt must be a list of token ids, got {type(prompt).__name__}")
            if len(prompt) == 0:
                raise RequestError(f"request {index}: empty prompt")
            ids = [_token_id(t, self.vocab_size) for t in prompt]
            if None in ids:
                bad = [t for t, i in zip(prompt, ids) if i is None]
                raise RequestError(
                    f"request {index}: token ids must be ints in [0, {self.vocab_size}), got {bad[:5]}"
                )
            # Not only >= 1: a float or bool would run (2.5 -> 3 tokens) and a str or None would raise
            # past this request, so every bad count fails the request here (a numpy int is an int).
            count = check_int(f"request {index}: max_new_tokens", max_new_tokens, 1, RequestError)
            if self.max_positions is not None:
                if len(ids) >= self.max_positions:
                    raise RequestError(f"request {index}: prompt of {len(ids)} tokens leaves no room for a new token "
                                       f"in the target's {self.max_positions} positions (max_position_embeddings)")
                count = min(count, self.max_positions - len(ids))  # ends there as at max_new_tokens ("length")
            request.prompt, request.max_new_tokens = ids, count
            self.scheduler.check_fits(request)
        except RequestError as error:
            request.fail(str(error))
            request.released = True  # never registered: nothing to give back
            return request
        if request.rid in self.cache.allocator:  # the whole call is refused (ids are the caller's numbering)
            raise ValueError(f"request {index} already exists: a live request outside this call holds the id (a "
                             "context phase's not yet exported, or an imported handoff); finish or export it first, "
                             "or number this batch past it (run_context_phase's first_index)")
        if not self.config.sampling.greedy:
            request.generator = request_generator(self.config.sampling.seed, index, self.device)
        self.cache.add_request(request.rid)
        return request

    def adopt(self, request: Request) -> Request:
        """Mark ``request`` (built outside `make_request`: an imported handoff) as this engine's."""
        request.owner = self._mark
        return request

    def owns(self, request: Request) -> bool:
        """Whether ``request`` was made or adopted here: its id names pages in this cache only (a
        request of another engine can share the id with one of ours)."""
        return isinstance(request, Request) and request.owner is self._mark

    def finish(self, request: Request) -> None:
        """Return a finished (or failed) request's pages and its scheduler slot (once: idempotent)."""
        self.scheduler.release(request)
        if not request.released:
            self.cache.free(request.rid)
            request.released = True  # after the free: one that raised is run again by the clean-up

    def stop_unfinished(self, requests: Sequence[Request], reason: str = "engine stopped before the request finished"
                        ) -> None:
        """Fail every request not done yet with ``reason``, and return the pages and scheduler slot of
        every request still holding them: also of one that finished just before an interrupt (Ctrl-C
        between its last tokens and `finish`), which would otherwise keep its id in the cache."""
        for request in requests:
            if not request.done:
                request.fail(reason)
                self._uncount_generated(request)
            self.finish(request)

    def _count_generated(self, request: Request, kept: int) -> None:
        """Count ``kept`` new tokens of ``request`` as generated, noting them on the request."""
        if request.counted_in is not self.stats:  # the first in these statistics (`generate` restarts them)
            request.counted_in, request.counted_tokens = self.stats, 0
        request.counted_tokens += kept
        self.stats.generated_tokens += kept

    def _uncount_generated(self, request: Request) -> None:
        """Take a failed request's tokens out of generated_tokens: its output is not returned."""
        if request.counted_in is self.stats:
            self.stats.generated_tokens -= request.counted_tokens
        request.counted_in, request.counted_tokens = None, 0

    def result(self, requests: Sequence[Request]) -> GenerationResult:
        """``requests`` with a copy of this engine's statistics (the disaggregation phases keep adding
        to the live ones after a `generate`): the tokens of each FINISHED request; [] for the others,
        whose ``errors`` entry says why."""
        return GenerationResult(
            outputs=[list(r.output) if r.state is RequestState.FINISHED else [] for r in requests],
            errors=[r.error for r in requests],
            stop_reasons=[r.stop_reason for r in requests],
            stats=copy.deepcopy(self.stats), overlap=self.overlap, forced_acceptance=self.config.force_accepted,
            draft_source=self.draft_source,
        )

    # ----- the step loop -------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> GenerationResult:
        """Run ``prompts`` to completion. A bad request fails alone (its ``errors`` entry says why);
        an exception from a step (the model, the head, a proposer, ``progress``) reaches the caller
        with a note naming the step and its requests, after every request's KV pages and admission
        budget went back, so the engine runs the next call as a fresh one would. That exception's
        ``partial_result`` is what the call had done: a `GenerationResult` with the output of every
        request that finished before it, the others failed ("engine stopped before the request
        finished"). Calls from other threads wait for the running one; a call from inside the
        running one is refused (`exclusive`)."""
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be a callable (done, total) or None, got {progress!r}")
        with self.exclusive("Engine.generate"):
            return self._generate(prompts, max_new_tokens, progress)

    @torch.no_grad()
    def _generate(self, prompts, max_new_tokens: int, progress) -> GenerationResult:
        try:  # refused before anything changes (the last call's stats stay readable)
            prompt_iter = enumerate(prompts)
        except TypeError:
            raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {prompts!r}") from None
        self.stats = SpecStats(draft_len=self.k)  # per call
        self.runner.restart_forced_schedule()  # so is a fractional forced mean's 2, 3, 2, ... schedule
        requests: list[Request] = []
        inflight: StepOutput | None = None
        started = time.perf_counter()  # restarted once the requests are built; read if building fails
        try:
            # Inside the try: a prompt source that raises part-way (a generator, an interrupt) must
            # not leave the requests built before it registered in the cache.
            for i, prompt in prompt_iter:
                requests.append(self.make_request(i, prompt, max_new_tokens))
            started = time.perf_counter()
            while True:
                rows = self.scheduler.schedule(requests)
                if not rows and inflight is None:
                    if self._fail_unadmitted(requests):
                        if progress is not None:
                            progress(sum(r.done for r in requests), len(requests))
                        continue  # the ones it held back (first come, first admitted) may fit
                    break
                launched = None
                if rows:
                    step_id = self.stats.engine_steps
                    with _step_context(f"in engine step {step_id}", rows):
                        launched = self.launch(rows, step_id)
                    self.stats.engine_steps += 1
                if inflight is not None:
                    self._commit_noted(inflight, requests, progress)
                    if launched is not None:
                        self._return_void_forced_count(launched)
                inflight = launched
                if inflight is not None and not self.overlap:
                    self._commit_noted(inflight, requests, progress)
                    inflight = None
        except BaseException as error:
            self.stop_unfinished(requests)
            self.stats.elapsed_s = time.perf_counter() - started
            attach_partial_result(error, self.result(requests))
            raise
        self.stop_unfinished(requests)  # none left once the loop ran dry; a guard against leaking pages
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.elapsed_s = time.perf_counter() - started
        return self.result(requests)

    def _fail_unadmitted(self, requests: Sequence[Request]) -> bool:
        """With nothing left to run, fail the first waiting request, naming the cause, and say
        whether there was one. Each request fits alone (`make_request` checked), so the budget it
        cannot get is held by live requests outside this call (a context phase's not yet exported,
        imported handoffs not yet continued), which no step of this call gives back."""
        for request in requests:
            if request.state is RequestState.WAITING:
                request.fail(f"request {request.index}: never admitted: it needs "
                             f"{self.scheduler.blocks_needed(request)} KV blocks, but "
                             f"{self.scheduler.admitted_blocks} of the cache's {self.scheduler.total_blocks} stay "
                             f"reserved by live requests outside this call (context-phase or imported handoffs)")
                self.finish(request)
                return True
        return False

    def _commit_noted(self, out: StepOutput, requests: list[Request], progress) -> None:
        """`commit`, with a step's exception noted by the step and its requests."""
        with _step_context(f"while committing engine step {out.step_id}", out.rows):
            self.commit(out, requests, progress)

    def _return_void_forced_count(self, out: StepOutput) -> None:
        """``out`` was launched before the step in flight committed. Where that commit finished every
        request ``out`` verifies, ``out`` is void (the plain loop would not have run it): its entry of
        a fractional forced schedule goes back, so later verify steps see the plain loop's counts."""
        verified = [row.request for row in out.rows if row.kind is RowKind.VERIFY]
        if verified and all(request.done for request in verified):
            self.runner.return_forced_count()

    def launch(self, rows, step_id: int) -> StepOutput:
        """Run one step's rows and stage lengths as if every draft were accepted (corrected on commit)."""
        out = self.runner.launch(rows, step_id)
        out.readback = _start_readback(out)
        for row_index, row in enumerate(out.rows):
            request = row.request
            request.inflight_steps += 1
            if row.kind is RowKind.CONTEXT:
                request.num_prefilled = row.start + row.length
                request.kv_len = request.num_prefilled
                if row.final:
                    request.state = RequestState.DECODE
                    request.pending_deficit = None
            else:
                request.kv_len += 1 + self.k
                request.pending_deficit = out.deficit[row_index]
        for j, row_index in enumerate(out.drafting_rows):
            request = out.rows[row_index].request
            request.pending_inputs = out.next_inputs[j]
            request.pending_draft_len = self.k if out.head_drafts else 0
            request.pending_draft_probs = None if out.next_draft_probs is None else out.next_draft_probs[j]
            request.pending_step = step_id
        return out

    def commit(self, out: StepOutput, requests: list[Request], progress) -> None:
        """Apply a launched step's acceptance: stats, emitted tokens, KV rewind, finished requests."""
        emitted, num_emitted, num_accepted = _finish_readback(out.readback, out.emitted.shape[1])
        for i, row in enumerate(out.rows):
            request = row.request
            request.inflight_steps -= 1
            if request.done:
                continue  # finished while this (overlapped) step was in flight: its result is void
            if row.kind is RowKind.VERIFY:
                self.stats.record_verify(out.draft_lens[i], num_accepted[i])
                request.kv_len -= self.k - num_accepted[i]
                if request.pending_step == out.step_id:
                    request.pending_deficit = None
            before = len(request.output)
            request.append_tokens(emitted[i][: num_emitted[i]])
            self._count_generated(request, len(request.output) - before)
            if request.done:
                self.finish(request)
            else:
                self._rewind(request)
        if self._hook_drafts:
            self._host_proposals(out)
        if progress is not None:
            progress(sum(r.done for r in requests), len(requests))

    def _rewind(self, request: Request) -> None:
        """Drop pages past what the request (and its in-flight step, if any) can still use."""
        ahead = self.k - 1 if (self.head is not None and self.k > 0 and request.inflight_steps) else 0
        keep = min(request.kv_len + max(ahead, 0), self.cache.num_tokens(request.rid))
        self.cache.rewind(request.rid, keep)

    def _host_proposals(self, out: StepOutput) -> None:
        """Ask the explicit proposer or the plugin hook for the next drafts of this step's requests."""
        from m3_eagle_plugin.hooks import DraftContext

        ready = [out.rows[i].request for i in out.drafting_rows]
        ready = [r for r in ready if not r.done and r.pending_step == out.step_id]
        if not ready or self.k == 0:
            return
        context = DraftContext.build([r.rid for r in ready], [r.prompt + r.output for r in ready], self.k)
        if self.proposer is not None:
            drafts = self.proposer(context)
        else:
            drafts = self.plugin_manager.propose_drafts(context)
        if drafts is None:
            return  # the Eagle3 head's drafts (or none) stay in place
        try:  # any iterable, as `DrafterPlugin` takes (len() of a generator was a TypeError naming nothing)
            drafts = list(drafts)
        except TypeError:
            raise ValueError(f"{self.draft_source} drafts: expected one list of token ids per request, "
                             f"got {drafts!r}") from None
        if len(drafts) != len(ready):
            raise ValueError(f"proposer returned drafts for {len(drafts)} requests, expected {len(ready)}")
        for request, proposal in zip(ready, drafts):
            proposal = self._proposal_ids(request, proposal)
            padded = [request.output[-1]] + proposal + [0] * (self.k - len(proposal))
            request.pending_inputs = torch.tensor(padded, dtype=torch.long, device=self.device)
            request.pending_draft_len = len(proposal)
            request.pending_draft_probs = None

    def _proposal_ids(self, request: Request, proposal) -> list[int]:
        """A proposer's drafts for ``request`` as vocabulary ids (at most K), else ValueError naming it."""
        where = f"{self.draft_source} drafts for request {request.index}"
        try:
            proposal = list(proposal)[: self.k]
        except TypeError:
            raise ValueError(f"{where}: expected a list of token ids, got {proposal!r}") from None
        ids = [_token_id(t, self.vocab_size) for t in proposal]
        if None in ids:
            bad = [t for t, i in zip(proposal, ids) if i is None]
            raise ValueError(f"{where}: token ids must be ints in [0, {self.vocab_size}), got {bad[:5]}")
        return ids


def attach_partial_result(error: BaseException, result: GenerationResult) -> None:
    """Keep what a failed call had done on its exception, as ``error.partial_result``; where some
    request had finished, a note (Python 3.11+) says which."""
    error.partial_result = result
    finished = [i for i, reason in enumerate(result.stop_reasons) if reason is not None]
    if finished and hasattr(error, "add_note"):
        error.add_note(f"partial_result on this exception holds the outputs of the requests that finished "
                       f"before it (positions {finished} of its lists)")


@contextlib.contextmanager
def _step_context(where: str, rows) -> Iterator[None]:
    """Adds a note naming the step and its requests to an exception raised inside (Python 3.11+:
    the exception itself, its type and message reach the caller unchanged)."""
    try:
        yield
    except BaseException as error:
        if hasattr(error, "add_note"):
            error.add_note(f"{where}: {describe_rows(rows)}")
        raise


def describe_rows(rows) -> str:
    """A step's rows in words: ``prefill of request 1 (prompt tokens 0..6), verify of request 0``."""
    parts = []
    for row in rows:
        if row.kind is RowKind.CONTEXT:
            last = row.start + row.length - 1
            parts.append(f"prefill of request {row.request.index} (prompt tokens {row.start}..{last})")
        else:
            parts.append(f"verify of request {row.request.index}")
    return ", ".join(parts) or "no rows"


def _token_id(token, vocab_size: int) -> int | None:
    """``token`` as a vocabulary id (an integer, `_ints.exact_index`, in ``[0, vocab_size)``), or None."""
    index = exact_index(token)
    return index if index is not None and 0 <= index < vocab_size else None


def _start_readback(out: StepOutput) -> tuple:
    """Start copying a step's emitted tokens and counts to the host now, behind that step only.

    Reading them at commit time with `.cpu()` would queue the copy behind whatever was launched
    since (under the overlapped loop: the whole next step), so the host would wait for that too.
    One packed copy into pinned memory, and an event to wait on.
    """
    packed = torch.cat([out.emitted.to(torch.long), out.num_emitted.to(torch.long).unsqueeze(1),
                        out.num_accepted.to(torch.long).unsqueeze(1)], dim=1)
    if packed.device.type != "cuda":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(packed.device))  # the copy's stream, not the current device's
    return host, done


def _finish_readback(readback: tuple, width: int) -> tuple[list, list[int], list[int]]:
    """(emitted rows, num_emitted, num_accepted) as host lists, once the copy has landed."""
    host, done = readback
    if done is not None:
        done.synchronize()
    rows = host.tolist()
    return [r[:width] for r in rows], [r[width] for r in rows], [r[width + 1] for r in rows]
