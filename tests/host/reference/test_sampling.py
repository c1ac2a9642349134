"""Speculative sampling end to end on the fake model: the distribution of generated tokens equals
target-only sampling (chi-square against the exact distribution computed from the fake's table)."""
from __future__ import annotations

import torch

from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.sampler import SamplingParams
from m3_eagle_plugin.host.reference.scheduler import RowKind

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


def test_drafts_are_accepted_at_the_rejection_sampling_rate_with_or_without_their_probabilities():
    """K = 1, two new tokens: every request runs one verify step of one head draft. A draft sampled from
    the head's q is accepted with probability sum_x min(p, q) (its probabilities kept); a draft whose
    probabilities are unknown (an imported handoff carries none: dropped here for the even requests) is
    checked as a certain proposal, accepted with probability p(draft), so sum_x q p. Either way the second
    token follows the target's p. The rates and distribution are computed from the fake's tables."""
    prompt, copies = [1, 2, 3], 800
    target = _fakes.FakeTarget()
    head = _fakes.FakeHead(target.table)  # wrong where the hash is divisible by 3: q rolled by one
    config = EngineConfig(draft_len=1, max_batch_size=copies, max_tokens_per_step=4096,
                          sampling=SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=5))
    engine = Engine(target, _fakes.make_cache(num_blocks=2 * copies), config, vocab_size=_fakes.VOCAB, head=head,
                    capture=_fakes.fake_capture())
    launch, commit, accepted = engine.launch, engine.commit, {0: [], 1: []}

    def launch_dropping_probs(rows, step_id):
        for row in rows:
            if row.kind is RowKind.VERIFY and row.request.index % 2 == 0:
                assert row.request.pending_draft_probs is not None  # the head's, dropped here
                row.request.pending_draft_probs = None
        return launch(rows, step_id)

    def counting_commit(out, requests, progress):
        for i, row in enumerate(out.rows):
            if row.kind is RowKind.VERIFY:
                accepted[row.request.index % 2].append(int(out.num_accepted[i]))
        return commit(out, requests, progress)

    engine.launch, engine.commit = launch_dropping_probs, counting_commit
    result = engine.generate([prompt] * copies, max_new_tokens=2)
    assert [len(accepted[0]), len(accepted[1])] == [copies // 2] * 2

    p1 = exact_probs(target.table, prompt)
    kept = certain = 0.0
    p2 = torch.zeros(_fakes.VOCAB)
    for t in range(_fakes.VOCAB):
        h = _fakes.prefix_hash(prompt + [t])
        p = exact_probs(target.table, prompt + [t])
        q = exact_probs(torch.roll(target.table, 1, dims=1) if head.wrong(h) else target.table, prompt + [t])
        kept += float(p1[t] * torch.minimum(p, q).sum())
        certain += float(p1[t] * (p * q).sum())
        p2 += p1[t] * p
    assert kept - certain > 0.3  # far apart: the check below tells them apart
    for parity, rate in ((1, kept), (0, certain)):
        measured = sum(accepted[parity]) / len(accepted[parity])
        assert abs(measured - rate) < 4 * (rate * (1 - rate) / len(accepted[parity])) ** 0.5 + 0.01, (parity, measured)
    outputs = torch.tensor(result.outputs)
    for parity in (0, 1):
        counts = torch.bincount(outputs[parity::2, 1], minlength=_fakes.VOCAB).double()
        expected = p2.double() * (copies // 2)
        keep = expected > 1e-9
        assert counts[~keep].sum() == 0
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2 < 35.0, (parity, chi2)


def _nucleus(probs, top_p):
    """top-p written out: walk the tokens from the most probable, keep each while the mass before it is under top_p."""
    kept, before = torch.zeros_like(probs), 0.0
    for token in sorted(range(len(probs)), key=lambda t: -float(probs[t])):
        if before >= top_p or probs[token] == 0:
            break
        kept[token], before = probs[token], before + float(probs[token])
    return kept / kept.sum()


def test_joint_distribution_of_three_sampled_tokens_with_top_k_and_top_p_equals_target_sampling():
    """The joint law of the first three tokens (not only each one's marginal: a draw shared between
    steps would correlate them), under top-k and top-p, drafted by the Eagle3 head at K = 1 and 3 and
    by prompt lookup (certain proposals), equals target-only sampling, computed exactly from the fake's
    table with the filters written out here. 1000 fixed-seed copies each (CPU, about 2 s in all):
    chi-square under 3 x its 16 degrees of freedom (the null's 99.99th percentile here), and nothing
    outside the filtered support. A target without its top-p in the acceptance rule, the rule's p and
    q swapped, or a residual draw restarting the request's stream fail it."""
    from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

    temperature, top_k, top_p, copies = 1.3, 4, 0.75, 1000
    prompt = [8, 6, 1, 2, 6]  # prompt lookup's first draft is accepted about 60% of the time here

    def exact(prefix):
        logits = _fakes.logit_table()[_fakes.prefix_hash(prompt + prefix)] / temperature
        keep = torch.topk(logits, top_k).indices
        probs = torch.zeros_like(logits)
        probs[keep] = torch.softmax(logits[keep], dim=0)
        return _nucleus(probs, top_p)

    joint = {}
    for a, pa in enumerate(exact([])):
        for b, pb in enumerate(exact([a]) if pa > 0 else []):
            for c, pc in enumerate(exact([a, b]) if pb > 0 else []):
                if pc > 0:
                    joint[(a, b, c)] = float(pa * pb * pc)
    assert 8 < len(joint) < 64  # top-p cut somewhere: fewer than top-k's 4 x 4 x 4
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
    for draft_len, drafter in ((1, "eagle3"), (3, "eagle3"), (3, "lookup")):
        target = _fakes.FakeTarget()
        config = EngineConfig(draft_len=draft_len, max_batch_size=256, max_tokens_per_step=4096, sampling=sampling)
        drafting = (dict(head=_fakes.FakeHead(target.table, wrong=lambda h: h % 3 != 0), capture=_fakes.fake_capture())
                    if drafter == "eagle3" else dict(proposer=PromptLookupProposer()))
        engine = Engine(target, _fakes.make_cache(num_blocks=2048), config, vocab_size=_fakes.VOCAB, **drafting)
        result = engine.generate([prompt] * copies, max_new_tokens=3)
        assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens, drafter
        counts = {}
        for output in result.outputs:
            counts[tuple(output)] = counts.get(tuple(output), 0) + 1
        assert set(counts) <= set(joint), (drafter, draft_len, set(counts) - set(joint))
        chi2 = sum((counts.get(o, 0) - copies * p) ** 2 / (copies * p) for o, p in joint.items())
        assert chi2 < 3 * (len(joint) - 1), (drafter, draft_len, chi2)


def test_each_eagle3_draft_carries_the_heads_filtered_distribution_it_was_drawn_from():
    """What the rejection rule divides by is the distribution each draft was drawn from: the head's
    logits after the same temperature, top-k and top-p as the target's. Checked at every verify step
    against the fake head's table filtered here (its logits for a sequence are table[prefix hash],
    rolled by one where it is wrong), and each draft lies in that support."""
    temperature, top_k, top_p = 1.3, 4, 0.75
    target = _fakes.FakeTarget()
    head = _fakes.FakeHead(target.table, wrong=lambda h: h % 3 != 0)
    config = EngineConfig(draft_len=1, max_batch_size=8, max_tokens_per_step=64,
                          sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=2))
    engine = Engine(target, _fakes.make_cache(), config, vocab_size=_fakes.VOCAB, head=head,
                    capture=_fakes.fake_capture())
    launch, seen = engine.launch, []

    def spy(rows, step_id):
        for row in rows:
            if row.kind is RowKind.VERIFY:
                request = row.request
                seen.append((request.prompt + request.output, int(request.pending_inputs[1]),
                             request.pending_draft_probs[0].clone()))
        return launch(rows, step_id)

    engine.launch = spy
    engine.generate([[1, 2, 3], [4, 5], [6, 0, 7, 7]] * 4, max_new_tokens=5)
    assert len(seen) >= 12
    for sequence, draft, q in seen:
        h = _fakes.prefix_hash(sequence)
        logits = (torch.roll(target.table[h], 1) if head.wrong(h) else target.table[h]) / temperature
        keep = torch.topk(logits, top_k).indices
        probs = torch.zeros_like(logits)
        probs[keep] = torch.softmax(logits[keep], dim=0)
        want = _nucleus(probs, top_p)
        torch.testing.assert_close(q, want)
        assert want[draft] > 0
