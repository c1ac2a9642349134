"""SpecStats: the definitions of its docstring, computed by hand, and what a request stopping inside an
accepted run does to them (the drafter is measured as the verifier judged it; only kept tokens count as
generated)."""
from __future__ import annotations

import pytest

from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.proposers import ReplayProposer
from m3_eagle_plugin.host.reference.stats import SpecStats

from . import _fakes


def test_definitions_by_hand():
    stats = SpecStats(draft_len=3)
    for drafts, accepted in ((3, 3), (3, 0), (2, 1), (0, 0)):
        stats.record_verify(drafts, accepted)
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (4, 8, 4)
    assert stats.acceptance_rate == 4 / 8
    assert stats.mean_acceptance_length == (4 + 4) / 4
    # proposed: positions 0, 1 by three steps, position 2 by the two 3-draft steps;
    # accepted: position 0 by the (3, 3) and (2, 1) steps, positions 1 and 2 by the (3, 3) step only
    assert stats.proposed_at == [3, 3, 2] and stats.accepted_at == [2, 1, 1]
    assert stats.per_position_acceptance == [2 / 3, 1 / 3, 1 / 2]
    assert SpecStats(draft_len=3).as_dict()["mean_acceptance_length"] is None  # no verify step: nothing measured


def test_a_position_no_step_proposed_has_no_acceptance_rather_than_a_measured_zero():
    """Prompt lookup drafts fewer than draft_len where its n-gram runs out: position 2 was never
    proposed, position 1 was proposed and never accepted."""
    from m3_eagle_plugin.host.reference.cli import _report_text
    import io

    stats = SpecStats(draft_len=3)
    stats.record_verify(2, 1)
    stats.record_verify(1, 0)
    assert stats.per_position_acceptance == [1 / 2, 0.0, None]
    out = io.StringIO()
    report = {"outputs": [], "errors": [], "draft_len": 3, "draft_source": "proposer", "overlap": False,
              "forced_acceptance": None, **stats.as_dict()}
    _report_text(report, out)
    assert "per_position_acceptance=0.500,0.000,-\n" in out.getvalue()


@pytest.mark.parametrize("drafts,accepted,draft_len", [(1, 0, 0), (4, 4, 3), (2, 3, 3), (-1, 0, 3), (2, -1, 3)])
def test_an_impossible_verify_step_is_refused_and_not_counted(drafts, accepted, draft_len):
    stats = SpecStats(draft_len=draft_len)
    with pytest.raises(ValueError, match="num_drafts"):
        stats.record_verify(drafts, accepted)
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (0, 0, 0)


@pytest.mark.parametrize("stop", ["eos", "length"])
def test_a_request_stopping_inside_an_accepted_run(stop):
    """Prompt -> first token; one verify step whose 3 correct drafts are all accepted, but the request
    stops after the second new token of that step."""
    prompt = [4, 5, 6, 7]
    target = _fakes.FakeTarget()
    ref = target.greedy(prompt, 8)
    assert ref[2] not in ref[:2]
    eos = (ref[2],) if stop == "eos" else ()
    max_new = 10 if stop == "eos" else 3
    proposer = ReplayProposer({0: prompt + ref}, _fakes.VOCAB)
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=3, max_batch_size=1, max_tokens_per_step=8,
                                                              eos_ids=eos),
                    vocab_size=_fakes.VOCAB, proposer=proposer)
    result = engine.generate([prompt], max_new_tokens=max_new)
    assert result.outputs == [ref[:3]] and result.stop_reasons == [stop]
    stats = result.stats
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (1, 3, 3)
    assert stats.mean_acceptance_length == 4.0 and stats.acceptance_rate == 1.0
    assert stats.generated_tokens == 3  # the first token + the 2 kept of that step's 4


def test_tokens_per_s_is_generated_tokens_over_elapsed_seconds():
    """Throughput by hand: kept (generated) tokens per elapsed second; no time measured -> 0."""
    assert SpecStats(generated_tokens=30, elapsed_s=2.0).tokens_per_s == 15.0
    assert SpecStats(generated_tokens=7, elapsed_s=0.5).as_dict()["tokens_per_s"] == 14.0
    assert SpecStats(generated_tokens=30, elapsed_s=0.0).tokens_per_s == 0.0


def test_short_proposals_count_only_the_drafts_proposed():
    """A proposer that drafts 1 correct token per step at K = 3: each verify step proposed one draft
    (position 0 only) and the verifier accepts it, so every step emits 2 tokens. Counted by hand:
    1 first token + 2 per verify step up to 9 new tokens -> 4 verify steps, 4 drafts, 4 accepted."""
    prompt = [4, 5, 6, 7]
    target = _fakes.FakeTarget()
    ref = target.greedy(prompt, 20)
    full = prompt + ref
    proposer = lambda ctx: [[full[len(tokens)]] for tokens in ctx.tokens]  # noqa: E731
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=3, max_batch_size=1, max_tokens_per_step=8),
                    vocab_size=_fakes.VOCAB, proposer=proposer)
    result = engine.generate([prompt], max_new_tokens=9)
    assert result.outputs == [ref[:9]]
    stats = result.stats
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (4, 4, 4)
    assert stats.proposed_at == [4, 0, 0] and stats.accepted_at == [4, 0, 0]
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 2.0


def test_a_run_without_verify_steps_reports_every_position_as_unmeasured():
    """Every request ended on its first token: no verify step proposed any position, so each of the
    draft_len entries is None (the list was empty, one entry per position short)."""
    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=3), vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    result = engine.generate([[1, 2], [3]], max_new_tokens=1)
    assert result.outputs == [target.greedy([1, 2], 1), target.greedy([3], 1)]
    assert result.stats.verify_steps == 0
    assert result.as_dict()["per_position_acceptance"] == [None, None, None]


def test_a_request_failed_by_an_error_takes_its_tokens_out_of_generated_tokens():
    """One batch slot: request 0 runs to its end (3 tokens), then request 1 emits 2 tokens and the
    proposer raises. The partial result returns request 0's 3 tokens and none of request 1's, so
    generated_tokens (and tokens_per_s) count those 3, as the outputs do."""
    prompts = [[4, 5, 6, 7], [1, 2]]
    target = _fakes.FakeTarget()

    def proposer(ctx):  # no drafts: each step emits one token
        if list(ctx.request_ids) == [1] and len(ctx.tokens[0]) == len(prompts[1]) + 2:
            raise RuntimeError("injected proposer fault")
        return [[] for _ in ctx.tokens]

    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=3, max_batch_size=1, max_tokens_per_step=8),
                    vocab_size=_fakes.VOCAB, proposer=proposer)
    with pytest.raises(RuntimeError, match="injected proposer fault") as caught:
        engine.generate(prompts, max_new_tokens=3)
    partial = caught.value.partial_result
    assert partial.outputs == [target.greedy(prompts[0], 3), []]
    assert partial.stats.generated_tokens == 3
    assert partial.stats.tokens_per_s == 3 / partial.stats.elapsed_s


def test_a_request_counted_in_an_earlier_call_takes_nothing_from_this_calls_generated_tokens():
    """A context-phase request (its first token counted in the engine's statistics then) is stopped
    after a `generate` restarted them: that call's generated_tokens stay its own outputs' tokens."""
    from m3_eagle_plugin.parallel.disagg import run_context_phase

    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=0), vocab_size=_fakes.VOCAB)
    [waiting] = run_context_phase(engine, [[4, 5, 6, 7]], max_new_tokens=5, first_index=1)
    assert engine.stats.generated_tokens == 1
    result = engine.generate([[1, 2]], max_new_tokens=4)
    assert result.outputs == [target.greedy([1, 2], 4)]
    engine.stop_unfinished([waiting])
    assert engine.stats.generated_tokens == 4


def _text_report(result) -> str:
    from m3_eagle_plugin.host.reference.cli import _report_text
    import io

    out = io.StringIO()
    _report_text(result.as_dict(), out)
    return out.getvalue()


def test_a_run_without_verify_steps_reports_its_acceptance_as_unmeasured():
    """Every request ended on its first token: no draft was verified and no verify step ran, so
    neither the acceptance rate nor the acceptance length was measured (JSON null, text "-"), as
    for the per-position rates: a measured 0 would say every draft was rejected."""
    import json

    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=3), vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    result = engine.generate([[1, 2], [3]], max_new_tokens=1)
    assert (result.stats.verify_steps, result.stats.draft_tokens) == (0, 0)
    report = json.loads(json.dumps(result.as_dict()))
    assert report["acceptance_rate"] is None and report["mean_acceptance_length"] is None
    text = _text_report(result)
    assert " acceptance_rate=- mean_acceptance_length=- " in text
    assert "per_position_acceptance=-,-,-\n" in text


def test_a_run_where_nothing_drafts_has_no_acceptance_rate_but_one_token_per_verify_step():
    """No head, proposer or drafter plugin: each of the 4 verify steps (after the first token)
    verified no draft and emitted one token, so the acceptance length is measured (1.0) and the
    acceptance rate is not."""
    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=3), vocab_size=_fakes.VOCAB)
    result = engine.generate([[1, 2]], max_new_tokens=5)
    assert result.outputs == [target.greedy([1, 2], 5)]
    assert (result.stats.verify_steps, result.stats.draft_tokens) == (4, 0)
    assert result.stats.acceptance_rate is None and result.stats.mean_acceptance_length == 1.0
    assert " acceptance_rate=- mean_acceptance_length=1.000 " in _text_report(result)
