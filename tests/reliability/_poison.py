"""A paged KV pool that is NaN everywhere a request does not own, for out-of-bounds detection.

Every slot (page, offset) starts as NaN. A test marks the slots a request legitimately holds
(`own`), which fills them with finite random values. After the code under test ran, the unowned
slots must still be NaN (nothing wrote out of bounds) and every output must be finite (nothing
read out of bounds: a single NaN read poisons a softmax or a matmul).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class PoisonedPool:
    num_pages: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    index_dim: int
    seed: int = 0
    k: torch.Tensor = field(init=False)
    v: torch.Tensor = field(init=False)
    index_k: torch.Tensor = field(init=False)
    owned: torch.Tensor = field(init=False)
    sentinel: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        nan = float("nan")
        shape = (self.num_pages, self.num_kv_heads, self.block_size, self.head_dim)
        self.k = torch.full(shape, nan)
        self.v = torch.full(shape, nan)
        self.index_k = torch.full((self.num_pages, self.block_size, self.index_dim), nan)
        self.owned = torch.zeros(self.num_pages, self.block_size, dtype=torch.bool)
        self.sentinel = torch.zeros(self.num_pages, self.block_size, dtype=torch.bool)
        self.sentinel_value = 0.0
        self._gen = torch.Generator().manual_seed(self.seed)

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._gen)

    def own(self, page: int, offsets: range, *, fill: bool = True) -> None:
        """Mark `offsets` of `page` as owned; `fill` writes finite values there (the prefix)."""
        for off in offsets:
            self.owned[page, off] = True
            if fill:
                self.k[page, :, off] = self._rand(self.num_kv_heads, self.head_dim)
                self.v[page, :, off] = self._rand(self.num_kv_heads, self.head_dim)
                self.index_k[page, off] = self._rand(self.index_dim)

    def own_request(self, block_row: list[int], kv_len: int, prefix_len: int) -> None:
        """Own positions [0, kv_len) of a request; fill [0, prefix_len) (the cached part)."""
        for pos in range(kv_len):
            page = block_row[pos // self.block_size]
            self.own(page, range(pos % self.block_size, pos % self.block_size + 1), fill=pos < prefix_len)

    def mark_tails(self, value: float) -> None:
        """Not-yet-written slots of partly owned pages (a request's last-page tail, and its own
        slots still to be written) hold the finite `value` instead of NaN: a kernel that loads
        them but masks them exactly then passes, one that lets them into the result does not.
        (NaN tails are checked separately.)"""
        partly = self.owned.any(dim=1, keepdim=True).expand_as(self.owned)
        fill = partly & torch.isnan(self.k.permute(0, 2, 1, 3)).all(-1).all(-1)
        self.k.permute(0, 2, 1, 3)[fill] = value
        self.v.permute(0, 2, 1, 3)[fill] = value
        self.index_k[fill] = value
        self.sentinel, self.sentinel_value = fill & ~self.owned, float(value)

    def assert_unowned_untouched(self) -> None:
        """Every unowned slot of K, V and index-K still holds NaN, or its tail sentinel (nothing
        wrote out of bounds)."""
        for name, t in (("k", self.k.permute(0, 2, 1, 3)), ("v", self.v.permute(0, 2, 1, 3)), ("index_k", self.index_k)):
            if not (t[self.sentinel] == self.sentinel_value).all():
                raise AssertionError(f"write into an unowned {name} tail slot")
        unowned = ~self.owned & ~self.sentinel
        k_bad = ~torch.isnan(self.k.permute(0, 2, 1, 3)[unowned]).all()
        v_bad = ~torch.isnan(self.v.permute(0, 2, 1, 3)[unowned]).all()
        i_bad = ~torch.isnan(self.index_k[unowned]).all()
        if k_bad or v_bad or i_bad:
            hit = torch.nonzero(unowned & ~torch.isnan(self.k.permute(0, 2, 1, 3)).all(-1).all(-1))
            raise AssertionError(f"write outside the owned slots (page, offset): {hit[:8].tolist()}")

    def assert_owned_finite(self) -> None:
        """Every owned slot holds a finite value (everything the step should write was written)."""
        for name, t in (("k", self.k.permute(0, 2, 1, 3)), ("v", self.v.permute(0, 2, 1, 3))):
            if not torch.isfinite(t[self.owned]).all():
                raise AssertionError(f"owned {name} slot left unwritten")
        if not torch.isfinite(self.index_k[self.owned]).all():
            raise AssertionError("owned index-K slot left unwritten")


def distinct_block_tables(num_blocks: list[int], width: int, num_pages: int, seed: int) -> torch.Tensor:
    """int32 `[R, width]` tables with pairwise distinct random pages, `-1` past each row's blocks."""
    if sum(num_blocks) > num_pages:
        raise ValueError("not enough pages for the requested blocks")
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(num_blocks), width), -1, dtype=torch.int32)
    cursor = 0
    for row, n in enumerate(num_blocks):
        table[row, :n] = torch.tensor(perm[cursor:cursor + n], dtype=torch.int32)
        cursor += n
    return table


def blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size) if num_tokens > 0 else 0
