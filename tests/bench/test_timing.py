"""bench.timing on CPU: the median of per-call samples, each thunk timed in turn, and the copy
ceiling's bytes-read-plus-written arithmetic, against hand-computed values (the clock is scripted)."""
from __future__ import annotations

from types import SimpleNamespace

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
    assert calls == ["a", "b", "c", "a", "b", "c"]


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
