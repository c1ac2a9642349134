"""Block allocator: per-request page tables over a fixed set of cache slots.

One block = one slot of every pool = ``block_size`` tokens. Requests grow with ``reserve``
(a verify step reserves its 1 + draft_len tokens up front) and shrink with ``rewind`` after
rejection. Every change is all-or-nothing: when blocks run out, or a call is cut off part-way
(Ctrl-C), nothing is modified (a free cut off once its pages went back leaves the request empty, at
0 tokens, and runs again).
"""
from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Optional, Sequence

import torch

from m3_eagle_plugin._ints import as_int


class OutOfBlocksError(RuntimeError):
    """Not enough free cache blocks; the allocator state is unchanged."""


class UnknownRequestError(KeyError, ValueError):
    """The request id is not (or no longer) known to the allocator."""


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks-1``, lowest free id first."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = as_int("num_blocks", num_blocks)
        self.block_size = as_int("block_size", block_size)
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self._free: list[int] = list(range(self.num_blocks))
        heapq.heapify(self._free)
        self._pages: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._pages)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._pages

    def blocks_for(self, num_tokens: int) -> int:
        num_tokens = as_int("num_tokens", num_tokens)
        if num_tokens < 0:  # -5 tokens gave -1 blocks
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def add_request(self, rid: Hashable) -> None:
        if rid in self._pages:
            raise ValueError(f"request {rid!r} already exists")
        self._pages[rid] = []
        self._tokens[rid] = 0

    def _require(self, rid: Hashable) -> list[int]:
        try:
            return self._pages[rid]
        except KeyError:
            raise UnknownRequestError(f"unknown request {rid!r}") from None

    def num_tokens(self, rid: Hashable) -> int:
        self._require(rid)
        return self._tokens[rid]

    def pages(self, rid: Hashable) -> list[int]:
        return list(self._require(rid))

    def reserve(self, rid: Hashable, num_tokens: int) -> list[int]:
        """Make ``rid`` hold at least ``num_tokens`` tokens; returns the newly added pages."""
        pages = self._require(rid)
        num_tokens = as_int("num_tokens", num_tokens)
        need = self.blocks_for(num_tokens) - len(pages)  # refuses num_tokens < 0
        if need > len(self._free):
            raise OutOfBlocksError(
                f"request {rid!r} needs {need} more blocks for {num_tokens} tokens, "
                f"only {len(self._free)} of {self.num_blocks} are free"
            )
        held, tokens = len(pages), self._tokens[rid]
        added: list[int] = []
        try:
            # not `while len(added) < need`: CPython 3.13 puts that loop's back edge, where a Ctrl-C is
            # raised, outside the try (python/cpython#130279), and the pages taken so far were lost
            for _ in range(need):
                # noted before it is popped: a Ctrl-C raised as heappop returns would lose a popped page
                added.append(self._free[0])
                heapq.heappop(self._free)
            # inside too: a Ctrl-C raised as extend or max returned left the pages held for the old count
            pages.extend(added)
            self._tokens[rid] = max(tokens, num_tokens)
        except BaseException:  # cut off part-way (Ctrl-C): the pages taken so far go back
            del pages[held:]
            self._tokens[rid] = tokens
            still_free = set(self._free)
            for page in added:
                if page not in still_free:
                    heapq.heappush(self._free, page)
            raise
        return added

    def allocate(self, rid: Hashable, num_tokens: int) -> list[int]:
        """Add ``rid`` holding ``num_tokens`` tokens in one step (all-or-nothing)."""
        if rid in self._pages:
            raise ValueError(f"request {rid!r} already exists")
        num_tokens = as_int("num_tokens", num_tokens)
        if num_tokens < 0:  # before anything is registered
            raise ValueError(f"request {rid!r}: num_tokens must be >= 0, got {num_tokens}")
        if self.blocks_for(num_tokens) > len(self._free):
            raise OutOfBlocksError(
                f"request {rid!r} needs {self.blocks_for(num_tokens)} blocks for {num_tokens} "
                f"tokens, only {len(self._free)} of {self.num_blocks} are free"
            )
        try:  # add_request inside: CPython 3.10 raises a pending Ctrl-C as it returns
            self.add_request(rid)
            self.reserve(rid, num_tokens)
            return self.pages(rid)
        except BaseException:  # no id left registered by a call that failed
            if rid in self._pages:
                self.free(rid)
            raise

    def rewind(self, rid: Hashable, num_tokens: int) -> list[int]:
        """Shrink ``rid`` to ``num_tokens`` tokens; returns the freed pages."""
        self._require(rid)
        num_tokens = as_int("num_tokens", num_tokens)
        if not 0 <= num_tokens <= self._tokens[rid]:
            raise ValueError(
                f"cannot rewind request {rid!r} to {num_tokens} tokens: "
                f"it holds {self._tokens[rid]}"
            )
        return self._give_back(rid, num_tokens)

    def free(self, rid: Hashable) -> None:
        self._require(rid)
        self._give_back(rid, 0)  # cut off as it returns, the request is left empty (0 tokens): free runs again
        del self._pages[rid], self._tokens[rid]

    def _give_back(self, rid: Hashable, num_tokens: int) -> list[int]:
        """Move ``rid``'s pages past ``num_tokens`` tokens to the free heap and hold it at that count,
        all or none: cut off part-way (Ctrl-C), the pages already pushed are taken back, so none is both
        held and free and the call can run again. The request is updated after the last call and jump,
        in one go: CPython 3.10 raises a pending Ctrl-C as any call returns, and one raised as this
        method returned left the pages given back with the old token count."""
        pages = self._pages[rid]
        keep = self.blocks_for(num_tokens)
        freed = pages[keep:]
        try:
            for page in freed:
                heapq.heappush(self._free, page)
        except BaseException:  # every one of them that reached the heap (a Ctrl-C may come as a push returns)
            back = set(freed)
            self._free = [page for page in self._free if page not in back]
            heapq.heapify(self._free)
            raise
        del pages[keep:]
        self._tokens[rid] = num_tokens
        return freed

    def block_table(
        self, rids: Sequence[Hashable], width: Optional[int] = None
    ) -> torch.Tensor:
        """int32 ``[len(rids), width]`` page ids per request, ``-1`` where unused."""
        rows = [self._require(rid) for rid in rids]
        longest = max((len(r) for r in rows), default=0)
        if width is None:
            width = max(longest, 1)
        elif as_int("width", width, minimum=0) < longest:  # -1 was blamed on the pages held
            raise ValueError(f"block table width {width} < {longest} pages held by a request")
        table = torch.full((len(rows), int(width)), -1, dtype=torch.int32)
        for i, row in enumerate(rows):
            if row:
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table

    def used_blocks(self) -> Iterable[int]:
        for pages in self._pages.values():
            yield from pages
