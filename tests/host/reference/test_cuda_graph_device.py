"""Capture and replay run with the step's own CUDA device current.

Streams, `torch.cuda.current_stream()` and the capture stream belong to the *current* device. With
the engine on cuda:1 while cuda:0 is current, the warm-up would wait on the wrong streams and the
graph would be captured on cuda:0 while every op runs (eagerly, uncaptured) on cuda:1's stream: an
empty graph whose replays hand back the first step's outputs forever. Checked without a GPU by
faking torch's stream/graph API and the current device (`fake_current_device`)."""
from __future__ import annotations

import contextlib

import torch

from m3_eagle_plugin.host.reference.cuda_graphs import StepGraphs
from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig

from . import _fakes


class _Recording(StepGraphs):
    def __init__(self, runner, seen) -> None:
        super().__init__(runner, capture=False)
        self.seen = seen

    def _body(self, bucket):
        self.seen.append(("body", self._current()))
        return (torch.zeros(1),)


def test_capture_and_replay_run_on_the_steps_device(monkeypatch, fake_current_device):
    current, _ = fake_current_device
    seen = []

    class Stream:
        def __init__(self):
            seen.append(("stream", current[0]))

        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            seen.append(("replay", current[0]))

    @contextlib.contextmanager
    def stream(_s):
        yield

    @contextlib.contextmanager
    def graph(_g, pool=None):
        seen.append(("capture", current[0]))
        yield

    def current_stream(device=None):
        seen.append(("current_stream", current[0]))
        return Stream.__new__(Stream)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)

    target = _fakes.FakeTarget()
    engine = Engine(target, _fakes.make_cache(), EngineConfig(draft_len=2), vocab_size=_fakes.VOCAB,
                    head=_fakes.FakeHead(target.table), capture=_fakes.fake_capture())
    graphs = _Recording(engine.runner, seen)
    graphs._current = lambda: current[0]
    graphs.capture, graphs.device = True, torch.device("cuda", 1)  # the engine's tensors on cuda:1

    class Bucket:
        graph = None
        outputs = None

    bucket = Bucket()
    graphs._run(bucket)  # first use: warm-up, capture, replay
    graphs._run(bucket)  # replay
    assert current[0] == 0  # the caller's device is restored
    assert [kind for kind, _ in seen].count("replay") == 2
    assert all(_index(device) == 1 for _, device in seen), seen


def _index(device) -> int:
    return device.index if isinstance(device, torch.device) else int(device)
