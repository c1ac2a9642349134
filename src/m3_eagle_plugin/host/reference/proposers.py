"""Host-side draft proposers, usable directly or as plugins of the `m3_eagle_propose_drafts` hook.

The Eagle3 head is the default drafter and runs on the device inside the step (runner). These are
examples and test tools: `ReplayProposer` replays a known continuation with controlled mistakes
(so tests know exactly how many drafts must be accepted), `PromptLookupProposer` copies what
followed the latest earlier occurrence of the current suffix. Whatever they propose, greedy output
is the target's; only the acceptance statistics change.
"""
from __future__ import annotations

import random
from typing import Callable, Mapping, Sequence

from m3_eagle_plugin._ints import as_int, exact_index
from m3_eagle_plugin.hooks import DraftContext, hookimpl

__all__ = ["ReplayProposer", "PromptLookupProposer", "DrafterPlugin"]


class ReplayProposer:
    """Proposes ``reference[rid][len(tokens):][:K]``, each draft replaced by a wrong token where
    ``is_wrong(rid, position)`` says so. ``expected_accepted`` sums the correct leading drafts of every
    proposal, which is what a correct verifier must accept."""

    def __init__(
        self,
        references: Mapping[int, Sequence[int]],
        vocab_size: int,
        is_wrong: Callable[[int, int], bool] | None = None,
    ) -> None:
        # as_int, not int(): a float id or vocabulary size was truncated (vocab 2.5 drew mistakes mod 2)
        self.references = {as_int("ReplayProposer request id", rid, error=ValueError): list(seq)
                           for rid, seq in references.items()}
        self.vocab_size = as_int("ReplayProposer vocab_size", vocab_size, 1, ValueError)
        self.is_wrong = is_wrong or (lambda rid, position: False)
        self.expected_accepted = 0
        self.proposed = 0

    @classmethod
    def with_error_rate(cls, references, vocab_size: int, error_rate: float, seed: int = 0) -> "ReplayProposer":
        """Mistakes at a fixed, seeded set of positions (``error_rate`` of them)."""
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        salt = random.Random(seed).random()
        return cls(references, vocab_size, lambda rid, pos: random.Random(hash((salt, rid, pos))).random() < error_rate)

    def __call__(self, context: DraftContext) -> list[list[int]]:
        drafts = []
        for rid, tokens in zip(context.request_ids, context.tokens):
            reference = self.references.get(int(rid))
            if reference is None:
                raise KeyError(f"ReplayProposer has no reference for request {rid}")
            start = len(tokens)
            # Compared over what both hold: tokens past the reference's end did not diverge from it
            # (there is nothing left to propose: reference[start:] is empty).
            known = min(start, len(reference))
            if list(reference[:known]) != list(tokens)[:known]:
                raise ValueError(f"request {rid}: generated tokens diverged from the replayed reference")
            proposal, leading, still_right = [], 0, True
            for position in range(start, min(start + context.draft_len, len(reference))):
                token = reference[position]
                if self.is_wrong(rid, position):
                    token = (token + 1) % self.vocab_size
                    still_right = False
                elif still_right:
                    leading += 1
                proposal.append(token)
            self.expected_accepted += leading
            self.proposed += len(proposal)
            drafts.append(proposal)
        return drafts


class PromptLookupProposer:
    """N-gram prompt lookup: find the longest suffix (``max_ngram`` down to ``min_ngram`` tokens) that
    occurred earlier and propose the tokens that followed it; nothing when no n-gram matches."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        # any integer (a numpy one too, `_ints`); a float 1.5 would fail later inside range()
        sizes = exact_index(min_ngram), exact_index(max_ngram)
        if None in sizes or not 1 <= sizes[0] <= sizes[1]:
            raise ValueError(f"need ints 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
        self.min_ngram, self.max_ngram = sizes

    def propose_one(self, tokens: Sequence[int], draft_len: int) -> list[int]:
        tokens = list(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start: start + n] == suffix:
                    follow = tokens[start + n: start + n + draft_len]
                    if follow:
                        return follow
        return []

    def __call__(self, context: DraftContext) -> list[list[int]]:
        return [self.propose_one(tokens, context.draft_len) for tokens in context.tokens]


class DrafterPlugin:
    """Registers a proposer under the `m3_eagle_propose_drafts` hook (pads short proposals by
    repeating their last token, else the request's last token, since the hook contract asks for
    exactly ``draft_len`` ids; with neither there is nothing to repeat and it raises ValueError)."""

    def __init__(self, proposer: Callable[[DraftContext], list[list[int]] | None]) -> None:
        self.proposer = proposer

    @hookimpl
    def m3_eagle_propose_drafts(self, context: DraftContext) -> list[list[int]] | None:
        drafts = self.proposer(context)
        if drafts is None:
            return None
        try:  # iter() alone: a TypeError raised inside a generator's body is the generator's own
            rows = iter(drafts)
        except TypeError:  # 'int' object is not iterable named neither the proposer nor what it returned
            raise ValueError(f"proposer returned {drafts!r}: expected one list of token ids per request") from None
        drafts = list(rows)
        if len(drafts) != len(context.tokens):  # zip below would silently drop the extra proposals
            raise ValueError(f"proposer returned drafts for {len(drafts)} requests, expected {len(context.tokens)}")
        padded = []
        for rid, proposal, tokens in zip(context.request_ids, drafts, context.tokens):
            try:
                proposal = list(proposal)[: context.draft_len]
            except TypeError:
                raise ValueError(f"proposer's drafts for request {rid}: expected a list of token ids, "
                                 f"got {proposal!r}") from None
            missing = context.draft_len - len(proposal)
            if missing:
                repeat = proposal or tokens
                if not repeat:
                    raise ValueError(f"proposer's drafts for request {rid}: {context.draft_len} ids needed, but the "
                                     f"proposal and the request's tokens are both empty (nothing to pad with)")
                proposal += [repeat[-1]] * missing
            padded.append(proposal)
        return padded
