"""The one-model Eagle3 draft loop: ``K`` head steps on the shared cache, device-only.

Eagle3 semantics: the head at position ``p`` consumes (token at ``p + 1``, target feature at ``p``)
and predicts the token at ``p + 2``. Step 0 runs over every token of the target step (prompt chunks
and the full ``1 + K`` verify rows, ids shifted by one, the target's aux features), which also
(re)writes the draft layer's KV for those positions; each drafting row then continues from one
gathered position (the last prompt token, or the last accepted verify token). Steps ``1..K-1`` are
single-token steps at consecutive positions fed with the head's own hidden state.

Their metadata is prepared on the host beforehand with optimistic lengths (all drafts accepted) and
corrected here on the device through ``on_update_kv_lens``: nothing waits for the acceptance result,
so the loop can be captured in a CUDA graph or overlapped with host work. Draft KV written at
positions that later turn out to be rejected is overwritten by the next step 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.msa.blocks import is_integer_dtype

__all__ = ["DraftResult", "DraftHead", "run_draft_loop"]


class DraftHead(Protocol):
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta, cache) -> tuple[torch.Tensor, torch.Tensor]:
        ...


@dataclass
class DraftResult:
    """``tokens [Rd, K]`` (int64) and, when sampling, the distribution each came from ``probs [Rd, K, V]``."""

    tokens: torch.Tensor
    probs: torch.Tensor | None


TokenChooser = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


def _call_head(head, input_ids, hidden, meta, cache):
    forward = head.forward if hasattr(head, "forward") else head
    return forward(input_ids, hidden, meta, cache)


def _check_gather_range(gather_index: torch.Tensor, num_tokens: int) -> None:
    """Refuse a step-0 index outside ``[0, num_tokens)`` where reading it is free: a CPU tensor.
    A CUDA index is left to ``index_select`` (after step 0): checking it would wait for the
    device, and the engine builds it on the device from the acceptance result, in range by
    construction."""
    if gather_index.device.type != "cpu" or gather_index.numel() == 0:
        return
    low, high = int(gather_index.min()), int(gather_index.max())
    if low < 0 or high >= num_tokens:
        bad = low if low < 0 else high
        raise ValueError(f"gather_index must pick step-0 tokens in [0, {num_tokens}), got {bad}")


def run_draft_loop(
    head: DraftHead,
    cache,
    *,
    first_meta,
    first_input_ids: torch.Tensor,
    first_features: torch.Tensor,
    gather_index: torch.Tensor,
    step_metas: Sequence,
    gathered_kv_lens: torch.Tensor,
    num_drafts: int,
    choose: TokenChooser,
) -> DraftResult:
    """Run ``num_drafts`` draft steps and return the proposals of the ``Rd = len(gather_index)`` drafting rows.

    ``first_meta`` is the target step's metadata (same tokens, same positions, already corrected);
    ``gather_index [Rd]`` picks each drafting row's token in step 0; ``gathered_kv_lens [Rd]`` is the
    true ``position + 1`` of that token (device); ``step_metas[i - 1]`` was prepared for step ``i``
    with one token per drafting row at the optimistic position and gets ``gathered_kv_lens + i``.
    ``choose(logits [Rd, V]) -> (tokens [Rd], probs [Rd, V] | None)`` picks each draft.
    ``first_features [T, width]``, ``gather_index`` and ``gathered_kv_lens`` live on the device of
    ``first_input_ids``.
    """
    # Everything is checked before the head runs: step 0 writes the draft layer's KV.
    num_drafts = as_int("num_drafts", num_drafts, 1)
    for name, value in (("first_input_ids", first_input_ids), ("gather_index", gather_index),
                        ("gathered_kv_lens", gathered_kv_lens)):
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or not is_integer_dtype(value.dtype):
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"{name} must be a 1-D integer tensor, got {got}")
    # index_select takes no narrower index, and `gathered_kv_lens + step` stays in its dtype (int16 wrapped
    # a length of 32767 + 1 to -32768, which the metadata clamps to 0)
    for name, value in (("gather_index", gather_index), ("gathered_kv_lens", gathered_kv_lens)):
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
    if not isinstance(first_features, torch.Tensor) or first_features.dim() != 2:
        got = (f"shape {tuple(first_features.shape)}" if isinstance(first_features, torch.Tensor)
               else type(first_features).__name__)
        raise TypeError(f"first_features must be a [T, width] tensor, got {got}")
    # Comparing devices reads no tensor (no sync); a mismatch failed only after step 0 wrote the draft KV.
    for name, value in (("first_features", first_features), ("gather_index", gather_index),
                        ("gathered_kv_lens", gathered_kv_lens)):
        if value.device != first_input_ids.device:
            raise ValueError(f"{name} is on {value.device}, first_input_ids on {first_input_ids.device}: "
                             f"the draft loop runs on one device")
    if gathered_kv_lens.shape != gather_index.shape:
        raise ValueError(f"gathered_kv_lens must be [Rd] = [{gather_index.shape[0]}] like gather_index, "
                         f"got {tuple(gathered_kv_lens.shape)}")
    if len(step_metas) < num_drafts - 1:
        raise ValueError(f"need {num_drafts - 1} prepared step metadata objects, got {len(step_metas)}")
    if first_input_ids.shape[0] != first_features.shape[0]:
        raise ValueError(
            f"step 0 ids and features disagree: {first_input_ids.shape[0]} vs {first_features.shape[0]} tokens"
        )
    _check_gather_range(gather_index, first_input_ids.shape[0])
    num_rows = gather_index.shape[0]
    for step, meta in enumerate(step_metas[:num_drafts - 1] if num_rows else (), start=1):
        # host counts (no sync); another shape failed only at its step, after step 0, blaming the loop's kv_lens
        rows, tokens = getattr(meta, "num_requests", num_rows), getattr(meta, "num_tokens", num_rows)
        if rows != num_rows or tokens != num_rows:
            raise ValueError(f"step_metas[{step - 1}] was prepared for {rows} request(s) and {tokens} token(s); "
                             f"step {step} runs one token for each of the {num_rows} drafting rows of gather_index")
    logits, hidden = _call_head(head, first_input_ids, first_features, first_meta, cache)
    if num_rows == 0:
        empty = torch.empty((0, num_drafts), dtype=torch.long, device=first_input_ids.device)
        return DraftResult(empty, None)
    logits = logits.index_select(0, gather_index)
    hidden = hidden.index_select(0, gather_index)
    tokens, probs = [], []
    for step in range(num_drafts):
        if step > 0:
            meta = step_metas[step - 1]
            meta.on_update_kv_lens(gathered_kv_lens + step)
            logits, hidden = _call_head(head, tokens[-1], hidden, meta, cache)
        token, prob = choose(logits)
        tokens.append(token.to(torch.long))
        probs.append(prob)
    stacked_probs = None if probs[0] is None else torch.stack(probs, dim=1)
    return DraftResult(torch.stack(tokens, dim=1), stacked_probs)
