"""The device-only draft loop against a naive sequential reference.

A toy head writes its input token into the draft layer and predicts from the sum of every draft-layer
token it can see (positions <= its own), so draft KV read past the accepted position (stale tokens
from rejected verify positions) or written at the optimistic instead of the corrected position
changes the drafts.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.eagle3.draft_loop import run_draft_loop
from m3_eagle_plugin.kv import PagedKVCache
from m3_eagle_plugin.msa import MsaDecodeMetadata

VOCAB, BLOCK, DRAFT_LAYER = 13, 4, 1


class SumHead:
    def forward(self, input_ids, hidden, meta, cache):
        k = cache.k(DRAFT_LAYER)
        for slot, token in zip(meta.cache_slots.tolist(), input_ids.tolist()):
            k[slot // BLOCK, 0, slot % BLOCK, 0] = float(token)
        out = []
        for t, (r, pos) in enumerate(zip(meta.token_request.tolist(), meta.positions.tolist())):
            table = meta.block_tables[r]
            seen = sum(int(k[int(table[p // BLOCK]), 0, p % BLOCK, 0]) for p in range(pos + 1))
            out.append((int(hidden[t, 0]) + seen) % VOCAB)
        logits = torch.nn.functional.one_hot(torch.tensor(out, dtype=torch.long), VOCAB).float().reshape(-1, VOCAB)
        return logits, (hidden[:, :1] + input_ids.unsqueeze(1).float())


def naive(prior, ids, features, gather, num_drafts):
    """Sequential reference: draft cache = prior tokens + step-0 ids up to the gathered position."""
    cache = list(prior) + list(ids[: gather + 1])
    h = features[gather]
    drafts = [(h + sum(cache)) % VOCAB]
    h = h + ids[gather]
    for _ in range(num_drafts - 1):
        cache.append(drafts[-1])
        drafts.append((h + sum(cache)) % VOCAB)
        h = h + drafts[-2]
    return drafts


def greedy_choice(logits):
    return torch.argmax(logits, -1), None


def run_case(prior, ids, features, accepted, num_drafts, num_step_metas=None, choose=greedy_choice):
    """One row of len(ids) tokens after `prior` committed ones; the head continues from token `accepted`.

    `num_step_metas` (default num_drafts - 1) is how many prepared step metadata objects are passed."""
    cache = PagedKVCache.for_minimax_m3(1, [], 1, 4, 4, BLOCK, 32, num_draft_layers=1, dtype=torch.float32)
    cache.add_request(0)
    start, length = len(prior), len(ids)
    staged = start + length
    cache.reserve(0, staged + num_drafts)
    table = cache.block_table([0], width=32)
    k = cache.k(DRAFT_LAYER)
    for p, token in enumerate(prior):
        k[int(table[0, p // BLOCK]), 0, p % BLOCK, 0] = float(token)
    meta = MsaDecodeMetadata(2, 16, 32, BLOCK, "cpu", max_draft_len=num_drafts)
    meta.prepare([length], [staged], table)
    step_metas = []
    for step in range(1, num_drafts):
        m = MsaDecodeMetadata(2, 2, 32, BLOCK, "cpu")
        m.prepare([1], [staged + step], table)  # optimistic: as if the last token were gathered
        step_metas.append(m)
    feats = torch.tensor(features, dtype=torch.float32).view(-1, 1)
    result = run_draft_loop(
        SumHead(), cache, first_meta=meta, first_input_ids=torch.tensor(ids), first_features=feats,
        gather_index=torch.tensor([accepted]),
        step_metas=step_metas[:num_drafts - 1 if num_step_metas is None else num_step_metas],
        gathered_kv_lens=torch.tensor([start + accepted + 1], dtype=torch.int32), num_drafts=num_drafts,
        choose=choose,
    )
    return result


def test_verify_row_with_a_rejection_drafts_from_the_accepted_position():
    prior, ids, features = [3, 1, 4, 1, 5], [9, 2, 6, 5], [2, 7, 1, 8]
    result = run_case(prior, ids, features, accepted=1, num_drafts=3)
    assert result.tokens.tolist() == [naive(prior, ids, features, 1, 3)]
    assert result.probs is None


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_draft_loop_matches_sequential_reference(data):
    num_drafts = data.draw(st.integers(1, 4))
    prior = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=9))
    length = data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
    features = data.draw(st.lists(st.integers(0, 20), min_size=length, max_size=length))
    accepted = data.draw(st.integers(0, length - 1))
    result = run_case(prior, ids, features, accepted, num_drafts)
    assert result.tokens.tolist() == [naive(prior, ids, features, accepted, num_drafts)]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="num_drafts"):
        run_draft_loop(SumHead(), None, first_meta=None, first_input_ids=torch.zeros(1, dtype=torch.long),
                       first_features=torch.zeros(1, 1), gather_index=torch.zeros(1, dtype=torch.long),
                       step_metas=[], gathered_kv_lens=torch.ones(1, dtype=torch.int32), num_drafts=0,
                       choose=lambda x: (x.argmax(-1), None))
    with pytest.raises(ValueError, match="prepared step metadata"):
        run_draft_loop(SumHead(), None, first_meta=None, first_input_ids=torch.zeros(1, dtype=torch.long),
                       first_features=torch.zeros(1, 1), gather_index=torch.zeros(1, dtype=torch.long),
                       step_metas=[], gathered_kv_lens=torch.ones(1, dtype=torch.int32), num_drafts=3,
                       choose=lambda x: (x.argmax(-1), None))


@pytest.mark.parametrize("num_drafts", [2, 3, 4])
def test_exactly_num_drafts_minus_one_step_metas_suffice_and_one_fewer_is_refused(num_drafts):
    """Steps 1..K-1 each need their own prepared metadata: K - 1 objects run the whole loop (and match
    the sequential reference); K - 2 are refused with the documented error."""
    prior, ids, features = [3, 1, 4], [9, 2, 6], [2, 7, 1]
    result = run_case(prior, ids, features, 1, num_drafts, num_step_metas=num_drafts - 1)
    assert result.tokens.tolist() == [naive(prior, ids, features, 1, num_drafts)]
    with pytest.raises(ValueError, match=rf"^need {num_drafts - 1} prepared step metadata objects, "
                                         rf"got {num_drafts - 2}$"):
        run_case(prior, ids, features, 1, num_drafts, num_step_metas=num_drafts - 2)


def test_sampled_drafts_come_back_as_int64_rows_with_their_distributions_per_step():
    """`tokens [Rd, K]` int64 and `probs [Rd, K, V]`: probs[r, k] is the distribution draft k of row r
    was chosen from. A chooser that returns int32 ids must still give int64 tokens. With one row and
    K = 3 the layout [Rd, K, V] is told apart from [K, Rd, V]; the SumHead's logits are the one-hot
    of the sequential reference's draft, so each step's distribution is softmax(one_hot(draft))."""
    prior, ids, features = [3, 1, 4, 1, 5], [9, 2, 6, 5], [2, 7, 1, 8]
    num_drafts = 3
    result = run_case(prior, ids, features, accepted=1, num_drafts=num_drafts,
                      choose=lambda logits: (logits.argmax(-1).to(torch.int32), torch.softmax(logits, -1)))
    want = naive(prior, ids, features, 1, num_drafts)
    assert result.tokens.dtype == torch.int64 and result.tokens.tolist() == [want]
    assert result.probs is not None and result.probs.shape == (1, num_drafts, VOCAB)
    for step, token in enumerate(want):
        expected = torch.full((VOCAB,), 1.0)
        expected[token] = torch.e
        torch.testing.assert_close(result.probs[0, step], expected / expected.sum())


class CountingHead:
    """Stands for a head whose step 0 writes the draft KV: counts its calls."""

    def __init__(self):
        self.calls = 0

    def forward(self, input_ids, hidden, meta, cache):
        self.calls += 1
        return torch.nn.functional.one_hot(input_ids % VOCAB, VOCAB).float(), hidden


@pytest.mark.parametrize("index", [[2], [0, 5], [-1], [-2, 1]])
def test_a_cpu_gather_index_out_of_range_is_refused_before_step_0_writes_the_cache(index):
    """It failed in index_select after the head's step 0 had already written the draft KV."""
    head = CountingHead()
    bad = 5 if 5 in index else index[0]  # the first out-of-range one, the low end when below 0
    with pytest.raises(ValueError, match=rf"^gather_index must pick step-0 tokens in \[0, 2\), got {bad}$"):
        run_draft_loop(head, None, first_meta=None, first_input_ids=torch.tensor([3, 4]),
                       first_features=torch.zeros(2, 1), gather_index=torch.tensor(index), step_metas=[],
                       gathered_kv_lens=torch.ones(len(index), dtype=torch.int32), num_drafts=1,
                       choose=greedy_choice)
    assert head.calls == 0
    ok = run_draft_loop(head, None, first_meta=None, first_input_ids=torch.tensor([3, 4]),
                        first_features=torch.zeros(2, 1), gather_index=torch.tensor([1]), step_metas=[],
                        gathered_kv_lens=torch.ones(1, dtype=torch.int32), num_drafts=1, choose=greedy_choice)
    assert ok.tokens.tolist() == [[4]] and head.calls == 1


def _loop_args(**overrides):
    args = dict(first_meta=None, first_input_ids=torch.tensor([3, 4]), first_features=torch.zeros(2, 1),
                gather_index=torch.tensor([1]), step_metas=[], gathered_kv_lens=torch.ones(1, dtype=torch.int32),
                num_drafts=1, choose=greedy_choice)
    args.update(overrides)
    return args


@pytest.mark.parametrize("features, got", [
    ([[0.0], [0.0]], "list"),
    (None, "NoneType"),
    (torch.zeros(2), r"shape \(2,\)"),
    (torch.zeros(2, 1, 1), r"shape \(2, 1, 1\)"),
])
def test_first_features_that_are_not_a_two_dimensional_tensor_are_refused_before_step_0(features, got):
    """A list failed with AttributeError ('list' object has no attribute 'shape'); a 1-D or 3-D tensor
    reached the head, which writes the draft KV before it can fail."""
    head = CountingHead()
    with pytest.raises(TypeError, match=rf"^first_features must be a \[T, width\] tensor, got {got}$"):
        run_draft_loop(head, None, **_loop_args(first_features=features))
    assert head.calls == 0


@pytest.mark.parametrize("name", ["gather_index", "gathered_kv_lens", "first_features"])
def test_an_argument_on_another_device_than_the_step_0_ids_is_refused_before_step_0(name):
    """The meta device stands for a second accelerator (no GPU here): a device comparison reads no
    tensor. A gather_index elsewhere failed in index_select after the head had written the draft KV,
    and gathered_kv_lens elsewhere was not looked at at all with one draft."""
    head = CountingHead()
    good = _loop_args()
    moved = good[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name} is on meta, first_input_ids on cpu: "):
        run_draft_loop(head, None, **_loop_args(**{name: moved}))
    assert head.calls == 0
    assert run_draft_loop(head, None, **good).tokens.tolist() == [[4]] and head.calls == 1


class _RecordingMeta:
    def __init__(self):
        self.updates = []

    def on_update_kv_lens(self, kv_lens):
        self.updates.append(kv_lens)


def test_no_drafting_rows_runs_step_0_only_and_returns_an_empty_int64_result():
    """Step 0 still (re)writes the draft KV of every token of the target step; with no row to continue
    (gather_index empty) there is nothing to draft: the head runs once, no later step metadata is
    touched, and the result is an empty [0, K] int64 tensor."""
    head, metas = CountingHead(), [_RecordingMeta(), _RecordingMeta()]
    result = run_draft_loop(head, None, **_loop_args(
        gather_index=torch.zeros(0, dtype=torch.long), gathered_kv_lens=torch.zeros(0, dtype=torch.int32),
        step_metas=metas, num_drafts=3))
    assert head.calls == 1 and all(m.updates == [] for m in metas)
    assert result.tokens.dtype == torch.int64 and result.tokens.shape == (0, 3)


def test_step_0_ids_and_features_of_different_lengths_are_refused_before_step_0():
    head = CountingHead()
    with pytest.raises(ValueError, match=r"^step 0 ids and features disagree: 2 vs 3 tokens$"):
        run_draft_loop(head, None, **_loop_args(first_features=torch.zeros(3, 1)))
    assert head.calls == 0


@pytest.mark.parametrize("name, dtype", [("gather_index", torch.int16), ("gather_index", torch.uint8),
                                         ("gathered_kv_lens", torch.int16), ("gathered_kv_lens", torch.int8)])
def test_a_gather_index_or_kv_lens_narrower_than_int32_is_refused_before_step_0(name, dtype):
    """An int16 gather_index failed in index_select ('Expected dtype int32 or int64 for index') after
    step 0 had written the draft KV; int16 gathered_kv_lens of 32767 gave step 1 the length -32768 (the
    documented `gathered_kv_lens + 1` is 32768), which the metadata clamps to 0."""
    head = CountingHead()
    with pytest.raises(TypeError, match=rf"^{name} must be int32 or int64, got {dtype}$"):
        run_draft_loop(head, None, **_loop_args(**{name: _loop_args()[name].to(dtype)}))
    assert head.calls == 0
    meta = _RecordingMeta()
    run_draft_loop(head, None, **_loop_args(gathered_kv_lens=torch.tensor([32767], dtype=torch.int32),
                                            step_metas=[meta], num_drafts=2))
    assert [int(x) for x in meta.updates[0]] == [32768] and head.calls == 2


@pytest.mark.parametrize("qo_lens", [[1, 1, 1], [2, 2], [1]])
def test_step_metadata_prepared_for_other_rows_is_refused_before_step_0(qo_lens):
    """`step_metas[i - 1]` holds one token per drafting row (docstring). Metadata of three rows for two
    drafting rows failed only at step 1, after step 0, blaming the loop's own kv_lens ('kv_lens must be
    [num_requests=3], got (2,)'); two tokens a row reached the head. Both are named before step 0 now,
    and the same metadata prepared for the two rows runs."""
    def meta_for(qo):
        meta = MsaDecodeMetadata(4, 8, 8, BLOCK, "cpu")
        meta.prepare(qo, [6] * len(qo), torch.arange(8, dtype=torch.int32).repeat(len(qo), 1))
        return meta

    head = CountingHead()
    args = _loop_args(first_input_ids=torch.tensor([3, 4, 5, 6]), first_features=torch.zeros(4, 1),
                      gather_index=torch.tensor([1, 3]), gathered_kv_lens=torch.tensor([2, 4], dtype=torch.int32),
                      num_drafts=2)
    rows, tokens = len(qo_lens), sum(qo_lens)
    with pytest.raises(ValueError, match=rf"^step_metas\[0\] was prepared for {rows} request\(s\) and {tokens} "
                                         rf"token\(s\); step 1 runs one token for each of the 2 drafting rows"):
        run_draft_loop(head, None, **{**args, "step_metas": [meta_for(qo_lens)]})
    assert head.calls == 0
    result = run_draft_loop(head, None, **{**args, "step_metas": [meta_for([1, 1])]})
    assert head.calls == 2 and result.tokens.tolist() == [[4, 4], [6, 6]]
