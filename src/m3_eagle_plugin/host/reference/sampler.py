"""Token choice for the reference host: greedy argmax, or sampling with temperature / top-k / top-p.

One `SamplingParams` per run. `filtered_probs` turns logits into the filtered distribution that both the
target (for acceptance) and the drafter (for proposing) use, so rejection sampling sees exactly the
distribution each token was drawn from. Per-request generators keep sampled outputs independent of
how requests happen to be batched.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from m3_eagle_plugin._ints import exact_index

__all__ = ["SamplingParams", "filtered_probs", "choose_tokens", "request_generator"]


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        # Types first: a float top_k or seed would fail inside the first step, a bool run as 0 or 1.
        for name, kind in (("temperature", numbers.Real), ("top_p", numbers.Real), ("top_k", numbers.Integral),
                           ("seed", numbers.Integral)):
            value = getattr(self, name)
            if kind is numbers.Integral:  # any integer (`_ints`: a 0-d torch one too, not a numbers.Integral)
                index = exact_index(value)
                if index is None:
                    raise ValueError(f"{name} must be an int, got {value!r}")
                object.__setattr__(self, name, index)  # a numpy seed wraps (or overflows) in the seed arithmetic
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{name} must be a number, got {value!r}")
            try:  # a Fraction or an int past float range failed dividing the scores in the first step
                object.__setattr__(self, name, float(value))
            except OverflowError:
                raise ValueError(f"{name} must be a finite number, got one past float range") from None
        if not 0.0 <= self.temperature < math.inf:  # inf: logits / inf is 0 or NaN (a masked -inf logit)
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**63:  # `request_generator` reduces mod 2**63: 2**63 would sample as seed 0
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` fp32 probabilities after temperature, top-k and top-p (nucleus) filtering."""
    if params.greedy:
        raise ValueError("filtered_probs needs temperature > 0 (greedy has no distribution to sample)")
    scores = logits.to(torch.float32)
    vocab = scores.shape[-1]
    # Top-k on the logits themselves (the temperature keeps their order): divided first, a huge
    # temperature rounded distinct scores to equal ones, and the ties at the k-th kept more than k
    # tokens (1e46 kept every token).
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    # Shifted by the row max first (softmax does not change): a tiny temperature then sends the
    # other scores to -inf instead of every score to +-inf (a NaN distribution).
    scores = scores - scores.amax(dim=-1, keepdim=True)
    if 0 < float(torch.tensor(params.temperature, dtype=torch.float32)) < math.inf:
        scores = scores / params.temperature
    else:  # 0 in fp32 under its smallest subnormal (1e-46), the row max's 0 / 0 NaN; inf past its largest
        # finite (3.4e38), a masked logit's -inf / inf NaN: float64
        scores = (scores.to(torch.float64) / params.temperature).to(torch.float32)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        # The top token always survives, also when top_p rounds to 0 in fp32 (0 >= 0 would drop it).
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def request_generator(seed: int, request_index: int, device: torch.device | str) -> torch.Generator:
    """A generator private to one request, so its samples do not depend on the rest of the batch. The
    multiplier is odd, so distinct seeds in [0, 2**63) give one request index distinct generator seeds."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + request_index) % (2**63))
    return generator


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row of ``logits [R, V]``: ``(tokens [R] int64, probs [R, V] or None if greedy)``."""
    if params.greedy:
        return torch.argmax(logits, dim=-1), None
    probs = filtered_probs(logits, params)
    if generators is None or len(generators) != probs.shape[0]:
        raise ValueError("sampling needs one generator per row")
    if probs.shape[0] == 0:
        return torch.empty((0,), dtype=torch.long, device=logits.device), probs
    tokens = torch.stack([torch.multinomial(p, 1, generator=g).squeeze(0) for p, g in zip(probs, generators)])
    return tokens, probs
