"""CUDA-event timing (eager and CUDA-graph replay) and the copy ceiling measured in the same run.

Why: one place that times the way the README's Performance section reports: warm-up, several
input sets rotated so caches do not flatter small problems, medians over batches of back-to-back
calls, graph replay to take host launch overhead out.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

Thunk = Callable[[], object]


def _median_us(run_batch: Callable[[], None], calls_per_batch: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_batch()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1000.0 / calls_per_batch)
    return statistics.median(samples)


def whole_rotations(calls: int, num_thunks: int) -> int:
    """`calls` rounded up to whole rotations through `num_thunks` input sets: every set is called
    equally often, so a time per call is the sets' plain mean, as the byte floor beside it is
    (10 calls over 3 sets ran set 0 four times and the others three)."""
    return -(-max(calls, num_thunks) // num_thunks) * num_thunks


def time_eager_us(thunks: Sequence[Thunk], *, warmup: int = 3, repeats: int = 15, calls: int = 10) -> float:
    """Median microseconds per call, launching `thunks` round-robin from the host (at least `calls`
    calls a batch, whole rotations)."""
    if not torch.cuda.is_available():
        return time_cpu_us(thunks, repeats=max(1, repeats // 5), warmup=min(warmup, 1))
    for _ in range(warmup):
        for fn in thunks:
            fn()
    torch.cuda.synchronize()
    n = whole_rotations(calls, len(thunks))

    def batch() -> None:
        for i in range(n):
            thunks[i % len(thunks)]()

    return _median_us(batch, n, repeats)


def capture_graphs(thunks: Sequence[Thunk]) -> list[torch.cuda.CUDAGraph]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in thunks:  # warm-up (and Triton compilation) outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for fn in thunks:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    torch.cuda.synchronize()
    return graphs


def time_graph_us(thunks: Sequence[Thunk], *, repeats: int = 15, calls: int = 24) -> float:
    """Median microseconds per call, with at least `calls` back-to-back calls (input sets rotated,
    whole rotations) captured in one CUDA graph, as a whole-model step graph runs them: no per-call
    graph-launch gap."""
    n = whole_rotations(calls, len(thunks))
    graph = capture_graphs([lambda: [thunks[i % len(thunks)]() for i in range(n)]])[0]
    graph.replay()
    torch.cuda.synchronize()
    return _median_us(graph.replay, n, repeats)


def time_cpu_us(thunks: Sequence[Thunk], *, repeats: int = 3, warmup: int = 1) -> float:
    """Median microseconds per call on the CPU, after `warmup` calls of each input set (a first call
    pays one-time costs: the smoke table's first rows read 15-45 ms against about 0.3 ms steady)."""
    for _ in range(warmup):
        for fn in thunks:
            fn()
    samples = []
    for i in range(repeats * len(thunks)):
        t = time.perf_counter()
        thunks[i % len(thunks)]()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def copy_ceiling_gbps(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = time_eager_us([lambda: dst.copy_(src)], warmup=2, repeats=repeats, calls=2)
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e9
