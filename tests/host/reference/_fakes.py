"""A deterministic fake target + Eagle3 head that honour the model contracts and use the paged cache.

The target's prediction at position p depends on every token at positions 0..p, and it reads
them back from the cache through the block table, so any wrong slot, stale page, wrong rollback
or wrong overlap correction changes its output. The head predicts the target's next token except
where the prefix hash is divisible by 3 (a known, independent acceptance pattern); it also writes
its input token into the draft layer and reads it back by position.
"""
from __future__ import annotations

import torch

from m3_eagle_plugin.eagle3.capture import AuxCapture
from m3_eagle_plugin.kv import PagedKVCache

MODULUS = 997
VOCAB = 11
BLOCK = 4


def fold(h: int, token: int) -> int:
    return (h * 31 + token + 1) % MODULUS


def prefix_hash(tokens) -> int:
    h = 0
    for t in tokens:
        h = fold(h, int(t))
    return h


def logit_table(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MODULUS, VOCAB, generator=g) * 2.0


def make_cache(num_blocks: int = 64) -> PagedKVCache:
    return PagedKVCache.for_minimax_m3(1, [], 1, 4, 4, BLOCK, num_blocks, num_draft_layers=1, dtype=torch.float32)


def _read_prefix(layer_k: torch.Tensor, table_row: torch.Tensor, position: int) -> list[int]:
    tokens = []
    for p in range(position + 1):
        page = int(table_row[p // BLOCK])
        tokens.append(int(layer_k[page, 0, p % BLOCK, 0]))
    return tokens


def _write(layer_k: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    for slot, token in zip(slots.tolist(), tokens.tolist()):
        if slot >= 0:
            layer_k[slot // BLOCK, 0, slot % BLOCK, 0] = float(token)


class FakeTarget:
    def __init__(self, seed: int = 0) -> None:
        self.table = logit_table(seed)
        self.vocab_size = VOCAB
        self.calls = 0

    def forward(self, input_ids, meta, cache, *, capture=None):
        self.calls += 1
        k0 = cache.k(0)
        _write(k0, meta.cache_slots, input_ids)
        hidden = []
        for t, (r, pos) in enumerate(zip(meta.token_request.tolist(), meta.positions.tolist())):
            prefix = _read_prefix(k0, meta.block_tables[r], pos)
            assert prefix[-1] == int(input_ids[t]), "token not where its slot says"
            hidden.append([float(prefix_hash(prefix)), float(pos)])
        hidden = torch.tensor(hidden, dtype=torch.float32).reshape(-1, 2)
        if capture is not None:
            capture.reset()
            capture.record(0, hidden)
        return hidden

    def compute_logits(self, hidden):
        return self.table[hidden[:, 0].long()]

    def greedy(self, prompt, n):
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(torch.argmax(self.table[prefix_hash(seq)])))
        return seq[len(prompt):]


class FakeHead:
    """Predicts the target's token at p + 2 from (token p + 1, hash of 0..p); wrong when that hash % 3 == 0."""

    def __init__(self, table: torch.Tensor, draft_layer: int = 1, wrong=lambda h: h % 3 == 0) -> None:
        self.table = table
        self.draft_layer = draft_layer
        self.wrong = wrong

    def forward(self, input_ids, hidden, meta, cache):
        k = cache.k(self.draft_layer)
        _write(k, meta.cache_slots, input_ids)
        logits, next_hidden = [], []
        for t, (r, pos) in enumerate(zip(meta.token_request.tolist(), meta.positions.tolist())):
            page = int(meta.block_tables[r][pos // BLOCK])
            token = int(k[page, 0, pos % BLOCK, 0])  # read back by position
            h = fold(int(hidden[t, 0]), token)
            row = self.table[h]
            logits.append(torch.roll(row, 1) if self.wrong(h) else row)
            next_hidden.append([float(h), float(pos + 1)])
        return torch.stack(logits) if logits else torch.empty(0, VOCAB), torch.tensor(next_hidden).reshape(-1, 2)


def head_is_right(sequence, position: int) -> bool:
    """Whether the head predicts the token at ``position + 1`` correctly given the true prefix."""
    return prefix_hash(sequence[: position + 1]) % 3 != 0


def expected_accepted(prompt, continuation, num_new: int, draft_len: int) -> tuple[int, int]:
    """(verify steps, accepted drafts) of greedy speculative decoding with FakeHead, simulated independently."""
    seq = list(prompt) + list(continuation)
    n = len(prompt)  # position of the last emitted token
    emitted, steps, accepted = 1, 0, 0
    while emitted < num_new:
        a = 0
        while a < draft_len and head_is_right(seq, n + a):
            a += 1
        steps += 1
        accepted += a
        emitted += a + 1
        n += a + 1
    return steps, accepted


def fake_capture() -> AuxCapture:
    return AuxCapture([0])
