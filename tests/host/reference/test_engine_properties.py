"""The engine on random workloads against the fake target's plain greedy loop, one token at a time.

Per drafter (Eagle3 head, a host proposer, none; with or without overlap) each example draws K, the
step limits, prompt lengths on and around block multiples, max_new_tokens, an eos id taken from a
request's own greedy run (so it falls inside accepted drafts as often as anywhere), the target's
max_position_embeddings and a KV pool that may hold requests back. Speculative decoding must emit
exactly the greedy tokens, cut at min(max_new_tokens, max_position_embeddings - prompt) and at the first
eos id (kept); no step may exceed the batch or token limit; the statistics count only the tokens
returned, and the head's acceptance follows its known error pattern (`_fakes.expected_accepted`); every
page and admission block comes back.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.scheduler import kv_budget_tokens

from . import _fakes


def greedy_stopped(run: list[int], limit: int, eos: tuple[int, ...]) -> list[int]:
    for j, token in enumerate(run[:limit]):
        if token in eos:
            return run[:j + 1]
    return run[:limit]


def hash_proposer(target: _fakes.FakeTarget, k: int):
    """Drafts the greedy continuation, cut to a length and wrong at a place that depend on the tokens."""
    def propose(context):
        drafts = []
        for tokens in context.tokens:
            h = _fakes.prefix_hash(tokens)
            proposal = target.greedy(tokens, k)[: h % (k + 1)]
            if proposal and h % 4 == 0:
                proposal[-1] = (proposal[-1] + 1) % _fakes.VOCAB
            drafts.append(proposal)
        return drafts
    return propose


# A proposer's drafts need committed tokens: it never overlaps.
@pytest.mark.parametrize("drafter, overlap", [("head", True), ("head", False), ("proposer", False), ("none", True)])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(k=st.integers(1, 4), batch=st.integers(1, 4), extra_tokens=st.integers(0, 9),
       prompt_lens=st.lists(st.sampled_from([1, 3, 4, 5, 7, 8, 9, 12, 16]), min_size=1, max_size=5),
       max_new=st.integers(1, 12), max_positions=st.one_of(st.none(), st.integers(2, 24)),
       eos_at=st.one_of(st.none(), st.integers(1, 9)), pool=st.floats(0.0, 1.0), seed=st.integers(0, 3))
def test_random_workloads_emit_the_targets_greedy_tokens_within_the_limits(
        drafter, overlap, k, batch, extra_tokens, prompt_lens, max_new, max_positions, eos_at, pool, seed):
    target = _fakes.FakeTarget(seed)
    prompts = [[(seed + 3 * i + j) % _fakes.VOCAB for j in range(n)] for i, n in enumerate(prompt_lens)]
    runs = [target.greedy(p, 40) for p in prompts]
    eos = () if eos_at is None else (runs[0][eos_at],)
    limits = [max_new if max_positions is None else min(max_new, max_positions - len(p)) for p in prompts]
    drafts = 0 if drafter == "none" else k
    needs = [-(-kv_budget_tokens(len(p), n, drafts) // _fakes.BLOCK) for p, n in zip(prompts, limits) if n > 0]
    num_blocks = max(needs, default=1) + int(pool * sum(needs))  # the largest alone, up to all at once
    budget = 1 + drafts + extra_tokens
    cache = _fakes.make_cache(num_blocks)
    config = EngineConfig(draft_len=k, max_batch_size=batch, max_tokens_per_step=budget, overlap=overlap,
                          eos_ids=eos)
    engine = Engine(target, cache, config, vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table) if drafter == "head" else None,
                    capture=_fakes.fake_capture() if drafter == "head" else None,
                    proposer=hash_proposer(target, k) if drafter == "proposer" else None,
                    max_position_embeddings=max_positions)
    schedule, steps = engine.scheduler.schedule, []

    def watched(requests):
        rows = schedule(requests)
        steps.append((len(rows), sum(row.length for row in rows)))
        return rows

    engine.scheduler.schedule = watched
    result = engine.generate(prompts, max_new)

    expected = [greedy_stopped(run, n, eos) if n > 0 else [] for run, n in zip(runs, limits)]
    assert result.outputs == expected
    assert [e is not None for e in result.errors] == [n <= 0 for n in limits]
    assert result.stop_reasons == [None if not out else "eos" if out[-1] in eos else "length" for out in expected]
    assert all(rows <= batch and tokens <= budget for rows, tokens in steps)
    assert result.stats.generated_tokens == sum(map(len, expected))
    if drafter == "head":
        walks = [_fakes.expected_accepted(p, run, len(out), k) for p, run, out in zip(prompts, runs, expected) if out]
        assert result.stats.verify_steps == sum(verify for verify, _ in walks)
        assert result.stats.accepted_tokens == sum(accepted for _, accepted in walks)
    assert cache.num_free_blocks == cache.num_blocks and not cache.allocator.request_ids
    assert engine.scheduler.admitted_blocks == 0
