"""Where a decode step's GPU time goes, per mode (a profiling aid, not a test).

Why: the end-to-end speed-up is (tokens per verify cycle) x (target step / cycle time); this
profiles only the full-batch decode window (the profiler starts at the commit after which every
request has its first token, so prefill is excluded, and stops at the first commit at which a
request finishes) and prints, per mode, wall time and GPU kernel time per engine step and the
kernels that take it.
    python scripts/profile_e2e.py [--batch 1] [--tokens 96] [--overlap]     (CUDA)
"""

import argparse
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from m3_eagle_plugin.bench.e2e import GPU_SHAPE, _engine, _prompts, all_decoding, build_random_models, measure_decode


class DecodeWindow:
    """A generate's progress callback marking its full-batch decode window: from the commit after
    which every request has its first token to the first commit at which a request finishes (that
    step included). `start` and `stop` (the profiler) run at its ends, so the steps they bracket are
    the ones `steps` counts (at batch > 1 the prompts prefill one a step, so requests finish over
    many later steps; a profile to the end of generate held those too)."""

    def __init__(self, engine, num_requests: int, start, stop):
        self.engine, self.num_requests, self.start, self.stop = engine, num_requests, start, stop
        self.steps, self.t0, self.t1, self.closed = 0, None, None, False

    def __call__(self, done: int, total: int) -> None:
        stats = self.engine.stats
        if self.t0 is None:
            if done == 0 and all_decoding(stats, self.num_requests):
                self.start()
                self.t0, self.tok0 = time.perf_counter(), stats.generated_tokens
        elif not self.closed:
            self.steps += 1  # one commit per engine step
            self.t1, self.tok1 = time.perf_counter(), stats.generated_tokens
            if done:
                self.closed = True
                self.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()

    shape = replace(GPU_SHAPE, new_tokens=args.tokens, batches=(args.batch,), overlap=args.overlap)
    dev = torch.device("cuda")
    target, head = build_random_models(shape, dev, torch.bfloat16, 0)
    target.set_graph_safe_moe(True)
    prompts = _prompts(shape, args.batch, 1)
    for spec in (False, True):
        engine = _engine(target, head, shape, speculate=spec, batch=args.batch, prompts=prompts, device=dev,
                         dtype=torch.bfloat16, graphs=True)
        measure_decode(engine, prompts, shape.new_tokens)  # captures the graphs
        prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])

        def start():
            torch.cuda.synchronize()
            prof.start()
        window = DecodeWindow(engine, len(prompts), start, prof.stop)
        engine.generate(prompts, shape.new_tokens, progress=window)
        if window.t0 is not None and not window.closed:  # no request finished (a failed generate)
            prof.stop()
        if not window.steps:
            raise SystemExit(f"no full-batch decode step: raise --tokens ({args.tokens})")
        steps = window.steps
        wall_ms = (window.t1 - window.t0) * 1e3
        evs = [e for e in prof.key_averages() if e.self_device_time_total > 0]  # kernels, not their CPU callers
        gpu_ms = sum(e.self_device_time_total for e in evs) / 1e3
        cpu = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
        print(f"== spec={spec} batch={args.batch} overlap={args.overlap}: {steps} decode steps, "
              f"{window.tok1 - window.tok0} tokens, wall {wall_ms / steps:.3f} ms/step, "
              f"GPU kernels {gpu_ms / steps:.3f} ms/step, "
              f"cudaGraphLaunch CPU {cpu.get('cudaGraphLaunch', 0) / steps:.3f} ms/step, "
              f"cudaStreamSynchronize+cudaMemcpyAsync CPU "
              f"{(cpu.get('cudaStreamSynchronize', 0) + cpu.get('cudaMemcpyAsync', 0)) / steps:.3f} ms/step")
        for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:args.top]:
            print(f"{e.self_device_time_total / steps:9.1f} us/step {e.count / steps:6.1f}x  {e.key[:100]}")
        host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                      key=lambda e: -e.self_cpu_time_total)
        print("  host (self CPU us/step): " + ", ".join(f"{e.key[:40]} {e.self_cpu_time_total / steps:.0f} "
                                                        f"({e.count / steps:.1f}x)" for e in host[:args.top]))
        del engine


if __name__ == "__main__":
    main()
