"""Speculative-decoding statistics of one run: acceptance, draft counts, throughput.

Definitions follow the usual Eagle reporting: ``acceptance_rate = accepted_tokens / draft_tokens``;
``mean_acceptance_length`` = accepted drafts + 1 (the bonus token) per verify step;
``per_position_acceptance[i]`` = accepted / proposed among the verify steps that proposed a draft ``i``;
None where none did (a proposer that drafts fewer than ``draft_len``): not a measured 0. Likewise
``acceptance_rate`` is None where no draft was verified (nothing drafts, or every verify step had
none) and ``mean_acceptance_length`` where no verify step ran (every request ended at prefill).

They measure the drafter as the verifier judged it: a verify step's accepted drafts all count even
where the request then stopped inside them (an eos among them, or ``max_new_tokens`` reached), so
they do not depend on where requests end. ``generated_tokens`` counts only the tokens actually kept,
so on a request's last step it can be less than the accepted drafts + 1 recorded for it; once the
run ends, it is the tokens of the outputs returned: a request that fails (and returns none) takes
its tokens back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecStats"]


@dataclass
class SpecStats:
    draft_len: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    engine_steps: int = 0
    elapsed_s: float = 0.0
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        # Refused, not grown: ``draft_len`` is the width the per-position rates are reported for,
        # and a step outside it (or accepting more than it drafted) is a caller's bug to surface.
        if not 0 <= num_accepted <= num_drafts <= self.draft_len:
            raise ValueError(f"a verify step needs 0 <= num_accepted ({num_accepted}) <= num_drafts ({num_drafts}) "
                             f"<= draft_len ({self.draft_len})")
        if len(self.accepted_at) < self.draft_len:
            self.accepted_at = [0] * self.draft_len
            self.proposed_at = [0] * self.draft_len
        self.verify_steps += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for position in range(num_drafts):
            self.proposed_at[position] += 1
            if position < num_accepted:
                self.accepted_at[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else None

    @property
    def per_position_acceptance(self) -> list[float | None]:
        if not self.proposed_at:  # no verify step yet: still one entry per position, none measured
            return [None] * self.draft_len
        return [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "generated_tokens": self.generated_tokens,
            "engine_steps": self.engine_steps,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
        }
