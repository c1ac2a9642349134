"""The fixed-shape generation step that CUDA graphs capture: capacity-staged lengths corrected on
the device. Run eagerly on CPU (same code path minus capture) it must change nothing; the real
capture/replay runs on a GPU only."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.cuda_graphs import GenerationGraphs
from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
from m3_eagle_plugin.host.reference.sampler import SamplingParams

from . import _fakes

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4], [7]]


@pytest.mark.parametrize("overlap", [False, True])
def test_fixed_shape_step_matches_on_the_fake_model(overlap):
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(48)
    engine = Engine(target, cache, EngineConfig(draft_len=3, max_batch_size=3, max_tokens_per_step=12,
                                                overlap=overlap),
                    vocab_size=_fakes.VOCAB, head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    engine.runner.graphs = GenerationGraphs(engine.runner, capture=False)
    result = engine.generate(PROMPTS, max_new_tokens=9)
    assert result.outputs == [target.greedy(p, 9) for p in PROMPTS]
    refs = [target.greedy(p, 16) for p in PROMPTS]
    assert result.stats.accepted_tokens == sum(_fakes.expected_accepted(p, r, 9, 3)[1] for p, r in zip(PROMPTS, refs))
    assert set(engine.runner.graphs.buckets) >= {3}
    assert cache.num_free_blocks == cache.num_blocks


def test_fixed_shape_step_matches_on_tiny_checkpoints(tiny_pair):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (14, 6)]
    outputs = []
    for graphs in (False, True):
        engine = build_engine(*tiny_pair, EngineConfig(draft_len=2, max_batch_size=2, max_tokens_per_step=32),
                              num_blocks=blocks_for_prompts(prompts, 6, 2, 4))
        if graphs:
            engine.runner.graphs = GenerationGraphs(engine.runner, capture=False)
        outputs.append(engine.generate(prompts, 6).outputs)
    assert outputs[0] == outputs[1]


def test_graphs_refuse_what_they_cannot_capture():
    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=2, sampling=SamplingParams(temperature=1.0)),
                    vocab_size=_fakes.VOCAB, head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    with pytest.raises(ValueError, match="greedy"):
        GenerationGraphs(engine.runner, capture=False)
    with pytest.raises(ValueError, match="CUDA device"):
        GenerationGraphs(engine.runner)


@pytest.mark.parametrize("with_head,draft_len", [(False, 2), (True, 0)])
def test_graphs_refuse_a_runner_without_a_head_or_drafts(with_head, draft_len):
    """They capture the Eagle3 generation step (verify 1 + K, then K draft steps): with no head, or
    K = 0, there is no step to capture."""
    target = _fakes.FakeTarget()
    head = dict(head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture()) if with_head else {}
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=draft_len), vocab_size=_fakes.VOCAB, **head)
    with pytest.raises(ValueError, match=r"^CUDA graphs capture the Eagle3 generation step: they need a draft head "
                                         r"and K >= 1$"):
        GenerationGraphs(engine.runner, capture=False)


class _PlannedMeta:
    """Records every `prepare`; `counted=False` has no `prepare_count` (always re-planned)."""

    def __init__(self, counted: bool = True) -> None:
        self.calls = []
        if counted:
            self.prepare_count = 0

    def prepare(self, qo_lens, kv_lens, tables, **kw):
        self.calls.append((list(qo_lens), list(kv_lens), tables.clone(), kw))
        if hasattr(self, "prepare_count"):
            self.prepare_count += 1


def test_an_unchanged_plan_is_not_staged_again():
    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=2), vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    graphs = GenerationGraphs(engine.runner, capture=False)
    meta, tables = _PlannedMeta(), torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    graphs._plan(meta, [3, 3], tables, num_context_requests=0)
    graphs._plan(meta, [3, 3], tables.clone(), num_context_requests=0)
    assert len(meta.calls) == 1 and meta.calls[0][1] == [graphs.capacity] * 2
    graphs._plan(meta, [3, 3], torch.tensor([[3, 1], [0, 5]], dtype=torch.int32), num_context_requests=0)
    assert len(meta.calls) == 2  # a request moved into a new page
    meta.prepare([5], [9], tables)  # someone else (an eager step) re-planned the object
    graphs._plan(meta, [3, 3], torch.tensor([[3, 1], [0, 5]], dtype=torch.int32), num_context_requests=0)
    assert len(meta.calls) == 4
    graphs._plan(meta, [3], tables[:1], num_context_requests=0)
    assert len(meta.calls) == 5  # other rows
    plain = _PlannedMeta(counted=False)
    for _ in range(2):
        graphs._plan(plain, [3], tables[:1])
    assert len(plain.calls) == 2


def test_a_plan_cut_off_inside_prepare_is_staged_again():
    """A Ctrl-C inside `prepare` after it staged a new plan, before its count moved on: the buffers hold
    that plan, so the plan staged before it is staged again when it comes back, not skipped (its replay
    read the cut-off plan's block table, another request's pages)."""
    class CutOff(_PlannedMeta):
        cut = False

        def prepare(self, qo_lens, kv_lens, tables, **kw):
            self.calls.append((list(qo_lens), list(kv_lens), tables.clone(), kw))
            if self.cut:
                raise KeyboardInterrupt  # staged, not counted
            self.prepare_count += 1

    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=2), vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    graphs = GenerationGraphs(engine.runner, capture=False)
    meta = CutOff()
    first, second = (torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([[5, 6]], dtype=torch.int32))
    graphs._plan(meta, [3], first, num_context_requests=0)
    meta.cut = True
    with pytest.raises(KeyboardInterrupt):
        graphs._plan(meta, [3], second, num_context_requests=0)
    meta.cut = False
    graphs._plan(meta, [3], first, num_context_requests=0)
    assert len(meta.calls) == 3 and torch.equal(meta.calls[-1][2], first)  # what the object holds now


def test_replayed_steps_skip_redundant_plans_and_still_match(tiny_pair):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5)]
    outputs, prepares = [], []
    for graphs in (False, True):
        engine = build_engine(*tiny_pair, EngineConfig(draft_len=2, max_batch_size=2, max_tokens_per_step=32),
                              num_blocks=blocks_for_prompts(prompts, 12, 2, 4))
        if graphs:
            engine.runner.graphs = GenerationGraphs(engine.runner, capture=False)
        metas = [engine.runner.meta, *engine.runner.draft_metas]
        before = [m.prepare_count for m in metas]
        outputs.append(engine.generate(prompts, 12).outputs)
        prepares.append(sum(m.prepare_count - b for m, b in zip(metas, before)))
        steps = engine.stats.engine_steps
    assert outputs[0] == outputs[1]
    assert prepares[1] < prepares[0] and prepares[1] < steps * len(metas)
