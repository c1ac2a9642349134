"""build_engine refuses what the engine would refuse before it reads any weight."""
from __future__ import annotations

import pytest

import m3_eagle_plugin.models.loader as loader
from m3_eagle_plugin.host.reference import build
from m3_eagle_plugin.host.reference.build import build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.host.reference.sampler import SamplingParams


@pytest.mark.parametrize("cause,config,num_blocks", [
    ("num_blocks", EngineConfig(draft_len=2), 0),
    ("num_blocks", EngineConfig(draft_len=2), 2.5),
    ("eos_ids", EngineConfig(draft_len=2, eos_ids=(10**6,)), 64),
    ("force_accepted", EngineConfig(draft_len=2, force_accepted=3), 64),
    ("max_tokens_per_step", EngineConfig(draft_len=3, max_tokens_per_step=2), 64),
    ("cuda-graphs", EngineConfig(draft_len=2, cuda_graphs=True), 64),
])
def test_settings_the_engine_refuses_are_refused_before_any_weight_is_read(tiny_pair, monkeypatch, cause, config,
                                                                           num_blocks):
    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    with pytest.raises(ValueError, match=cause):
        build_engine(*tiny_pair, config, num_blocks=num_blocks, device="cpu")


def test_a_draft_length_no_drafter_uses_is_not_held_against_the_target_only_engine(tiny_pair):
    """Without a head or proposer nothing drafts: draft_len 3 with 2 tokens per step runs target only."""
    engine = build_engine(tiny_pair[0], None, EngineConfig(draft_len=3, max_tokens_per_step=2), num_blocks=16)
    assert engine.k == 0


@pytest.mark.parametrize("with_draft,config,cause", [
    (False, EngineConfig(draft_len=2, cuda_graphs=True), "draft head"),
    (True, EngineConfig(draft_len=0, cuda_graphs=True), "draft head and K >= 1"),
    (True, EngineConfig(draft_len=2, cuda_graphs=True, sampling=SamplingParams(temperature=1.0)), "greedy"),
])
def test_cuda_graphs_the_engine_cannot_capture_are_refused_before_any_weight_is_read(tiny_pair, monkeypatch,
                                                                                   with_draft, config, cause):
    """On a CUDA device the engine's graphs refuse a run without a head (or K = 0) and sampling: so
    must build_engine, before it reads a target that may take minutes to load. Nothing here touches
    a GPU: the memory check is stubbed and the run stops before any weight would be read."""
    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    monkeypatch.setattr(build, "_free_bytes", lambda device: None)
    with pytest.raises(ValueError, match=cause):
        build_engine(tiny_pair[0], tiny_pair[1] if with_draft else None, config, num_blocks=64, device="cuda")


def test_cuda_graphs_with_a_proposer_but_no_head_are_refused_before_any_weight_is_read(tiny_pair, monkeypatch):
    """A proposer drafts K tokens, but the graphs capture the Eagle3 head's step: no head is refused even
    though K >= 1."""
    from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    monkeypatch.setattr(build, "_free_bytes", lambda device: None)
    with pytest.raises(ValueError, match="need a draft head"):
        build_engine(tiny_pair[0], None, EngineConfig(draft_len=2, cuda_graphs=True), num_blocks=64, device="cuda",
                     proposer=PromptLookupProposer())


def test_blocks_for_prompts_gives_each_request_its_own_whole_blocks():
    """Blocks are per request (pages are not shared): prompt + new tokens + 4K + 1 tokens each, rounded
    up to whole blocks of 4, then summed. By hand: 3 + 1 + 0 + 1 = 5 tokens -> 2 blocks, twice -> 4
    (not ceil(10 / 4) = 3); with K = 1: 3 + 1 + 4 + 1 = 9 -> 3 blocks, twice -> 6; no prompts -> 1."""
    assert build.blocks_for_prompts([[1, 2, 3], [4, 5, 6]], 1, 0, 4) == 4
    assert build.blocks_for_prompts([[1, 2, 3], [4, 5, 6]], 1, 1, 4) == 6
    assert build.blocks_for_prompts([], 4, 1, 4) == 1


def test_with_blocks_for_prompts_no_request_waits_for_admission():
    """Its promise, on the fake engine: every prompt is admitted in the first step."""
    from m3_eagle_plugin.host.reference.engine import Engine
    from m3_eagle_plugin.host.reference.request import RequestState

    from . import _fakes

    prompts, new, k = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2]], 1, 0
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(build.blocks_for_prompts(prompts, new, k, _fakes.BLOCK))
    engine = Engine(target, cache, EngineConfig(draft_len=k, max_batch_size=8, max_tokens_per_step=64),
                    vocab_size=_fakes.VOCAB)
    schedule, first = engine.scheduler.schedule, []

    def recorded(requests):
        rows = schedule(requests)
        if not first:
            first.append([r.state for r in requests])
        return rows

    engine.scheduler.schedule = recorded
    result = engine.generate(prompts, max_new_tokens=new)
    assert result.outputs == [target.greedy(p, new) for p in prompts]
    assert RequestState.WAITING not in first[0]


def test_a_cache_that_fills_free_memory_exactly_is_refused_for_the_step_buffers(monkeypatch):
    """The cache itself fits (equal to the free bytes); the step buffers beside it do not: the message
    names them, not the cache."""
    import torch

    monkeypatch.setattr(build, "_free_bytes", lambda device: 1000)
    build._check_memory_fits(900, 100, 4, EngineConfig(), torch.device("cpu"))  # exactly fits
    with pytest.raises(ValueError, match="the step buffers"):
        build._check_memory_fits(1000, 1, 4, EngineConfig(), torch.device("cpu"))
    with pytest.raises(ValueError, match="^a KV cache of 4 blocks needs"):  # the step-buffer message names it too
        build._check_memory_fits(1001, 0, 4, EngineConfig(), torch.device("cpu"))


def test_a_draft_head_of_another_head_dim_is_refused_naming_the_field_before_any_weight_is_read(tiny_pair, tmp_path,
                                                                                               monkeypatch):
    """The draft layer lives in the target's K/V pages: a head exported for a target with 32-wide heads
    (the tiny draft has 16) is refused by its head_dim, not by a page size the user never set."""
    import json
    import shutil

    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the draft was checked")

    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    raw = json.loads((target / "config.json").read_text())
    raw["text_config"]["head_dim"] = 32
    (target / "config.json").write_text(json.dumps(raw))
    monkeypatch.setattr(loader, "load_target", read_weights)
    with pytest.raises(ValueError, match=r"draft/config\.json: head_dim: the draft head's 16 differs from the "
                                         r"target's 32"):
        build_engine(target, tiny_pair[1], EngineConfig(draft_len=2), num_blocks=16, device="cpu")
