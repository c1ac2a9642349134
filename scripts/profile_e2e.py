"""Where a decode step's GPU time goes, per mode (a profiling aid, not a test).

Why: the end-to-end speed-up is (tokens per verify cycle) x (target step / cycle time); this
profiles only the full-batch decode window (the profiler starts at the commit after which every
request has its first token, so prefill is excluded) and prints, per mode, wall time and GPU
kernel time per engine step and the kernels that take it.
    python scripts/profile_e2e.py [--batch 1] [--tokens 96] [--overlap]     (CUDA)
"""

import argparse
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from m3_eagle_plugin.bench.e2e import GPU_SHAPE, _engine, _prompts, all_decoding, build_random_models, measure_decode

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
    window = {}

    def on_commit(done, total, engine=engine):
        if done == 0 and all_decoding(engine.stats, len(prompts)):
            if "t0" not in window:
                torch.cuda.synchronize()
                window.update(t0=time.perf_counter(), commits=0, tok0=engine.stats.generated_tokens)
                prof.start()
            else:
                window["commits"] += 1
                window.update(t1=time.perf_counter(), tok1=engine.stats.generated_tokens)

    engine.generate(prompts, shape.new_tokens, progress=on_commit)
    prof.stop()
    steps = window["commits"]  # one commit per engine step
    wall_ms = (window["t1"] - window["t0"]) * 1e3
    evs = [e for e in prof.key_averages() if e.self_device_time_total > 0]  # kernels, not their CPU callers
    gpu_ms = sum(e.self_device_time_total for e in evs) / 1e3
    cpu = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    print(f"== spec={spec} batch={args.batch} overlap={args.overlap}: {steps} decode steps, "
          f"{window['tok1'] - window['tok0']} tokens, wall {wall_ms / steps:.3f} ms/step, "
          f"GPU kernels {gpu_ms / steps:.3f} ms/step, cudaGraphLaunch CPU {cpu.get('cudaGraphLaunch', 0) / steps:.3f} "
          f"ms/step, cudaStreamSynchronize+cudaMemcpyAsync CPU "
          f"{(cpu.get('cudaStreamSynchronize', 0) + cpu.get('cudaMemcpyAsync', 0)) / steps:.3f} ms/step")
    for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:args.top]:
        print(f"{e.self_device_time_total / steps:9.1f} us/step {e.count / steps:6.1f}x  {e.key[:100]}")
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    print("  host (self CPU us/step): " + ", ".join(f"{e.key[:40]} {e.self_cpu_time_total / steps:.0f} ({e.count / steps:.1f}x)"
                                                    for e in host[:args.top]))
    del engine
