"""profile_e2e's decode window on the reference engine (its profile runs on a GPU): the profiler
brackets exactly the engine steps it divides its totals by, with the prompts prefilled one a
step as on the H200 (requests then finish over several later steps)."""
from __future__ import annotations

from dataclasses import replace

import torch

from m3_eagle_plugin.bench.e2e import CPU_SHAPE, _engine, _prompts, build_random_models
from tests.scripts._load import load_script


def test_the_profiled_steps_are_the_steps_counted():
    profile_e2e = load_script("profile_e2e")
    batch = 3
    shape = replace(CPU_SHAPE, new_tokens=12, batches=(batch,), max_tokens_per_step=CPU_SHAPE.prompt_len)
    dev = torch.device("cpu")
    target, head = build_random_models(shape, dev, torch.float32, 0)
    prompts = _prompts(shape, batch, 1)
    engine = _engine(target, head, shape, speculate=True, batch=batch, prompts=prompts, device=dev,
                     dtype=torch.float32, graphs=False)
    marks = []
    window = profile_e2e.DecodeWindow(engine, batch, start=lambda: marks.append(engine.stats.engine_steps),
                                      stop=lambda: marks.append(engine.stats.engine_steps))
    result = engine.generate(prompts, shape.new_tokens, progress=window)
    assert not any(result.errors)
    started, stopped = marks
    assert window.steps == stopped - started > 0
    assert result.stats.engine_steps > stopped   # requests finished after the window: not profiled
