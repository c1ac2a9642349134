"""Faults injected into `Engine.generate` at every stage, with and without overlap.

After each: the exception reaches the caller unchanged with a note naming the engine step and its
requests and with what the call had done (`partial_result`: each request finished, with its whole
output, or stopped, with none), every KV block is back in the allocator, no request id is left
registered, the scheduler's admission budget is zero, and the same engine's next call gives
target-only greedy output (the fake's naive loop, an independent oracle). Also: prompt sources
that fail part-way, calls from another thread (serialized) or from inside a running call
(refused), and odd but valid inputs.
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch

import m3_eagle_plugin.host.reference.runner as runner_mod
from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.sampler import SamplingParams

from . import _fakes

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4], [7], [2, 2, 2, 2, 2, 2]]
NEW = 6
HAS_NOTES = sys.version_info >= (3, 11)
STOPPED = "engine stopped before the request finished"


class Injected(RuntimeError):
    pass


def build(*, head=True, overlap=False, proposer=None, **config):
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(64)
    kwargs = dict(draft_len=3, max_batch_size=3, max_tokens_per_step=7, overlap=overlap)
    kwargs.update(config)
    engine = Engine(target, cache, EngineConfig(**kwargs), vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table) if head else None,
                    capture=_fakes.fake_capture() if head else None, proposer=proposer)
    return engine, target, cache


def fail_on_call(function, n: int, error=Injected):
    """``function``, raising ``error`` on its ``n``-th call (and only then)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise error(f"injected fault at call {n}")
        return function(*args, **kwargs)
    return wrapped


def assert_partial_result(error, target, prompts=PROMPTS) -> list[int]:
    """Every request of a failed call's ``partial_result`` finished (its whole greedy output, from
    the fake's naive loop) or stopped (no output, an error saying so); returns the finished ones."""
    partial = error.partial_result
    assert len(partial.outputs) == len(partial.errors) == len(partial.stop_reasons) == len(prompts)
    finished = []
    for i, prompt in enumerate(prompts):
        if partial.stop_reasons[i] is None:
            assert (partial.outputs[i], partial.errors[i]) == ([], STOPPED), i
        else:
            assert (partial.outputs[i], partial.errors[i]) == (target.greedy(prompt, NEW), None), i
            finished.append(i)
    return finished


def assert_clean_and_reusable(engine, target, cache):
    assert cache.num_free_blocks == cache.num_blocks, "a failed generate leaked KV blocks"
    assert not cache.allocator.request_ids, "a failed generate left requests registered in the cache"
    assert engine.scheduler.admitted_blocks == 0, "a failed generate left admission budget reserved"
    result = engine.generate(PROMPTS, max_new_tokens=NEW)  # the same engine, after the fault
    assert result.errors == [None] * len(PROMPTS)
    assert result.outputs == [target.greedy(p, NEW) for p in PROMPTS]
    assert cache.num_free_blocks == cache.num_blocks


# (site, call number): where the fault is injected, counted in calls of that site
SITES = [
    ("target.forward", 1),  # the first prefill chunk
    ("target.forward", 3),  # a mixed step: prefill chunk + verify row
    ("target.forward", 6),  # a verify step
    ("target.compute_logits", 4),
    ("head.forward", 1),  # the draft loop's first step
    ("head.forward", 5),  # a later draft step
    ("sampler", 2),
    ("accept", 3),
    ("meta.prepare", 4),  # MsaDecodeMetadata.prepare of the step
    ("draft_meta.prepare", 2),  # ... of a draft step
]


def inject(engine, target, site: str, n: int, monkeypatch, error=Injected):
    if site == "target.forward":
        monkeypatch.setattr(target, "forward", fail_on_call(target.forward, n, error))
    elif site == "target.compute_logits":
        monkeypatch.setattr(target, "compute_logits", fail_on_call(target.compute_logits, n, error))
    elif site == "head.forward":
        monkeypatch.setattr(engine.head, "forward", fail_on_call(engine.head.forward, n, error))
    elif site == "sampler":
        monkeypatch.setattr(runner_mod, "choose_tokens", fail_on_call(runner_mod.choose_tokens, n, error))
    elif site == "accept":
        monkeypatch.setattr(runner_mod, "greedy_accept", fail_on_call(runner_mod.greedy_accept, n, error))
    elif site == "meta.prepare":
        meta = engine.runner.meta
        monkeypatch.setattr(meta, "prepare", fail_on_call(meta.prepare, n, error))
    elif site == "draft_meta.prepare":
        meta = engine.runner.draft_metas[-1]
        monkeypatch.setattr(meta, "prepare", fail_on_call(meta.prepare, n, error))
    else:
        raise AssertionError(site)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("site,n", SITES, ids=[f"{s}#{n}" for s, n in SITES])
def test_a_fault_in_any_step_stage_loses_nothing_and_names_the_step(site, n, overlap, monkeypatch):
    engine, target, cache = build(overlap=overlap)
    inject(engine, target, site, n, monkeypatch)
    with pytest.raises(Injected, match=f"injected fault at call {n}") as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW)
    if HAS_NOTES:
        notes = getattr(caught.value, "__notes__", [])
        assert any(note.startswith("in engine step ") and "request " in note for note in notes), notes
    assert_partial_result(caught.value, target)
    monkeypatch.undo()
    assert_clean_and_reusable(engine, target, cache)


def test_the_note_names_the_failing_step_and_its_rows():
    """Step 0 with a 7-token budget: request 0's 3 prompt tokens, then request 1's first 4."""
    engine, target, cache = build(head=False, draft_len=0)
    target.forward = fail_on_call(target.forward, 1)
    with pytest.raises(Injected) as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW)
    if HAS_NOTES:
        assert caught.value.__notes__ == [
            "in engine step 0: prefill of request 0 (prompt tokens 0..2), prefill of request 1 (prompt tokens 0..3)"
        ]
    del target.forward
    assert_clean_and_reusable(engine, target, cache)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("where", ["schedule", "commit", "progress"])
def test_a_keyboard_interrupt_between_steps_frees_everything(where, overlap, monkeypatch):
    engine, target, cache = build(overlap=overlap)
    progress = None
    if where == "schedule":
        monkeypatch.setattr(engine.scheduler, "schedule", fail_on_call(engine.scheduler.schedule, 3, KeyboardInterrupt))
    elif where == "commit":
        monkeypatch.setattr(engine, "commit", fail_on_call(engine.commit, 2, KeyboardInterrupt))
    else:
        progress = fail_on_call(lambda done, total: None, 3, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt) as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW, progress=progress)
    assert_partial_result(caught.value, target)
    monkeypatch.undo()
    assert_clean_and_reusable(engine, target, cache)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_an_interrupt_after_a_request_finished_but_before_its_pages_went_back_frees_them(overlap, monkeypatch):
    """Ctrl-C landing in a commit between a request's last tokens (it is done) and `Engine.finish`:
    the clean-up must still give its pages, id and admission budget back (it skipped done requests,
    so the next call failed with "request 0 already exists")."""
    engine, target, cache = build(overlap=overlap)
    monkeypatch.setattr(engine, "finish", fail_on_call(engine.finish, 1, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt) as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW)
    assert assert_partial_result(caught.value, target), "the interrupted request had finished"
    monkeypatch.undo()
    assert_clean_and_reusable(engine, target, cache)


@pytest.mark.parametrize("n", [1, 3])
def test_a_failing_proposer_loses_nothing_and_names_the_step(n):
    calls = [0]

    def proposer(context):
        calls[0] += 1
        if calls[0] == n:
            raise Injected("proposer fault")
        return None

    engine, target, cache = build(head=False, proposer=proposer)
    with pytest.raises(Injected, match="proposer fault") as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW)
    if HAS_NOTES:
        assert any(note.startswith("while committing engine step ") for note in caught.value.__notes__)
    calls[0] = -10**9
    assert_clean_and_reusable(engine, target, cache)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_failed_call_keeps_the_outputs_of_the_requests_that_had_finished(overlap):
    """Three batch slots for four prompts: the progress callback raises once some request finished,
    while the fourth still waits; the finished ones' outputs are those of the same call without it."""
    without_fault = build(overlap=overlap)[0].generate(PROMPTS, max_new_tokens=NEW)
    engine, target, cache = build(overlap=overlap)
    finished_when_raised = []

    def progress(done, total):
        if done:
            finished_when_raised.append(done)
            raise Injected(f"progress fault with {done} of {total} requests finished")

    with pytest.raises(Injected, match="progress fault") as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW, progress=progress)
    finished = assert_partial_result(caught.value, target)
    assert len(finished) == finished_when_raised[0] and 0 < len(finished) < len(PROMPTS)
    partial = caught.value.partial_result
    for i in finished:
        assert partial.outputs[i] == without_fault.outputs[i]
        assert partial.stop_reasons[i] == without_fault.stop_reasons[i] == "length"
    assert partial.stats.generated_tokens >= NEW * len(finished)
    assert partial.stats.elapsed_s > 0 and partial.stats.tokens_per_s > 0  # the call's time up to the fault
    if HAS_NOTES:
        assert any("partial_result" in note and f"positions {finished}" in note for note in caught.value.__notes__)
    assert_clean_and_reusable(engine, target, cache)


def test_a_fault_under_sampling_leaves_the_engine_equal_to_a_fresh_one(monkeypatch):
    """Non-greedy: the recovered engine's seeded samples equal a fresh engine's."""
    sampling = SamplingParams(temperature=0.9, seed=4)
    fresh, _, _ = build(overlap=True, sampling=sampling)
    expected = fresh.generate(PROMPTS, max_new_tokens=NEW)
    engine, target, cache = build(overlap=True, sampling=sampling)
    monkeypatch.setattr(engine.head, "forward", fail_on_call(engine.head.forward, 5))
    with pytest.raises(Injected):
        engine.generate(PROMPTS, max_new_tokens=NEW)
    monkeypatch.undo()
    again = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert again.outputs == expected.outputs
    assert again.stats.accepted_tokens == expected.stats.accepted_tokens
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_a_prompt_source_failing_part_way_leaves_no_request_registered(error):
    engine, target, cache = build()

    def prompts():
        yield [1, 2, 3]
        yield [4, 5]
        raise error("tokenizer failed on text 2")

    with pytest.raises(error, match="tokenizer failed"):
        engine.generate(prompts(), max_new_tokens=NEW)
    assert_clean_and_reusable(engine, target, cache)


def test_a_call_from_another_thread_waits_for_the_running_one():
    engine, target, cache = build(max_tokens_per_step=8)
    first_prompts, second_prompts = [[1, 2, 3], [4, 5]], [[7, 7], [2]]
    second: dict = {}

    def run_second():
        try:
            second["result"] = engine.generate(second_prompts, max_new_tokens=5)
        except BaseException as error:  # noqa: BLE001 - reported below
            second["error"] = error

    thread = threading.Thread(target=run_second)

    def progress(done, total):
        if "started" not in second:
            second["started"] = True
            thread.start()
            thread.join(0.5)  # refused or racing: back by now; serialized: still waiting
            second["waited"] = thread.is_alive()

    first = engine.generate(first_prompts, max_new_tokens=5, progress=progress)
    thread.join(30)
    assert "error" not in second, f"the second call failed: {second['error']!r}"
    assert second["waited"], "the second call ran while the first was in progress"
    assert first.outputs == [target.greedy(p, 5) for p in first_prompts]
    assert second["result"].outputs == [target.greedy(p, 5) for p in second_prompts]
    assert first.stats.generated_tokens == 10 and second["result"].stats.generated_tokens == 10
    assert cache.num_free_blocks == cache.num_blocks and engine.scheduler.admitted_blocks == 0


def test_a_call_from_inside_a_running_call_is_refused_clearly():
    engine, target, cache = build(head=False, draft_len=0)
    refused = []

    def progress(done, total):
        if not refused:
            with pytest.raises(RuntimeError, match="already running") as caught:
                engine.generate([[1]], max_new_tokens=2)
            refused.append(caught.value)

    result = engine.generate([[1, 2, 3]], max_new_tokens=4, progress=progress)
    assert refused
    assert result.outputs == [target.greedy([1, 2, 3], 4)]
    assert_clean_and_reusable(engine, target, cache)


def test_a_call_from_inside_is_refused_while_another_thread_waits_for_the_engine():
    """A thread waiting for the engine does not pass for the one holding it: the running call's callback
    is still refused (not left waiting for itself), and so is the waiting call's once it runs.
    Both calls run on daemon threads so that a hang fails the test instead of stalling it."""
    engine, target, cache = build(head=False, draft_len=0)
    seen: dict = {}

    def progress_of(name, waiter=None):
        def progress(done, total):
            if name in seen:
                return
            if waiter is not None:
                waiter.start()
                waiter.join(0.5)  # now blocked on the engine
            try:
                engine.generate([[1]], max_new_tokens=2)
            except RuntimeError as error:
                seen[name] = error
            else:
                seen[name] = None
        return progress

    def call(name, prompt, waiter=None):
        seen[f"{name} result"] = engine.generate([prompt], max_new_tokens=4, progress=progress_of(name, waiter))

    waiter = threading.Thread(target=call, args=("second", [4, 5]), daemon=True)
    runner = threading.Thread(target=call, args=("first", [1, 2, 3], waiter), daemon=True)
    runner.start()
    runner.join(20)
    waiter.join(20)
    assert not runner.is_alive() and not waiter.is_alive(), f"a call hung (seen so far: {seen})"
    for name in ("first", "second"):
        assert "already running on this thread" in str(seen[name]), name
    assert seen["first result"].outputs == [target.greedy([1, 2, 3], 4)]
    assert seen["second result"].outputs == [target.greedy([4, 5], 4)]
    assert_clean_and_reusable(engine, target, cache)


@pytest.mark.parametrize("progress", [5, "bar"])
def test_a_progress_that_is_not_callable_is_refused_before_any_step(progress):
    engine, target, cache = build()
    with pytest.raises(TypeError, match="progress must be a callable"):
        engine.generate(PROMPTS, max_new_tokens=NEW, progress=progress)
    assert target.calls == 0
    assert_clean_and_reusable(engine, target, cache)


def test_prompts_that_are_not_iterable_are_refused_naming_the_argument():
    engine, target, cache = build()
    done = engine.generate(PROMPTS[:1], max_new_tokens=NEW).stats
    with pytest.raises(TypeError, match="prompts must be a list of prompts"):
        engine.generate(None, max_new_tokens=NEW)
    assert engine.stats == done  # a refused call changes nothing, the last call's stats included
    assert_clean_and_reusable(engine, target, cache)


def test_no_prompts_is_an_empty_result():
    engine, target, cache = build()
    result = engine.generate([], max_new_tokens=NEW)
    assert (result.outputs, result.errors, result.stop_reasons) == ([], [], [])
    assert result.stats.engine_steps == 0 and target.calls == 0
    assert_clean_and_reusable(engine, target, cache)


@pytest.mark.parametrize("overlap", [False, True])
def test_duplicate_prompts_are_independent_requests(overlap):
    engine, target, cache = build(overlap=overlap)
    prompt = [4, 5, 6, 7, 8]
    result = engine.generate([prompt] * 5, max_new_tokens=NEW)
    assert result.outputs == [target.greedy(prompt, NEW)] * 5
    assert cache.num_free_blocks == cache.num_blocks


def test_a_prompt_that_fills_max_seq_len_fails_alone_naming_the_headroom():
    """max_seq_len 32 (8 blocks of 4): a request needs prompt + max_new_tokens + 4 x draft_len + 1
    = 13 tokens of headroom (derived from the admission rule, not read from the code)."""
    engine, target, cache = build(max_seq_len=32)
    prompts = [[1] * 32, [2] * 3, [3] * 18]  # 32 + 2 + 13 = 47 > 32; 3 + 2 + 13 = 18 fits; 18 + 2 + 13 = 33
    result = engine.generate(prompts, max_new_tokens=2)
    assert result.outputs[1] == target.greedy([2] * 3, 2) and result.errors[1] is None
    assert result.outputs[0] == [] and result.outputs[2] == []
    assert "draft headroom 13 = 47 tokens" in result.errors[0] and "32 tokens" in result.errors[0]
    assert "request 2" in result.errors[2] and "= 33 tokens" in result.errors[2]
    assert "max_seq_len" in result.errors[0]
    assert cache.num_free_blocks == cache.num_blocks and engine.scheduler.admitted_blocks == 0


def test_the_engine_is_still_usable_after_every_fault_in_a_row(monkeypatch):
    """One engine through several different faults back to back, then a clean run."""
    engine, target, cache = build(overlap=True)
    for site, n in SITES:
        inject(engine, target, site, n, monkeypatch)
        with pytest.raises(Injected):
            engine.generate(PROMPTS, max_new_tokens=NEW)
        monkeypatch.undo()
        assert cache.num_free_blocks == cache.num_blocks, site
    assert_clean_and_reusable(engine, target, cache)
    assert torch.is_grad_enabled()  # the step loop's no_grad does not leak out of a failed call


def interrupt_inside_free(allocator, monkeypatch, at_push: int = 2) -> list:
    """Ctrl-C landing in the first `BlockAllocator.free` that gives back more than one page, as its
    ``at_push``-th page goes back (one page back, the others still held); returns [rid] once fired."""
    import heapq

    free, push = allocator.free, heapq.heappush
    fired: list = []
    inside = [0, None]  # pushes so far in the free running now, its request id

    def counting_push(heap, item):
        if inside[1] is not None and not fired:
            inside[0] += 1
            if inside[0] == at_push:
                fired.append(inside[1])
                raise KeyboardInterrupt
        return push(heap, item)

    def tracked_free(rid):
        inside[:] = [0, rid if len(allocator.pages(rid)) >= at_push else None]
        try:
            return free(rid)
        finally:
            inside[1] = None

    monkeypatch.setattr(heapq, "heappush", counting_push)
    monkeypatch.setattr(allocator, "free", tracked_free)
    return fired


def assert_every_page_held_once(cache):
    """An independent recount: once every request is gone, one request can take the whole cache, and
    gets each page exactly once (a page given back twice would be handed out twice)."""
    pages = cache.allocator.allocate("recount", cache.num_blocks * cache.block_size)
    cache.free("recount")
    assert sorted(pages) == list(range(cache.num_blocks))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_an_interrupt_part_way_through_giving_a_finished_requests_pages_back_loses_none(overlap, monkeypatch):
    """Ctrl-C inside `Engine.finish`'s page free, after one of the request's pages went back: the request
    was marked released before the free ran, so the clean-up skipped it and its id and the pages still
    listed stayed registered (the next call: "request 0 already exists"). The clean-up must finish the
    free, handing no page out twice."""
    engine, target, cache = build(overlap=overlap)
    fired = interrupt_inside_free(cache.allocator, monkeypatch)
    with pytest.raises(KeyboardInterrupt) as caught:
        engine.generate(PROMPTS, max_new_tokens=NEW)
    assert fired, "no free of two pages or more ran"
    assert_partial_result(caught.value, target)
    monkeypatch.undo()
    assert not cache.allocator.request_ids
    assert_every_page_held_once(cache)
    assert_clean_and_reusable(engine, target, cache)
