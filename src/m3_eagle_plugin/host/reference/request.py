"""One generation request on the reference host: its tokens, its lifecycle state and its KV bookkeeping.

`kv_len` is optimistic: it counts target KV positions as if every in-flight step accepted all of
its drafts. The host corrects it when a step is committed; in between, the device holds the
correction (`pending_deficit`), which is what lets the next step be prepared before the current
one's acceptance is known.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

__all__ = ["RequestState", "Request", "RequestError"]


class RequestError(ValueError):
    """A request that cannot run (bad token ids, does not fit the cache, ...); it fails alone."""


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted: no KV budget yet
    PREFILL = "prefill"  # prompt chunks still to run
    DECODE = "decode"  # generating: verify rows
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    state: RequestState = RequestState.WAITING
    error: str | None = None
    output: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens already scheduled
    kv_len: int = 0  # optimistic committed target KV length
    kv_budget_tokens: int = 0  # worst-case KV tokens reserved at admission
    inflight_steps: int = 0  # launched, not yet committed
    pending_inputs: torch.Tensor | None = None  # [1 + K] device: last token, then drafts
    pending_draft_len: int = 0
    pending_draft_probs: torch.Tensor | None = None  # [K, V] device, when drafts were sampled
    pending_deficit: torch.Tensor | None = None  # 0-d device: kv_len minus the true length
    pending_step: int = -1  # id of the step that produced the pending inputs
    generator: torch.Generator | None = None
    stop_reason: str | None = None
    # Set by `Engine.finish` (and for a request refused before it was registered): its KV pages and
    # admission budget went back, so the clean-up after an error knows which done requests still hold them.
    released: bool = False
    # Of ``output``, the tokens counted in the generated_tokens of the statistics ``counted_in``: taken
    # back there if the request fails, whose output is not returned.
    counted_tokens: int = 0
    counted_in: object | None = field(default=None, repr=False)
    owner: object | None = field(default=None, repr=False)  # the engine's mark (`Engine.owns`)

    @property
    def rid(self) -> int:
        return self.index

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.FAILED)

    def fail(self, message: str) -> None:
        self.state = RequestState.FAILED
        self.error = message

    def append_tokens(self, tokens: list[int]) -> None:
        """Append emitted tokens, stopping at the first eos id (kept) or at ``max_new_tokens``."""
        for token in tokens:
            if self.done:
                return
            self.output.append(token)
            if token in self.eos_ids:
                self.state, self.stop_reason = RequestState.FINISHED, "eos"
            elif len(self.output) >= self.max_new_tokens:
                self.state, self.stop_reason = RequestState.FINISHED, "length"
