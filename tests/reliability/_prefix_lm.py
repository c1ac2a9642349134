"""A cheap target model for soaking the reference host: its next token hashes the prefix it READS
BACK from the paged cache, so any lost, stale or foreign KV slot changes the output.

Forward contract as in docs/internals.md: `forward(input_ids [T], meta, cache, *, capture=None)
-> hidden [T, H]`, `compute_logits(hidden) -> [T, V]` fp32. Each token writes (token id,
position) into layer 0's K and V at `meta.cache_slots`, then reads positions 0..p of its request
through `meta.block_tables` and hashes the (token, position) pairs it finds. `reference()` is
the same chain computed without any cache: what a single request must produce.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

HIDDEN = 4
_MOD = 1_000_003


def _fold(h: int, token: int, position: int) -> int:
    return (h * 131 + token * 7 + position + 1) % _MOD


class PrefixHashLM:
    def __init__(self, vocab_size: int, msa_mod) -> None:
        self.vocab_size = vocab_size
        self.msa = msa_mod

    def forward(self, input_ids: torch.Tensor, meta, cache, *, capture=None) -> torch.Tensor:
        t = input_ids.shape[0]
        positions = meta.positions[:t].to(torch.long)
        k_view, v_view = cache.k(0), cache.v(0)
        heads, block, dim = k_view.shape[1], k_view.shape[2], k_view.shape[3]
        values = torch.zeros(t, heads, dim, dtype=k_view.dtype)
        values[:, :, 0] = input_ids.to(k_view.dtype).unsqueeze(1)
        values[:, :, 1] = positions.to(k_view.dtype).unsqueeze(1)
        self.msa.write_kv(k_view, v_view, meta.cache_slots[:t], values, values)
        rows = meta.token_request[:t].to(torch.long).tolist()
        tables = meta.block_tables
        hidden = torch.zeros(t, HIDDEN)
        for i, (row, pos) in enumerate(zip(rows, positions.tolist())):
            span = torch.arange(pos + 1)
            pages = tables[row].to(torch.long)[span // block]
            seen = k_view[pages, 0, span % block, :2].to(torch.long).tolist()
            h = 0
            for token, where in seen:
                h = _fold(h, token, where)
            hidden[i, 0] = float(h % self.vocab_size)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].to(torch.long)] = 1.0
        return logits

    def reference(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of one request, computed without the cache."""
        tokens, out, h = list(prompt), [], 0
        for position, token in enumerate(tokens):
            h = _fold(h, token, position)
        while len(out) < max_new_tokens:
            nxt = h % self.vocab_size
            out.append(nxt)
            if nxt in eos_ids:
                break
            h = _fold(h, nxt, len(tokens) + len(out) - 1)
        return out


class NoisyOracle:
    """Host-side drafter: the true continuation with seeded mistakes, so acceptance varies."""

    def __init__(self, model: PrefixHashLM, error_rate: float, seed: int) -> None:
        self.model, self.error_rate, self.seed = model, error_rate, seed
        self.proposals = 0

    def __call__(self, context) -> list[list[int]]:
        drafts = []
        for rid, tokens in zip(context.request_ids, context.tokens):
            truth = self.model.reference(tokens, context.draft_len)
            rng = random.Random(hash((self.seed, rid, len(tokens))))
            drafts.append([(x + 1) % self.model.vocab_size if rng.random() < self.error_rate else x for x in truth])
            self.proposals += 1
        return drafts
