"""CUDA-graph replay of generation steps (verify + draft loop), one graph per batch size.

A generation step has a fixed shape once its batch size ``R`` is fixed: ``R`` verify rows of
``1 + K`` tokens, then ``K`` draft steps. Everything that varies from step to step is a device
buffer the graph reads: the input ids, the true kv lengths, the step metadata (whose buffers never
move). Lengths are staged at a request's largest span (``max_blocks_per_seq`` blocks) on the
host, so every host-side loop bound of the attention references is the same at capture and at
replay, and the true lengths enter on the device through ``on_update_kv_lens`` (which may only
shrink them), inside the graph.
Greedy only: sampling draws from host-held generators.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3_eagle_plugin.eagle3.accept import forced_accept, greedy_accept
from m3_eagle_plugin.eagle3.draft_loop import run_draft_loop
from m3_eagle_plugin.host.reference.scheduler import RowKind

__all__ = ["StepGraphs", "GenerationGraphs"]


@dataclass
class _Bucket:
    input_ids: torch.Tensor  # [R * (1 + K)]
    true_kv: torch.Tensor  # [R] int32
    draft_lens: torch.Tensor  # [R]
    row_starts: torch.Tensor  # [R]
    graph: "torch.cuda.CUDAGraph | None" = None
    outputs: tuple | None = None


class StepGraphs:
    """What every fixed-shape decode-step replay shares: capacity staging of the rows' lengths and
    block tables, and one graph per bucket, captured on first use after an eager warm-up."""

    def __init__(self, runner, *, capture: bool = True) -> None:
        """``capture=False`` runs the same fixed-shape step eagerly (CPU tests of the staging logic)."""
        cfg = runner.config
        if capture and cfg.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not cfg.sampling.greedy:
            raise ValueError("CUDA graphs support greedy decoding only (sampling uses host-held generators)")
        self.runner = runner
        self.buckets: dict = {}
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capacity = cfg.max_blocks_per_seq * cfg.block_size
        self._planned: dict[int, tuple] = {}
        # The device the step's tensors live on: capture and replay run with it current. Streams,
        # `current_stream()` and the capture stream belong to the current device; on another one
        # (cuda:1 while cuda:0 is current) the ops would run eagerly outside an empty graph and
        # every replay would hand back the first step's outputs.
        self.device = cfg.device

    def _plan(self, meta, qo_lens: list[int], tables: torch.Tensor, **kw) -> None:
        """`meta.prepare` at capacity, skipped when it would stage exactly what it staged last time.

        A replayed step's plan (lengths at capacity, block tables) changes only when a request
        crosses into a new page or the rows change, and the graph re-derives every kv-dependent
        field on the device (`on_update_kv_lens`) anyway; an unchanged plan costs nothing but the
        comparison. Any other `prepare` of the same object in between (an eager step) re-plans.
        """
        key = (tuple(qo_lens), tuple(tables.shape), tables.cpu().numpy().tobytes(), tuple(sorted(kw.items())))
        count = getattr(meta, "prepare_count", None)  # a metadata class without the counter always re-plans
        if count is not None and self._planned.get(id(meta)) == (count, key):
            return
        # Forgotten first: a prepare cut off after staging, before its count moved on (Ctrl-C), leaves
        # this plan in the buffers under the old count, and the old plan's next step would skip.
        self._planned.pop(id(meta), None)
        meta.prepare(qo_lens, [self.capacity] * len(qo_lens), tables, **kw)
        self._planned[id(meta)] = (getattr(meta, "prepare_count", None), key)

    @staticmethod
    def eligible(rows) -> bool:
        return bool(rows) and all(row.kind is RowKind.VERIFY for row in rows)

    def _stage(self, rows, tokens_per_row: int) -> tuple[torch.Tensor, list[int]]:
        """Reserve each row's pages for `tokens_per_row` more tokens; return the block tables at the
        graph's full width and the rows' kv lengths after the step, from the optimistic ``kv_len``
        (an in-flight step's deficit, `_step_inputs`' shrink, makes them true on the device)."""
        runner, cfg = self.runner, self.runner.config
        rids, staged = [], []
        for row in rows:
            kv = row.request.kv_len + tokens_per_row
            runner.cache.reserve(row.request.rid, runner._reserve_tokens(kv))
            rids.append(row.request.rid)
            staged.append(kv)
        # Capacity staging maps every column; unreserved ones point at page 0, whose keys sit past
        # every token's position once the true lengths are in, so they are never visible.
        return runner.cache.block_table(rids, width=cfg.max_blocks_per_seq).clamp(min=0), staged

    def _run(self, bucket, after_warmup=None):
        """`self._body(bucket)`: eagerly, or replayed from the bucket's graph (captured on first use).
        Returns the static outputs, which the next replay overwrites."""
        if not self.capture:
            return self._body(bucket)
        with torch.cuda.device(self.device):
            return self._capture_and_replay(bucket, after_warmup)

    def _capture_and_replay(self, bucket, after_warmup):
        if bucket.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body(bucket)  # warm-up; idempotent with the replay below (same inputs)
            torch.cuda.current_stream().wait_stream(side)
            if after_warmup is not None:
                after_warmup()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                bucket.outputs = self._body(bucket)
            bucket.graph = graph
        bucket.graph.replay()
        return bucket.outputs

    def _body(self, bucket):
        raise NotImplementedError


class GenerationGraphs(StepGraphs):
    def __init__(self, runner, *, capture: bool = True) -> None:
        super().__init__(runner, capture=capture)
        if runner.head is None or runner.config.draft_len < 1:
            raise ValueError("CUDA graphs capture the Eagle3 generation step: they need a draft head and K >= 1")

    def _bucket(self, num_rows: int) -> _Bucket:
        bucket = self.buckets.get(num_rows)
        if bucket is None:
            k, device = self.runner.config.draft_len, self.runner.config.device
            bucket = _Bucket(
                input_ids=torch.zeros(num_rows * (k + 1), dtype=torch.long, device=device),
                true_kv=torch.zeros(num_rows, dtype=torch.int32, device=device),
                draft_lens=torch.full((num_rows,), k, dtype=torch.long, device=device),
                row_starts=torch.arange(num_rows, device=device) * (k + 1),
            )
            self.buckets[num_rows] = bucket
        return bucket

    def _body(self, bucket: _Bucket) -> tuple:
        """The device-only generation step (captured; also run once eagerly to warm up)."""
        runner, k = self.runner, self.runner.config.draft_len
        num_rows = bucket.true_kv.shape[0]
        runner.meta.on_update_kv_lens(bucket.true_kv)
        hidden = runner.target.forward(bucket.input_ids, runner.meta, runner.cache, capture=runner.capture)
        target_tokens = torch.argmax(runner.target.compute_logits(hidden), dim=-1).view(num_rows, k + 1)
        drafts = bucket.input_ids.view(num_rows, k + 1)[:, 1:]
        if runner.config.force_accepted is not None:
            accept = forced_accept(drafts, target_tokens, runner.forced_count(), bucket.draft_lens)
        else:
            accept = greedy_accept(drafts, target_tokens, bucket.draft_lens)
        gathered_kv = (bucket.true_kv.to(torch.long) - k + accept.num_accepted).to(torch.int32)
        result = run_draft_loop(
            runner.head, runner.cache, first_meta=runner.meta, first_input_ids=accept.tokens.reshape(-1),
            first_features=runner.capture.stacked(), gather_index=bucket.row_starts + accept.num_accepted,
            step_metas=runner.draft_metas, gathered_kv_lens=gathered_kv, num_drafts=k,
            choose=lambda logits: (torch.argmax(logits, dim=-1), None),
        )
        last = accept.tokens.gather(1, accept.num_accepted.unsqueeze(1))
        return accept.tokens, accept.num_accepted, torch.cat([last, result.tokens], dim=1)

    def launch(self, rows, step_id: int):
        from m3_eagle_plugin.host.reference.runner import StepOutput

        runner, k = self.runner, self.runner.config.draft_len
        num_rows = len(rows)
        tables, staged = self._stage(rows, 1 + k)
        self._plan(runner.meta, [k + 1] * num_rows, tables, num_context_requests=0)
        for meta in runner.draft_metas:
            self._plan(meta, [1] * num_rows, tables)

        bucket = self._bucket(num_rows)
        input_ids, shrink = runner._step_inputs(list(rows), list(range(num_rows)))
        bucket.input_ids.copy_(input_ids)
        true_kv = runner._to_device(staged, torch.int32)
        bucket.true_kv.copy_(true_kv if shrink is None else true_kv - shrink)
        bucket.draft_lens.copy_(runner._to_device([row.request.pending_draft_len for row in rows]))
        restore = None
        if self.capture and bucket.graph is None and runner.forced_step is not None:
            forced_step = runner.forced_step.clone()
            restore = lambda: runner.forced_step.copy_(forced_step)  # noqa: E731 - the warm-up is not a verify step
        outputs = self._run(bucket, after_warmup=restore)
        # The next replay overwrites the static outputs, possibly before this step is committed.
        tokens, num_accepted, next_inputs = (t.clone() for t in outputs)
        return StepOutput(
            step_id=step_id, rows=list(rows), draft_lens=[row.request.pending_draft_len for row in rows],
            emitted=tokens, num_emitted=num_accepted + 1, num_accepted=num_accepted, deficit=k - num_accepted,
            drafting_rows=list(range(num_rows)), next_inputs=next_inputs, next_draft_probs=None, head_drafts=True,
        )
