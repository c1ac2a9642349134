"""Host proposers through the engine: replayed drafts with controlled mistakes must be accepted
exactly up to the first mistake, and no proposal changes the greedy output."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.hooks import DraftContext
from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.proposers import DrafterPlugin, PromptLookupProposer, ReplayProposer
from m3_eagle_plugin.registry import PluginError, make_plugin_manager

from . import _fakes

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 1], [7]]
NEW = 10


def run(proposer=None, plugin_manager=None, overlap=False, draft_len=3):
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache()
    engine = Engine(target, cache, EngineConfig(draft_len=draft_len, max_batch_size=2, max_tokens_per_step=8,
                                                overlap=overlap),
                    vocab_size=_fakes.VOCAB, proposer=proposer, plugin_manager=plugin_manager)
    result = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert result.outputs == [target.greedy(p, NEW) for p in PROMPTS]
    assert cache.num_free_blocks == cache.num_blocks
    return result


def references():
    target = _fakes.FakeTarget()
    return {i: p + target.greedy(p, NEW + 8) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("error_rate", [0.0, 1.0, 0.3, 0.7])
def test_replay_acceptance_equals_correct_proposals(error_rate):
    proposer = ReplayProposer.with_error_rate(references(), _fakes.VOCAB, error_rate, seed=5)
    result = run(proposer, overlap=True)
    assert result.stats.accepted_tokens == proposer.expected_accepted
    assert result.stats.draft_tokens == proposer.proposed
    assert result.overlap is False  # host proposals need committed tokens
    if error_rate == 0.0:
        assert result.stats.acceptance_rate == 1.0
        assert result.stats.mean_acceptance_length == 4.0
    if error_rate == 1.0:
        assert result.stats.accepted_tokens == 0


def test_prompt_lookup_through_the_plugin_hook():
    manager = make_plugin_manager(register_builtin=False)
    manager.register(DrafterPlugin(PromptLookupProposer()), name="lookup")
    result = run(plugin_manager=manager)
    assert result.draft_source == "plugin"
    assert result.stats.draft_tokens > 0


def test_prompt_lookup_reference_examples():
    lookup = PromptLookupProposer(max_ngram=2)
    assert lookup.propose_one([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert lookup.propose_one([5, 6, 7], 2) == []
    assert lookup.propose_one([4, 4], 3) == [4]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 4))
def test_prompt_lookup_proposes_what_followed_a_matching_suffix(tokens, k):
    proposal = PromptLookupProposer(max_ngram=3).propose_one(tokens, k)
    assert len(proposal) <= k
    if proposal:
        n = len(tokens)
        assert any(
            tokens[s: s + m] == tokens[n - m:] and tokens[s + m: s + m + len(proposal)] == proposal
            for m in range(1, 4) for s in range(0, n - m)
        )


def test_replay_refuses_a_diverged_request():
    proposer = ReplayProposer({0: [1, 2, 3, 4]}, 11)
    with pytest.raises(ValueError, match="diverged"):
        proposer(DraftContext.build([0], [[1, 9]], 2))


def test_replay_refuses_a_request_it_has_no_reference_for_naming_it():
    """A request id outside the references failed subscripting None."""
    proposer = ReplayProposer({0: [1, 2, 3, 4]}, 11)
    with pytest.raises(KeyError, match="ReplayProposer has no reference for request 7"):
        proposer(DraftContext.build([7], [[1, 2]], 2))


@pytest.mark.parametrize("error_rate", [-0.1, 1.5, float("nan")])
def test_replay_refuses_an_error_rate_that_is_not_a_fraction(error_rate):
    """A share of positions lies in [0, 1]: 1.5 ran as 1, -0.1 as 0 and nan as 0 (no mistakes) silently."""
    with pytest.raises(ValueError, match=rf"^error_rate must be in \[0, 1\], got {error_rate}$"):
        ReplayProposer.with_error_rate(references(), _fakes.VOCAB, error_rate)


def test_drafter_plugin_refuses_a_proposal_count_that_does_not_match_the_requests():
    context = DraftContext.build([0, 1], [[1, 2], [3]], 2)
    plugin = DrafterPlugin(lambda ctx: [[5], [6, 7], [8, 9]])  # three proposals for two requests
    with pytest.raises(ValueError, match="3 requests, expected 2"):
        plugin.m3_eagle_propose_drafts(context)
    assert DrafterPlugin(lambda ctx: [[5], []]).m3_eagle_propose_drafts(context) == [[5, 5], [3, 3]]


@pytest.mark.parametrize("token", [2.7, 3.0, "3", True])
@pytest.mark.parametrize("through_plugin", [False, True])
def test_a_non_integer_draft_token_is_refused_naming_the_request(token, through_plugin):
    """`int` would verify 2 for a proposed 2.7 (or 3 for "3"): a token nobody proposed."""
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache()
    proposer = lambda ctx: [[token] * ctx.draft_len for _ in ctx.tokens]  # noqa: E731
    manager = None
    if through_plugin:
        manager = make_plugin_manager(register_builtin=False)
        manager.register(DrafterPlugin(proposer), name="floats")
        proposer = None
    engine = Engine(target, cache, EngineConfig(draft_len=2, max_batch_size=1, max_tokens_per_step=8),
                    vocab_size=_fakes.VOCAB, proposer=proposer, plugin_manager=manager)
    with pytest.raises(Exception, match=r"request 0\b") as raised:
        engine.generate(PROMPTS[:1], max_new_tokens=NEW)
    assert repr(token) in str(raised.value)
    assert cache.num_free_blocks == cache.num_blocks


def test_integer_draft_tokens_of_other_types_are_taken():
    """0-d torch integers are integers (`operator.index` takes them): the replayed drafts are
    accepted exactly as the plain-int replay's are."""
    import torch

    replay = ReplayProposer.with_error_rate(references(), _fakes.VOCAB, 0.3, seed=5)
    result = run(lambda ctx: [list(torch.tensor(p, dtype=torch.long)) for p in replay(ctx)])
    assert result.stats.accepted_tokens == replay.expected_accepted > 0


def test_prompt_lookup_copies_the_latest_earlier_occurrence():
    """Docstring: what followed the *latest* earlier occurrence. [1] occurs at 0 and 2 before the
    suffix: the latest (2) is followed by [3, 1]; the earliest would give [2, 1]."""
    assert PromptLookupProposer(max_ngram=1).propose_one([1, 2, 1, 3, 1], 2) == [3, 1]


def test_prompt_lookup_prefers_the_longest_matching_suffix():
    """The 2-gram [1, 2] matched at 0 (followed by 9) wins over the later 1-gram [2] at 3 (followed by 5)."""
    tokens = [1, 2, 9, 2, 5, 1, 2]
    assert PromptLookupProposer(max_ngram=2).propose_one(tokens, 1) == [9]
    assert PromptLookupProposer(max_ngram=1).propose_one(tokens, 1) == [5]


def test_prompt_lookup_takes_equal_min_and_max_ngram():
    lookup = PromptLookupProposer(max_ngram=2, min_ngram=2)
    assert lookup.propose_one([7, 8, 3, 7, 8], 2) == [3, 7]
    assert lookup.propose_one([7, 8, 3, 8], 2) == []  # a 1-gram match does not count
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)
    for sizes in ({"max_ngram": 2.5}, {"min_ngram": True}, {"max_ngram": "3"}):  # would fail later, in range()
        with pytest.raises(ValueError, match="min_ngram"):
            PromptLookupProposer(**sizes)


def test_replay_proposes_up_to_the_end_of_the_reference():
    """reference[len(tokens):][:K]: the reference's last tokens are proposed too."""
    proposer = ReplayProposer({0: [1, 2, 3, 4]}, 11)
    assert proposer(DraftContext.build([0], [[1, 2]], 3)) == [[3, 4]]
    assert proposer.proposed == 2 and proposer.expected_accepted == 2
    assert proposer(DraftContext.build([0], [[1, 2, 3]], 3)) == [[4]]


def test_replay_past_the_end_of_its_reference_proposes_nothing_rather_than_a_divergence():
    """reference[len(tokens):][:K] is empty once the run is longer than the reference: its tokens agree
    with all of it, so nothing diverged; a reference covering only the first new tokens still runs."""
    proposer = ReplayProposer({0: [1, 2, 3]}, 11)
    assert proposer(DraftContext.build([0], [[1, 2, 3, 4, 5]], 3)) == [[]]
    assert proposer.proposed == 0 and proposer.expected_accepted == 0
    with pytest.raises(ValueError, match="request 0: generated tokens diverged"):
        proposer(DraftContext.build([0], [[1, 5, 3, 4]], 3))
    target = _fakes.FakeTarget()
    short = ReplayProposer({i: p + target.greedy(p, 3) for i, p in enumerate(PROMPTS)}, _fakes.VOCAB)
    run(proposer=short)  # NEW = 10 tokens, past the 3 replayed: greedy output all the same
    assert short.proposed == short.expected_accepted == 2 * len(PROMPTS)  # the 2 after the first new token


def test_drafter_plugin_pads_with_the_last_proposed_token():
    context = DraftContext.build([0], [[1, 2]], 4)
    assert DrafterPlugin(lambda ctx: [[5, 6]]).m3_eagle_propose_drafts(context) == [[5, 6, 6, 6]]


def test_drafter_plugin_pads_an_empty_proposal_with_the_requests_last_token():
    context = DraftContext.build([0], [[1, 2, 3]], 2)
    assert DrafterPlugin(lambda ctx: [[]]).m3_eagle_propose_drafts(context) == [[3, 3]]


def test_drafter_plugin_cuts_a_long_proposal_to_draft_len():
    context = DraftContext.build([0, 1], [[1, 2], [3]], 2)
    assert DrafterPlugin(lambda ctx: [[5, 6, 7, 8], [9, 9, 9]]).m3_eagle_propose_drafts(context) == [[5, 6], [9, 9]]


def test_drafter_plugin_refuses_to_pad_from_nothing_naming_the_request():
    """Padding repeats the proposal's last token, else the request's; when both are empty the
    contract's draft_len ids cannot be made up, so it is an error that names the request (id 7)."""
    context = DraftContext.build([3, 7], [[1], []], 2)
    plugin = DrafterPlugin(lambda ctx: [[5], []])
    with pytest.raises(ValueError, match=r"request 7\b.*nothing to pad with"):
        plugin.m3_eagle_propose_drafts(context)
    # nothing to pad: an empty request with a full proposal, or draft_len 0, is fine
    assert DrafterPlugin(lambda ctx: [[5, 6], [8, 9]]).m3_eagle_propose_drafts(context) == [[5, 6], [8, 9]]
    empty = DraftContext.build([4], [[]], 0)
    assert DrafterPlugin(lambda ctx: [[]]).m3_eagle_propose_drafts(empty) == [[]]


@pytest.mark.parametrize("proposal", [6, None])
def test_drafter_plugin_refuses_a_proposal_that_is_not_a_list_naming_the_request(proposal):
    context = DraftContext.build([3, 7], [[1], [2]], 2)
    plugin = DrafterPlugin(lambda ctx: [[5], proposal])
    with pytest.raises(ValueError, match=rf"request 7\b.*expected a list of token ids, got {proposal!r}"):
        plugin.m3_eagle_propose_drafts(context)


def test_non_integer_ids_of_a_drafter_plugin_are_refused_naming_the_request():
    """DrafterPlugin pads (repeating 2.5) and leaves ids to the plugin manager, which refuses them
    naming the request id (7), not its position."""
    manager = make_plugin_manager(register_builtin=False)
    manager.register(DrafterPlugin(lambda ctx: [[5], [2.5]]), name="floats")
    with pytest.raises(PluginError, match=r"2\.5 for request 7\b"):
        manager.propose_drafts(DraftContext.build([3, 7], [[1], [2]], 2))


def test_a_drafter_plugins_proposer_returning_no_list_of_proposals_is_named():
    """A proposer returning 5 failed listing it: a bare "'int' object is not iterable" named neither."""
    context = DraftContext.build([0], [[1, 2, 3]], 2)
    with pytest.raises(ValueError, match=r"^proposer returned 5: expected one list of token ids per request$"):
        DrafterPlugin(lambda ctx: 5).m3_eagle_propose_drafts(context)


def test_prompt_lookup_takes_any_integer_n_gram_sizes():
    """The package's int rule (`_ints`): numpy and 0-d torch integers are ints; they were refused as
    "need ints". The lookup then is the plain-int one's."""
    np = pytest.importorskip("numpy")
    import torch

    tokens = [1, 2, 9, 2, 5, 1, 2]
    for sizes in ((np.int64(2), np.int32(1)), (torch.tensor(2), torch.tensor(1))):
        lookup = PromptLookupProposer(max_ngram=sizes[0], min_ngram=sizes[1])
        assert (type(lookup.max_ngram), type(lookup.min_ngram)) == (int, int)
        assert lookup.propose_one(tokens, 1) == PromptLookupProposer(max_ngram=2).propose_one(tokens, 1) == [9]


@pytest.mark.parametrize("references,vocab_size,field", [
    ({0: [1, 2, 3, 4]}, 2.5, "vocab_size"), ({0: [1, 2, 3, 4]}, 0, "vocab_size"),
    ({0.5: [1, 2, 3, 4]}, 11, "request id"), ({True: [1, 2, 3, 4]}, 11, "request id"),
])
def test_replay_refuses_a_vocabulary_size_or_request_id_that_is_not_an_int(references, vocab_size, field):
    """int() truncated them: vocab_size 2.5 drew its mistakes modulo 2 and reference 0.5 replayed for
    request 0 (the package's int rule refuses, never truncates)."""
    with pytest.raises(ValueError, match=rf"ReplayProposer {field} must be an int"):
        ReplayProposer(references, vocab_size)
