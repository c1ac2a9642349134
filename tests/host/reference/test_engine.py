"""Engine end to end on the fake hash model: continuous batching, chunked prefill, Eagle3 drafting,
overlap, rollback, error isolation. Expected outputs come from the fake's naive greedy loop and
the expected acceptance from an independent simulation of the head's known error pattern."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.scheduler import RowKind

from . import _fakes

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4], [7], [2, 2, 2, 2, 2, 2]]


def build(draft_len=3, head=True, overlap=False, num_blocks=64, proposer=None, **config):
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(num_blocks)
    kwargs = dict(draft_len=draft_len, max_batch_size=3, max_tokens_per_step=7, overlap=overlap)
    kwargs.update(config)
    engine = Engine(
        target, cache, EngineConfig(**kwargs), vocab_size=_fakes.VOCAB,
        head=_fakes.FakeHead(target.table) if head else None,
        capture=_fakes.fake_capture() if head else None, proposer=proposer,
    )
    return engine, target, cache


def test_target_only_matches_naive_greedy():
    engine, target, cache = build(head=False)
    result = engine.generate(PROMPTS, max_new_tokens=6)
    assert result.outputs == [target.greedy(p, 6) for p in PROMPTS]
    assert result.stats.draft_tokens == 0
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_eagle3_greedy_equals_target_and_accepts_the_known_pattern(draft_len, overlap):
    engine, target, cache = build(draft_len=draft_len, overlap=overlap, max_tokens_per_step=2 * (draft_len + 1))
    num_new = 9
    result = engine.generate(PROMPTS, max_new_tokens=num_new)
    refs = [target.greedy(p, num_new + draft_len + 2) for p in PROMPTS]
    assert result.outputs == [r[:num_new] for r in refs]
    steps = accepted = 0
    for prompt, ref in zip(PROMPTS, refs):
        s, a = _fakes.expected_accepted(prompt, ref, num_new, draft_len)
        steps, accepted = steps + s, accepted + a
    assert result.stats.verify_steps == steps
    assert result.stats.accepted_tokens == accepted
    assert result.stats.draft_tokens == steps * draft_len
    assert 0 < result.stats.acceptance_rate < 1
    assert cache.num_free_blocks == cache.num_blocks
    assert result.overlap is overlap


def test_overlap_runs_ahead_and_matches_plain():
    plain, _, _ = build(draft_len=3)
    ahead, _, _ = build(draft_len=3, overlap=True)
    a = plain.generate(PROMPTS, max_new_tokens=7)
    b = ahead.generate(PROMPTS, max_new_tokens=7)
    assert a.outputs == b.outputs
    assert a.stats.accepted_tokens == b.stats.accepted_tokens


def _record_launch_commit_order(engine):
    """Wrap the engine's launch and commit so each call is logged as ("launch"|"commit", step_id)."""
    events = []
    launch, commit = engine.launch, engine.commit

    def logged_launch(rows, step_id):
        events.append(("launch", step_id))
        return launch(rows, step_id)

    def logged_commit(out, requests, progress):
        events.append(("commit", out.step_id))
        return commit(out, requests, progress)

    engine.launch, engine.commit = logged_launch, logged_commit
    return events


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_launches_the_next_step_before_committing_this_one(overlap):
    """Overlap means step N+1 is launched while step N is uncommitted; the plain loop commits N first."""
    engine, target, cache = build(draft_len=3, overlap=overlap)
    events = _record_launch_commit_order(engine)
    result = engine.generate(PROMPTS, max_new_tokens=7)
    assert result.outputs == [target.greedy(p, 7) for p in PROMPTS]
    launched = [s for kind, s in events if kind == "launch"]
    assert len(launched) >= 5 and launched == sorted(launched)
    assert sorted(s for kind, s in events if kind == "commit") == launched  # each step committed once
    where = {event: i for i, event in enumerate(events)}
    for previous, following in zip(launched, launched[1:]):
        if overlap:
            assert where[("launch", following)] < where[("commit", previous)]
        else:
            assert where[("commit", previous)] < where[("launch", following)]


def _accepted_per_verify_step(prompt, continuation, num_new, draft_len):
    """[(outputs before the step, drafts accepted)] per verify step of one request, simulated from
    FakeHead's known error pattern (the same walk as `_fakes.expected_accepted`)."""
    seq = list(prompt) + list(continuation)
    position, emitted, steps = len(prompt), 1, []
    while emitted < num_new:
        a = 0
        while a < draft_len and _fakes.head_is_right(seq, position + a):
            a += 1
        steps.append((emitted, a))
        emitted, position = emitted + a + 1, position + a + 1
    return steps


def test_overlap_corrects_the_optimistic_kv_lengths_on_the_device_and_matches_greedy():
    """One request, so every verify step is launched while the previous one is in flight, staged as
    if all K drafts were accepted. The device correction must run for each such step and bring the
    row's kv length to prompt + outputs so far + K (its K + 1 inputs end there)."""
    prompt, k, num_new = PROMPTS[1], 3, 12
    engine, target, cache = build(draft_len=k, overlap=True)
    corrections = []
    update = engine.runner.meta.on_update_kv_lens

    def spy(kv_lens=None):
        corrections.append(None if kv_lens is None else kv_lens.tolist())
        return update(kv_lens)

    engine.runner.meta.on_update_kv_lens = spy
    result = engine.generate([prompt], max_new_tokens=num_new)
    assert result.outputs == [target.greedy(prompt, num_new)]
    steps = _accepted_per_verify_step(prompt, target.greedy(prompt, num_new + k + 2), num_new, k)
    assert steps[-1][0] + 1 >= num_new  # no void step runs ahead past the last one needed
    assert any(a < k for _, a in steps[:-1])  # some correction really shrinks the optimistic length
    # The first verify step follows a (committed-length) prompt chunk: nothing to correct there.
    assert corrections == [[len(prompt) + emitted + k] for emitted, _ in steps[1:]]
    assert result.stats.verify_steps == len(steps)
    assert result.stats.accepted_tokens == sum(a for _, a in steps)
    assert cache.num_free_blocks == cache.num_blocks


def test_eos_stops_a_request_and_is_kept():
    ref = _fakes.FakeTarget().greedy(PROMPTS[1], 8)
    eos = ref[3]
    engine, target, cache = build(draft_len=2, eos_ids=(eos,))
    result = engine.generate([PROMPTS[1]], max_new_tokens=8)
    assert result.outputs[0] == ref[: ref.index(eos) + 1]
    assert result.stop_reasons[0] == "eos"
    assert cache.num_free_blocks == cache.num_blocks


def test_bad_requests_fail_alone_without_leaks():
    engine, target, cache = build(draft_len=2, num_blocks=16)
    prompts = [[1, 2], [1, 99], [], list(range(1, 11)) * 6, [3, 4, 5]]
    result = engine.generate(prompts, max_new_tokens=4)
    assert result.outputs[0] == target.greedy([1, 2], 4)
    assert result.outputs[4] == target.greedy([3, 4, 5], 4)
    assert "99" in result.errors[1] and "[0, 11)" in result.errors[1]
    assert "empty" in result.errors[2]
    assert "KV blocks" in result.errors[3]
    assert result.outputs[1] == result.outputs[2] == result.outputs[3] == []
    assert result.errors[0] is None and result.errors[4] is None
    assert cache.num_free_blocks == cache.num_blocks


def test_prompts_of_numpy_and_torch_integers_run_like_lists_and_floats_still_fail():
    """Token ids from `list(array)`, a 1-D tensor or a 1-D array are integers: they run as the lists
    would; a float id (2.0 would quietly become 2), a 2-D tensor or a bool still fail their request."""
    import numpy as np
    import torch

    engine, target, cache = build(draft_len=2)
    prompts = [list(np.array([1, 2, 3])), torch.tensor([4, 5, 6]), np.array([7, 1], dtype=np.int32),
               [torch.tensor(2), 3], [1, 2.0], torch.tensor([[1, 2]]), [True, 2]]
    result = engine.generate(prompts, max_new_tokens=4)
    assert result.outputs[:4] == [target.greedy(p, 4) for p in ([1, 2, 3], [4, 5, 6], [7, 1], [2, 3])]
    assert result.errors[:4] == [None] * 4
    assert "2.0" in result.errors[4] and "must be ints" in result.errors[4]
    assert "prompt must be a list" in result.errors[5] and "True" in result.errors[6]
    assert result.outputs[4:] == [[], [], []]
    assert cache.num_free_blocks == cache.num_blocks


def test_requests_wait_for_kv_budget_and_all_complete():
    engine, target, cache = build(draft_len=2, num_blocks=12, max_batch_size=4)
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    result = engine.generate(prompts, max_new_tokens=5)
    assert result.outputs == [target.greedy(p, 5) for p in prompts]
    assert cache.num_free_blocks == cache.num_blocks


def test_force_accepted_takes_drafts_regardless():
    engine, target, cache = build(draft_len=3, force_accepted=2)
    result = engine.generate(PROMPTS[:2], max_new_tokens=7)
    assert result.forced_acceptance == 2
    assert result.stats.accepted_tokens == 2 * result.stats.verify_steps
    assert result.as_dict()["forced_acceptance"] == 2
    assert cache.num_free_blocks == cache.num_blocks


def test_cuda_graphs_refused_on_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        build(cuda_graphs=True)


def test_cuda_graphs_with_a_proposer_but_no_head_are_refused_before_the_cache_is_read():
    """The graphs capture the Eagle3 head's step: a proposer's K >= 1 does not stand in for the head.
    The device is named only (nothing touches a GPU): the refusal comes before the cache is read."""
    from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

    with pytest.raises(ValueError, match="need a draft head"):
        Engine(None, None, EngineConfig(draft_len=2, cuda_graphs=True), vocab_size=_fakes.VOCAB,
               proposer=PromptLookupProposer(), device="cuda")


def test_statistics_are_per_generate_call():
    engine, target, cache = build(draft_len=2)
    first = engine.generate(PROMPTS[:1], max_new_tokens=5).stats.as_dict()
    second = engine.generate(PROMPTS[:1], max_new_tokens=5).stats.as_dict()
    for key in ("draft_tokens", "accepted_tokens", "verify_steps", "generated_tokens"):
        assert first[key] == second[key]
    assert second["generated_tokens"] == 5


def test_max_seq_len_bounds_the_table_width_and_refuses_longer_requests_alone():
    from m3_eagle_plugin.host.reference.scheduler import kv_budget_tokens

    fits = kv_budget_tokens(len(PROMPTS[1]), 6, 3)  # the longest prompt of the set
    engine, target, cache = build(max_seq_len=fits)
    assert engine.runner.config.max_blocks_per_seq == -(-fits // cache.block_size) < cache.num_blocks
    result = engine.generate(PROMPTS + [PROMPTS[1] * 2], max_new_tokens=6)
    assert result.outputs[:4] == [target.greedy(p, 6) for p in PROMPTS]
    assert result.outputs[4] == [] and "max_seq_len" in result.errors[4]
    assert cache.num_free_blocks == cache.num_blocks
    with pytest.raises(ValueError, match="max_seq_len"):
        EngineConfig(max_seq_len=0)


@pytest.mark.parametrize("max_new_tokens", [2.5, True, "3", None])
def test_a_non_integer_max_new_tokens_fails_the_requests_instead_of_running(max_new_tokens):
    engine, target, cache = build(draft_len=2)
    result = engine.generate(PROMPTS[:2], max_new_tokens=max_new_tokens)
    assert result.outputs == [[], []]
    assert all("max_new_tokens" in error for error in result.errors)
    assert cache.num_free_blocks == cache.num_blocks
    assert engine.generate(PROMPTS[:2], max_new_tokens=3).outputs == [target.greedy(p, 3) for p in PROMPTS[:2]]


def test_a_numpy_max_new_tokens_counts_as_the_int_it_is():
    """Token ids from an array are taken (numpy ints), and so is a count read from one."""
    import numpy as np

    engine, target, _ = build(draft_len=2)
    result = engine.generate(PROMPTS[:2], max_new_tokens=np.int64(3))
    assert result.errors == [None, None] and result.outputs == [target.greedy(p, 3) for p in PROMPTS[:2]]


def test_fractional_forced_acceptance_restarts_its_schedule_every_generate_call():
    """2.5 forces 2, 3, 2, ... from the first verify step of each call: n steps accept floor(2.5 n)."""
    engine, target, cache = build(draft_len=3, force_accepted=2.5)
    for _ in range(3):
        stats = engine.generate(PROMPTS[:1], max_new_tokens=4).stats  # one verify step: forces 2
        assert stats.verify_steps == 1
        assert stats.accepted_tokens == 2


def test_a_force_accepted_below_the_schedules_resolution_is_refused_by_the_config():
    """1e-7 would round to "never force a draft" (the schedule counts in millionths): refused when
    configured, not at the first verify step; a millionth itself is 1/10**6 and runs."""
    with pytest.raises(ValueError, match="force_accepted.*resolution"):
        EngineConfig(draft_len=3, force_accepted=1e-7)
    engine, target, cache = build(draft_len=3, force_accepted=1e-6)
    stats = engine.generate(PROMPTS[:1], max_new_tokens=4).stats
    assert stats.accepted_tokens == 0  # floor(n / 10**6) = 0 for the first n < 10**6 verify steps


def test_step_metadata_bytes_is_what_the_runner_allocates():
    """The up-front memory estimate against the metadata a runner actually holds (step + draft steps)."""
    from m3_eagle_plugin.host.reference.runner import step_metadata_bytes

    for head in (True, False):
        engine, target, cache = build(draft_len=3, head=head)
        metas = [engine.runner.meta, *engine.runner.draft_metas]
        assert len(metas) == (3 if head else 1)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for meta in metas for t in vars(meta).values() if isinstance(t, torch.Tensor)}
        assert step_metadata_bytes(engine.runner.config, has_head=head) == sum(storages.values())


def test_the_step_metadata_knows_the_cache_size():
    """The runner's metadata refuses a block table pointing past the cache (its pages come from the cache)."""
    from m3_eagle_plugin.msa import MsaInputError

    engine, target, cache = build(draft_len=2, head=True)
    for meta in (engine.runner.meta, *engine.runner.draft_metas):
        assert meta.num_pages == cache.num_blocks
        with pytest.raises(MsaInputError, match=f"past the cache's {cache.num_blocks} pages"):
            meta.prepare([1], [1], torch.tensor([[cache.num_blocks]], dtype=torch.int32))


@pytest.mark.parametrize("field,value", [
    ("draft_len", True), ("draft_len", 2.0), ("draft_len", "3"), ("draft_len", -1),
    ("max_seq_len", 64.0), ("max_seq_len", True), ("max_seq_len", "64"),
    ("eos_ids", 5), ("eos_ids", "5"), ("eos_ids", (5.0,)), ("eos_ids", (True,)), ("eos_ids", (-1,)),
    ("max_batch_size", 2.5), ("max_batch_size", True), ("max_batch_size", 0),
    ("max_tokens_per_step", "8"), ("max_tokens_per_step", 7.5),
    ("force_accepted", True), ("force_accepted", "2"), ("force_accepted", -1), ("force_accepted", float("nan")),
    ("overlap", "yes"), ("cuda_graphs", 1), ("sampling", None),
])
def test_engine_config_refuses_a_mistyped_field_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_steps_count_the_steps_run(overlap):
    """Target only, one prompt that fits one step: each step emits exactly one token, so 5 new
    tokens take 5 steps, overlapped or not (the overlapped loop's last pass launches nothing)."""
    engine, target, cache = build(head=False, overlap=overlap)
    result = engine.generate([PROMPTS[0]], max_new_tokens=5)
    assert result.outputs == [target.greedy(PROMPTS[0], 5)]
    assert result.stats.engine_steps == 5


@pytest.mark.parametrize("answer", [None, 5])
def test_a_proposal_that_is_not_a_list_of_ids_is_refused_naming_the_request(answer):
    engine, target, cache = build(head=False, proposer=lambda context: [answer for _ in context.tokens])
    with pytest.raises(ValueError, match="drafts for request 0: expected a list of token ids"):
        engine.generate(PROMPTS[:1], max_new_tokens=4)
    assert cache.num_free_blocks == cache.num_blocks



def test_proposals_as_any_iterable_run_as_their_list_and_a_non_iterable_answer_is_named():
    """`DrafterPlugin` takes a proposer's answer as any iterable; an explicit proposer's generator was a
    TypeError from len() naming nothing, and so was an answer that is no sequence at all."""
    from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

    lookup, prompts = PromptLookupProposer(), [[1, 2, 1, 2, 1], [3, 4, 3, 4]]
    runs = []
    for answer in (list, iter, lambda proposals: (p for p in proposals)):
        engine, target, cache = build(head=False, proposer=lambda context, answer=answer: answer(lookup(context)))
        result = engine.generate(prompts, max_new_tokens=6)
        assert result.outputs == [target.greedy(p, 6) for p in prompts]
        assert cache.num_free_blocks == cache.num_blocks
        runs.append((result.stats.draft_tokens, result.stats.accepted_tokens))
    assert runs[0][0] > 0 and runs[1] == runs[2] == runs[0]
    engine, target, cache = build(head=False, proposer=lambda context: 5)
    with pytest.raises(ValueError, match=r"^proposer drafts: expected one list of token ids per request, got 5($|\n)"):
        engine.generate(prompts, max_new_tokens=4)
    assert cache.num_free_blocks == cache.num_blocks


def test_an_eos_id_outside_the_vocabulary_is_refused_naming_it():
    """It could never match a generated token, so the requests it was meant to end would run to
    max_new_tokens with no word why."""
    with pytest.raises(ValueError, match=rf"eos_ids \[{_fakes.VOCAB}\] are outside the vocabulary \[0, {_fakes.VOCAB}\)"):
        build(eos_ids=(3, _fakes.VOCAB))
    build(eos_ids=(_fakes.VOCAB - 1,))  # the last id is a token


def test_engine_config_takes_eos_ids_as_a_list_and_stays_hashable():
    ref = _fakes.FakeTarget().greedy(PROMPTS[0], 6)
    assert ref[2] not in ref[:2]
    engine, target, cache = build(draft_len=2, eos_ids=[ref[2]])
    assert engine.config.eos_ids == (ref[2],) and hash(engine.config) is not None
    result = engine.generate(PROMPTS[:1], max_new_tokens=6)
    assert result.outputs == [ref[:3]] and result.stop_reasons == ["eos"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_readback_event_follows_the_copy_on_another_device():
    """With cuda:0 current, a cuda:1 step's readback copy runs on cuda:1's stream: its event must too."""
    from types import SimpleNamespace

    from m3_eagle_plugin.host.reference.engine import _finish_readback, _start_readback

    torch.cuda.set_device(0)
    out = SimpleNamespace(emitted=torch.tensor([[5, 6]], device="cuda:1"),
                          num_emitted=torch.tensor([2], device="cuda:1"),
                          num_accepted=torch.tensor([1], device="cuda:1"))
    # A first launch of a kernel may load its module, which waits for the device to idle (lazy
    # loading): one readback first, so the one below only queues work behind the sleep.
    _finish_readback(_start_readback(out), 2)
    with torch.cuda.device(1):
        torch.cuda._sleep(1 << 30)  # the copy queues behind this on cuda:1
    readback = _start_readback(out)
    assert not readback[1].query()  # recorded on idle cuda:0 it would read done at once
    assert _finish_readback(readback, 2) == ([[5, 6]], [2], [1])


def test_an_eos_as_the_first_generated_token_ends_the_request_there():
    prompt = PROMPTS[0]
    first = _fakes.FakeTarget().greedy(prompt, 1)[0]
    for head in (False, True):
        engine, target, cache = build(draft_len=2, head=head, eos_ids=(first,))
        result = engine.generate([prompt], max_new_tokens=8)
        assert result.outputs == [[first]] and result.stop_reasons == ["eos"]
        assert result.stats.generated_tokens == 1
        assert cache.num_free_blocks == cache.num_blocks


def test_token_ids_equal_to_the_vocabulary_size_are_outside_it():
    """Ids must lie in [0, vocab): the id vocab itself fails its request (prompt) or the step (draft)."""
    engine, target, cache = build(draft_len=2)
    result = engine.generate([[1, _fakes.VOCAB], [1, _fakes.VOCAB - 1]], max_new_tokens=3)
    assert result.outputs[0] == [] and f"[0, {_fakes.VOCAB})" in result.errors[0]
    assert result.outputs[1] == target.greedy([1, _fakes.VOCAB - 1], 3) and result.errors[1] is None
    outside = lambda ctx: [[_fakes.VOCAB] * 2 for _ in ctx.tokens]  # noqa: E731
    engine, target, cache = build(draft_len=2, head=False, proposer=outside)
    with pytest.raises(ValueError, match=rf"request 0: token ids must be ints in \[0, {_fakes.VOCAB}\)"):
        engine.generate([[1, 2]], max_new_tokens=4)
    assert cache.num_free_blocks == cache.num_blocks


def test_force_accepted_may_equal_the_draft_length():
    """Forcing every draft (mean == K) is within the schedule: each verify step accepts all 3."""
    engine, target, cache = build(draft_len=3, force_accepted=3)
    result = engine.generate(PROMPTS[:1], max_new_tokens=9)
    # 1 first token, then 4 per verify step: 1 + 4 + 4 = 9 -> 2 verify steps, 6 accepted
    assert (result.stats.verify_steps, result.stats.accepted_tokens) == (2, 6)
    assert len(result.outputs[0]) == 9
    with pytest.raises(ValueError, match="exceeds the draft length"):
        build(draft_len=2, force_accepted=3)
    with pytest.raises(ValueError, match="needs drafts, but nothing drafts here"):  # K=3 configured, no head
        build(draft_len=3, head=False, force_accepted=2)


def _accepted_per_request(engine):
    """Wrap the engine's commit: {request index: drafts accepted per live verify step, in order}."""
    accepted, commit = {}, engine.commit

    def recorded(out, requests, progress):
        for i, row in enumerate(out.rows):
            if row.kind is RowKind.VERIFY and not row.request.done:  # a void row's result is dropped
                accepted.setdefault(row.request.index, []).append(int(out.num_accepted[i]))
        return commit(out, requests, progress)

    engine.commit = recorded
    return accepted


def test_a_void_overlapped_step_leaves_the_fractional_forced_schedule_to_the_next_request():
    """Mean acceptance 3.5 at K = 3 (2.5 forced: 2, 3, 2, 3, ...), one row per step so each request
    runs after the one before: the overlapped loop launches a last verify step for a request that its
    in-flight step then finishes. That void step consumed a schedule entry, so every later request
    ran the schedule shifted by one (3, 2, ... where the plain loop gives 2, 3, ...)."""
    runs = {}
    for overlap in (False, True):
        engine, _, cache = build(draft_len=3, overlap=overlap, max_batch_size=1, force_accepted=2.5)
        accepted = _accepted_per_request(engine)
        result = engine.generate(PROMPTS[:3], max_new_tokens=6)
        assert cache.num_free_blocks == cache.num_blocks
        runs[overlap] = accepted, result.outputs, result.stats.accepted_tokens
    assert runs[False][0] == {0: [2, 3], 1: [2, 3], 2: [2, 3]}
    assert runs[True] == runs[False]


# ----- tests added from mutation testing of host/reference ------------------------------------


def test_a_max_new_tokens_of_zero_or_less_fails_the_requests():
    """At least one new token: a prefill alone already emits one, so 0 would still return a token."""
    engine, target, cache = build(draft_len=2)
    for count in (0, -1):
        result = engine.generate(PROMPTS[:2], max_new_tokens=count)
        assert result.outputs == [[], []]
        assert all("max_new_tokens" in error for error in result.errors)
        assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_after_each_commit_a_request_holds_only_the_kv_it_and_its_in_flight_step_use(overlap):
    """Counted by hand in tokens: a decoding request has every token but its last emitted one in the
    target's KV (prompt + outputs - 1). A verify step in flight writes its 1 + K inputs from the last
    emitted token's position on (prompt + outputs + K) and the head's K - 1 later draft steps one position
    each beyond that (prompt + outputs + 2K - 1): those pages must stay while it runs, nothing past them."""
    k = 3
    engine, target, cache = build(draft_len=k, overlap=overlap)
    commit, checked = engine.commit, []

    def checked_commit(out, requests, progress):
        commit(out, requests, progress)
        for row in out.rows:
            request = row.request
            if request.done or not request.output:
                continue
            used = len(request.prompt) + len(request.output) - 1
            if request.inflight_steps:
                assert overlap and request.inflight_steps == 1
                used += 1 + k + (k - 1)
            assert cache.num_tokens(request.rid) == used, (out.step_id, request.index)
            checked.append(bool(request.inflight_steps))

    engine.commit = checked_commit
    result = engine.generate(PROMPTS, max_new_tokens=9)
    assert result.outputs == [target.greedy(p, 9) for p in PROMPTS]
    assert len(checked) >= 8 and any(checked) is overlap
    assert cache.num_free_blocks == cache.num_blocks


def test_a_void_overlapped_row_beside_a_live_one_keeps_the_fractional_forced_schedule():
    """Two rows and 8 tokens per step, K = 3, 2.5 forced (2, 3, 2, 3, ... per verify step). Worked by hand
    for the plain loop: step 0 prefills [1, 2, 3] (first token) and 5 tokens of the 11-token prompt; step 1
    verifies request 0 (forces 2: 4 tokens) beside the next 4 prompt tokens; step 2 verifies request 0
    (forces 3: done at 6) beside the last 2 (first token of request 1); steps 3 and 4 verify request 1
    alone (2, then 3: done). The overlapped loop launches its step 3 with a void row of request 0 beside
    the live row of request 1: that step is not void, so its schedule entry stays taken and request 1
    still gets 2, then 3 (giving it back would force 2 twice)."""
    runs = {}
    for overlap in (False, True):
        engine, _, cache = build(draft_len=3, overlap=overlap, max_batch_size=2, max_tokens_per_step=8,
                                 force_accepted=2.5)
        accepted = _accepted_per_request(engine)
        result = engine.generate(PROMPTS[:2], max_new_tokens=6)
        assert cache.num_free_blocks == cache.num_blocks
        assert [len(o) for o in result.outputs] == [6, 6]
        runs[overlap] = accepted, result.outputs, result.stats.accepted_tokens
    assert runs[False][0] == {0: [2, 3], 1: [2, 3]}
    assert runs[True] == runs[False]


@pytest.mark.parametrize("head", [False, True])
def test_a_proposer_that_declines_leaves_the_head_drafts_or_none(head):
    """A proposer answering None proposes nothing: with the Eagle3 head its drafts stay (the head's known
    error pattern, simulated independently), without one no draft is counted (each verify step emits the
    target's one token, so 6 new tokens take 5 verify steps after the prefill's first token)."""
    asked = []
    engine, target, cache = build(draft_len=3, head=head, max_batch_size=1,
                                  proposer=lambda context: asked.append(context) or None)
    prompt, num_new = PROMPTS[1], 6
    result = engine.generate([prompt], max_new_tokens=num_new)
    assert result.outputs == [target.greedy(prompt, num_new)] and asked
    if head:
        steps, accepted = _fakes.expected_accepted(prompt, target.greedy(prompt, num_new + 5), num_new, 3)
        assert (result.stats.verify_steps, result.stats.draft_tokens, result.stats.accepted_tokens) == (
            steps, 3 * steps, accepted)
        assert result.draft_source == "proposer"
    else:
        assert (result.stats.verify_steps, result.stats.draft_tokens, result.stats.accepted_tokens) == (5, 0, 0)
    assert cache.num_free_blocks == cache.num_blocks


def test_a_proposal_longer_than_draft_len_is_cut_to_it():
    """The proposer returns the whole true continuation; only its first K = 2 are verified, all accepted:
    1 first token + 3 per verify step -> 7 new tokens take 2 verify steps, 4 drafts, 4 accepted."""
    prompt = PROMPTS[0]
    full = prompt + _fakes.FakeTarget().greedy(prompt, 20)
    proposer = lambda context: [full[len(tokens):] for tokens in context.tokens]  # noqa: E731
    engine, target, cache = build(draft_len=2, head=False, proposer=proposer)
    result = engine.generate([prompt], max_new_tokens=7)
    assert result.outputs == [full[len(prompt):][:7]]
    assert (result.stats.verify_steps, result.stats.draft_tokens, result.stats.accepted_tokens) == (2, 4, 4)
    assert cache.num_free_blocks == cache.num_blocks


def test_progress_counts_failed_requests_as_done_and_ends_at_the_total():
    """A request refused on arrival is over: a progress bar that left it out would never reach the end."""
    calls = []
    engine, target, cache = build(draft_len=2)
    result = engine.generate([PROMPTS[0], [], PROMPTS[2]], max_new_tokens=4,
                             progress=lambda done, total: calls.append((done, total)))
    assert result.errors[1] is not None and result.errors[0] is None and result.errors[2] is None
    assert calls[0][0] >= 1  # the failed request counts from the first call on
    assert calls[-1] == (3, 3)
    assert all(total == 3 for _, total in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)


@pytest.mark.parametrize("head", [False, True])
def test_an_eos_that_is_also_the_last_allowed_token_stops_for_eos(head):
    """Both stops fall on the same token: the request ended because it produced eos."""
    prompt = PROMPTS[3]
    ref = _fakes.FakeTarget().greedy(prompt, 8)
    eos = ref[3]
    assert eos not in ref[:3]
    engine, target, cache = build(draft_len=2, head=head, eos_ids=(eos,))
    result = engine.generate([prompt], max_new_tokens=4)
    assert result.outputs == [ref[:4]] and result.stop_reasons == ["eos"]
    result = engine.generate([prompt], max_new_tokens=3)
    assert result.outputs == [ref[:3]] and result.stop_reasons == ["length"]


def test_with_draft_len_zero_a_proposer_is_never_asked():
    """K = 0: there is nothing to propose, so the host proposer is not called every step."""
    def proposer(context):
        raise AssertionError(f"asked for {context.draft_len} drafts")

    engine, target, cache = build(draft_len=0, head=False, proposer=proposer)
    assert engine.k == 0
    result = engine.generate(PROMPTS[:2], max_new_tokens=4)
    assert result.outputs == [target.greedy(p, 4) for p in PROMPTS[:2]]
    assert result.stats.draft_tokens == 0


def test_a_step_is_staged_decode_only_exactly_when_it_has_no_prompt_chunk():
    """The step metadata's decode-only flag (what a backend's verify-only path keys on) follows the rows:
    a step of verify rows only is decode-only; one with any prompt chunk, final or not, is not."""
    engine, target, cache = build(draft_len=3, max_batch_size=2)
    launch, seen = engine.runner.launch, []

    def recorded(rows, step_id):
        out = launch(rows, step_id)
        seen.append((all(row.kind is RowKind.VERIFY for row in rows), engine.runner.meta.is_decode_only))
        return out

    engine.runner.launch = recorded
    result = engine.generate(PROMPTS, max_new_tokens=7)
    assert result.outputs == [target.greedy(p, 7) for p in PROMPTS]
    assert all(verify_only == flag for verify_only, flag in seen), seen
    assert {verify_only for verify_only, _ in seen} == {False, True}


def test_a_request_left_waiting_by_budget_held_outside_the_call_fails_naming_it():
    """A prefilled request awaiting export holds 9 of 12 blocks. A prompt needing 5 could never be
    admitted during `generate`, and held back (first come, first admitted) one needing 3 that fits:
    both failed as "engine stopped before the request finished". Now the first fails alone naming the
    held budget, the second runs, progress ends at the total, and the held request is untouched."""
    from m3_eagle_plugin.parallel.disagg import export_handoff, run_context_phase

    engine, target, cache = build(draft_len=1, num_blocks=12)
    held, = run_context_phase(engine, [[1, 2, 3, 4, 5, 6, 7, 8]], 20, first_index=100)
    pages = cache.pages(100)
    long, short = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2], [7]
    seen = []
    result = engine.generate([long, short], 3, progress=lambda done, total: seen.append((done, total)))
    assert result.outputs == [[], target.greedy(short, 3)] and result.stop_reasons == [None, "length"]
    assert "never admitted: it needs 5 KV blocks" in result.errors[0] and "9 of the cache's 12" in result.errors[0]
    assert result.errors[1] is None and seen[-1] == (2, 2)
    assert cache.pages(100) == pages and export_handoff(engine, held).kv_len == 8
    assert cache.num_free_blocks == cache.num_blocks and engine.scheduler.admitted_blocks == 0


def test_a_generate_result_keeps_its_statistics_when_a_disaggregation_phase_runs_after_it():
    """The context phase adds its steps and tokens to the engine's running statistics; a `generate`
    result held that very object, so its counts grew after it returned (3 steps and 6 tokens read 4 and 7)."""
    from m3_eagle_plugin.parallel.disagg import run_context_phase

    engine, target, cache = build(draft_len=2)
    result = engine.generate([[1, 2, 3]], 6)
    before = result.stats.as_dict()
    assert before["generated_tokens"] == 6
    run_context_phase(engine, [[4, 5, 6, 7]], 6, first_index=10)
    assert engine.stats.generated_tokens == 7  # the engine's own count did go on
    assert result.stats.as_dict() == before


def test_generate_over_an_id_a_context_phase_still_holds_is_refused_naming_the_holder():
    """`generate` numbers its requests from 0; a prefilled request 1 awaiting export holds that id.
    The call is refused (the allocator's bare "request 1 already exists" said nothing of why), the
    request built before it is given back, and the held one keeps its pages."""
    from m3_eagle_plugin.parallel.disagg import run_context_phase

    engine, target, cache = build(draft_len=1, num_blocks=24)
    run_context_phase(engine, [[1, 2, 3, 4, 5]], 8, first_index=1)
    pages = cache.pages(1)
    with pytest.raises(ValueError, match="request 1 already exists: a live request outside this call holds"):
        engine.generate([[3, 4], [5, 6]], 2)
    assert cache.allocator.request_ids == [1] and cache.pages(1) == pages
    assert engine.generate([[3, 4]], 2).outputs == [target.greedy([3, 4], 2)]


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_proposer_answering_for_more_or_fewer_requests_than_asked_is_refused(extra):
    """One list of drafts per request asked, as `DraftContext` numbers them: an answer with one list too
    many was cut to the requests (zip) without a word, so which list belongs to which request was a guess."""
    proposer = lambda context: [[1]] * (len(context.tokens) + extra)  # noqa: E731
    engine, target, cache = build(head=False, proposer=proposer)
    with pytest.raises(ValueError, match=r"proposer returned drafts for \d+ requests, expected \d+"):
        engine.generate(PROMPTS[:2], max_new_tokens=4)
    assert cache.num_free_blocks == cache.num_blocks


def test_without_a_head_a_step_reserves_no_draft_positions_ahead():
    """Counted by hand in tokens: a proposer's drafts come from the host, so nothing writes past a
    verify step's 1 + K inputs. While one is in flight a request holds its KV up to its last emitted
    token's position plus K (prompt + outputs + K), not the head's K - 1 draft positions beyond."""
    k = 3
    prompt = PROMPTS[1]
    full = prompt + _fakes.FakeTarget().greedy(prompt, 20)
    proposer = lambda context: [full[len(tokens):][:1] for tokens in context.tokens]  # noqa: E731
    engine, target, cache = build(draft_len=k, head=False, proposer=proposer)
    commit, checked = engine.commit, []

    def checked_commit(out, requests, progress):
        for row in out.rows:
            request = row.request
            if row.kind is RowKind.VERIFY:
                assert cache.num_tokens(request.rid) == len(request.prompt) + len(request.output) + k
            else:
                assert cache.num_tokens(request.rid) == row.start + row.length
            checked.append(row.kind)
        commit(out, requests, progress)

    engine.commit = checked_commit
    result = engine.generate([prompt], max_new_tokens=7)
    assert result.outputs == [full[len(prompt):][:7]]
    assert RowKind.VERIFY in checked and RowKind.CONTEXT in checked


@pytest.mark.parametrize("head, overlap", [(False, False), (True, False), (True, True)])
def test_generation_stops_at_the_targets_positions_and_a_prompt_filling_them_fails_alone(head, overlap):
    """max_position_embeddings 12: a prompt of L tokens gets at most 12 - L new ones (stop reason "length",
    as at max_new_tokens), one of 12 fails naming its length and the limit; the engine generated past them."""
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(64)
    engine = Engine(target, cache, EngineConfig(draft_len=3, max_batch_size=3, max_tokens_per_step=8, overlap=overlap),
                    vocab_size=_fakes.VOCAB, head=_fakes.FakeHead(target.table) if head else None,
                    capture=_fakes.fake_capture() if head else None, max_position_embeddings=12)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4], [7], [2] * 12, [2, 2, 2, 2, 2, 2]]
    result = engine.generate(prompts, max_new_tokens=9)
    new = [9, 1, 9, None, 6]  # min(9, 12 - L)
    assert result.outputs == [target.greedy(p, n) if n else [] for p, n in zip(prompts, new)]
    assert result.stop_reasons == ["length", "length", "length", None, "length"]
    assert result.errors[:3] == [None] * 3 and result.errors[4] is None
    assert result.errors[3] == ("request 3: prompt of 12 tokens leaves no room for a new token in the target's 12 "
                                "positions (max_position_embeddings)")
    assert result.stats.generated_tokens == 25
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("limit", [0, 2.5, "12"])
def test_a_bad_max_position_embeddings_is_refused_by_name(limit):
    target = _fakes.FakeTarget()
    with pytest.raises((ValueError, TypeError), match="max_position_embeddings"):
        Engine(target, _fakes.make_cache(8), EngineConfig(draft_len=0), vocab_size=_fakes.VOCAB,
               max_position_embeddings=limit)
