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
