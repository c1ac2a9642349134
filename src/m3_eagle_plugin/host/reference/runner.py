"""One engine step on the device: metadata, target forward with aux capture, acceptance, draft loop.

`launch(rows)` does the host work first (KV reservation, `prepare()` of the step metadata and of
every draft step's metadata, with optimistic lengths where an earlier step's acceptance is still
unknown), then queues device work only: the correction of those lengths through
`on_update_kv_lens`, the target forward, the acceptance rule and the Eagle3 draft loop. It
returns device tensors; nothing here reads a device value back, so the engine may prepare the
next step before this one's results are known (overlap) and the device part can be replayed
from a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from m3_eagle_plugin.eagle3.accept import (
    AcceptResult, forced_accept, forced_count_at, forced_ratio, greedy_accept, rejection_accept,
)
from m3_eagle_plugin.eagle3.draft_loop import run_draft_loop
from m3_eagle_plugin.host.reference.sampler import SamplingParams, choose_tokens, filtered_probs
from m3_eagle_plugin.host.reference.scheduler import RowKind, ScheduledRow

__all__ = ["RunnerConfig", "StepOutput", "StepRunner", "step_metadata_bytes"]


@dataclass(frozen=True)
class RunnerConfig:
    draft_len: int
    max_batch_size: int
    max_tokens_per_step: int
    max_blocks_per_seq: int
    block_size: int
    device: torch.device
    sampling: SamplingParams = SamplingParams()
    force_accepted: float | None = None  # int: that many per step; fractional: that mean (see forced_count)
    num_index_heads: int = 1
    cuda_graphs: bool = False
    num_pages: int | None = None  # the cache's pages: the step metadata refuses block-table ids past them


@dataclass
class StepOutput:
    """Device results of one step, row-aligned with `rows`.

    ``emitted [R, K + 1]`` holds each row's new tokens (first ``num_emitted`` valid: ``a + 1`` for
    a verify row, 1 for a final prompt chunk, 0 otherwise); ``num_accepted [R]``; ``deficit [R]`` is
    how far the optimistic kv length staged for the next step overshoots (``K - a``).
    ``next_inputs [Rd, 1 + K]`` (last emitted token, then drafts) and ``next_draft_probs`` belong
    to the drafting rows ``drafting_rows`` (indices into `rows`).
    """

    step_id: int
    rows: list[ScheduledRow]
    draft_lens: list[int]
    emitted: torch.Tensor
    num_emitted: torch.Tensor
    num_accepted: torch.Tensor
    deficit: torch.Tensor
    drafting_rows: list[int]
    next_inputs: torch.Tensor
    next_draft_probs: torch.Tensor | None
    head_drafts: bool
    # (host tensor, event): emitted | num_emitted | num_accepted on their way to the host, started
    # by the engine right after launch (`engine._start_readback`); None until then.
    readback: tuple | None = None


MetadataFactory = Callable[..., object]


def _metadata_args(config: RunnerConfig, has_head: bool) -> list[tuple[tuple, dict]]:
    """Constructor arguments of the step metadata a runner allocates: the step's own, then one per
    draft step after the first (the head's)."""
    k = config.draft_len
    common = (config.max_blocks_per_seq, config.block_size, config.device)
    step = ((config.max_batch_size, config.max_tokens_per_step, *common),
            dict(max_draft_len=k, num_index_heads=config.num_index_heads, num_pages=config.num_pages))
    draft = ((config.max_batch_size, config.max_batch_size, *common),
             dict(max_draft_len=0, num_index_heads=config.num_index_heads, num_pages=config.num_pages))
    return [step] + [draft] * (max(k - 1, 0) if has_head else 0)


def step_metadata_bytes(config: RunnerConfig, has_head: bool) -> int:
    """Bytes of the `MsaDecodeMetadata` buffers a `StepRunner` with this config allocates (sized by
    max_batch_size, max_tokens_per_step and max_blocks_per_seq), computed without allocating them."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata

    return sum(MsaDecodeMetadata.buffer_bytes(*args, **kwargs) for args, kwargs in _metadata_args(config, has_head))


class StepRunner:
    def __init__(
        self,
        target,
        cache,
        config: RunnerConfig,
        *,
        head=None,
        capture=None,
        metadata_factory: MetadataFactory | None = None,
    ) -> None:
        if metadata_factory is None:
            from m3_eagle_plugin.msa import MsaDecodeMetadata as metadata_factory  # noqa: N813
        if head is not None and capture is None:
            raise ValueError("an Eagle3 head needs an AuxCapture for the target's features")
        self.target = target
        self.cache = cache
        self.config = config
        self.head = head
        self.capture = capture
        (args, kwargs), *drafts = _metadata_args(config, head is not None)
        self.meta = metadata_factory(*args, **kwargs)
        self.draft_metas = [metadata_factory(*a, **kw) for a, kw in drafts]
        # `forced_ratio` decides what the configured mean is; a whole one needs no step counter.
        self.forced_mean = None if config.force_accepted is None else forced_ratio(config.force_accepted)
        fractional = self.forced_mean is not None and self.forced_mean.denominator != 1
        self.forced_step = torch.zeros((), dtype=torch.long, device=config.device) if fractional else None
        self.graphs = None
        if config.cuda_graphs:
            from m3_eagle_plugin.host.reference.cuda_graphs import GenerationGraphs

            self.graphs = GenerationGraphs(self)

    def forced_count(self) -> int | torch.Tensor:
        """Drafts to force in this verify step: the configured int, or for a fractional mean the next
        count of `forced_count_at`'s schedule, read from a device step counter that this advances."""
        if self.forced_step is None:
            return int(self.forced_mean)
        count = forced_count_at(float(self.config.force_accepted), self.forced_step)
        self.forced_step.add_(1)
        return count

    def return_forced_count(self) -> None:
        """Give back the schedule entry the last verify step took (its rows turned out void), so the
        next verify step gets it; on the device, queued behind that step's read of the counter."""
        if self.forced_step is not None:
            self.forced_step.sub_(1)

    def restart_forced_schedule(self) -> None:
        """Start `forced_count_at`'s schedule over (each `generate` call), in place: a captured CUDA
        graph keeps reading the same counter."""
        if self.forced_step is not None:
            self.forced_step.zero_()

    # ----- host side ---------------------------------------------------------------------------
    def _reserve_tokens(self, staged_kv: int) -> int:
        """KV tokens a row needs: its staged length, plus the positions the draft steps write ahead."""
        return staged_kv + (max(self.config.draft_len - 1, 0) if self.head is not None else 0)

    def _to_device(self, values: list[int], dtype=torch.long) -> torch.Tensor:
        """Through pinned memory: a pageable source may make the copy wait for the stream's earlier
        work (under the overlapped loop, the step in flight)."""
        pinned = self.config.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(self.config.device, non_blocking=True)

    # ----- one step ----------------------------------------------------------------------------
    def launch(self, rows: Sequence[ScheduledRow], step_id: int) -> StepOutput:
        cfg, k, device = self.config, self.config.draft_len, self.config.device
        rows = list(rows)
        if self.graphs is not None and self.graphs.eligible(rows):
            return self.graphs.launch(rows, step_id)
        qo_lens, staged, rids = [], [], []
        offsets, offset = [], 0
        for row in rows:
            request = row.request
            if row.kind is RowKind.CONTEXT:
                kv = row.start + row.length
            else:
                kv = request.kv_len + 1 + k
            qo_lens.append(row.length)
            staged.append(kv)
            rids.append(request.rid)
            offsets.append(offset)
            offset += row.length
            self.cache.reserve(request.rid, self._reserve_tokens(kv))
        num_context = sum(1 for row in rows if row.kind is RowKind.CONTEXT)
        block_tables = self.cache.block_table(rids, width=cfg.max_blocks_per_seq)
        self.meta.prepare(qo_lens, staged, block_tables, num_context_requests=num_context)

        final_rows = [i for i, row in enumerate(rows) if row.kind is RowKind.CONTEXT and row.final]
        verify_rows = [i for i, row in enumerate(rows) if row.kind is RowKind.VERIFY]
        drafting_rows = final_rows + verify_rows
        use_head = self.head is not None and k > 0
        if use_head and self.draft_metas and drafting_rows:
            draft_rids = [rids[i] for i in drafting_rows]
            draft_tables = self.cache.block_table(draft_rids, width=cfg.max_blocks_per_seq)
            for step, meta in enumerate(self.draft_metas, start=1):
                meta.prepare([1] * len(drafting_rows), [staged[i] + step for i in drafting_rows], draft_tables)

        # ----- device side: nothing below reads a device value back -----
        input_ids, shrink = self._step_inputs(rows, verify_rows)
        staged_dev = self._to_device(staged, torch.int32)
        if shrink is not None:
            self.meta.on_update_kv_lens(staged_dev - shrink)
        capture = self.capture if use_head else None
        hidden = self.target.forward(input_ids, self.meta, self.cache, capture=capture)

        final_index = self._to_device([offsets[i] + rows[i].length - 1 for i in final_rows])
        verify_index = self._to_device([offsets[i] + j for i in verify_rows for j in range(k + 1)])
        logits = self.target.compute_logits(hidden.index_select(0, torch.cat([final_index, verify_index])))
        final_logits, verify_logits = logits[: len(final_rows)], logits[len(final_rows):]
        first_tokens, _ = choose_tokens(final_logits, cfg.sampling, self._generators(rows, final_rows))
        draft_lens = [row.request.pending_draft_len if row.kind is RowKind.VERIFY else 0 for row in rows]
        accept = self._accept(rows, verify_rows, verify_logits, draft_lens)

        num_rows = len(rows)
        emitted = torch.zeros((num_rows, k + 1), dtype=torch.long, device=device)
        num_emitted = torch.zeros((num_rows,), dtype=torch.long, device=device)
        num_accepted = torch.zeros((num_rows,), dtype=torch.long, device=device)
        final_pos = self._to_device(final_rows)
        verify_pos = self._to_device(verify_rows)
        emitted[final_pos, 0] = first_tokens
        num_emitted[final_pos] = 1
        emitted[verify_pos] = accept.tokens
        num_emitted[verify_pos] = accept.num_accepted + 1
        num_accepted[verify_pos] = accept.num_accepted
        deficit = torch.zeros((num_rows,), dtype=torch.long, device=device)
        deficit[verify_pos] = k - accept.num_accepted

        last_emitted = torch.cat([first_tokens, accept.tokens.gather(1, accept.num_accepted.unsqueeze(1)).squeeze(1)])
        drafts, draft_probs = self._draft(
            rows, offsets, staged_dev, shrink, final_rows, verify_rows, first_tokens, accept, use_head
        )
        next_inputs = torch.cat([last_emitted.unsqueeze(1), drafts], dim=1)
        return StepOutput(
            step_id=step_id, rows=rows, draft_lens=draft_lens, emitted=emitted, num_emitted=num_emitted,
            num_accepted=num_accepted, deficit=deficit, drafting_rows=drafting_rows, next_inputs=next_inputs,
            next_draft_probs=draft_probs, head_drafts=use_head,
        )

    def _step_inputs(self, rows: list[ScheduledRow],
                     verify_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input ids ``[T]`` (prompt chunks from the host, verify rows from device-held drafts) and the
        per-row device correction of the staged kv lengths (None when every length is exact)."""
        pieces: list[torch.Tensor] = []
        for row in rows:
            if row.kind is RowKind.CONTEXT:
                chunk = row.request.prompt[row.start: row.start + row.length]
                pieces.append(self._to_device(chunk))
            else:
                pieces.append(row.request.pending_inputs.to(torch.long))
        input_ids = torch.cat(pieces)
        deficits = [rows[i].request.pending_deficit for i in verify_rows]
        if all(d is None for d in deficits):
            return input_ids, None
        zero = torch.zeros((), dtype=torch.long, device=self.config.device)
        per_row = [zero] * len(rows)
        for i, d in zip(verify_rows, deficits):
            if d is not None:
                per_row[i] = d
        return input_ids, torch.stack(per_row).to(torch.int32)

    def _generators(self, rows: list[ScheduledRow], indices: list[int]) -> list[torch.Generator] | None:
        if self.config.sampling.greedy:
            return None
        return [rows[i].request.generator for i in indices]

    def _accept(
        self, rows: list[ScheduledRow], verify_rows: list[int], verify_logits: torch.Tensor, draft_lens: list[int]
    ) -> AcceptResult:
        cfg, k = self.config, self.config.draft_len
        num_verify = len(verify_rows)
        pending = [rows[i].request.pending_inputs for i in verify_rows]
        if num_verify:
            drafts = torch.stack([p[1:] for p in pending]).to(torch.long)
        else:
            drafts = torch.zeros((0, k), dtype=torch.long, device=cfg.device)
        lens = self._to_device([draft_lens[i] for i in verify_rows])
        if cfg.force_accepted is not None:
            target_tokens = torch.argmax(verify_logits, dim=-1).view(num_verify, k + 1)
            return forced_accept(drafts, target_tokens, self.forced_count() if num_verify else 0, lens)
        if cfg.sampling.greedy:
            target_tokens = torch.argmax(verify_logits, dim=-1).view(num_verify, k + 1)
            return greedy_accept(drafts, target_tokens, lens)
        target_probs = filtered_probs(verify_logits, cfg.sampling).view(num_verify, k + 1, verify_logits.shape[-1])
        draft_probs = None
        row_probs = [rows[i].request.pending_draft_probs for i in verify_rows]
        if k and any(p is not None for p in row_probs):
            vocab = target_probs.shape[-1]
            draft_probs = torch.stack([
                p if p is not None else torch.nn.functional.one_hot(d, vocab).to(torch.float32)
                for p, d in zip(row_probs, drafts)
            ])
        return rejection_accept(drafts, draft_probs, target_probs, self._generators(rows, verify_rows), lens)

    def _draft(
        self, rows, offsets, staged_dev, shrink, final_rows, verify_rows, first_tokens, accept, use_head
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The Eagle3 draft loop over this step's tokens; zeros (no drafts) without a head."""
        k, device = self.config.draft_len, self.config.device
        num_drafting = len(final_rows) + len(verify_rows)
        if not use_head:
            return torch.zeros((num_drafting, k), dtype=torch.long, device=device), None
        # Step-0 ids: every token shifted by one position; a prompt chunk's last id is the next
        # prompt token or, for the final chunk, the sampled first token; a verify row takes its
        # emitted tokens (accepted drafts, then the bonus; entries past it are never read).
        shifted: list[int] = []
        for row in rows:
            if row.kind is RowKind.CONTEXT:
                prompt = row.request.prompt
                shifted.extend(prompt[row.start + 1: row.start + row.length])
                shifted.append(prompt[row.start + row.length] if not row.final else 0)
            else:
                shifted.extend([0] * row.length)
        step0_ids = self._to_device(shifted)
        final_last = self._to_device([offsets[i] + rows[i].length - 1 for i in final_rows])
        step0_ids[final_last] = first_tokens
        if verify_rows:
            verify_tokens = self._to_device([offsets[i] + j for i in verify_rows for j in range(k + 1)])
            step0_ids[verify_tokens] = accept.tokens.reshape(-1)
        verify_start = self._to_device([offsets[i] for i in verify_rows])
        gather_index = torch.cat([final_last, verify_start + accept.num_accepted])
        # True kv length of each gathered token: the final prompt token sits at position P - 1; the
        # last accepted verify token at (first verify position) + a.
        staged_long = staged_dev.to(torch.long)
        true_kv = staged_long if shrink is None else staged_long - shrink.to(torch.long)
        verify_pos = self._to_device(verify_rows)
        final_pos = self._to_device(final_rows)
        gathered_kv = torch.cat([
            true_kv.index_select(0, final_pos),
            true_kv.index_select(0, verify_pos) - k + accept.num_accepted,
        ]).to(torch.int32)
        result = run_draft_loop(
            self.head, self.cache,
            first_meta=self.meta, first_input_ids=step0_ids, first_features=self.capture.stacked(),
            gather_index=gather_index, step_metas=self.draft_metas, gathered_kv_lens=gathered_kv,
            num_drafts=k, choose=self._draft_chooser(rows, final_rows + verify_rows),
        )
        return result.tokens, result.probs

    def _draft_chooser(self, rows, drafting_rows):
        sampling = self.config.sampling
        generators = self._generators(rows, drafting_rows)
        return lambda logits: choose_tokens(logits, sampling, generators)
