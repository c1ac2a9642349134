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


def test_max_blocks_per_seq_bounds_one_request_and_names_max_seq_len():
    sched = Scheduler(max_batch_size=4, max_tokens_per_step=16, draft_len=1, block_size=4, total_blocks=64,
                      max_blocks_per_seq=3)
    sched.check_fits(make(0, 4, max_new=3))  # 4 + 3 + 4 + 1 = 12 tokens: 3 blocks
    with pytest.raises(RequestError, match="max_seq_len allows one request only 3"):
        sched.check_fits(make(1, 4, max_new=4))  # 13 tokens: 4 blocks
