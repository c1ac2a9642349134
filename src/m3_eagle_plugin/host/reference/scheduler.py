"""Continuous batching: which rows run in the next step.

Each step mixes context rows (prompt chunks, chunked to the per-step token limit) and verify rows
(``1 + K`` tokens per generating request). Running requests are served first, then prompt chunks
in arrival order. A request is admitted only when its worst-case KV need fits next to the worst
cases of the requests already admitted, so a running request never waits for a free page.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

from m3_eagle_plugin.host.reference.request import Request, RequestError, RequestState

__all__ = ["RowKind", "ScheduledRow", "Scheduler", "kv_budget_tokens"]


class RowKind(enum.Enum):
    CONTEXT = "context"
    VERIFY = "verify"


@dataclass(frozen=True)
class ScheduledRow:
    """``start`` is the row's first position; a context row is final when it reaches the prompt's end."""

    request: Request
    kind: RowKind
    start: int
    length: int
    final: bool = False


def kv_budget_tokens(prompt_len: int, max_new_tokens: int, draft_len: int) -> int:
    """Worst-case KV tokens of one request: every token, plus the optimistic overhang of an
    in-flight verify step and the positions its draft steps write ahead."""
    return prompt_len + max_new_tokens + 4 * draft_len + 1


class Scheduler:
    def __init__(
        self, *, max_batch_size: int, max_tokens_per_step: int, draft_len: int, block_size: int, total_blocks: int,
        max_blocks_per_seq: int | None = None,
    ) -> None:
        self.check_limits(max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step, draft_len=draft_len)
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.draft_len = draft_len
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.max_blocks_per_seq = total_blocks if max_blocks_per_seq is None else min(max_blocks_per_seq, total_blocks)
        self.admitted_blocks = 0

    @staticmethod
    def check_limits(*, max_batch_size: int, max_tokens_per_step: int, draft_len: int) -> None:
        """Refuse step limits that could never schedule a verify row."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_tokens_per_step < 1 + draft_len:
            raise ValueError(
                f"max_tokens_per_step ({max_tokens_per_step}) must hold one verify row of 1 + draft_len "
                f"= {1 + draft_len} tokens"
            )

    def blocks_needed(self, request: Request) -> int:
        tokens = kv_budget_tokens(len(request.prompt), request.max_new_tokens, self.draft_len)
        return math.ceil(tokens / self.block_size)

    def check_fits(self, request: Request) -> None:
        """Raise `RequestError` when the request could never fit the cache, even alone."""
        need = self.blocks_needed(request)
        if need > self.max_blocks_per_seq:
            # Every term in tokens: the headroom alone (4 x draft_len + 1) can be what does not fit.
            where = ("the cache has only" if self.max_blocks_per_seq == self.total_blocks
                     else "max_seq_len allows one request only")
            headroom = kv_budget_tokens(0, 0, self.draft_len)
            total = kv_budget_tokens(len(request.prompt), request.max_new_tokens, self.draft_len)
            raise RequestError(
                f"request {request.index} needs {need} KV blocks of {self.block_size} tokens (prompt "
                f"{len(request.prompt)} + max_new_tokens {request.max_new_tokens} + draft headroom {headroom} "
                f"= {total} tokens) but {where} {self.max_blocks_per_seq} "
                f"blocks ({self.max_blocks_per_seq * self.block_size} tokens)"
            )

    def release(self, request: Request) -> None:
        """Give back the admission budget of a request that ended (idempotent)."""
        if request.kv_budget_tokens:
            need = self.blocks_needed(request)  # no call between the two updates: a Ctrl-C comes after a call
            request.kv_budget_tokens = 0
            self.admitted_blocks -= need

    def fits_now(self, request: Request) -> bool:
        """Whether `admit` would take the request now (nothing is reserved)."""
        return self.admitted_blocks + self.blocks_needed(request) <= self.total_blocks

    def admit(self, request: Request) -> bool:
        """Reserve the KV blocks a request needs for its whole life; False when they do not fit now."""
        if not self.fits_now(request):
            return False
        need = self.blocks_needed(request)  # no call between the two updates: a Ctrl-C comes after a call
        budget = kv_budget_tokens(len(request.prompt), request.max_new_tokens, self.draft_len)
        self.admitted_blocks += need
        request.kv_budget_tokens = budget
        request.state = RequestState.PREFILL
        return True

    def schedule(self, requests: Sequence[Request]) -> list[ScheduledRow]:
        """Rows for the next step; admits waiting requests as KV budget allows (FIFO, no overtaking)."""
        verify_cost = 1 + self.draft_len
        verify_rows: list[ScheduledRow] = []
        tokens = 0
        for request in requests:
            if request.state is not RequestState.DECODE:
                continue
            if len(request.output) + request.inflight_steps >= request.max_new_tokens:
                continue  # will finish when its in-flight step commits
            if len(verify_rows) == self.max_batch_size or tokens + verify_cost > self.max_tokens_per_step:
                break
            verify_rows.append(ScheduledRow(request, RowKind.VERIFY, request.kv_len, verify_cost))
            tokens += verify_cost
        context_rows: list[ScheduledRow] = []
        for request in requests:
            if len(verify_rows) + len(context_rows) == self.max_batch_size or tokens == self.max_tokens_per_step:
                break
            if request.state is RequestState.WAITING and not self.admit(request):
                break
            if request.state is not RequestState.PREFILL:
                continue
            remaining = len(request.prompt) - request.num_prefilled
            chunk = min(remaining, self.max_tokens_per_step - tokens)
            context_rows.append(
                ScheduledRow(request, RowKind.CONTEXT, request.num_prefilled, chunk, final=chunk == remaining)
            )
            tokens += chunk
        return context_rows + verify_rows
