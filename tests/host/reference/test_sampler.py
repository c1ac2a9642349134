"""Token choice: greedy argmax and the filtered sampling distribution (temperature, top-k, top-p)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.host.reference.sampler import SamplingParams, choose_tokens, filtered_probs, request_generator


def test_reference_examples():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    nucleus = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    top2 = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    hot = filtered_probs(logits, SamplingParams(temperature=0.5))
    want = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    torch.testing.assert_close(hot[0], want / want.sum())
    tokens, probs = choose_tokens(logits, SamplingParams())
    assert tokens.tolist() == [0] and probs is None


def test_a_tiny_temperature_tends_to_greedy_without_nans():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.25, 0.0, float("-inf")]])
    for temperature in (1e-300, 1e-46, 1e-39, 1e-30, 1e-6):  # 1e-46 and below round to 0 in fp32
        probs = filtered_probs(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_a_top_p_that_rounds_to_zero_in_fp32_keeps_only_the_most_probable_token():
    """top_p keeps at least one token by definition: a top_p below fp32's smallest subnormal
    (1e-300, 1e-46) filters like greedy, one-hot on each row's argmax, not NaN."""
    logits = torch.tensor([[3.0, 1.0, 0.5], [0.2, 2.0, -1.0]])
    for top_p in (1e-300, 1e-46):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        torch.testing.assert_close(filtered_probs(logits, params), torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
        tokens, _ = choose_tokens(logits, params, [torch.Generator().manual_seed(s) for s in range(2)])
        assert tokens.tolist() == [0, 1]



def test_a_temperature_past_fp32s_largest_finite_keeps_masked_logits_out_without_nans():
    """3.5e38 and above are inf in fp32, and a masked (-inf) logit's -inf / inf was NaN: every row
    with one sampled from NaN. Divided in float64 the scores of the finite logits are near 0, so the
    distribution is uniform over them (the limit of softmax(x / T) as T grows) and 0 on the masked one."""
    logits = torch.tensor([[0.5, 0.25, 0.0, float("-inf")], [2.0, -1.0, float("-inf"), 1.0]])
    want = torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 0.0, 1 / 3]])
    for temperature in (3.5e38, 1e39, 1e300):
        torch.testing.assert_close(filtered_probs(logits, SamplingParams(temperature=temperature)), want)


def test_top_k_keeps_k_tokens_under_a_temperature_that_rounds_their_scores_together():
    """top_k keeps the k highest logits whatever the temperature (which keeps their order). Divided
    first, 1e45 rounded the scores 0, -1, -2 to equal fp32 subnormals (ties at the k-th kept 3 of
    4), 1e46 and above all to 0 (every token kept). The limit as T grows: uniform over the top k.
    Shifting by the row max rounds too: 2e-8 - 1 and 1e-8 - 1 are both -1 in fp32."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 5.0, float("-inf"), 4.0]])
    want = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5]])
    for temperature in (1e30, 1e45, 1e46, 1e300):
        torch.testing.assert_close(filtered_probs(logits, SamplingParams(temperature=temperature, top_k=2)), want)
    close = filtered_probs(torch.tensor([[1.0, 2e-8, 1e-8, -3.0]]), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(close, torch.tensor([[math.e / (math.e + 1), 1 / (math.e + 1), 0.0, 0.0]]))


def test_rational_parameters_filter_as_their_floats_and_one_past_float_range_is_refused():
    """A Fraction is a real number the checks take: it failed dividing the scores in the first step."""
    from fractions import Fraction

    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0], [0.2, 2.0, -1.0, 0.0]])
    exact = SamplingParams(temperature=Fraction(1, 2), top_p=Fraction(9, 10), top_k=3)
    assert (exact.temperature, exact.top_p) == (0.5, 0.9)
    torch.testing.assert_close(filtered_probs(logits, exact),
                               filtered_probs(logits, SamplingParams(temperature=0.5, top_p=0.9, top_k=3)))
    for value in (10**400, Fraction(10**400, 3)):  # finite by the range check, past any float
        with pytest.raises(ValueError, match=r"^temperature must be a finite number, got one past float range$"):
            SamplingParams(temperature=value)


def test_bad_parameters_name_the_cause():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    for temperature in (-1.0, math.inf, math.nan):  # the CLI refuses the same ones
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingParams(temperature=temperature)
    with pytest.raises(ValueError, match=r"^top_k must be >= 0, got -1$"):  # 0 turns it off; -1 is not "off"
        SamplingParams(temperature=1.0, top_k=-1)
    with pytest.raises(ValueError, match="greedy"):
        filtered_probs(torch.zeros(1, 3), SamplingParams())
    with pytest.raises(ValueError, match="generator per row"):
        choose_tokens(torch.zeros(2, 3), SamplingParams(temperature=1.0), [torch.Generator()])


@pytest.mark.parametrize("field,value", [
    ("top_k", 2.5), ("top_k", True), ("seed", 1.5), ("seed", "1"), ("temperature", True), ("temperature", "1"),
    ("top_p", "0.9"), ("top_p", None),
])
def test_a_mistyped_parameter_is_refused_naming_it(field, value):
    """Not only ranges: a float top_k or seed failed inside the first step, a bool temperature ran as 1."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{"temperature": 1.0, field: value})


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(2, 8), st.floats(0.3, 2.0), st.integers(0, 8), st.floats(0.05, 1.0), st.integers(0, 1000))
def test_filtered_distribution_properties(vocab, temperature, top_k, top_p, seed):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    probs = filtered_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    for row, p in zip(logits, probs):
        support = (p > 0).nonzero().flatten().tolist()
        order = torch.argsort(row, descending=True).tolist()
        assert order[0] in support
        if 0 < top_k < vocab:
            assert len(support) <= top_k
        # the nucleus is a prefix of the descending order, minimal for top_p
        assert sorted(support, key=order.index) == order[: len(support)]
        base = torch.softmax(row / temperature, 0)
        if 0 < top_k < vocab:
            kept = order[:top_k]
            base = torch.zeros_like(base).index_put_((torch.tensor(kept),), torch.softmax(row[kept] / temperature, 0))
        mass_without_last = float(base[order[: len(support) - 1]].sum())
        assert mass_without_last < top_p + 1e-6 or math.isclose(mass_without_last, top_p, abs_tol=1e-6)


def test_request_generators_are_reproducible_per_request():
    a = torch.rand(4, generator=request_generator(7, 3, "cpu"))
    b = torch.rand(4, generator=request_generator(7, 3, "cpu"))
    c = torch.rand(4, generator=request_generator(7, 4, "cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_it():
    """Nucleus = the fewest most-probable tokens whose mass is at least top_p: with four equal
    logits (each exactly 0.25 in fp32) top_p 0.5 keeps exactly two tokens at 0.5 each (a third would
    start at mass 0.5, already enough), top_p 0.5 + 2**-20 keeps three at 1/3 each."""
    logits = torch.zeros(1, 4)
    two = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert sorted(two[0].tolist()) == [0.0, 0.0, 0.5, 0.5]
    three = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5 + 2**-20))
    torch.testing.assert_close(three[0].sort().values, torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3]))
    exact = filtered_probs(torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]])),
                           SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(exact, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_nearby_seeds_do_not_alias_other_requests_streams():
    """Seed s + 1 is a different run, not seed s's run shifted by one request: the stream of (seed, request)
    differs from that of (seed - 1, request + 1) and of (seed + 1, request - 1) for small values."""
    draws = {(s, i): torch.rand(4, generator=request_generator(s, i, "cpu")) for s in range(4) for i in range(4)}
    for (s, i), values in draws.items():
        for other in ((s - 1, i + 1), (s + 1, i - 1)):
            if other in draws:
                assert not torch.equal(values, draws[other]), ((s, i), other)


@pytest.mark.parametrize("seed", [-1, 2**63, 2**70])
def test_a_seed_outside_the_range_the_per_request_seeds_tell_apart_is_refused(seed):
    """Seeds are taken mod 2**63: 2**63 and 2**70 drew exactly what seed 0 draws, -1 what 2**63 - 1 does."""
    wrapped = seed % 2**63
    assert torch.equal(torch.rand(4, generator=request_generator(seed, 1, "cpu")),
                       torch.rand(4, generator=request_generator(wrapped, 1, "cpu")))  # the aliasing refused
    with pytest.raises(ValueError, match=rf"^seed must be in \[0, 2\*\*63\), got {seed}$"):
        SamplingParams(temperature=1.0, seed=seed)
    assert SamplingParams(temperature=1.0, seed=2**63 - 1).seed == 2**63 - 1


def test_numpy_integer_parameters_are_the_ints_they_hold():
    """A numpy seed passed the type check, then its seed arithmetic overflowed int64 (OverflowError
    at the first sampled request); it must draw exactly what the same Python int draws."""
    np = pytest.importorskip("numpy")
    for seed in (3, 2**62):
        params = SamplingParams(temperature=1.0, top_k=np.int64(2), seed=np.int64(seed))
        assert params == SamplingParams(temperature=1.0, top_k=2, seed=seed)
        assert torch.equal(torch.rand(4, generator=request_generator(params.seed, 5, "cpu")),
                           torch.rand(4, generator=request_generator(seed, 5, "cpu")))


def test_zero_dimensional_torch_integer_parameters_are_the_ints_they_hold():
    """The package's int rule (`_ints`) takes a 0-d torch integer as an int; top_k and seed refused
    one as "must be an int". A one-element 1-D tensor or a torch bool is still not one."""
    params = SamplingParams(temperature=1.0, top_k=torch.tensor(2), seed=torch.tensor(7, dtype=torch.int32))
    assert params == SamplingParams(temperature=1.0, top_k=2, seed=7)
    assert (type(params.top_k), type(params.seed)) == (int, int)
    for value in (torch.tensor([2]), torch.tensor(True)):
        with pytest.raises(ValueError, match=r"^top_k must be an int"):
            SamplingParams(temperature=1.0, top_k=value)


def test_greedy_ties_go_to_the_lowest_token_id():
    """Greedy picks the first of equal maxima, as transformers' greedy search (an argmax) does, so tied
    logits give the same tokens as the HF oracle; checked against a naive loop over each row."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    tokens, probs = choose_tokens(logits, SamplingParams())
    naive = [max(range(len(row)), key=lambda i, row=row: (row[i], -i)) for row in logits.tolist()]
    assert tokens.tolist() == naive == [1, 0, 2] and probs is None


def test_bf16_logits_give_the_fp32_distribution_of_their_values():
    """A bf16 model's logits: the filtered distribution is fp32 (the docstring), computed from the bf16
    values themselves, not rounded to bf16 (8 bits of mantissa: 0.3 vs 0.30078); oracle in float64."""
    logits = torch.tensor([[0.1, 1.3, -0.7, 2.9, 0.45, 2.2]], dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    probs = filtered_probs(logits, params)
    assert probs.dtype == torch.float32
    values = logits.double()[0]
    kept = values >= values.sort(descending=True).values[3]  # top 4
    base = torch.where(kept, torch.softmax(torch.where(kept, values, float("-inf")) / 0.7, 0), 0.0)
    order = base.argsort(descending=True)
    before = base[order].cumsum(0) - base[order]
    nucleus = torch.zeros_like(base)
    nucleus[order[before < 0.9]] = base[order[before < 0.9]]
    torch.testing.assert_close(probs[0].double(), nucleus / nucleus.sum(), rtol=1e-6, atol=1e-7)
