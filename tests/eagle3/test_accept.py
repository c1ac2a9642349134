"""Acceptance rules against naive references: greedy prefix matching, forced acceptance, and the
lossless rejection-sampling rule (chi-square against the target distribution)."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.eagle3.accept import forced_accept, forced_count_at, greedy_accept, rejection_accept


def naive_greedy(drafts, targets, draft_len):
    a = 0
    while a < draft_len and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + [targets[a]], a


def test_greedy_reference_example():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3], [5, 6, 7]])
    targets = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [0, 2, 3, 4], [5, 6, 7, 8]])
    result = greedy_accept(drafts, targets, torch.tensor([3, 3, 3, 1]))
    assert result.num_accepted.tolist() == [3, 1, 0, 1]
    assert result.tokens[0].tolist() == [5, 6, 7, 8]
    assert result.tokens[1, :2].tolist() == [5, 9]
    assert result.tokens[2, :1].tolist() == [0]
    assert result.tokens[3, :2].tolist() == [5, 6]  # draft_len 1: the bonus is the target at position 1


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_greedy_matches_naive_loop(data):
    rows = data.draw(st.integers(1, 5))
    k = data.draw(st.integers(0, 4))
    vocab = data.draw(st.integers(2, 4))
    drafts = [[data.draw(st.integers(0, vocab - 1)) for _ in range(k)] for _ in range(rows)]
    targets = [[data.draw(st.integers(0, vocab - 1)) for _ in range(k + 1)] for _ in range(rows)]
    lens = [data.draw(st.integers(0, k)) for _ in range(rows)]
    result = greedy_accept(torch.tensor(drafts, dtype=torch.long).view(rows, k), torch.tensor(targets), torch.tensor(lens))
    for r in range(rows):
        tokens, a = naive_greedy(drafts[r], targets[r], lens[r])
        assert int(result.num_accepted[r]) == a
        assert result.tokens[r, : a + 1].tolist() == tokens


def test_forced_accept_ignores_the_target():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    targets = torch.tensor([[0, 0, 0, 9], [0, 7, 0, 9]])
    result = forced_accept(drafts, targets, 2, torch.tensor([3, 1]))
    assert result.num_accepted.tolist() == [2, 1]
    assert result.tokens[0, :3].tolist() == [1, 2, 0]
    assert result.tokens[1, :2].tolist() == [1, 7]
    with pytest.raises(ValueError, match="num_forced"):
        forced_accept(drafts, targets, -1)



@pytest.mark.parametrize("num_forced", [3, 4, 2**62, 2**63, 2**80])
def test_forced_accept_with_a_count_past_int64_accepts_every_draft(num_forced):
    """"Force everything" may be spelled with any large int: each row accepts its draft_len drafts
    (a count past int64 must not overflow the device clamp), then the target's token at that index."""
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    targets = torch.tensor([[0, 0, 0, 9], [0, 7, 8, 9]])
    result = forced_accept(drafts, targets, num_forced, torch.tensor([3, 1]))
    assert result.num_accepted.tolist() == [3, 1]
    assert result.tokens.tolist() == [[1, 2, 3, 9], [4, 7, 7, 7]]

def test_forced_accept_takes_a_device_count():
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    targets = torch.tensor([[0, 0, 0, 9], [0, 7, 8, 9]])
    shared = forced_accept(drafts, targets, torch.tensor(3), torch.tensor([3, 2]))
    assert shared.num_accepted.tolist() == [3, 2]
    assert shared.tokens.tolist() == [[1, 2, 3, 9], [4, 5, 8, 8]]
    per_row = forced_accept(drafts, targets, torch.tensor([0, 1]))
    assert per_row.num_accepted.tolist() == [0, 1]
    assert per_row.tokens[:, :2].tolist() == [[0, 0], [4, 7]]
    with pytest.raises(ValueError, match="num_forced"):
        forced_accept(drafts, targets, torch.tensor([1, 1, 1]))


def test_forced_count_alternates_for_two_and_a_half():
    counts = [int(forced_count_at(2.5, torch.tensor(s))) for s in range(6)]
    assert counts == [2, 3, 2, 3, 2, 3]
    assert [int(forced_count_at(2, torch.tensor(s))) for s in range(3)] == [2, 2, 2]
    assert forced_count_at(1.25, torch.arange(4)).tolist() == [1, 1, 1, 2]
    for bad in (-0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="forced acceptance"):
            forced_count_at(bad, torch.tensor(0))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(0, 3), st.integers(1, 9), st.integers(1, 40))
def test_forced_count_running_sum_is_exact(whole, tenths, steps):
    mean = whole + tenths / 10
    counts = forced_count_at(mean, torch.arange(steps)).tolist()
    low = int(mean)  # a naive running floor: sum of the first n counts is floor(n * mean)
    assert all(c in (low, low + 1) for c in counts)
    running = 0
    for n, c in enumerate(counts, start=1):
        running += c
        assert running == (n * (10 * whole + tenths)) // 10


def test_shape_errors_name_the_cause():
    with pytest.raises(ValueError, match=r"\[R, K \+ 1\]"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_accept(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 3, 4), torch.ones(1, 3, 4) / 4)
    with pytest.raises(ValueError, match="one generator per row"):
        rejection_accept(torch.zeros(2, 1, dtype=torch.long), None, torch.ones(2, 2, 4) / 4, [torch.Generator()])


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_is_lossless_chi_square():
    gen = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.5, 0.2, 0.1, 0.15, 0.05], [0.1, 0.1, 0.6, 0.0, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.1, 0.2, 0.3, 0.1]])
    rows = 20000
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(2)], dim=1)
    result = rejection_accept(drafts, q.expand(rows, 2, 5), p.expand(rows, 3, 5), gen)
    # df = 4 (first token) / 3 (second token has one zero-probability entry); 0.1% critical values.
    assert chi_square(result.tokens[:, 0], p[0]) < 18.47
    second = result.tokens[result.num_accepted >= 1, 1]
    assert second.numel() > 2000
    assert chi_square(second, p[1]) < 16.27
    rate = result.num_accepted.double().mean().item()
    assert 0.3 < rate < 1.5


def test_deterministic_proposals_use_one_hot_q():
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    result = rejection_accept(torch.tensor([[1], [1]]), None, target, torch.Generator().manual_seed(0))
    assert result.num_accepted.tolist() == [1, 0]  # p(d) = 1 always accepted, p(d) = 0 never
    assert result.tokens[0].tolist() == [1, 2]
    assert result.tokens[1, 0].item() == 0  # residual max(p - onehot, 0) = p here


def test_per_row_generators_make_rows_independent_of_the_batch():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, 6), dim=-1)
    q = torch.softmax(torch.randn(3, 3, 6), dim=-1)
    drafts = torch.randint(0, 6, (3, 3))
    batch = rejection_accept(drafts, q, p, [torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    alone = rejection_accept(drafts[1:2], q[1:2], p[1:2], [torch.Generator().manual_seed(8)])
    assert batch.num_accepted[1] == alone.num_accepted[0]
    assert torch.equal(batch.tokens[1], alone.tokens[0])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(2, 5), st.integers(0, 10_000))
def test_rejection_outputs_are_consistent(rows, k, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, k + 1, vocab, generator=gen) * 3, dim=-1)
    p = torch.where(p < 0.05, torch.zeros_like(p), p)
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(rows, k, vocab, generator=gen), dim=-1)
    drafts = torch.randint(0, vocab, (rows, k), generator=gen)
    lens = torch.randint(0, k + 1, (rows,), generator=gen)
    result = rejection_accept(drafts, q, p, gen, lens)
    for r in range(rows):
        a = int(result.num_accepted[r])
        assert 0 <= a <= int(lens[r])
        assert result.tokens[r, :a].tolist() == drafts[r, :a].tolist()
        assert all(p[r, j, drafts[r, j]] > 0 for j in range(a))  # zero target mass is never accepted
        assert p[r, a, result.tokens[r, a]] > 0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_draft_lens_outside_zero_to_k_mean_the_nearest_end_in_all_three_rules(data):
    """A row cannot carry more than K drafts nor fewer than none: every rule treats a length past
    either end as that end. One-hot targets make rejection sampling deterministic (a draft with
    p = 1 is always accepted, one with p = 0 never, and the token after is the target's), so all
    three rules are checked against the naive loops on the clamped length."""
    rows = data.draw(st.integers(1, 5))
    k = data.draw(st.integers(0, 4))
    vocab = data.draw(st.integers(2, 4))
    drafts = [[data.draw(st.integers(0, vocab - 1)) for _ in range(k)] for _ in range(rows)]
    targets = [[data.draw(st.integers(0, vocab - 1)) for _ in range(k + 1)] for _ in range(rows)]
    lens = [data.draw(st.integers(-3, k + 3)) for _ in range(rows)]
    forced = [data.draw(st.integers(-2, k + 3)) for _ in range(rows)]
    draft_t, target_t = torch.tensor(drafts, dtype=torch.long).view(rows, k), torch.tensor(targets)
    lens_t = torch.tensor(lens)
    probs = torch.nn.functional.one_hot(target_t, vocab).float()
    results = {
        "greedy": greedy_accept(draft_t, target_t, lens_t),
        "rejection": rejection_accept(draft_t, None, probs, torch.Generator().manual_seed(0), lens_t),
        "forced": forced_accept(draft_t, target_t, torch.tensor(forced), lens_t),
        "forced int": forced_accept(draft_t, target_t, k + 2, lens_t),
    }
    for r in range(rows):
        length = min(max(lens[r], 0), k)
        expected = {"greedy": naive_greedy(drafts[r], targets[r], length),
                    "forced": _naive_forced(drafts[r], targets[r], min(max(forced[r], 0), length)),
                    "forced int": _naive_forced(drafts[r], targets[r], length)}
        expected["rejection"] = expected["greedy"]
        for rule, result in results.items():
            tokens, a = expected[rule]
            assert int(result.num_accepted[r]) == a, rule
            assert result.tokens[r, : a + 1].tolist() == tokens, rule


def _naive_forced(drafts, targets, a):
    return drafts[:a] + [targets[a]], a


# 1.78: plugin_ecosystem.md's forced-acceptance example, AL 2.78 - 1 (GQA head, K=3)
@pytest.mark.parametrize("mean", ["0.0005", "0.5", "1.5", "1.78", "2.999", "0.000123", "1.000001"])
def test_forced_schedule_sums_to_the_decimal_mean_times_the_steps(mean):
    """First principles: the first n counts of a schedule whose long-run mean is m sum to
    floor(n m); m is the decimal as written (exact arithmetic on its digits)."""
    from fractions import Fraction

    exact = Fraction(mean)
    steps = 2 * exact.denominator + 7  # past two full periods of the schedule
    counts = forced_count_at(float(mean), torch.arange(steps)).tolist()
    running = 0
    for n, count in enumerate(counts, start=1):
        running += count
        assert running == n * exact.numerator // exact.denominator, (mean, n)


def test_forced_schedule_refuses_a_positive_mean_it_would_round_to_zero():
    with pytest.raises(ValueError, match="resolution"):
        forced_count_at(1e-7, torch.tensor(0))
    assert forced_count_at(0.0, torch.arange(5)).tolist() == [0] * 5


@pytest.mark.parametrize("mean", [1e19, 2.0**63, 1e12 + 1 / 3])  # the last: negative counts past step 3e6
def test_forced_schedule_refuses_a_mean_its_int64_arithmetic_would_wrap(mean):
    """floor((s + 1) * mean) - floor(s * mean) is >= floor(mean) > 0 for every step; int64 products
    wrapped instead (1e19 gave -8446744073709551616 at step 0, which forced_accept turned into 0
    accepted drafts): such a mean is refused naming the cause, one the schedule can hold still runs."""
    with pytest.raises(ValueError, match="too large to schedule"):
        forced_count_at(mean, torch.arange(3_000_000, 3_100_000))
    assert forced_count_at(2147.5, torch.arange(4)).tolist() == [2147, 2148, 2147, 2148]


@pytest.mark.parametrize("step", [torch.tensor(1.7), torch.tensor(True), torch.tensor([0.0, 1.5]), 1])
def test_forced_schedule_refuses_a_step_that_is_not_an_integer_counter(step):
    """The schedule's step is an integer counter: a float 1.7 was truncated and ran as step 1
    (count 3 at mean 2.5), a bool as step 1, a Python int failed on `.to` naming nothing."""
    with pytest.raises(TypeError, match="step must be an integer tensor"):
        forced_count_at(2.5, step)
    assert forced_count_at(2.5, torch.tensor(1, dtype=torch.int32)).item() == 5 - 2  # floor(2 * 2.5) - floor(2.5)


def _assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Pearson chi-square goodness of fit of `samples` to `probs`, refused below p-value 1e-4.

    The p-value is the chi-square survival function, Q(df / 2, x / 2) (regularized upper incomplete
    gamma); cells of probability zero must stay empty and do not count towards the degrees of freedom.
    """
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"{what}: sampled a token of target probability zero"
    assert expected[keep].min() >= 20, f"{what}: too few samples for a chi-square test"
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(df, statistic / 2))
    assert p_value > 1e-4, f"{what}: chi-square {float(statistic):.1f} (p = {p_value:.2e}), counts {counts.tolist()}"


def _assert_rate(hits: torch.Tensor, prob: float, what: str) -> None:
    """A binomial frequency within 5 standard deviations of `prob` (false failure ~ 6e-7)."""
    n = hits.numel()
    sd = (prob * (1 - prob) / n) ** 0.5
    rate = hits.double().mean().item()
    assert abs(rate - prob) <= 5 * sd + 1e-12, f"{what}: rate {rate:.4f}, expected {prob:.4f} (n = {n})"


def test_rejection_sampling_is_lossless_for_rows_with_fewer_drafts():
    """Per-row draft_lens < K: every emitted position j <= draft_len is distributed as the target's p_j.

    Each target position here is independent of the prefix, so speculative sampling's guarantee reads:
    the first token ~ p_0 whatever the draft; among rows that got past j drafts, token j ~ p_j; in
    particular the token after a row's last accepted draft (the bonus, drawn at j = draft_len < K) is
    p_j and NOT the rejection residual norm(max(p_j - q_j, 0)). Acceptance of draft j has probability
    sum_x min(p_j(x), q_j(x)) (derived by hand from the rule), so a row reaches j with the product."""
    gen = torch.Generator().manual_seed(20240611)
    k, vocab, per_len = 3, 5, 12000
    p = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],
                      [0.05, 0.15, 0.30, 0.10, 0.40],
                      [0.25, 0.00, 0.25, 0.25, 0.25],
                      [0.10, 0.20, 0.30, 0.40, 0.00]])
    q = torch.tensor([[0.10, 0.60, 0.10, 0.10, 0.10],
                      [0.50, 0.20, 0.10, 0.10, 0.10],
                      [0.20, 0.20, 0.20, 0.20, 0.20]])
    lens = torch.arange(k + 1).repeat_interleave(per_len)  # per_len rows of each draft_len 0..K
    rows = lens.numel()
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(k)], dim=1)
    result = rejection_accept(drafts, q.expand(rows, k, vocab), p.expand(rows, k + 1, vocab), gen, lens)
    accept_prob = [float(torch.minimum(p[j], q[j]).sum()) for j in range(k)]  # 0.65, 0.5, 0.8
    for length in range(k + 1):
        in_group = lens == length
        tokens, accepted = result.tokens[in_group], result.num_accepted[in_group]
        assert int(accepted.max()) <= length
        reach = 1.0
        for j in range(length + 1):
            got_here = accepted >= j
            if j > 0:
                reach *= accept_prob[j - 1]
                _assert_rate(got_here, reach, f"draft_len {length}: reached position {j}")
            _assert_distributed_as(tokens[got_here, j], p[j], f"draft_len {length}, position {j}")
        # The bonus alone (every draft of the row accepted, drawn at position draft_len).
        _assert_distributed_as(tokens[accepted == length, length], p[length], f"draft_len {length}, bonus")


def test_deterministic_proposals_are_lossless_against_a_soft_target():
    """draft_probs=None: q is one-hot on the draft, so draft d is accepted with probability p(d) and a
    rejection draws from p with d removed (renormalized). Whatever d is (every id, the last one
    included), the emitted token is ~ p; with draft_len < K the bonus after acceptance is ~ p too."""
    gen = torch.Generator().manual_seed(777)
    k, vocab, per_len = 2, 4, 12000
    p = torch.tensor([[0.10, 0.20, 0.30, 0.40],
                      [0.35, 0.05, 0.25, 0.35],
                      [0.25, 0.25, 0.10, 0.40]])
    lens = torch.arange(k + 1).repeat_interleave(per_len)
    rows = lens.numel()
    drafts = torch.randint(0, vocab, (rows, k), generator=gen)
    result = rejection_accept(drafts, None, p.expand(rows, k + 1, vocab), gen, lens)
    tokens, accepted = result.tokens, result.num_accepted
    assert torch.equal(tokens[:, 0][accepted >= 1], drafts[:, 0][accepted >= 1])
    for d in range(vocab):  # the first token ~ p_0 whatever the draft; draft d accepted with p_0(d)
        with_d = drafts[:, 0] == d
        _assert_distributed_as(tokens[with_d, 0], p[0], f"first token after draft {d}")
        _assert_rate(accepted[with_d & (lens >= 1)] >= 1, float(p[0, d]), f"acceptance of draft {d}")
        _assert_distributed_as(tokens[with_d & (lens == 0), 0], p[0], f"bonus at 0, draft {d} not offered")
    for length in (1, 2):
        reached = (lens == length) & (accepted >= 1)
        _assert_distributed_as(tokens[reached, 1], p[1], f"draft_len {length}, position 1")
    bonus = (lens == 1) & (accepted == 1)  # every draft of the row accepted, bonus drawn at 1 < K
    _assert_distributed_as(tokens[bonus, 1], p[1], "draft_len 1, bonus")


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_draft_ids_outside_the_vocabulary_are_always_rejected(with_draft_probs):
    """The target gives an id outside [0, V) probability 0, so it is never accepted (nor emitted), and
    it takes no mass from the residual: here the target is one-hot on V - 1, the id it must emit."""
    vocab, rows = 4, 64
    target = torch.zeros(rows, 2, vocab)
    target[:, :, vocab - 1] = 1.0
    drafts = torch.tensor([[vocab + 5], [-1]]).repeat(rows // 2, 1)
    draft_probs = torch.full((rows, 1, vocab), 1.0 / vocab) if with_draft_probs else None
    result = rejection_accept(drafts, draft_probs, target, torch.Generator().manual_seed(0))
    assert result.num_accepted.tolist() == [0] * rows
    assert result.tokens[:, 0].tolist() == [vocab - 1] * rows


def test_out_of_vocabulary_deterministic_drafts_leave_the_whole_target_distribution():
    """draft_probs=None with ids outside [0, V): q is the one-hot of a token the target can never give,
    so the draft is rejected and the residual max(p - q, 0) is p itself. The clamped index must not put
    q's mass on a real id (V - 1 here, which the target gives 3/4): emitted tokens are ~ p."""
    vocab, rows = 4, 4000
    p = torch.tensor([0.25, 0.0, 0.0, 0.75])
    drafts = torch.tensor([[vocab], [vocab + 7]]).repeat(rows // 2, 1)
    result = rejection_accept(drafts, None, p.expand(rows, 2, vocab), torch.Generator().manual_seed(5))
    assert result.num_accepted.tolist() == [0] * rows
    _assert_distributed_as(result.tokens[:, 0], p, "after an out-of-vocabulary deterministic draft")


def test_a_rejection_with_no_residual_mass_samples_the_target():
    """q == p exactly and a draft both give probability 0 (q need not be the draft's sampler here): the
    rule rejects it (u * 0 < 0 is false) and max(p - q, 0) is all zero, so the documented fallback
    draws from p. Hand-computed: num_accepted 0 and the emitted token ~ p_0, never a NaN draw."""
    vocab, rows = 3, 3000
    p = torch.tensor([[0.0, 0.3, 0.7], [0.5, 0.25, 0.25]])
    drafts = torch.zeros(rows, 1, dtype=torch.long)  # p_0(0) = q_0(0) = 0
    result = rejection_accept(drafts, p[:1].expand(rows, 1, vocab), p.expand(rows, 2, vocab),
                              torch.Generator().manual_seed(6))
    assert result.num_accepted.tolist() == [0] * rows
    _assert_distributed_as(result.tokens[:, 0], p[0], "fallback after a rejection without residual mass")


DRAFTS, UNIFORM = torch.zeros(1, 2, dtype=torch.long), torch.full((1, 3, 4), 0.25)


@pytest.mark.parametrize("args, error, match", [
    ((DRAFTS, [[0.25] * 4] * 2, UNIFORM), TypeError, r"^draft_probs must be a tensor or None, got list$"),
    ((DRAFTS, torch.zeros(1, 2, 4, dtype=torch.long), UNIFORM), TypeError,
     r"^draft_probs must be a floating-point tensor of probabilities, got torch.int64$"),
    ((DRAFTS, None, UNIFORM.to(torch.long)), TypeError,
     r"^target_probs must be a floating-point tensor of probabilities, got torch.int64$"),
    ((DRAFTS, None, torch.zeros(1, 3, 0)), ValueError, r"^target_probs must have a vocabulary of at least one token"),
    ((DRAFTS, None, UNIFORM, 0), TypeError, r"^generator must be a torch.Generator, one per row or None, got int$"),
    ((DRAFTS, None, UNIFORM, [0]), TypeError, r"^generator\[0\] must be a torch.Generator, got int$"),
])
def test_rejection_accept_names_a_malformed_argument(args, error, match):
    """These failed with an AttributeError ('list' object has no attribute 'shape') or deep inside
    torch (one_hot, rand), or, given integer probabilities, ran on values truncated to 0 and 1."""
    with pytest.raises(error, match=match):
        rejection_accept(*args)


# ---- found by mutation testing: each test below kills a mutant the suite above let through ----


def test_forced_accept_refuses_a_count_tensor_of_more_than_one_dimension():
    """A [R, 1] count broadcast against draft_lens [R] into [R, R] and failed inside gather."""
    drafts, targets = torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^num_forced must be an int, a 0-d tensor or \[R\] = \[2\], "
                                         r"got shape \(2, 1\)$"):
        forced_accept(drafts, targets, torch.tensor([[1], [2]]))


def test_more_generators_than_rows_is_refused():
    """One generator per row means exactly as many: a spare one hints at rows and generators out of step."""
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    with pytest.raises(ValueError, match=r"^need one generator per row: 2 rows, 3 generators$"):
        rejection_accept(torch.zeros(2, 1, dtype=torch.long), None, torch.full((2, 2, 4), 0.25), gens)


def test_draft_probs_with_another_row_count_are_refused():
    with pytest.raises(ValueError, match=r"^draft_probs must be \[R, K, V\] = \[2, 1, 4\], got \(1, 1, 4\)$"):
        rejection_accept(torch.zeros(2, 1, dtype=torch.long), torch.full((1, 1, 4), 0.25), torch.full((2, 2, 4), 0.25))


@pytest.mark.parametrize("rule", ["greedy", "forced", "rejection"])
def test_draft_lens_that_is_not_one_dimensional_is_refused(rule):
    """A [R, 1] draft_lens broadcast inside the prefix count into [R, R, K] instead of failing."""
    drafts, ids = torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, 3, dtype=torch.long)
    lens = torch.tensor([[2], [1]])
    call = {"greedy": lambda: greedy_accept(drafts, ids, lens),
            "forced": lambda: forced_accept(drafts, ids, 1, lens),
            "rejection": lambda: rejection_accept(drafts, None, torch.full((2, 3, 5), 0.2), None, lens)}[rule]
    with pytest.raises(ValueError, match=r"^draft_lens must be \[R\] = \[2\], got \(2, 1\)$"):
        call()


def test_a_rejection_with_a_tiny_residual_draws_from_the_residual_not_from_the_target():
    """Worked by hand: p_0 = [0, 1/2, 1/2] and q_0 = [1e-6, 1/2, 1/2 - 1e-6] (q can propose token 0).
    Draft 0 has p = 0, so it is always rejected; max(p - q, 0) = [0, 0, ~1e-6] normalizes to [0, 0, 1],
    so the emitted token is 2 every time. Falling back to p because the residual mass is small would emit
    token 1 about half the time (and break losslessness: token 1 would be over-represented overall)."""
    rows = 400
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[1e-6, 0.5, 0.5 - 1e-6]])
    result = rejection_accept(torch.zeros(rows, 1, dtype=torch.long), q.expand(rows, 1, 3), p.expand(rows, 2, 3),
                              torch.Generator().manual_seed(3))
    assert result.num_accepted.tolist() == [0] * rows
    assert result.tokens[:, 0].tolist() == [2] * rows


def test_every_row_with_its_own_generator_draws_exactly_as_it_would_alone():
    """The documented point of per-row generators: a row's acceptance and emitted token depend on its
    own generator only, not on its place in the batch. Checked for every row (the first and last too)
    of a batch where each row's final token is sampled (rejections and bonuses both occur)."""
    gen = torch.Generator().manual_seed(99)
    rows, k, vocab = 5, 2, 6
    p = torch.softmax(2 * torch.randn(rows, k + 1, vocab, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(rows, k, vocab, generator=gen), dim=-1)
    seeds = [101, 202, 303, 404, 505]
    for trial in range(4):
        drafts = torch.randint(0, vocab, (rows, k), generator=gen)
        batch = rejection_accept(drafts, q, p, [torch.Generator().manual_seed(s + trial) for s in seeds])
        for r in range(rows):
            alone = rejection_accept(drafts[r:r + 1], q[r:r + 1], p[r:r + 1],
                                     [torch.Generator().manual_seed(seeds[r] + trial)])
            assert int(batch.num_accepted[r]) == int(alone.num_accepted[0]), (trial, r)
            assert batch.tokens[r].tolist() == alone.tokens[0].tolist(), (trial, r)


@pytest.mark.parametrize("args, name", [
    (([[1, 2]], torch.tensor([[1, 2, 3]])), "draft_tokens"),
    ((torch.tensor([[1, 2]]), [[1, 2, 3]]), "target"),
    ((torch.tensor([[1, 2]]), torch.tensor([[1, 2, 3]]), [2]), "draft_lens"),
])
def test_an_argument_that_is_not_a_tensor_is_refused_naming_it(args, name):
    """Ids still in host lists (as the scheduler holds them before upload) failed with an AttributeError."""
    with pytest.raises(TypeError, match=rf"^{name} must be a tensor, got list$"):
        greedy_accept(*args)


@pytest.mark.parametrize("rule, args, name", [
    (greedy_accept, (None, torch.tensor([[1, 2, 3]])), "draft_tokens"),
    (greedy_accept, (torch.tensor([[1, 2]]), None), "target"),
    (forced_accept, (torch.tensor([[1, 2]]), None, 1), "target"),
    (rejection_accept, (torch.tensor([[1, 2]]), None, None), "target"),  # draft_probs None is legal, not the target
])
def test_a_missing_argument_is_refused_naming_it(rule, args, name):
    """Only draft_lens (and rejection's draft_probs) may be None; a None token or target tensor failed with
    "'NoneType' object has no attribute 'dim'", naming no argument."""
    with pytest.raises(TypeError, match=rf"^{name} must be a tensor, got NoneType$"):
        rule(*args)


@pytest.mark.parametrize("drafts", [torch.tensor([1, 2]), torch.tensor([[[1, 2]]])])
def test_draft_tokens_that_are_not_r_by_k_are_refused_naming_the_shape(drafts):
    """One row's drafts [K] without the row dimension (or with an extra one) failed unpacking the shape."""
    shape = re.escape(str(tuple(drafts.shape)))
    with pytest.raises(ValueError, match=rf"^draft_tokens must be \[R, K\], got shape {shape}$"):
        greedy_accept(drafts, torch.tensor([[1, 2, 3]]))


def test_a_target_without_the_row_dimension_is_refused_naming_the_shape():
    """A single row's [K + 1] target failed with an IndexError on its second dimension."""
    with pytest.raises(ValueError, match=r"^target must be \[R, K \+ 1, \.\.\.\], got shape \(3,\)$"):
        greedy_accept(torch.tensor([[1, 2]]), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 4, 1)])
def test_target_probs_without_exactly_one_vocabulary_dimension_are_refused(shape):
    """[R, K + 1] passes the row check; the missing (or extra) vocabulary dimension failed unpacking."""
    with pytest.raises(ValueError, match=rf"^target_probs must be \[R, K \+ 1, V\], got shape {re.escape(str(shape))}"):
        rejection_accept(torch.tensor([[1, 2]]), None, torch.full(shape, 0.25))


@pytest.mark.parametrize("mean", [1e19, 3000.123457, 1e12 + 1 / 3])
def test_forced_ratio_refuses_every_mean_the_schedule_refuses(mean):
    """`forced_ratio` is the up-front check of a configured mean ("refuses what it cannot schedule"):
    3000.123457 is 3000123457/10**6, a numerator past 2**31, which `forced_count_at` refuses at the
    first verify step; the up-front check passed it."""
    from fractions import Fraction

    from m3_eagle_plugin.eagle3.accept import forced_ratio

    with pytest.raises(ValueError, match="too large to schedule"):
        forced_count_at(mean, torch.tensor(0))
    with pytest.raises(ValueError, match="too large to schedule"):
        forced_ratio(mean)
    assert forced_ratio(2147.5) == Fraction(4295, 2)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("generator", ["none", "one", "per-row"])
def test_a_step_without_verify_rows_accepts_nothing_in_every_rule(k, generator):
    """A step of context rows only verifies no row: the reference runner then calls the rule with
    [0, K] drafts and, when sampling, an empty per-row generator list. torch.stack of no rows
    (uniforms, sampled tokens) raises, so the empty batch must come back as [0, K + 1] and [0]."""
    gen = {"none": None, "one": torch.Generator().manual_seed(0), "per-row": []}[generator]
    drafts, ids = torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k + 1, dtype=torch.long)
    results = [
        greedy_accept(drafts, ids, torch.zeros(0, dtype=torch.long)),
        forced_accept(drafts, ids, 2),
        rejection_accept(drafts, None, torch.full((0, k + 1, 4), 0.25), gen),
        rejection_accept(drafts, torch.full((0, k, 4), 0.25), torch.full((0, k + 1, 4), 0.25), gen,
                         torch.zeros(0, dtype=torch.long)),
    ]
    for result in results:
        assert result.tokens.shape == (0, k + 1) and result.tokens.dtype == torch.int64
        assert result.num_accepted.shape == (0,) and result.num_accepted.dtype == torch.int64
