"""Continuous-batching policy: verify rows first, prompt chunks within the token budget, FIFO
admission under the KV budget."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.host.reference.request import Request, RequestError, RequestState
from m3_eagle_plugin.host.reference.scheduler import RowKind, Scheduler, kv_budget_tokens


def make(index, prompt_len, state=RequestState.WAITING, max_new=4):
    r = Request(index=index, prompt=list(range(1, prompt_len + 1)), max_new_tokens=max_new)
    r.state = state
    return r


def test_reference_example():
    sched = Scheduler(max_batch_size=3, max_tokens_per_step=10, draft_len=2, block_size=4, total_blocks=100)
    decoding = make(0, 3, RequestState.DECODE)
    decoding.kv_len = 5
    long_prompt, short_prompt = make(1, 9), make(2, 2)
    rows = sched.schedule([decoding, long_prompt, short_prompt])
    assert [(r.request.index, r.kind, r.start, r.length, r.final) for r in rows] == [
        (1, RowKind.CONTEXT, 0, 7, False), (0, RowKind.VERIFY, 5, 3, False)]
    long_prompt.num_prefilled = 7
    rows = sched.schedule([decoding, long_prompt, short_prompt])
    assert [(r.request.index, r.start, r.length, r.final) for r in rows] == [(1, 7, 2, True), (2, 0, 2, True), (0, 5, 3, False)]


def test_admission_waits_for_kv_budget_and_refuses_what_never_fits():
    need = -(-kv_budget_tokens(4, 4, 1) // 4)
    sched = Scheduler(max_batch_size=8, max_tokens_per_step=64, draft_len=1, block_size=4, total_blocks=need + 1)
    a, b = make(0, 4), make(1, 4)
    rows = sched.schedule([a, b])
    assert [r.request.index for r in rows] == [0] and b.state is RequestState.WAITING
    a.state = RequestState.FINISHED
    sched.release(a)
    assert [r.request.index for r in sched.schedule([a, b])] == [1]
    with pytest.raises(RequestError, match="KV blocks"):
        sched.check_fits(make(2, 400))


def test_requests_finishing_in_flight_are_not_rescheduled():
    sched = Scheduler(max_batch_size=4, max_tokens_per_step=16, draft_len=3, block_size=4, total_blocks=64)
    r = make(0, 3, RequestState.DECODE, max_new=2)
    r.output, r.inflight_steps = [5], 1
    assert sched.schedule([r]) == []


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="verify row"):
        Scheduler(max_batch_size=1, max_tokens_per_step=3, draft_len=3, block_size=4, total_blocks=8)
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler(max_batch_size=0, max_tokens_per_step=8, draft_len=1, block_size=4, total_blocks=8)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 20), st.booleans()), min_size=1, max_size=8),
       st.integers(1, 5), st.integers(0, 3), st.integers(4, 24))
def test_limits_hold_and_chunks_are_contiguous(specs, batch, draft_len, budget):
    budget = max(budget, 1 + draft_len)
    sched = Scheduler(max_batch_size=batch, max_tokens_per_step=budget, draft_len=draft_len, block_size=4,
                      total_blocks=10_000)
    requests = [make(i, n, RequestState.DECODE if dec else RequestState.WAITING) for i, (n, dec) in enumerate(specs)]
    for _ in range(6):
        rows = sched.schedule(requests)
        assert len(rows) <= batch
        assert sum(r.length for r in rows) <= budget
        assert len({r.request.index for r in rows}) == len(rows)
        for row in rows:
            if row.kind is RowKind.CONTEXT:
                assert row.start == row.request.num_prefilled and row.length >= 1
                assert row.start + row.length <= len(row.request.prompt)
                assert row.final == (row.start + row.length == len(row.request.prompt))
                row.request.num_prefilled += row.length
                if row.final:
                    row.request.state = RequestState.DECODE
            else:
                assert row.length == 1 + draft_len


def _blocks(prompt_len, max_new, draft_len, block_size=4):
    """The module docstring's worst case, written out: prompt + new tokens + 4K + 1, in whole blocks."""
    return -(-(prompt_len + max_new + 4 * draft_len + 1) // block_size)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 20), st.sampled_from(["waiting", "decode", "finishing"])),
                min_size=1, max_size=8),
       st.integers(1, 5), st.integers(0, 3), st.integers(1, 6), st.integers(0, 3), st.integers(0, 8),
       st.integers(-1, 1))
def test_a_step_is_filled_as_far_as_the_limits_allow(specs, batch, draft_len, verify_rows, extra, fitting, slack):
    """The documented policy, as lower bounds: verify rows first (all the same size, so one left out
    means the batch or the budget holds no more verify rows, whatever the context rows take), then
    prompt chunks in order up to the budget (only a step's last chunk may be cut, and only because
    the budget is used up), and FIFO admission under the KV budget (stops at the first request
    whose worst case does not fit next to those admitted)."""
    verify_cost = 1 + draft_len
    budget = verify_rows * verify_cost + extra  # extra 0: verify rows can fill the budget exactly
    # A cache sized around the worst cases of the first `fitting` waiting requests, so exact fits
    # (slack 0) and one-block misses (slack -1) come up, not only roomy or hopeless caches.
    needs = [_blocks(n, 4, draft_len) for n, kind in specs if kind == "waiting"]
    total_blocks = max(1, sum(needs[:fitting]) + slack)
    sched = Scheduler(max_batch_size=batch, max_tokens_per_step=budget, draft_len=draft_len, block_size=4,
                      total_blocks=total_blocks)
    requests = []
    for i, (n, kind) in enumerate(specs):
        r = make(i, n, RequestState.WAITING if kind == "waiting" else RequestState.DECODE)
        if kind == "finishing":  # its last token is in flight: nothing left to schedule
            r.output, r.inflight_steps = [0] * (r.max_new_tokens - 1), 1
        requests.append(r)
    admitted, held = set(), 0
    for _ in range(8):
        waiting = [r for r in requests if r.state is RequestState.WAITING]
        rows = sched.schedule(requests)
        scheduled = {row.request.index for row in rows}
        verify = [row for row in rows if row.kind is RowKind.VERIFY]
        tokens = sum(row.length for row in rows)
        full = len(rows) == batch or tokens == budget
        newly = [r for r in waiting if r.state is not RequestState.WAITING]
        assert newly == waiting[: len(newly)]  # FIFO, no overtaking
        for r in newly:
            assert r.state is RequestState.PREFILL and r.index in scheduled
            admitted.add(r.index)
            held += _blocks(len(r.prompt), r.max_new_tokens, draft_len)
        assert held <= total_blocks
        if len(newly) < len(waiting):  # the first one left waiting did not fit, or the step was full
            first = waiting[len(newly)]
            assert full or held + _blocks(len(first.prompt), first.max_new_tokens, draft_len) > total_blocks
        for r in requests:
            if r.index in scheduled:
                continue
            if r.state is RequestState.DECODE and len(r.output) + r.inflight_steps < r.max_new_tokens:
                assert len(verify) == batch or (len(verify) + 1) * verify_cost > budget
            if r.state is RequestState.PREFILL:
                assert full
        for row in rows:
            if row.kind is RowKind.CONTEXT:
                if not row.final:
                    assert tokens == budget
                row.request.num_prefilled += row.length
                if row.final:
                    row.request.state = RequestState.DECODE
            else:
                assert row.request.inflight_steps == 0
                row.request.state = RequestState.FINISHED  # one verify step each, so blocks come back
                sched.release(row.request)
                if row.request.index in admitted:
                    held -= _blocks(len(row.request.prompt), row.request.max_new_tokens, draft_len)


@pytest.mark.parametrize("draft_len", [0, 2, 3])
def test_verify_rows_that_exactly_fill_the_token_budget_are_all_scheduled(draft_len):
    cost = 1 + draft_len
    sched = Scheduler(max_batch_size=8, max_tokens_per_step=3 * cost, draft_len=draft_len, block_size=4,
                      total_blocks=64)
    decoding = [make(i, 3, RequestState.DECODE) for i in range(4)]
    rows = sched.schedule(decoding)
    assert [(r.request.index, r.kind, r.length) for r in rows] == [(i, RowKind.VERIFY, cost) for i in range(3)]
    one_short = Scheduler(max_batch_size=8, max_tokens_per_step=3 * cost - 1, draft_len=draft_len, block_size=4,
                          total_blocks=64)
    assert [r.request.index for r in one_short.schedule(decoding)] == [0, 1]


def test_admission_takes_a_request_whose_worst_case_exactly_fills_the_cache():
    need = _blocks(4, 4, 1)  # 4 + 4 + 4 + 1 = 13 tokens: 4 blocks of 4
    assert need == 4
    alone = Scheduler(max_batch_size=8, max_tokens_per_step=64, draft_len=1, block_size=4, total_blocks=need)
    a = make(0, 4)
    assert [r.request.index for r in alone.schedule([a])] == [0] and a.state is RequestState.PREFILL
    pair = Scheduler(max_batch_size=8, max_tokens_per_step=64, draft_len=1, block_size=4, total_blocks=2 * need)
    b, c, d = make(1, 4), make(2, 4), make(3, 4)
    assert [r.request.index for r in pair.schedule([b, c, d])] == [1, 2]
    assert d.state is RequestState.WAITING
    c.state = RequestState.FINISHED
    pair.release(c)
    assert [r.request.index for r in pair.schedule([b, c, d])] == [1, 3]


def test_max_blocks_per_seq_bounds_one_request_and_names_max_seq_len():
    sched = Scheduler(max_batch_size=4, max_tokens_per_step=16, draft_len=1, block_size=4, total_blocks=64,
                      max_blocks_per_seq=3)
    sched.check_fits(make(0, 4, max_new=3))  # 4 + 3 + 4 + 1 = 12 tokens: 3 blocks
    with pytest.raises(RequestError, match="max_seq_len allows one request only 3"):
        sched.check_fits(make(1, 4, max_new=4))  # 13 tokens: 4 blocks


def test_a_waiting_request_that_does_not_fit_blocks_the_ones_behind_it():
    """FIFO admission, no overtaking: a small request behind a big one that does not fit yet waits
    too, even though its own worst case would fit (hand sizes: 4 + 4 + 4 + 1 = 13 tokens is 4 blocks,
    20 + 4 + 4 + 1 = 29 tokens is 8 blocks; the cache holds 6)."""
    sched = Scheduler(max_batch_size=8, max_tokens_per_step=64, draft_len=1, block_size=4, total_blocks=6)
    big, small = make(0, 20), make(1, 4)
    assert _blocks(20, 4, 1) == 8 and _blocks(4, 4, 1) == 4
    assert sched.schedule([big, small]) == []
    assert big.state is RequestState.WAITING and small.state is RequestState.WAITING
    assert sched.admitted_blocks == 0


def test_release_is_idempotent():
    """Releasing an ended request twice gives its blocks back once: the second call must not let
    two more requests in than the cache holds (hand size: 13 tokens = 4 blocks, cache of 4)."""
    sched = Scheduler(max_batch_size=8, max_tokens_per_step=64, draft_len=1, block_size=4, total_blocks=4)
    a, b, c = make(0, 4), make(1, 4), make(2, 4)
    assert [r.request.index for r in sched.schedule([a])] == [0] and sched.admitted_blocks == 4
    a.state = RequestState.FINISHED
    sched.release(a)
    sched.release(a)
    assert sched.admitted_blocks == 0 and a.kv_budget_tokens == 0
    assert [r.request.index for r in sched.schedule([b, c])] == [1]
    assert c.state is RequestState.WAITING and sched.admitted_blocks == 4


def test_a_max_blocks_per_seq_above_the_cache_is_bounded_by_the_cache():
    """max_blocks_per_seq larger than the cache does not let a request through `check_fits` that
    the cache could never hold (it would wait forever): 4 + 4 + 4 + 1 = 13 tokens need 4 blocks."""
    sched = Scheduler(max_batch_size=4, max_tokens_per_step=16, draft_len=1, block_size=4, total_blocks=3,
                      max_blocks_per_seq=100)
    assert sched.max_blocks_per_seq == 3
    sched.check_fits(make(0, 4, max_new=3))  # 12 tokens: 3 blocks, exactly the cache
    with pytest.raises(RequestError, match="the cache has only 3 blocks"):
        sched.check_fits(make(1, 4, max_new=4))


@pytest.mark.parametrize("call", [1, 2, 3])
def test_an_admission_cut_off_as_a_call_returns_leaves_the_budget_consistent(monkeypatch, call):
    """CPython raises a pending Ctrl-C as a call returns: admit added the request's blocks, then was
    cut off computing its budget tokens, so release() (which goes by them) never gave the blocks back."""
    from m3_eagle_plugin.host.reference import scheduler as module

    sched = Scheduler(max_batch_size=8, max_tokens_per_step=64, draft_len=1, block_size=4, total_blocks=100)
    request, calls = make(0, 4), []

    def cut(*args):
        calls.append(1)
        out = kv_budget_tokens(*args)
        if len(calls) == call:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(module, "kv_budget_tokens", cut)
    with pytest.raises(KeyboardInterrupt):
        sched.admit(request)
    monkeypatch.undo()
    held = sched.blocks_needed(request) if request.kv_budget_tokens else 0
    assert sched.admitted_blocks == held  # what release() gives back is what admit took
    sched.release(request)
    assert sched.admitted_blocks == 0 and request.kv_budget_tokens == 0
