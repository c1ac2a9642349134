"""Where a batch-1 decode step's GPU time goes: kernels of one generate per mode (a profiling aid, not a test).
    python scripts/profile_e2e.py     (CUDA; prompt prefill included, 64 new tokens)
"""

from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from m3_eagle_plugin.bench.e2e import GPU_SHAPE, _engine, _prompts, build_random_models, measure_decode

shape = replace(GPU_SHAPE, new_tokens=64, batches=(1,))
dev = torch.device("cuda")
target, head = build_random_models(shape, dev, torch.bfloat16, 0)
target.set_graph_safe_moe(True)
prompts = _prompts(shape, 1, 1)
for spec in (False, True):
    engine = _engine(target, head, shape, speculate=spec, batch=1, prompts=prompts, device=dev, dtype=torch.bfloat16,
                     graphs=True)
    measure_decode(engine, prompts, shape.new_tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m = measure_decode(engine, prompts, shape.new_tokens)
    evs = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in evs)
    print(f"== spec={spec}: {m.tokens} tokens, {m.verify_steps} steps, {m.tokens_per_s:.1f} tok/s; "
          f"GPU kernel time {total / 1e3:.1f} ms over the whole generate")
    for e in sorted(evs, key=lambda e: -e.device_time_total)[:22]:
        print(f"{e.device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:110]}")
    del engine
