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
