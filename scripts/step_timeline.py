"""A per-program timeline of one graph-replayed sparse verify step (a profiling aid, not a test).

    python scripts/step_timeline.py 16 32768 1            # the step as the model runs it
    python scripts/step_timeline.py 16 32768 1 --early 16 # the attention launched early, 16 splits
    python scripts/step_timeline.py 64 8192 4 --grid-order # early, programs in the grid's order

Why: ncu serialises kernels, so it cannot show how the step's four launches (scoring, top-k,
attention, merge) overlap. Here instrumented copies of them read `%globaltimer` at each
program's start and end and store both (and the SM) into one buffer; the step is captured in a
CUDA graph, replayed warm, and the last replay's timeline printed relative to the first scoring
program: per kernel the first / last start and end and the median program time, how many
attention programs shared an SM at once (and their times by that count), and per request when its
scoring and top-k ended and its attention programs started and ended (each program records the
request it worked for: the early attention's programs run request-major for fp8 K/V). The timer
ticks in steps of about 0.25 us on H200.
"""
import argparse
import ast
import importlib.util
import inspect
import math
import os
import statistics
import tempfile
import textwrap

import torch
import triton.language as tl

from m3_eagle_plugin.bench.inputs import Geometry
from m3_eagle_plugin.bench.kernel_suite import StepSet
from m3_eagle_plugin.bench.timing import capture_graphs
from m3_eagle_plugin.cli import positive_int
from m3_eagle_plugin.msa.kernels import index_select, merge, sparse_verify, verify_step

MAX_PROGRAMS = 1 << 17
KERNELS = [(index_select, "_block_score_kernel"), (index_select, "_topk_union_kernel"),
           (sparse_verify, "_sparse_token_kernel"), (merge, "_merge_splits_kernel")]
RECORD = '''
from triton.language.extra.cuda import globaltimer as _now, smid as _smid

@triton.jit
def _record(t0, request, KID: tl.constexpr):
    t1 = _now()
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    at = tl.full([], TIMELINE_BASE, tl.int64).to(tl.pointer_type(tl.int64)) + (KID * TIMELINE_MAX + pid) * 4
    tl.store(at, t0)
    tl.store(at + 1, t1)
    tl.store(at + 2, _smid().to(tl.int64))
    tl.store(at + 3, request.to(tl.int64))
'''


def instrument(buffer: torch.Tensor) -> None:
    """Replace each kernel of KERNELS in its module by a copy that records into `buffer`."""
    sources = [RECORD]
    for kid, (module, name) in enumerate(KERNELS):
        src = textwrap.dedent(inspect.getsource(getattr(module, name).fn))
        body = ast.parse(src).body[0].body
        first = body[1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body[0]
        lines = src.splitlines()
        lines.insert(first.lineno - 1, "    _t0 = _now()")
        # the request a program worked for, where the kernel names it `r` (its grid order need not say)
        request = "r" if any(ln.strip().startswith(("r = ", "r, ")) for ln in lines) else "tl.program_id(0) * 0"
        lines.append(f"    _record(_t0, {request}, {kid})")
        sources.append("\n".join(lines))
    path = os.path.join(tempfile.mkdtemp(), "timeline_kernels.py")  # Triton reads a kernel's source file
    with open(path, "w") as f:
        f.write("\n\n".join(sources) + "\n")
    spec = importlib.util.spec_from_file_location("timeline_kernels", path)
    copies = importlib.util.module_from_spec(spec)
    for module, _ in KERNELS:
        copies.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    copies.__dict__.update(TIMELINE_BASE=tl.constexpr(buffer.data_ptr()), TIMELINE_MAX=tl.constexpr(MAX_PROGRAMS))
    spec.loader.exec_module(copies)
    for module, name in KERNELS:
        setattr(module, name, getattr(copies, name))


def report(buffer: torch.Tensor, batch: int) -> None:
    runs = buffer.view(len(KERNELS), MAX_PROGRAMS, 4).cpu()
    ran = [r[r[:, 1] > 0] for r in runs]  # a program's slot is its linear id, so order is grid order
    zero = int(ran[0][:, 0].min())

    def us(t):
        return (float(t) - zero) / 1000.0
    for (_, name), r in zip(KERNELS, ran):
        if len(r):
            print(f"{name:22} {len(r):6d} programs  start {us(r[:, 0].min()):7.2f}..{us(r[:, 0].max()):7.2f}  "
                  f"end {us(r[:, 1].min()):7.2f}..{us(r[:, 1].max()):7.2f}  "
                  f"median {statistics.median((r[:, 1] - r[:, 0]).tolist()) / 1000:5.2f} us")
    scoring, topk, attention = ran[0], ran[1], ran[2]
    residency(attention)
    print("request: scoring end / top-k end / attention start..end (us)")

    def of(r, req):  # the programs that worked for request `req` (recorded by each program)
        return r[r[:, 3] == req]
    for req in range(batch):
        mine = of(attention, req)
        print(f"  {req:4d}: {us(of(scoring, req)[:, 1].max()):7.2f} / {us(of(topk, req)[:, 1].max()):7.2f} / "
              f"{us(mine[:, 0].min()):7.2f}..{us(mine[:, 1].max()):7.2f}")


def residency(programs: torch.Tensor) -> None:
    """How many of the attention's programs ran side by side on one SM, and how long a program
    took by that count (the most programs on its SM at any time while it ran)."""
    by_sm: dict[int, list[tuple[int, int]]] = {}
    for start, end, sm, _ in programs.tolist():
        by_sm.setdefault(sm, []).append((start, end))
    times: dict[int, list[float]] = {}
    for spans in by_sm.values():
        for start, end in spans:
            # the count of programs running on this SM at some instant of [start, end): at a start
            together = max(sum(1 for s, e in spans if s <= t < e) for t in [start] + [s for s, _ in spans
                                                                                       if start <= s < end])
            times.setdefault(together, []).append((end - start) / 1000.0)
    print(f"attention: {len(by_sm)} SMs; median program us by programs side by side: "
          + ", ".join(f"{k}: {statistics.median(v):.2f} ({len(v)})" for k, v in sorted(times.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch", type=positive_int)
    ap.add_argument("context", type=positive_int)
    ap.add_argument("qo_len", type=positive_int)
    launch = ap.add_mutually_exclusive_group()  # both given: --early won and --plain was dropped unsaid
    launch.add_argument("--early", type=positive_int, metavar="SPLITS",
                        help="launch the attention early with SPLITS splits")  # 0 ran the rule with splits=0
    launch.add_argument("--plain", action="store_true", help="never launch the attention early")
    ap.add_argument("--grid-order", action="store_true",
                    help="keep the early attention's programs in the grid's order (not request-major)")
    args = ap.parse_args()
    if args.grid_order and args.plain:
        ap.error("--grid-order orders the early attention's programs: --plain never launches it early")
    if args.context < args.qo_len:
        ap.error(f"context {args.context} is shorter than qo_len {args.qo_len}")
    if args.grid_order:
        verify_step.early_order = lambda kv_bytes=1: False
    dev = torch.device("cuda")
    geo = Geometry()
    buffer = torch.zeros(len(KERNELS) * MAX_PROGRAMS * 4, dtype=torch.int64, device=dev)
    instrument(buffer)
    steps = StepSet(args.batch, args.context, geo, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.bfloat16,
                    q_dtype=torch.bfloat16, device=dev, num_sets=3)
    sets = [steps.step(s, args.qo_len) for s in range(3)]
    early = True if args.early else (False if args.plain else None)

    def step(st):
        c = st["cache"]
        return verify_step.sparse_verify_step(st["index_q"], c.index_k, st["q"], c.k, c.v, st["meta"], topk=geo.topk,
                                              scale=1 / math.sqrt(geo.head_dim), k_scale=c.k_scale,
                                              v_scale=c.v_scale, max_qo_len=args.qo_len, early=early,
                                              splits=args.early)
    graphs = capture_graphs([lambda st=st: step(st) for st in sets])
    for _ in range(20):
        for g in graphs:
            g.replay()
    buffer.zero_()
    graphs[0].replay()
    torch.cuda.synchronize()
    report(buffer, args.batch)


if __name__ == "__main__":
    main()
