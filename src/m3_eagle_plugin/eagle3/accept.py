"""Verification of draft tokens against the target: greedy prefix matching and lossless rejection sampling.

A verify row carries ``1 + K`` target positions: the last committed token followed by ``K`` drafts.
The target's output at row position ``j`` is its prediction for draft ``j`` (``j < K``) or the bonus
token (``j == K``). Both rules return, per row, the emitted tokens ``tokens[:, :a + 1]`` (``a``
accepted drafts, then one token from the target) and ``a``. Everything stays on the device: no
host sync, so the host can keep preparing the next step while these run.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import torch

from m3_eagle_plugin.msa.blocks import is_integer_dtype

__all__ = ["AcceptResult", "greedy_accept", "rejection_accept", "forced_accept", "forced_count_at", "forced_ratio"]


@dataclass
class AcceptResult:
    """``tokens [R, K + 1]`` (valid up to ``num_accepted + 1``), ``num_accepted [R]`` (int64)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    """Checks shapes; returns ``draft_lens`` as int64, clamped to ``[0, K]`` on the device (a row
    cannot carry more drafts than it has columns; checking instead would read them to the host)."""
    for name, value in (("draft_tokens", draft_tokens), ("target", target), ("draft_lens", draft_lens)):
        if (value is not None or name != "draft_lens") and not isinstance(value, torch.Tensor):  # None: no lengths
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    for name, value in (("draft_tokens", draft_tokens), ("draft_lens", draft_lens)):
        # token ids and lengths: a float 1.4 would be truncated to 1 and accepted as token 1
        if value is not None and not is_integer_dtype(value.dtype):
            raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [R, K], got shape {tuple(draft_tokens.shape)}")
    num_rows, num_drafts = draft_tokens.shape
    if target.dim() < 2:
        raise ValueError(f"target must be [R, K + 1, ...], got shape {tuple(target.shape)}")
    if target.shape[0] != num_rows or target.shape[1] != num_drafts + 1:
        raise ValueError(
            f"target must be [R, K + 1] = [{num_rows}, {num_drafts + 1}], got {tuple(target.shape[:2])}"
        )
    if draft_lens is None:
        return torch.full((num_rows,), num_drafts, dtype=torch.long, device=draft_tokens.device)
    if draft_lens.shape != (num_rows,):
        raise ValueError(f"draft_lens must be [R] = [{num_rows}], got {tuple(draft_lens.shape)}")
    return draft_lens.to(device=draft_tokens.device, dtype=torch.long).clamp(0, num_drafts)


def _prefix_length(ok: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of ``True`` in each row of ``ok [R, K]``, capped by ``draft_lens``."""
    num_drafts = ok.shape[1]
    in_range = torch.arange(num_drafts, device=ok.device).unsqueeze(0) < draft_lens.unsqueeze(1)
    return torch.cumprod((ok & in_range).to(torch.long), dim=1).sum(dim=1)


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``[R, K + 1]``: the accepted drafts, then ``last`` at index ``num_accepted``, then padding (= last)."""
    num_rows, num_drafts = draft_tokens.shape
    padded = torch.cat([draft_tokens, last.unsqueeze(1)], dim=1)
    index = torch.arange(num_drafts + 1, device=draft_tokens.device).unsqueeze(0)
    return torch.where(index < num_accepted.unsqueeze(1), padded, last.unsqueeze(1))


def _check_target_ids(target_tokens: torch.Tensor) -> None:
    """The greedy and forced rules take the target's argmax ids, not its logits or probabilities."""
    if target_tokens.dim() != 2 or not is_integer_dtype(target_tokens.dtype):
        raise ValueError(f"target_tokens must be an integer [R, K + 1] tensor of argmax ids, "
                         f"got {target_tokens.dtype} {tuple(target_tokens.shape)}")


def greedy_accept(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, draft_lens: torch.Tensor | None = None
) -> AcceptResult:
    """Accept the longest prefix of drafts equal to the target's argmax; the bonus is the target's next token.

    ``draft_tokens [R, K]``, ``target_tokens [R, K + 1]`` (argmax per verify position), optional
    ``draft_lens [R]`` (drafts past a row's length never count as accepted; clamped to ``[0, K]``).
    """
    draft_lens = _check_shapes(draft_tokens, target_tokens, draft_lens)
    _check_target_ids(target_tokens)
    target_tokens = target_tokens.to(torch.long)
    num_accepted = _prefix_length(draft_tokens.to(torch.long) == target_tokens[:, :-1], draft_lens)
    bonus = target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return AcceptResult(_emit(draft_tokens.to(torch.long), num_accepted, bonus), num_accepted)


def forced_accept(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, num_forced: int | torch.Tensor,
    draft_lens: torch.Tensor | None = None,
) -> AcceptResult:
    """Benchmark mode: accept ``min(num_forced, draft_len)`` drafts whatever they are (output is NOT the target's).

    ``num_forced`` is an int, or a device tensor (0-d or ``[R]``) such as `forced_count_at` returns;
    a tensor is clamped on the device, not checked (that would read it back to the host).
    """
    draft_lens = _check_shapes(draft_tokens, target_tokens, draft_lens)
    _check_target_ids(target_tokens)
    if isinstance(num_forced, torch.Tensor):
        if not is_integer_dtype(num_forced.dtype):
            raise TypeError(f"num_forced must be an integer tensor, got {num_forced.dtype}")
        if num_forced.dim() > 1 or (num_forced.dim() == 1 and num_forced.shape[0] != draft_lens.shape[0]):
            raise ValueError(f"num_forced must be an int, a 0-d tensor or [R] = [{draft_lens.shape[0]}], "
                             f"got shape {tuple(num_forced.shape)}")
        num_forced = num_forced.to(device=draft_lens.device, dtype=torch.long).clamp_min(0)
        num_accepted = torch.minimum(draft_lens, num_forced)
    else:
        if isinstance(num_forced, bool) or not isinstance(num_forced, numbers.Integral):
            # a float 1.5 / nan / inf failed deep inside gather, True counted as 1
            raise TypeError(f"num_forced must be an int or an integer tensor, got {num_forced!r}")
        num_forced = int(num_forced)
        if num_forced < 0:
            raise ValueError(f"num_forced must be >= 0, got {num_forced}")
        # drafts are capped by the K columns anyway; capping keeps 2**63 out of int64 overflow
        num_accepted = torch.clamp(draft_lens, max=min(num_forced, draft_tokens.shape[1]))
    bonus = target_tokens.to(torch.long).gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return AcceptResult(_emit(draft_tokens.to(torch.long), num_accepted, bonus), num_accepted)


_FORCED_DENOMINATOR = 10**6
_FORCED_NUMERATOR_LIMIT = 2**31  # 2**32 verify steps before (step + 1) * numerator could leave int64


def forced_ratio(mean: float) -> Fraction:
    """``mean`` as the fraction `forced_count_at` schedules; refuses what it cannot schedule (so a
    caller can check a configured mean up front, before the first verify step)."""
    if isinstance(mean, bool) or not isinstance(mean, numbers.Real) or not 0 <= mean < float("inf"):
        raise ValueError(f"mean forced acceptance must be a finite number >= 0, got {mean!r}")
    if not isinstance(mean, (int, float)):  # numpy scalars: np.int64(2) is a finite number too
        mean = int(mean) if isinstance(mean, numbers.Integral) else float(mean)
    ratio = Fraction(mean).limit_denominator(_FORCED_DENOMINATOR)
    if mean > 0 and ratio == 0:
        raise ValueError(f"mean forced acceptance {mean!r} is below the schedule's resolution "
                         f"1/{_FORCED_DENOMINATOR}: it would never force a draft")
    if ratio.numerator > _FORCED_NUMERATOR_LIMIT:  # int64 products wrapped: 1e19 gave a negative count
        raise ValueError(f"mean forced acceptance {mean!r} is too large to schedule (its fraction's numerator "
                         f"must stay <= 2**31 so that step * numerator fits int64); any mean at or above the "
                         f"draft length already forces every draft")
    return ratio


def forced_count_at(mean: float, step: torch.Tensor) -> torch.Tensor:
    """Drafts to force at verify step ``step`` (a device counter) so the running mean is ``mean``.

    ``floor((s + 1) * mean) - floor(s * mean)`` in exact rational arithmetic: each count is
    ``floor(mean)`` or ``ceil(mean)``, the first ``n`` counts sum to ``floor(n * mean)`` (2.5 gives
    2, 3, 2, 3, ...). Computed on the device from ``step``, so a CUDA graph can replay it.

    ``mean`` is taken as the nearest fraction with a denominator up to 10**6: exact for decimals of
    up to six places (0.0005 is 1/2000; a bound of 1000 made it 1/1000, twice the asked mean) and
    for simple ratios such as 1/3, while ``step * numerator`` stays far inside int64. A positive
    mean below that resolution would round to "never accept" and is refused instead.
    """
    if not isinstance(step, torch.Tensor) or not is_integer_dtype(step.dtype):  # a float 1.7 ran as step 1
        raise TypeError(f"step must be an integer tensor (a verify-step counter), got "
                        f"{step.dtype if isinstance(step, torch.Tensor) else type(step).__name__}")
    ratio = forced_ratio(mean)  # refuses a mean whose int64 products below would wrap
    step = step.to(torch.long)
    return ((step + 1) * ratio.numerator) // ratio.denominator - (step * ratio.numerator) // ratio.denominator


def _row_generators(generator: torch.Generator | Sequence[torch.Generator] | None, num_rows: int):
    if generator is None or isinstance(generator, torch.Generator):
        return None
    try:
        generators = list(generator)
    except TypeError:
        raise TypeError(f"generator must be a torch.Generator, one per row or None, "
                        f"got {type(generator).__name__}") from None
    if len(generators) != num_rows:
        raise ValueError(f"need one generator per row: {num_rows} rows, {len(generators)} generators")
    for row, g in enumerate(generators):
        if not isinstance(g, torch.Generator):
            raise TypeError(f"generator[{row}] must be a torch.Generator, got {type(g).__name__}")
    return generators


def _check_probs(draft_probs: torch.Tensor | None, target_probs: torch.Tensor) -> None:
    """Types and shapes of the distributions (after `_check_shapes`, which checked ``target_probs [R, K + 1]``).
    Both must be floating point: an integer tensor (ids passed by mistake, or probabilities cast
    to int) holds only zeros and ones."""
    if draft_probs is not None and not isinstance(draft_probs, torch.Tensor):
        raise TypeError(f"draft_probs must be a tensor or None, got {type(draft_probs).__name__}")
    for name, value in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if value is not None and not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor of probabilities, got {value.dtype}")
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [R, K + 1, V], got shape {tuple(target_probs.shape)}")
    num_rows, num_positions, vocab = target_probs.shape
    if vocab == 0:
        raise ValueError(f"target_probs must have a vocabulary of at least one token, got shape "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (num_rows, num_positions - 1, vocab):
        raise ValueError(f"draft_probs must be [R, K, V] = [{num_rows}, {num_positions - 1}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")


def _uniform(num_rows: int, num_drafts: int, device, generator, generators) -> torch.Tensor:
    if generators is None:
        return torch.rand((num_rows, num_drafts), device=device, generator=generator)
    if num_rows == 0:
        return torch.empty((0, num_drafts), device=device)
    return torch.stack([torch.rand((num_drafts,), device=device, generator=g) for g in generators])


def _sample_rows(probs: torch.Tensor, generator, generators) -> torch.Tensor:
    if generators is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    if probs.shape[0] == 0:
        return torch.empty((0,), dtype=torch.long, device=probs.device)
    return torch.stack([torch.multinomial(p, 1, generator=g).squeeze(0) for p, g in zip(probs, generators)])


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    draft_lens: torch.Tensor | None = None,
) -> AcceptResult:
    """The lossless speculative-sampling rule: emitted tokens are distributed exactly as target sampling.

    Draft ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection
    the emitted token is drawn from ``norm(max(p_j - q_j, 0))``; if every draft is accepted the bonus
    is drawn from ``p_K``. ``draft_probs [R, K, V]`` is the distribution each draft was sampled from;
    ``None`` means deterministic proposals (``q`` one-hot on the draft). ``target_probs [R, K + 1, V]``.
    ``generator`` is one generator, or one per row (sampling then does not depend on batch makeup).
    """
    draft_lens = _check_shapes(draft_tokens, target_probs, draft_lens)
    _check_probs(draft_probs, target_probs)
    num_rows, num_drafts = draft_tokens.shape
    generators = _row_generators(generator, num_rows)
    vocab = target_probs.shape[-1]
    draft_tokens = draft_tokens.to(torch.long)
    target_probs = target_probs.to(torch.float32)
    # An id outside the vocabulary has target probability 0: never accepted, and it takes no residual mass.
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)
    index = draft_tokens.clamp(0, vocab - 1).unsqueeze(-1)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(index.squeeze(-1), vocab) * in_vocab.unsqueeze(-1)
    draft_probs = draft_probs.to(torch.float32)

    p_of_draft = target_probs[:, :num_drafts].gather(2, index).squeeze(-1) * in_vocab
    q_of_draft = draft_probs.gather(2, index).squeeze(-1)
    uniform = _uniform(num_rows, num_drafts, target_probs.device, generator, generators)
    accepted = uniform * q_of_draft < p_of_draft
    num_accepted = _prefix_length(accepted, draft_lens)

    # Distribution of the emitted token at position a: residual where a draft was rejected, p itself
    # for the bonus (a == draft_len, including rows that ran out of drafts).
    residual = torch.clamp(target_probs[:, :num_drafts] - draft_probs, min=0.0)
    residual = torch.cat([residual, target_probs[:, num_drafts:]], dim=1)
    rejected_row = num_accepted < draft_lens
    pick = num_accepted.view(num_rows, 1, 1).expand(num_rows, 1, vocab)
    final_dist = torch.where(
        rejected_row.view(num_rows, 1),
        residual.gather(1, pick).squeeze(1),
        target_probs.gather(1, pick).squeeze(1),
    )
    # p == q exactly leaves no residual mass; then rejection has probability zero, sample p as a fallback.
    mass = final_dist.sum(dim=1, keepdim=True)
    fallback = target_probs.gather(1, pick).squeeze(1)
    final_dist = torch.where(mass > 0, final_dist / mass.clamp_min(1e-30), fallback)
    last = _sample_rows(final_dist, generator, generators)
    return AcceptResult(_emit(draft_tokens, num_accepted, last), num_accepted)
