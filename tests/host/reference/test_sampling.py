"""Speculative sampling end to end on the fake model: the distribution of generated tokens equals
target-only sampling (chi-square against the exact distribution computed from the fake's table)."""
from __future__ import annotations

import torch

from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.sampler import SamplingParams

from . import _fakes

TOP_K, TEMPERATURE = 5, 1.3


def exact_probs(table, prefix):
    logits = table[_fakes.prefix_hash(prefix)] / TEMPERATURE
    keep = torch.topk(logits, TOP_K).indices
    probs = torch.zeros_like(logits)
    probs[keep] = torch.softmax(logits[keep], dim=0)
    return probs


def test_speculative_sampling_matches_the_target_distribution():
    prompt, copies = [1, 2, 3], 600
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(num_blocks=1400)
    config = EngineConfig(draft_len=2, max_batch_size=64, max_tokens_per_step=256,
                          sampling=SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=11))
    head = _fakes.FakeHead(target.table, wrong=lambda h: h % 4 != 0)  # mostly wrong: q far from p
    engine = Engine(target, cache, config, vocab_size=_fakes.VOCAB, head=head, capture=_fakes.fake_capture())
    result = engine.generate([prompt] * copies, max_new_tokens=3)
    assert cache.num_free_blocks == cache.num_blocks
    assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens
    p1 = exact_probs(target.table, prompt)
    p2 = sum(p1[a] * exact_probs(target.table, prompt + [a]) for a in range(_fakes.VOCAB))
    p3 = sum(p1[a] * exact_probs(target.table, prompt + [a])[b] * exact_probs(target.table, prompt + [a, b])
             for a in range(_fakes.VOCAB) for b in range(_fakes.VOCAB))
    outputs = torch.tensor(result.outputs)
    for column, probs in ((0, p1), (1, p2), (2, p3)):
        counts = torch.bincount(outputs[:, column], minlength=_fakes.VOCAB).double()
        expected = probs.double() * copies
        keep = expected > 1e-9
        assert counts[~keep].sum() == 0
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2 < 35.0, (column, chi2)  # df <= 10, p ~ 1e-4


def test_sampled_outputs_do_not_depend_on_batching_or_overlap():
    prompts = [[1, 2, 3], [4, 5], [6]]
    outs = []
    for batch, overlap in ((3, False), (1, False), (2, True)):
        target = _fakes.FakeTarget()
        config = EngineConfig(draft_len=2, max_batch_size=batch, max_tokens_per_step=9, overlap=overlap,
                              sampling=SamplingParams(temperature=1.0, seed=3))
        engine = Engine(target, _fakes.make_cache(), config, vocab_size=_fakes.VOCAB,
                        head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
        outs.append(engine.generate(prompts, max_new_tokens=6).outputs)
    assert outs[0] == outs[1] == outs[2]
