"""Eagle3 with greedy acceptance against plain greedy decoding, on random tiny MiniMax-M3 checkpoints.

Several `make-tiny` seeds, batch sizes, step budgets (chunked prefill), prompt lengths across block
boundaries and past the MSA selection, overlap, a KV pool that holds requests back: every request
must emit exactly what transformers' greedy `generate` emits for it alone (its free run, cut at
max_new_tokens and at the first eos id).

A random Eagle3 head accepts almost nothing, so every verify step would reject all its drafts and
the stops that fall inside an accepted chain (max_new_tokens reached, or an eos among the accepted
drafts) would never run. `OracleHead` runs the real head (its draft KV, its hidden states) and only
replaces its logits with the reference continuation's next token, wrong at seeded positions, so the
same device path accepts long chains and rejects part-way; which of those stops each case hits is
checked on the committed steps, not assumed.
"""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.host.reference.build import build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.host.reference.request import RequestState
from m3_eagle_plugin.host.reference.scheduler import RowKind, kv_budget_tokens

SEEDS = (2, 3)
PROMPT_LENGTHS = (1, 4, 5, 13, 17, 26)  # one token, a block, past a block, past the MSA top-k window
LONGEST_NEW = 12
FREE_RUN = LONGEST_NEW + 4 + 2  # the drafts of the longest case's last step (K = 4) read past it


class OracleHead:
    """The real Eagle3 head, with its logits replaced: at position p of request r (a row's request is
    found by its first page) the draft is ``sequences[r][p + 2]``, wrong (+1) where ``(p + r) % miss``
    is 0 (never without ``miss``)."""

    def __init__(self, head, cache, sequences: dict[int, list[int]], miss: int | None) -> None:
        self.head, self.cache, self.sequences, self.miss = head, cache, sequences, miss

    def forward(self, input_ids, hidden, meta, cache):
        logits, hidden = self.head.forward(input_ids, hidden, meta, cache)
        owner = {self.cache.pages(rid)[0]: rid for rid in self.cache.allocator.request_ids if self.cache.pages(rid)}
        vocab = logits.shape[-1]
        forced = torch.zeros_like(logits)
        for t, (row, position) in enumerate(zip(meta.token_request.tolist(), meta.positions.tolist())):
            rid = owner[int(meta.block_tables[row, 0])]
            sequence = self.sequences[rid]
            token = sequence[position + 2] if position + 2 < len(sequence) else 0
            if self.miss is not None and (position + rid) % self.miss == 0:
                token = (token + 1) % vocab
            forced[t, token] = 1.0
        return forced, hidden


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per seed: (target dir, draft dir, prompts, transformers' greedy continuation of each prompt,
    long enough for every case's drafts)."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    from m3_eagle_plugin.models.tiny import make_tiny

    torch.set_num_threads(1)
    out = {}
    for seed in SEEDS:
        target_dir, draft_dir = make_tiny(tmp_path_factory.mktemp(f"differential_{seed}"), seed=seed)
        hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
            target_dir, dtype=torch.float32, attn_implementation="eager").eval()
        gen = torch.Generator().manual_seed(100 + seed)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        runs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():  # the mask given: one inferred from pad_token_id hides a prompt's 0 ids
                ids = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=FREE_RUN,
                                  min_new_tokens=FREE_RUN, do_sample=False, pad_token_id=0)
            runs.append(ids[0, len(prompt):].tolist())
        out[seed] = target_dir, draft_dir, prompts, runs
    return out


def stopped(run: list[int], max_new: int, eos) -> list[int]:
    """What greedy decoding emits: ``run`` up to ``max_new`` tokens, ending at the first eos id (kept)."""
    for j, token in enumerate(run[:max_new]):
        if token in eos:
            return run[:j + 1]
    return run[:max_new]


def record_stops(engine) -> list[tuple[str, int, int]]:
    """Wrap the engine's commit: (stop reason, tokens kept, drafts accepted) of every verify row that
    ended its request. Kept <= accepted: the last kept token was an accepted draft, not the bonus."""
    stops, commit = [], engine.commit

    def recorded(out, requests, progress):
        before = {id(row.request): (row.request.done, len(row.request.output)) for row in out.rows}
        commit(out, requests, progress)
        for i, row in enumerate(out.rows):
            was_done, length = before[id(row.request)]
            if row.kind is RowKind.VERIFY and not was_done and row.request.done:
                stops.append((row.request.stop_reason, len(row.request.output) - length, int(out.num_accepted[i])))

    engine.commit = recorded
    return stops


def eos_inside_a_chain(continuation: list[int], draft_len: int) -> int:
    """A token that, with every draft accepted, ends the request as an accepted draft: the first new
    token at an index a verify step fills with a draft (index 0 comes from the prefill, each step then
    emits K drafts and the bonus, so the bonus sits at multiples of K + 1)."""
    for j, token in enumerate(continuation):
        if j and j % (draft_len + 1) and token not in continuation[:j]:
            return token
    raise AssertionError(f"no eos candidate in {continuation}")


# (name, draft_len, max_batch_size, max_tokens_per_step, overlap, miss, max_new_tokens, eos, pool)
# miss None: every draft right, so the step structure is known and max_new_tokens (7 at K = 4: the
# second verify step keeps 1 of its 5 tokens) or the eos (an accepted draft's index) falls inside a
# chain; with a miss every few positions verify steps reject part-way. "tight": the pool holds the
# two largest requests' worst cases, so later ones wait for admission and reuse freed pages.
CASES = [
    ("K1 batch1", 1, 1, 8, False, 3, 9, False, "ample"),
    ("K3 batch3 chunked", 3, 3, 9, False, 4, LONGEST_NEW, False, "ample"),
    ("K4 all right, length inside a chain", 4, 4, 16, False, None, 7, False, "tight"),
    ("K4 all right overlap, length inside a chain", 4, 2, 10, True, None, 7, False, "ample"),
    ("K2 all right, eos inside a chain", 2, 6, 32, False, None, LONGEST_NEW, True, "ample"),
    ("K3 overlap, eos, misses", 3, 5, 12, True, 3, LONGEST_NEW, True, "tight"),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name,draft_len,batch,step_tokens,overlap,miss,max_new,with_eos,pool", CASES,
                         ids=[case[0] for case in CASES])
def test_eagle3_greedy_emits_exactly_the_targets_greedy_tokens(models, seed, name, draft_len, batch, step_tokens,
                                                               overlap, miss, max_new, with_eos, pool):
    target_dir, draft_dir, prompts, free_run = models[seed]
    eos = (eos_inside_a_chain(free_run[0], draft_len),) if with_eos else ()
    expected = [stopped(run, max_new, eos) for run in free_run]
    needs = [-(-kv_budget_tokens(len(p), max_new, draft_len) // 4) for p in prompts]
    num_blocks = sum(needs) if pool == "ample" else sum(sorted(needs)[-2:])
    config = EngineConfig(draft_len=draft_len, max_batch_size=batch, max_tokens_per_step=step_tokens,
                          overlap=overlap, eos_ids=eos)
    engine = build_engine(target_dir, draft_dir, config, num_blocks=num_blocks)
    sequences = {i: list(p) + run for i, (p, run) in enumerate(zip(prompts, free_run))}
    engine.head = engine.runner.head = OracleHead(engine.head, engine.cache, sequences, miss)
    stops = record_stops(engine)
    held_back, schedule = [], engine.scheduler.schedule

    def watched(requests):  # the first waiting request, were it next, would not fit beside the admitted ones
        waiting = [r for r in requests if r.state is RequestState.WAITING]
        held_back.append(bool(waiting) and not engine.scheduler.fits_now(waiting[0]))
        return schedule(requests)

    engine.scheduler.schedule = watched

    result = engine.generate(prompts, max_new)

    assert result.errors == [None] * len(prompts)
    assert result.outputs == expected
    assert engine.cache.num_free_blocks == engine.cache.num_blocks and engine.scheduler.admitted_blocks == 0
    assert not engine.cache.allocator.request_ids
    assert any(held_back) is (pool == "tight")
    if miss is None:
        assert result.stats.accepted_tokens == result.stats.draft_tokens > 0
    else:
        assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens
    inside = {reason for reason, kept, accepted in stops if kept <= accepted}
    if miss is None:
        assert ("eos" if with_eos else "length") in inside, stops
    if with_eos:
        assert any(out and out[-1] in eos and len(out) < max_new for out in result.outputs)
