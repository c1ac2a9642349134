"""bench.timing on CPU: the median of per-call samples, each thunk timed in turn, and the copy
ceiling's bytes-read-plus-written arithmetic, against hand-computed values (the clock is scripted)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m3_eagle_plugin.bench import timing


def scripted_clock(durations_s):
    """perf_counter readings so that call i lasts durations_s[i] (start and stop read per call)."""
    readings = []
    for d in durations_s:
        readings += [0.0, d]
    it = iter(readings)
    return SimpleNamespace(perf_counter=lambda: next(it))


def test_cpu_timing_is_the_median_of_the_per_call_samples(monkeypatch):
    monkeypatch.setattr(timing, "time", scripted_clock([1e-6, 2e-6, 10e-6]))
    assert abs(timing.time_cpu_us([lambda: None], repeats=3) - 2.0) < 1e-9  # mean would be 4.33


def test_cpu_timing_runs_every_thunk_repeats_times_round_robin(monkeypatch):
    monkeypatch.setattr(timing, "time", scripted_clock([1e-6] * 6))
    calls = []
    thunks = [lambda: calls.append("a"), lambda: calls.append("b"), lambda: calls.append("c")]
    timing.time_cpu_us(thunks, repeats=2)
    assert calls == ["a", "b", "c"] + ["a", "b", "c", "a", "b", "c"]  # one untimed warm-up round first


def test_cpu_timing_leaves_the_warm_up_calls_out_of_the_samples(monkeypatch):
    """A first call pays one-time costs; the warm-up round is not timed (the scripted clock holds
    exactly the timed calls' readings: one more read would raise StopIteration)."""
    monkeypatch.setattr(timing, "time", scripted_clock([1e-6, 2e-6, 3e-6]))
    calls = []
    assert abs(timing.time_cpu_us([lambda: calls.append(1)], repeats=3) - 2.0) < 1e-9
    assert len(calls) == 4
    monkeypatch.setattr(timing, "time", scripted_clock([1e-6]))
    calls.clear()
    timing.time_cpu_us([lambda: calls.append(1)], repeats=1, warmup=0)
    assert len(calls) == 1


def test_copy_ceiling_counts_bytes_read_plus_bytes_written(monkeypatch):
    seen = []

    def fake_eager(thunks, **kwargs):
        seen.append(len(thunks))
        thunks[0]()
        return 100.0  # microseconds per copy

    monkeypatch.setattr(timing, "time_eager_us", fake_eager)
    gbps = timing.copy_ceiling_gbps(torch.device("cpu"), nbytes=4096)
    assert seen == [1]
    assert abs(gbps - 2 * 4096 / 100e-6 / 1e9) < 1e-12  # 0.08192 GB/s


def test_copy_ceiling_copies_exactly_nbytes(monkeypatch):
    """The copy timed moves `nbytes` (the figure the bandwidth divides by), not twice or half of it."""
    copied = []

    def fake_eager(thunks, **kwargs):
        copied.append(thunks[0]())  # `dst.copy_(src)` returns dst
        return 100.0

    monkeypatch.setattr(timing, "time_eager_us", fake_eager)
    timing.copy_ceiling_gbps(torch.device("cpu"), nbytes=4096)
    (dst,) = copied
    assert dst.numel() * dst.element_size() == 4096


class _Graph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


@pytest.mark.parametrize("timer", ["eager", "graph"])
@pytest.mark.parametrize("num_sets", [3, 5, 7])
def test_every_input_set_is_called_equally_often(monkeypatch, timer, num_sets):
    """The row's byte floor is the plain mean over its input sets, so the time per call beside it
    must be too: a batch is whole rotations (10 eager calls over 3 sets ran set 0 four times)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "capture_graphs", lambda fns: [_Graph(fn) for fn in fns])
    batches = []

    def one_batch(run_batch, calls_per_batch, repeats):
        counts.clear()
        run_batch()
        batches.append((dict(counts), calls_per_batch))
        return 1.0

    monkeypatch.setattr(timing, "_median_us", one_batch)
    counts: dict[int, int] = {}
    thunks = [lambda s=s: counts.__setitem__(s, counts.get(s, 0) + 1) for s in range(num_sets)]
    (timing.time_eager_us if timer == "eager" else timing.time_graph_us)(thunks)
    ((ran, per_batch),) = batches
    assert sorted(ran) == list(range(num_sets)) and len(set(ran.values())) == 1   # each set as often
    assert per_batch == sum(ran.values()) >= (10 if timer == "eager" else 24)
