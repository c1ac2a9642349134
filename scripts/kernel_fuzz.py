#!/usr/bin/env python
"""Random-case fuzz of the MSA kernel dispatchers against the pure-torch references.

Every case draws fresh random inputs (deterministic in `--seed` and the case number) and calls:
  select_blocks_paged, sparse_attention, sparse_layer_attention, dense_attention, on_update_kv_lens,
  write_step_kv                      (the public dispatchers, `m3_eagle_plugin.msa.kernels`)
  sparse_verify_step                 (verify_step: selection + attention, early launch options)
  sparse_verify_attention            (sparse_verify: layouts / splits / tiles / warps / paired V / self-merge)
  replay:<dispatcher>                (eager `replay.Replayer` path: later calls on one metadata object,
                                      re-prepared with other kv lengths, fresh inputs)
  graph:<dispatcher>                 (CUDA graph captured, metadata re-prepared, inputs rewritten, replayed)
and compares with the torch references (`m3_eagle_plugin.msa`) on an `MsaDecodeMetadata` twin.

Attention: relative Frobenius error of the live rows (and per (token, head) row error) against a
tolerance by dtype (fp32 1e-4, 16-bit 1e-2, fp8 2e-2 and e5m2 3e-2, as the kernel tests use);
NaN/inf never passes; graph-padding rows must be exactly 0. Selection: shape/order/padding/forced rules, then
top-k optimality on exact float64 block scores: any disagreement with the reference must be a
near-tie (score gap within a tolerance scaled by |q| max|k|). Cache writes: bitwise.

Outcomes: pass; refused (a documented error type naming the cause: KernelInputError,
KernelBackendError, MsaInputError); fail (wrong result, NaN, any other exception, CUDA error,
timeout/hang, worker crash); skipped (OOM in the fuzz's own reference/setup).

Cases run in worker processes (`--workers`); a worker that hits a CUDA error (poisoned context),
hangs past `--case-timeout` or dies is replaced, and the case is reported, so later cases still run.
The case timeout counts the time a case spends outside Triton's compiler: on a cold cache a new
shape class compiles for 100 s and more (where its tiles fit no depth, at 3, 2 and 1 stages before
`KernelTooLargeError`), which is not a hang; a timed-out or unfinished case says how long it compiled.
Exit status 0 only when cases ran, every one finished without a failure, and checks reached a
verdict (an `--only` naming no check is refused; one whose checks never run here, graph: on CPU, is exit 1,
a `--case` run's too).

GPU:  python scripts/kernel_fuzz.py --seconds 300
CPU:  TRITON_INTERPRET is set automatically when no CUDA device is present (the dispatchers are
      then pointed at the Triton kernels, which run in Triton's interpreter):
      M3_EAGLE_PLUGIN=off PYTHONPATH=src:. python scripts/kernel_fuzz.py --seconds 60 --tiny
Reproduce one case: add `--seed S --case N` (runs in-process, prints every check).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
import traceback

SCRIPT = os.path.abspath(__file__)

GROUPS = ["select_blocks_paged", "sparse_attention", "sparse_layer_attention", "dense_attention",
          "on_update_kv_lens", "write_step_kv", "sparse_verify_step", "sparse_verify_attention",
          "replay:dense_attention", "replay:sparse_layer_attention", "graph"]

ENV_SWITCHES = ("M3_EAGLE_KERNELS", "M3_EAGLE_HANDOFF", "M3_EAGLE_PDL", "M3_EAGLE_REPLAY")


# ============================================================================================
# Case generation: pure Python, deterministic in (seed, case, tiny, gpu)
# ============================================================================================

def _pick(rng, weighted):
    items, weights = zip(*weighted)
    return rng.choices(items, weights=weights)[0]


def gen_case(seed: int, case: int, tiny: bool, gpu: bool) -> dict:
    rng = random.Random(f"fuzz33:{seed}:{case}:{int(tiny)}")  # its first name: old cases stay reproducible
    p: dict = {"seed": seed, "case": case, "tiny": tiny}
    fi_shape = gpu and not tiny and rng.random() < 0.10   # FlashInfer-eligible geometry (M3 under TP4)
    p["fi_shape"] = fi_shape
    if tiny:
        block = rng.choice([16, 32])
        dim = rng.choice([16, 32])
        idim = rng.choice([16, 32])
        hkv = rng.choice([1, 2])
        group = rng.choice([1, 2, 3, 4])
        batch = rng.choice([1, 1, 2, 3])
    elif fi_shape:
        block, dim, idim, hkv = 128, 128, 128, 1
        group = rng.choice([4, 8, 16])
        batch = rng.choice([1, 2, 4, 8, 16, 32, 64])
    else:
        block = _pick(rng, [(16, 2), (32, 2), (64, 2), (128, 3)])
        dim = _pick(rng, [(16, 0.3), (32, 0.7), (64, 2), (128, 3), (256, 1.5)])
        idim = _pick(rng, [(16, 0.3), (32, 0.7), (64, 2), (128, 3), (256, 0.7)])
        hkv = _pick(rng, [(1, 3), (2, 2), (3, 0.5), (4, 2)])
        group = _pick(rng, [(1, 1), (2, 1), (4, 1.5), (8, 1.5), (16, 2), (3, 0.3), (6, 0.3), (12, 0.3),
                            (32, 0.4), (64, 0.2), (128, 0.1)])
        batch = _pick(rng, [(1, 15), (rng.randint(2, 8), 35), (rng.randint(9, 32), 30), (rng.randint(33, 70), 20)])
    p.update(block=block, dim=dim, idim=idim, hkv=hkv, group=group, batch=batch)

    # ---- query lengths: uniform or mixed 1..8
    max_q = 4 if tiny else 8
    if fi_shape:
        qo = [rng.choice([1, 2, 3, 4])] * batch
    elif rng.random() < 0.5:
        qo = [rng.randint(1, max_q)] * batch
    else:
        qo = [rng.randint(1, max_q) for _ in range(batch)]

    # ---- kv lengths: 1, in the first block, exact blocks, partial last page, random, long
    long_left = 0 if tiny else (rng.choice([1, 1, 2, 3]) if rng.random() < 0.15 else 0)
    kv = []
    for q in qo:
        if tiny:
            kind = _pick(rng, [("one", 1), ("first", 2), ("exact", 2), ("partial", 3)])
        else:
            kind = _pick(rng, [("one", 0.5), ("first", 1), ("exact", 1.5), ("partial", 2), ("random", 3),
                               ("long", 1 if long_left else 0)])
        max_blocks = 6 if tiny else 48
        if kind == "one":
            q_, k = 1, 1
        elif kind == "first":
            q_, k = q, rng.randint(q, max(q, block))
        elif kind == "exact":
            q_, k = q, block * rng.randint(1, max_blocks)
        elif kind == "partial":
            q_, k = q, block * rng.randint(0, max_blocks - 1) + rng.randint(1, block - 1)
        elif kind == "random":
            q_, k = q, rng.randint(q, 6000)
        else:
            long_left -= 1
            q_, k = q, rng.randint(8192, 40960)
        if kind == "one" and (fi_shape or (len(set(qo)) == 1 and rng.random() < 0.7)):
            q_, k = q, max(q, 1)   # keep uniform q_len uniform
        kv.append(max(k, q_))
        qo[len(kv) - 1] = q_
    p["qo"], p["kv"] = qo, kv

    # ---- dtypes
    if fi_shape:
        p.update(q_dtype="bf16", kv_dtype="fp8e4m3", iq_dtype="bf16", ik_dtype="bf16")
    else:
        p["q_dtype"] = _pick(rng, [("bf16", 6), ("fp16", 3), ("fp32", 1)])
        p["kv_dtype"] = _pick(rng, [("bf16", 3.5), ("fp16", 2), ("fp8e4m3", 3.5), ("fp8e5m2", 0.5),
                                    ("fp32", 0.5)])
        p["iq_dtype"] = _pick(rng, [("bf16", 6), ("fp16", 3), ("fp32", 1)])
        p["ik_dtype"] = _pick(rng, [(p["iq_dtype"], 5), ("fp8e4m3", 3.5), ("bf16", 0.5), ("fp16", 0.5),
                                    ("fp32", 0.5)])
    if not gpu:
        # Triton 3.6's interpreter computes bf16 tl.dot wrongly here (garbage, see the report), so on
        # CPU the 16-bit MMA operands are fp16 (bf16 stays for the caches, converted in the kernels).
        p["q_dtype"] = "fp16" if p["q_dtype"] == "bf16" else p["q_dtype"]
        p["iq_dtype"] = "fp16" if p["iq_dtype"] == "bf16" else p["iq_dtype"]
        if p["ik_dtype"] == "bf16" and p["iq_dtype"] != "fp32":
            p["ik_dtype"] = "fp16"
    p["fp8_scales"] = p["kv_dtype"].startswith("fp8") and rng.random() < 0.8

    # ---- selection parameters
    p["index_heads"] = hkv if (fi_shape or rng.random() < 0.85) else rng.randint(1, 4)
    topk = 16 if fi_shape else (rng.randint(1, 5) if tiny else _pick(rng, [(rng.randint(1, 8), 3),
                                                                             (16, 3), (rng.randint(9, 32), 2)]))
    local = _pick(rng, [(1, 6), (0, 1), (2, 2), (3, 0.5)])
    init = _pick(rng, [(0, 6), (1, 2), (2, 1)])
    if local + init > topk and rng.random() < 0.9:   # 10% keep it: both sides must refuse
        local, init = min(local, topk), max(0, min(init, topk - min(local, topk)))
    p.update(topk=topk, local=local, init=init)
    p["scale"] = round(dim ** -0.5 if rng.random() < 0.6 else rng.uniform(0.02, 0.5), 6)

    # ---- layouts, tables, metadata
    p["kv_layout"] = "interleaved" if fi_shape and rng.random() < 0.8 else _pick(
        rng, [("pool", 4), ("contig", 2), ("interleaved", 1), ("nhd", 1)])
    p["ik_layout"] = "contig" if fi_shape and rng.random() < 0.8 else _pick(rng, [("pool", 3), ("contig", 2)])
    p["q_view"] = rng.random() < 0.2          # q / index_q as strided views (unit last stride)
    p["page_spread"] = _pick(rng, [(1, 3), (2, 2), (4, 1)]) if not tiny else rng.choice([1, 2])
    p["extra_width"] = rng.randint(0, 3)
    p["meta_kind"] = "msa" if (fi_shape or rng.random() < 0.8) else "step"
    p["table_on_device"] = rng.random() < 0.4
    p["table_noncontig"] = p["meta_kind"] == "step" and rng.random() < 0.6
    p["pad_tokens"] = 0 if (fi_shape or rng.random() < 0.75) else rng.randint(1, 5)
    p["max_draft_len"] = _pick(rng, [(0, 1), (1, 1), (3, 3), (7, 1)])
    hint = _pick(rng, [("none", 3), ("exact", 3), ("loose", 2), ("low", 0.5 if p["meta_kind"] == "msa" else 0)])
    if hint == "low" and max(qo) == 1:
        hint = "exact"
    p["hint"] = hint
    p["hint_value"] = {"none": None, "exact": max(qo), "loose": max(qo) + rng.randint(1, 8),
                       "low": max(qo) - 1}[hint]
    p["poison"] = rng.random() < 0.5          # NaN in unwritten tails and unused pages
    p["ties"] = not fi_shape and rng.random() < 0.15   # small-integer index data: exact score ties
    p["correlation"] = rng.choice([0.0, 0.0, 0.9])
    # unmapped (-1) page inside a request's range (device table; hostile test of the attentions only)
    p["unmapped"] = None
    if (p["meta_kind"] == "msa" and p["table_on_device"] and not fi_shape and rng.random() < 0.08):
        cands = [r for r, k in enumerate(kv) if -(-k // block) >= 3]
        if cands:
            r = rng.choice(cands)
            p["unmapped"] = [r, rng.randint(0, -(-kv[r] // block) - 2)]
    # random selection for sparse_attention: hostile entries (blocks past a token's position)
    p["sel_hostile"] = rng.random() < 0.3
    p["sel_source"] = _pick(rng, [("random", 3), ("reference", 2)])
    # kv correction (overlap scheduler) applied before the attentions
    p["shrink"] = p["meta_kind"] == "msa" and rng.random() < 0.25
    # second kv lengths (re-prepare for replay / graph): same qo, lengths within capacity
    kv2 = []
    for q, k in zip(qo, kv):
        if rng.random() < 0.5:
            kv2.append(k)
        else:
            kv2.append(max(q, k + rng.randint(-2 * block, 2 * block)))
    p["kv2"] = kv2
    p["env"] = {
        "M3_EAGLE_KERNELS": _pick(rng, [("auto", 7), ("triton", 2.5), ("flashinfer", 0.5 if not fi_shape else 3)]),
        "M3_EAGLE_HANDOFF": _pick(rng, [("1", 4), ("0", 1)]),
        "M3_EAGLE_PDL": _pick(rng, [("1", 4), ("0", 1), ("all", 1)]),
        "M3_EAGLE_REPLAY": _pick(rng, [("1", 4), ("0", 1)]),
    }
    # sparse_verify_attention options
    p["sva"] = {
        "layout": _pick(rng, [(None, 2), ("token", 2), ("union", 2)]),
        "splits": _pick(rng, [(None, 3), (1, 1), (2, 1), (3, 1), (5, 0.5), (16, 0.5)]),
        "self_merge": _pick(rng, [(None, 3), (True, 1), (False, 1)]),
        "key_tile": _pick(rng, [(None, 4), (16, 1), (32, 1), (64, 1), (128, 0.5)]),
        "compute_f16": _pick(rng, [(None, 4), (True, 1), (False, 1)]),
        "prefetch": rng.random() < 0.8,
        "pages_per_tile": _pick(rng, [(1, 4), (2, 1)]),
        "request_major": rng.random() < 0.2,
        "fused_union": rng.random() < 0.4,
        "num_stages": _pick(rng, [(None, 4), (1, 0.5), (2, 1)]),
    }
    p["step_opts"] = {"early": _pick(rng, [(None, 3), (True, 2), (False, 1)]),
                      "splits": _pick(rng, [(None, 4), (1, 1), (2, 1), (4, 1), (8, 0.5)])}
    p["write"] = {
        "dim": _pick(rng, [(dim, 4), (rng.choice([24, 40, 80, 96, 100, 192]), 1)]) if not tiny else
        rng.choice([dim, 24]),
        "idim": _pick(rng, [(idim, 4), (rng.choice([24, 72, 96, 136]), 1)]) if not tiny else idim,
        "index": rng.random() < 0.7,
        "skip_frac": rng.choice([0.0, 0.1, 0.5, 1.0]),
        "past_cache": rng.random() < 0.2,
        "slots_int64": rng.random() < 0.4,
        "rows_view": rng.random() < 0.3,
    }
    _fit_memory(p, 6e7 if tiny else 2.0e9)
    p["graph"] = gpu and p["meta_kind"] == "msa" and p["unmapped"] is None and rng.random() < 0.3
    p["graph_update"] = p["graph"] and rng.random() < 0.5
    p["replay"] = gpu and p["meta_kind"] == "msa" and p["unmapped"] is None and rng.random() < 0.5
    # Options added later draw from their own stream, so every earlier case keeps its parameters.
    later = random.Random(f"fuzz34:{seed}:{case}:{int(tiny)}")
    p["sva"]["num_warps"] = _pick(later, [(None, 4), (2, 0.5), (8, 1.5)])
    p["sva"]["paired_v"] = _pick(later, [(None, 4), (True, 1.5), (False, 1)])   # the 64-row tiles' miscompile
    return p


ELEM = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8e4m3": 1, "fp8e5m2": 1}


def cache_bytes(p) -> float:
    """Device bytes of a case's caches (pool of 3 sub-pages, generation temporaries, index-K)."""
    slots = sum(max(a, b) + p["block"] for a, b in zip(p["kv"], p["kv2"])) * p["page_spread"]
    kv = slots * p["hkv"] * p["dim"] * 3 * (ELEM[p["kv_dtype"]] + 2)
    ik = slots * p["idim"] * 2 * (ELEM[p["ik_dtype"]] + 4)
    return float(kv + ik)


def _fit_memory(p, budget: float) -> None:
    """Halve the longest requests until the caches fit `budget` bytes (several workers share a GPU)."""
    while cache_bytes(p) > budget:
        i = max(range(len(p["kv"])), key=lambda j: max(p["kv"][j], p["kv2"][j]))
        if max(p["kv"][i], p["kv2"][i]) <= 2 * p["block"]:
            break
        p["kv"][i] = max(p["qo"][i], p["kv"][i] // 2)
        p["kv2"][i] = max(p["qo"][i], p["kv2"][i] // 2)
    if p["unmapped"] is not None:
        r, b = p["unmapped"]
        if -(-p["kv"][r] // p["block"]) < 3 or b > -(-p["kv"][r] // p["block"]) - 2:
            p["unmapped"] = None


# ============================================================================================
# Worker side
# ============================================================================================

class Mismatch(AssertionError):
    """The kernel's result disagrees with the reference (or breaks its contract)."""


class Poisoned(RuntimeError):
    """The CUDA context is no longer usable."""


def _setup_runtime(device_kind: str):
    """Import torch and the package (TRITON_INTERPRET must already be set for the interpreter)."""
    global torch, msa, K, backend, _common, REFUSALS, DT
    import torch  # noqa: F811
    import m3_eagle_plugin.msa as msa  # noqa: F811
    import m3_eagle_plugin.msa.kernels as K  # noqa: F811
    from m3_eagle_plugin.msa.kernels import _common, backend  # noqa: F811

    if device_kind == "cpu":
        # The dispatchers send CPU tensors to the torch references; in the interpreter run the Triton
        # kernels instead (they run on CPU there), so the dispatchers' kernel paths are what is checked.
        backend.triton_available = lambda device=None: True
        torch.set_num_threads(1)
    REFUSALS = (K.KernelInputError, K.KernelBackendError, msa.MsaInputError)
    if device_kind == "cuda":
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = _compile_starts, _compile_ends
    DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


#: Seconds and kernels Triton compiled in this process (a kernel found in Triton's disk cache
#: counts too, for its load); `tell(line)` hears "@@COMPILING" and "@@COMPILED secs" (a worker's parent).
COMPILED = {"secs": 0.0, "kernels": 0, "since": None, "tell": None}


def _compile_starts(**_):
    COMPILED["since"] = time.time()
    if COMPILED["tell"] is not None:
        COMPILED["tell"]("@@COMPILING")
    return None  # a true answer would tell Triton to skip the compile


def _compile_ends(**_):
    secs = time.time() - COMPILED["since"] if COMPILED["since"] is not None else 0.0
    COMPILED["secs"] += secs
    COMPILED["kernels"] += 1
    COMPILED["since"] = None
    if COMPILED["tell"] is not None:
        COMPILED["tell"](f"@@COMPILED {secs:.3f}")


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def attn_tol(p) -> float:
    if p["kv_dtype"].startswith("fp8"):
        return 3e-2 if p["kv_dtype"] == "fp8e5m2" else 2e-2
    if p["q_dtype"] == "fp32" and p["kv_dtype"] == "fp32":
        return 1e-4
    return 1e-2


def score_tol_factor(p) -> float:
    """Score tolerance / (|q| max|k|): fp32 accumulation only when the kernel's k -> q-dtype
    conversion is exact, a bf16/fp16 rounding otherwise (`k.to(q.dtype)` in the scoring)."""
    iq, ik = p["iq_dtype"], p["ik_dtype"]
    exact = iq == ik or ik.startswith("fp8") or iq == "fp32"
    if p["ties"]:
        exact = True
    base = 6e-5 if exact else 2 ** -7
    if p["fi_shape"]:
        base = max(base, 2 ** -7)   # FlashInfer's proxy score may be the route
    return base


class Ctx:
    """One case's tensors, metadata objects and reference helpers."""

    def __init__(self, p, dev):
        self.p, self.dev = p, dev
        self.gen = torch.Generator(device=dev).manual_seed(p["seed"] * 1_000_003 + p["case"])
        self.cgen = torch.Generator().manual_seed(p["seed"] * 7919 + p["case"])
        B, R = p["block"], p["batch"]
        self.B, self.R = B, R
        self.T = sum(p["qo"])
        self.Tp = self.T + p["pad_tokens"]
        self.hkv, self.G, self.D = p["hkv"], p["group"], p["dim"]
        self.Hq = self.hkv * self.G
        self.Hi, self.Di = p["index_heads"], p["idim"]
        self.cap = [max(a, b) for a, b in zip(p["kv"], p["kv2"])]
        need = [-(-c // B) for c in self.cap]
        self.width = max(need) + p["extra_width"]
        self.num_pages = sum(need) * p["page_spread"] + 3
        perm = torch.randperm(self.num_pages, generator=self.cgen)
        table = torch.full((R, self.width), -1, dtype=torch.int32)
        at = 0
        for r, n in enumerate(need):
            table[r, :n] = perm[at:at + n].to(torch.int32)
            at += n
        self.used_pages = set(perm[:at].tolist())
        self.table_host = self.table_orig = table
        if p["unmapped"] is not None:
            r, b = p["unmapped"]
            self.table_host = table.clone()
            self.table_host[r, b] = -1
        self.make_caches()
        self.make_queries()
        self.ks = 0.05 if p["fp8_scales"] else None
        self.vs = 0.04 if p["fp8_scales"] else None
        self.meta = self.new_msa_meta(p["kv"]) if p["meta_kind"] == "msa" else self.new_step_meta()
        self.meta_r = self.new_msa_meta(p["kv"])

    # ----- tensors
    def randn(self, *shape, dtype=None, std=1.0):
        """Normal samples, generated in 16 bits for 16-bit / fp8 targets (no fp32 temporaries)."""
        gen_dtype = torch.float32 if dtype in (None, torch.float32) else (
            dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16)
        x = torch.randn(*shape, generator=self.gen, device=self.dev, dtype=gen_dtype)
        if std != 1.0:
            x.mul_(std)
        return x if dtype is None else x.to(dtype)

    def make_caches(self):
        p, P, H, B, D = self.p, self.num_pages, self.hkv, self.B, self.D
        kvd = DT[p["kv_dtype"]]
        std = (1.0 / (0.05 * 8)) if p["fp8_scales"] else 1.0
        layout = p["kv_layout"]
        if layout == "pool":
            pool = self.randn(P, 3, H * B * D, dtype=kvd, std=std)
            k_at, v_at = (0, 1) if self.cgen.initial_seed() % 2 else (2, 0)
            self.k = pool[:, k_at].view(P, H, B, D)
            self.v = pool[:, v_at].view(P, H, B, D)
            self.kv_bases = [pool]
        elif layout == "contig":
            self.k = self.randn(P, H, B, D, dtype=kvd, std=std)
            self.v = self.randn(P, H, B, D, dtype=kvd, std=std)
            self.kv_bases = [self.k, self.v]
        elif layout == "interleaved":
            packed = self.randn(P, H, B, 2 * D, dtype=kvd, std=std)
            self.k, self.v = packed[..., :D], packed[..., D:]
            self.kv_bases = [packed]
        else:  # "nhd": [P, B, H, D] storage seen as [P, H, B, D]
            kb = self.randn(P, B, H, D, dtype=kvd, std=std)
            vb = self.randn(P, B, H, D, dtype=kvd, std=std)
            self.k, self.v = kb.transpose(1, 2), vb.transpose(1, 2)
            self.kv_bases = [kb, vb]
        ikd = DT[p["ik_dtype"]]
        Di = self.Di
        if p["ties"]:
            src = torch.randint(-2, 3, (P, B, Di), generator=self.gen, device=self.dev).float()
        else:
            src = self.randn(P, B, Di, dtype=ikd)
        if p["ik_layout"] == "pool":
            ipool = torch.empty(P, 2, B * Di, device=self.dev, dtype=ikd)
            ipool[:, 0] = self.randn(P, B * Di, dtype=ikd)
            ipool[:, 1] = src.reshape(P, B * Di).to(ikd)
            self.ik = ipool[:, 1].view(P, B, Di)
        else:
            self.ik = src.to(ikd)
        if p["poison"]:
            self.poison()

    def poison(self):
        """NaN in every slot no request holds: tails past each request's capacity, unused pages."""
        B = self.B
        caches = [self.k, self.v, self.ik]

        def nan_fill(t, index):
            if t.element_size() == 1:
                t.view(torch.uint8)[index] = 0x7F   # e4m3fn / e5m2 NaN pattern
            else:
                t[index] = float("nan")

        unused = [pg for pg in range(self.num_pages) if pg not in self.used_pages]
        if unused:
            idx = torch.tensor(unused, device=self.dev)
            for c in caches:
                nan_fill(c, (idx,))
        for r, c_len in enumerate(self.cap):
            n = -(-c_len // B)
            tail = n * B - c_len
            if tail:
                page = int(self.table_host[r, n - 1]) if int(self.table_host[r, n - 1]) >= 0 else None
                if page is None:
                    continue
                nan_fill(self.k, (page, slice(None), slice(B - tail, None)))
                nan_fill(self.v, (page, slice(None), slice(B - tail, None)))
                nan_fill(self.ik, (page, slice(B - tail, None)))
        if self.p["unmapped"] is not None:   # the page the table no longer maps: never read
            r, b = self.p["unmapped"]
            page = int(self.table_orig[r, b])
            for c in caches[:2]:
                nan_fill(c, (page,))

    def make_queries(self):
        p, Tp = self.p, self.Tp
        self.q = self.new_rows(Tp, self.Hq, self.D, DT[p["q_dtype"]])
        self.iq = self.new_rows(Tp, self.Hi, self.Di, DT[p["iq_dtype"]], index=True)

    def new_rows(self, T, H, D, dtype, index=False):
        p = self.p
        if index and p["ties"]:
            x = torch.randint(-2, 3, (T, H, D), generator=self.gen, device=self.dev).float()
        else:
            x = self.randn(T, H, D)
            if p["correlation"] and T:
                x = p["correlation"] * x[:1] + (1 - p["correlation"] ** 2) ** 0.5 * x
        x = x.to(dtype)
        if p["q_view"]:
            wide = torch.zeros(T, H, D + 16, device=self.dev, dtype=dtype)
            wide[..., :D] = x
            return wide[..., :D]
        return x

    # ----- metadata
    def table_for_meta(self):
        t = self.table_host
        return t.to(self.dev) if self.p["table_on_device"] else t

    def new_msa_meta(self, kv):
        p = self.p
        m = msa.MsaDecodeMetadata(self.R + 2, self.T + 3, self.width, self.B, self.dev,
                                  max_draft_len=p["max_draft_len"], num_index_heads=self.Hi)
        table = self.table_host.to(self.dev) if (p["table_on_device"] or p["unmapped"] is not None) else self.table_host
        m.prepare(p["qo"], kv, table)
        return m

    def new_step_meta(self):
        from m3_eagle_plugin.bench.step_meta import build_step_meta

        p = self.p
        m = build_step_meta(p["qo"], p["kv"], self.table_host, self.B, device=self.dev, pad_tokens=p["pad_tokens"])
        if p["table_noncontig"]:
            wide = torch.full((self.R, self.width + 5), -1, dtype=torch.int32, device=self.dev)
            wide[:, :self.width] = self.table_host.to(self.dev)
            m.block_tables = wide[:, :self.width]
        return m

    def reprepare(self, kv):
        table = self.table_host.to(self.dev) if self.p["table_on_device"] else self.table_host
        self.meta.prepare(self.p["qo"], kv, table)
        self.meta_r.prepare(self.p["qo"], kv, table)

    # ----- references (always on the MsaDecodeMetadata twin, in fp32)
    def ref_sparse(self, sel, q=None):
        q = self.q if q is None else q
        out = msa.sparse_attention(q[:self.T].float(), self.k, self.v, self.meta_r, sel[:, :self.T],
                                   scale=self.p["scale"] * (self.ks or 1.0))
        return out * (self.vs or 1.0)

    def ref_dense(self, q=None):
        q = self.q if q is None else q
        out = msa.dense_attention(q[:self.T].float(), self.k, self.v, self.meta_r,
                                  scale=self.p["scale"] * (self.ks or 1.0))
        return out * (self.vs or 1.0)

    def ref_select(self, iq=None):
        iq = self.iq if iq is None else iq
        p = self.p
        return msa.select_blocks_paged(iq[:self.T], self.ik, self.meta_r, topk=p["topk"], local_blocks=p["local"],
                                       init_blocks=p["init"])

    def exact_scores(self, iq=None):
        """float64 [Hi, T, NB]: max visible score of each block per token (-inf: not visible)."""
        iq = self.iq if iq is None else iq
        B, m = self.B, self.meta_r
        nb = max(1, -(-max(self.cap) // B))
        S = torch.full((self.Hi, self.T, nb), float("-inf"), dtype=torch.float64, device=self.dev)
        pos = m.positions.long()
        cu = m.cu_qo_lens.tolist()
        kmax = 0.0
        for r, kvh in enumerate(m.kv_lens_host):
            t0, t1 = cu[r], cu[r + 1]
            if t1 == t0 or kvh == 0:
                continue
            n = -(-kvh // B)
            pages = m.block_tables[r, :n].long()
            keys = self.ik[pages.clamp(min=0)].double().reshape(n * B, self.Di)
            ok = (pages >= 0).repeat_interleave(B) & (torch.arange(n * B, device=self.dev) < kvh)
            keys = torch.where(ok[:, None], keys, torch.zeros_like(keys))
            kmax = max(kmax, float(keys.norm(dim=-1).max()))
            s = torch.einsum("thd,kd->htk", iq[t0:t1].double(), keys)
            hidden = (torch.arange(n * B, device=self.dev)[None, :] > pos[t0:t1, None]) | ~ok[None, :]
            s = s.masked_fill(hidden[None], float("-inf"))
            S[:, t0:t1, :n] = s.view(self.Hi, t1 - t0, n, B).amax(-1)
        qn = iq[:self.T].double().norm(dim=-1).transpose(0, 1)   # [Hi, T]
        return S, qn * kmax

    # ----- random selection for sparse_attention
    def random_selection(self):
        p, B = self.p, self.B
        m = self.meta_r
        pos = m.positions.tolist()
        kvh = list(m.kv_lens_host)
        req = m.token_request.tolist()
        topk = p["topk"]
        sel = torch.full((self.hkv, self.Tp, topk), -1, dtype=torch.int32)
        g = self.cgen
        for h in range(self.hkv):
            for t in range(self.T):
                if pos[t] < 0:
                    continue
                nv = pos[t] // B + 1
                allowed = -(-kvh[req[t]] // B) if p["sel_hostile"] else nv
                count = int(torch.randint(0, min(topk, allowed) + 1, (1,), generator=g))
                ids = torch.randperm(allowed, generator=g)[:count].tolist()
                if count and nv - 1 not in ids and float(torch.rand(1, generator=g)) < 0.8:
                    ids[0] = nv - 1
                ids = sorted(set(ids))
                if ids:
                    sel[h, t, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return sel.to(self.dev)


# ----- comparisons ---------------------------------------------------------------------------

def compare_attention(out, ref, T, tol, what):
    """Relative Frobenius error of the live rows; per-row errors; padding rows exactly 0."""
    if out.shape[1:] != ref.shape[1:] or out.shape[0] < T:
        raise Mismatch(f"{what}: output shape {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    o = out[:T].double()
    r = ref.double()
    if not torch.isfinite(r).all():
        raise Mismatch(f"{what}: the REFERENCE has NaN/inf ({int((~torch.isfinite(r)).sum())} values)")
    bad = ~torch.isfinite(o)
    if bad.any():
        rows = bad.flatten(1).any(1).nonzero().flatten().tolist()
        raise Mismatch(f"{what}: NaN/inf in kernel output, tokens {rows[:12]}{'...' if len(rows) > 12 else ''}")
    diff = o - r
    denom = max(float(r.norm()), 1e-6 * math.sqrt(max(1, r.numel())))
    g = float(diff.norm()) / denom
    rn = r.norm(dim=-1)
    floor = 0.1 * float(rn.pow(2).mean().sqrt()) + 1e-6 if rn.numel() else 1e-6
    rowerr = diff.norm(dim=-1) / rn.clamp(min=floor)
    worst = float(rowerr.max()) if rowerr.numel() else 0.0
    if g > tol or worst > 5 * tol:
        t, h = divmod(int(rowerr.argmax()), rowerr.shape[1]) if rowerr.numel() else (0, 0)
        raise Mismatch(f"{what}: rel err {g:.3e} (tol {tol:.0e}), worst row {worst:.3e} at token {t} head {h} "
                       f"(tol {5 * tol:.0e})", g)
    if out.shape[0] > T:
        pad = out[T:]
        if not (pad == 0).all():
            raise Mismatch(f"{what}: graph-padding rows {T}..{out.shape[0] - 1} not zero "
                           f"(max |x| {float(pad.double().abs().nan_to_num(float('inf')).max()):.3e})", g)
    return g


def check_selection(ctx, sel, what, iq=None, ref=None):
    """Contract + near-tie optimality on exact scores. Returns (worst normalised gap, rows differing
    from the reference)."""
    p, B, T = ctx.p, ctx.B, ctx.T
    topk, local, init = p["topk"], p["local"], p["init"]
    if tuple(sel.shape) != (ctx.Hi, ctx.Tp, topk) or sel.dtype != torch.int32:
        raise Mismatch(f"{what}: selection {sel.dtype} {tuple(sel.shape)}, want int32 {(ctx.Hi, ctx.Tp, topk)}")
    if ctx.Tp > T and not (sel[:, T:] == -1).all():
        raise Mismatch(f"{what}: graph-padding rows of the selection are not all -1")
    S, scale = ctx.exact_scores(iq)
    nb = S.shape[-1]
    s = sel[:, :T].long()
    pos = ctx.meta_r.positions.long()
    nv = torch.where(pos >= 0, pos // B + 1, torch.zeros_like(pos))[None, :].expand(ctx.Hi, -1)   # [Hi, T]
    want = nv.clamp(max=topk)
    lane = torch.arange(topk, device=sel.device)
    valid = s >= 0
    layout_ok = (valid == (lane[None, None, :] < want[..., None])).all(-1)
    asc = ((s[..., 1:] > s[..., :-1]) | ~valid[..., 1:]).all(-1)
    inrange = ((s < nv[..., None]) | ~valid).all(-1)
    bad = ~(layout_ok & asc & inrange)
    if bad.any():
        h, t = [int(x) for x in bad.nonzero()[0]]
        raise Mismatch(f"{what}: malformed row head {h} token {t} (pos {int(pos[t])}, {int(nv[h, t])} visible, "
                       f"topk {topk}): {sel[h, t].tolist()}")
    ids = torch.arange(nb, device=sel.device)
    chosen = torch.zeros(ctx.Hi, T, nb + 1, dtype=torch.bool, device=sel.device)
    chosen.scatter_(2, torch.where(valid, s, torch.full_like(s, nb)), True)
    chosen = chosen[..., :nb]
    visible = ids[None, None, :] < nv[..., None]
    forced = visible & ((ids[None, None, :] >= (nv - local)[..., None]) | (ids[None, None, :] < init))
    missing = forced & ~chosen
    if missing.any():
        h, t, b = [int(x) for x in missing.nonzero()[0]]
        raise Mismatch(f"{what}: forced block {b} missing, head {h} token {t}: {sel[h, t].tolist()}")
    free = chosen & ~forced
    unchosen = visible & ~chosen
    Sf = S.nan_to_num(nan=float("-inf"))
    lo = torch.where(free, Sf, torch.full_like(Sf, float("inf"))).amin(-1)
    hi = torch.where(unchosen, Sf, torch.full_like(Sf, float("-inf"))).amax(-1)
    gap = (hi - lo)                                           # > 0: an unchosen block beats a chosen one
    tol = score_tol_factor(p) * scale + 1e-9
    finite = torch.isfinite(gap)
    norm_gap = torch.where(finite, gap / scale.clamp(min=1e-30), torch.zeros_like(gap))
    viol = finite & (gap > tol)
    # a chosen non-forced block with -inf score while a finite one is left out is covered by the gap;
    # a chosen block with -inf exact score (nothing visible in it) while better ones exist: also a gap
    if viol.any():
        h, t = [int(x) for x in viol.nonzero()[0]]
        raise Mismatch(f"{what}: not a top-{topk} set at head {h} token {t}: unchosen score {float(hi[h, t]):.6g} > "
                       f"chosen {float(lo[h, t]):.6g} by {float(gap[h, t]):.3e} (tol {float(tol[h, t]):.3e}); "
                       f"kernel {sel[h, t].tolist()}" + (f" reference {ref[h, t].tolist()}" if ref is not None else ""))
    differ = 0
    if ref is not None:
        differ = int((torch.sort(sel[:, :T], -1).values != torch.sort(ref[:, :T].to(sel.device), -1).values)
                     .any(-1).sum())
    worst = float(norm_gap.clamp(min=0).max()) if norm_gap.numel() else 0.0
    return worst, differ


# ----- the checks --------------------------------------------------------------------------------

def hint(ctx):
    return ctx.p["hint_value"]


def reference(what, fn, *args):
    """The torch reference's answer for inputs the dispatcher took: its refusal here is the
    dispatcher's failure to refuse them (both sides must refuse the same inputs), not a refusal."""
    try:
        return fn(*args)
    except REFUSALS as exc:
        raise Mismatch(f"{what}: the dispatcher returned a result where the torch reference refuses "
                       f"({type(exc).__name__}: {exc})") from exc


def do_select(ctx):
    p = ctx.p
    sel = K.select_blocks_paged(ctx.iq, ctx.ik, ctx.meta, topk=p["topk"], local_blocks=p["local"],
                                init_blocks=p["init"], max_qo_len=hint(ctx))
    sync(ctx)
    ref = reference("select_blocks_paged", ctx.ref_select)
    worst, differ = check_selection(ctx, sel, "select_blocks_paged", ref=ref)
    ctx.kernel_sel = sel
    return worst, f"ties-differ-rows={differ}"


def do_sparse(ctx):
    p = ctx.p
    if p["sel_source"] == "reference" and p["index_heads"] == ctx.hkv and p["unmapped"] is None:
        try:
            sel = ctx.ref_select()
        except REFUSALS:
            sel = ctx.random_selection()[:, :ctx.T]
        if ctx.Tp > ctx.T:
            sel = torch.cat([sel, torch.full((ctx.hkv, ctx.Tp - ctx.T, p["topk"]), -1, dtype=torch.int32,
                                             device=ctx.dev)], 1)
        sel = sel.contiguous()
    else:
        sel = ctx.random_selection()
    ctx.sparse_sel = sel
    out = K.sparse_attention(ctx.q, ctx.k, ctx.v, ctx.meta, sel, scale=p["scale"], k_scale=ctx.ks, v_scale=ctx.vs,
                             max_qo_len=hint(ctx))
    sync(ctx)
    return compare_attention(out, reference("sparse_attention", ctx.ref_sparse, sel), ctx.T, attn_tol(p),
                             "sparse_attention"), ""


def do_dense(ctx, q=None, what="dense_attention"):
    p = ctx.p
    q = ctx.q if q is None else q
    out = K.dense_attention(q, ctx.k, ctx.v, ctx.meta, scale=p["scale"], k_scale=ctx.ks, v_scale=ctx.vs,
                            max_qo_len=hint(ctx))
    sync(ctx)
    return compare_attention(out, reference(what, ctx.ref_dense, q), ctx.T, attn_tol(p), what), ""


def do_layer(ctx, q=None, iq=None, what="sparse_layer_attention"):
    p = ctx.p
    q = ctx.q if q is None else q
    iq = ctx.iq if iq is None else iq
    out = K.sparse_layer_attention(q, ctx.k, ctx.v, iq, ctx.ik, ctx.meta, topk=p["topk"], scale=p["scale"],
                                   local_blocks=p["local"], init_blocks=p["init"], k_scale=ctx.ks, v_scale=ctx.vs,
                                   max_qo_len=hint(ctx))
    sync(ctx)
    return compare_layer_output(ctx, out, q, iq, what)


def compare_layer_output(ctx, out, q, iq, what):
    """Against the reference attention on the reference selection; on a mismatch also on the
    dispatcher's own selection (validated as a top-k set): selections may differ in near-ties."""
    p = ctx.p
    ref_sel = reference(what, ctx.ref_select, iq)
    try:
        return compare_attention(out, reference(what, ctx.ref_sparse, ref_sel, q), ctx.T, attn_tol(p), what), ""
    except Mismatch as first:
        sel = K.select_blocks_paged(iq, ctx.ik, ctx.meta, topk=p["topk"], local_blocks=p["local"],
                                    init_blocks=p["init"], max_qo_len=hint(ctx))
        check_selection(ctx, sel, what + " (its selection)", iq=iq, ref=ref_sel)
        try:
            return compare_attention(out, reference(what, ctx.ref_sparse, sel, q), ctx.T, attn_tol(p),
                                     what), "own-selection"
        except Mismatch as second:
            raise Mismatch(f"{first}; on the dispatcher's own selection: {second}")


def do_step(ctx):
    from m3_eagle_plugin.msa.kernels.verify_step import sparse_verify_step

    p, o = ctx.p, ctx.p["step_opts"]
    sel, out = sparse_verify_step(ctx.iq, ctx.ik, ctx.q, ctx.k, ctx.v, ctx.meta, topk=p["topk"], scale=p["scale"],
                                  local_blocks=p["local"], init_blocks=p["init"], k_scale=ctx.ks, v_scale=ctx.vs,
                                  max_qo_len=hint(ctx), early=o["early"], splits=o["splits"])
    sync(ctx)
    ref = reference("sparse_verify_step", ctx.ref_select)
    worst, differ = check_selection(ctx, sel, "sparse_verify_step selection", ref=ref)
    err = compare_attention(out, reference("sparse_verify_step", ctx.ref_sparse, sel), ctx.T, attn_tol(p),
                            "sparse_verify_step attention")
    return err, f"ties-differ-rows={differ}"


def do_variants(ctx):
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    p, o = ctx.p, dict(ctx.p["sva"])
    sel = getattr(ctx, "sparse_sel", None)
    if sel is None:
        sel = ctx.random_selection()
    kw = dict(scale=p["scale"], k_scale=ctx.ks, v_scale=ctx.vs, max_qo_len=hint(ctx), layout=o["layout"],
              splits=o["splits"], self_merge=o["self_merge"], key_tile=o["key_tile"], compute_f16=o["compute_f16"],
              prefetch=o["prefetch"], pages_per_tile=o["pages_per_tile"], request_major=o["request_major"])
    for name in ("num_stages", "num_warps", "paired_v"):
        if o.get(name) is not None:
            kw[name] = o[name]
    note = ""
    if (o["fused_union"] and o["layout"] == "union" and p["index_heads"] == ctx.hkv and p["unmapped"] is None):
        from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

        sel, union = select_blocks_verify(ctx.iq, ctx.ik, ctx.meta, topk=p["topk"], local_blocks=p["local"],
                                          init_blocks=p["init"], max_qo_len=hint(ctx), union_group=ctx.G)
        sync(ctx)
        check_selection(ctx, sel, "select_blocks_verify(union_group)", ref=None)
        kw["union"] = union
        note = "fused-union"
    out = sparse_verify_attention(ctx.q, ctx.k, ctx.v, ctx.meta, sel, **kw)
    sync(ctx)
    return compare_attention(out, reference("sparse_verify_attention", ctx.ref_sparse, sel), ctx.T, attn_tol(p),
                             "sparse_verify_attention"), note


def meta_fields(m):
    names = ("kv_lens", "qo_offsets", "positions", "token_kv_lens", "valid_blocks", "cache_slots")
    out = {n: getattr(m, n).clone() for n in names}
    for n in ("_kv_lens", "_qo_offsets", "_positions", "_token_kv_lens", "_valid_blocks", "_cache_slots"):
        out[n] = getattr(m, n).clone()
    return out


def correction(ctx, rng, kv):
    kind = rng.choice(["one-rejection", "random-shrink", "zero", "negative", "above", "below-qo", "mixed"])
    qo = ctx.p["qo"]
    vals = []
    for q, k in zip(qo, kv):
        v = {"one-rejection": k - rng.randint(0, q - 1) if q > 1 else k, "random-shrink": rng.randint(0, k),
             "zero": 0, "negative": -rng.randint(1, 9), "above": k + rng.randint(1, 50),
             "below-qo": rng.randint(0, max(0, q - 1)),
             "mixed": rng.choice([k, k - 1, 0, -3, k + 5, rng.randint(0, k)])}[kind]
        vals.append(v)
    return kind, vals


def do_on_update(ctx):
    p = ctx.p
    rng = random.Random(f"upd:{p['seed']}:{p['case']}")
    mk, mr = ctx.new_msa_meta(p["kv"]), ctx.new_msa_meta(p["kv"])
    notes = []
    for step in range(rng.randint(1, 3)):
        mode = rng.choice(["tensor", "tensor", "tensor", "none", "int64"])
        if mode == "none":
            new = None
        else:
            kind, vals = correction(ctx, rng, p["kv"])
            new = torch.tensor(vals, dtype=torch.int64 if mode == "int64" else torch.int32, device=ctx.dev)
            notes.append(kind)
        K.on_update_kv_lens(mk, new)
        sync(ctx)
        with env(M3_EAGLE_KERNELS="torch"):
            mr.on_update_kv_lens(None if new is None else new.clone())
        a, b = meta_fields(mk), meta_fields(mr)
        for name in a:
            if not torch.equal(a[name].cpu(), b[name].cpu()):
                diff = (a[name].cpu() != b[name].cpu()).nonzero().flatten()[:8].tolist()
                raise Mismatch(f"on_update_kv_lens step {step} ({mode}, {notes[-1] if notes else ''}): {name} differs "
                               f"at {diff}: kernel {a[name].cpu()[diff].tolist()} vs torch {b[name].cpu()[diff].tolist()}")
    return 0.0, "+".join(notes)


def apply_shrink(ctx):
    """The overlap scheduler's correction before the attentions: both metadata objects."""
    p = ctx.p
    rng = random.Random(f"shrink:{p['seed']}:{p['case']}")
    kind, vals = correction(ctx, rng, p["kv"])
    new = torch.tensor(vals, dtype=torch.int32, device=ctx.dev)
    K.on_update_kv_lens(ctx.meta, new)
    sync(ctx)
    with env(M3_EAGLE_KERNELS="torch"):
        ctx.meta_r.on_update_kv_lens(new.clone())
    a, b = meta_fields(ctx.meta), meta_fields(ctx.meta_r)
    for name in a:
        if not torch.equal(a[name].cpu(), b[name].cpu()):
            raise Mismatch(f"on_update_kv_lens (shrink {kind}): {name} differs")
    return kind


def do_write(ctx):
    p, w = ctx.p, ctx.p["write"]
    dev, B, H = ctx.dev, ctx.B, ctx.hkv
    T = ctx.T + p["pad_tokens"]
    kvd, ikd = DT[p["kv_dtype"]], DT[p["ik_dtype"]]
    D, Di = w["dim"], w["idim"]
    P = max(-(-T // B) * 2 + 2, 4)
    cap = P * B
    # caches: pool views or contiguous (the case's layout family)
    if p["kv_layout"] == "pool":
        pool = ctx.randn(P, 3, H * B * D).to(kvd)
        kc, vc = pool[:, 0].view(P, H, B, D), pool[:, 2].view(P, H, B, D)
        bases = [pool]
    elif p["kv_layout"] == "nhd":
        kb, vb = ctx.randn(P, B, H, D).to(kvd), ctx.randn(P, B, H, D).to(kvd)
        kc, vc = kb.transpose(1, 2), vb.transpose(1, 2)
        bases = [kb, vb]
    elif p["kv_layout"] == "interleaved":
        packed = ctx.randn(P, H, B, 2 * D).to(kvd)
        kc, vc = packed[..., :D], packed[..., D:]
        bases = [packed]
    else:
        kc, vc = ctx.randn(P, H, B, D).to(kvd), ctx.randn(P, H, B, D).to(kvd)
        bases = [kc, vc]
    ikc = None
    if w["index"]:
        ipool = ctx.randn(P, 2, B * Di).to(ikd)
        ikc = ipool[:, 1].view(P, B, Di)
        bases.append(ipool)
    g = ctx.cgen
    slots = torch.randperm(cap, generator=g)[:T]
    skip = torch.rand(T, generator=g) < w["skip_frac"]
    slots = torch.where(skip, torch.full_like(slots, -1), slots)
    ref_slots = slots.clone()
    if w["past_cache"] and T:
        i = int(torch.randint(T, (1,), generator=g))
        slots[i] = cap + int(torch.randint(0, 3 * B, (1,), generator=g))
        ref_slots[i] = -1
    dt = torch.int64 if w["slots_int64"] else torch.int32
    slots, ref_slots = slots.to(dt).to(dev), ref_slots.to(torch.int64).to(dev)

    def rows(*shape, dtype):
        x = ctx.randn(*shape).to(dtype)
        if w["rows_view"]:
            wide = torch.zeros(*shape[:-1], shape[-1] + 8, dtype=dtype, device=dev)
            wide[..., :shape[-1]] = x
            return wide[..., :shape[-1]]
        return x

    k, v = rows(T, H, D, dtype=kvd), rows(T, H, D, dtype=kvd)
    ik = rows(T, Di, dtype=ikd) if w["index"] else None
    clones = [b.clone() for b in bases]

    def twin(view):
        for b, c in zip(bases, clones):
            if view.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                return c.as_strided(view.shape, view.stride(), view.storage_offset())
        raise RuntimeError("no base")

    K.write_step_kv(kc, vc, slots, k, v, ikc, ik)
    sync(ctx)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

    def as_bits(t):
        return t.view(bits[t.element_size()])

    rk, rv = twin(kc), twin(vc)
    msa.write_kv(as_bits(rk), as_bits(rv), ref_slots, as_bits(k), as_bits(v))
    if w["index"]:
        msa.write_index_k(as_bits(twin(ikc)), ref_slots, as_bits(ik))
    for i, (b, c) in enumerate(zip(bases, clones)):
        if not torch.equal(as_bits(b), as_bits(c)):
            where = (as_bits(b) != as_bits(c)).nonzero()[:4].tolist()
            raise Mismatch(f"write_step_kv: cache storage {i} differs from the torch writers at {where}")
    return 0.0, f"T={T} D={D} Di={Di if w['index'] else '-'}"


def do_replay(ctx, which):
    """Later calls on the same metadata object (recorded on the first call of a signature, then
    replayed), with the metadata re-prepared (other kv lengths) and fresh inputs."""
    p = ctx.p
    worst, notes = 0.0, []
    for i, kv in enumerate([p["kv2"], p["kv"], p["kv2"]]):
        ctx.reprepare(kv)
        q = ctx.new_rows(ctx.Tp, ctx.Hq, ctx.D, DT[p["q_dtype"]])
        iq = ctx.new_rows(ctx.Tp, ctx.Hi, ctx.Di, DT[p["iq_dtype"]], index=True)
        if which == "dense":
            err, note = do_dense(ctx, q=q, what=f"replay:dense_attention call {i + 2}")
        else:
            err, note = do_layer(ctx, q=q, iq=iq, what=f"replay:sparse_layer_attention call {i + 2}")
        worst = max(worst, err)
        if note:
            notes.append(note)
    from m3_eagle_plugin.msa.kernels import dense_verify, replay as rp, verify_step

    rep = (dense_verify if which == "dense" else verify_step)._REPLAYER
    recorded = any(isinstance(r, rp._Recording) and r.meta() is ctx.meta for r in rep.recordings.values())
    notes.append("recorded" if recorded else "not-recorded")
    return worst, ",".join(notes)


def do_graph(ctx):
    """Capture the dispatchers in one CUDA graph, re-prepare the metadata with other kv lengths,
    rewrite the inputs in place, replay, compare."""
    p = ctx.p
    fns = []
    rng = random.Random(f"graph:{p['seed']}:{p['case']}")
    new_kv = torch.tensor(p["kv"], dtype=torch.int32, device=ctx.dev)
    sel_static = ctx.random_selection()
    if p["graph_update"]:
        fns.append(("on_update_kv_lens", lambda: K.on_update_kv_lens(ctx.meta, new_kv)))
    fns.append(("dense_attention", lambda: K.dense_attention(ctx.q, ctx.k, ctx.v, ctx.meta, scale=p["scale"],
                                                             k_scale=ctx.ks, v_scale=ctx.vs, max_qo_len=hint(ctx))))
    fns.append(("sparse_attention", lambda: K.sparse_attention(ctx.q, ctx.k, ctx.v, ctx.meta, sel_static,
                                                               scale=p["scale"], k_scale=ctx.ks, v_scale=ctx.vs,
                                                               max_qo_len=hint(ctx))))
    fns.append(("select_blocks_paged", lambda: K.select_blocks_paged(ctx.iq, ctx.ik, ctx.meta, topk=p["topk"],
                                                                     local_blocks=p["local"], init_blocks=p["init"],
                                                                     max_qo_len=hint(ctx))))
    fns.append(("sparse_layer_attention", lambda: K.sparse_layer_attention(
        ctx.q, ctx.k, ctx.v, ctx.iq, ctx.ik, ctx.meta, topk=p["topk"], scale=p["scale"], local_blocks=p["local"],
        init_blocks=p["init"], k_scale=ctx.ks, v_scale=ctx.vs, max_qo_len=hint(ctx))))
    # eager warm-up (per-device buffers made outside the capture); a refusal here is the case's refusal
    live, skipped = [], []
    from triton import knobs

    launches = []
    hook = lambda metadata: launches.append(1)  # noqa: E731
    for name, fn in fns:
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            launches.clear()
            fn()
            sync(ctx)
            if launches or name == "on_update_kv_lens":
                live.append((name, fn))
            else:  # the torch reference ran: it loops over the captured lengths, so no re-prepared replay
                skipped.append(f"{name}:torch-reference")
        except Exception as exc:  # noqa: BLE001 - the eager checks report it; the graph leaves it out
            if not isinstance(exc, REFUSALS) and context_poisoned():
                raise
            skipped.append(f"{name}:{type(exc).__name__}")
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
    # sparse_layer_attention is select_blocks_paged then sparse_attention: where either half ran the
    # torch reference (or was refused), its launches come from the other half only, and the graph
    # would replay that half's captured lengths
    off = {x.split(":")[0] for x in skipped} & {"select_blocks_paged", "sparse_attention"}
    if off and any(n == "sparse_layer_attention" for n, _ in live):
        live = [(n, fn) for n, fn in live if n != "sparse_layer_attention"]
        skipped.append(f"sparse_layer_attention:{'+'.join(sorted(off))}-not-live")
    if not any(n != "on_update_kv_lens" for n, _ in live):
        raise K.KernelInputError("graph: every dispatcher refused this case eagerly")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _, fn in live:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    sync(ctx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for _, fn in live]
    sync(ctx)
    # a later step: other kv lengths, new inputs
    ctx.reprepare(p["kv2"])
    ctx.q.copy_(ctx.new_rows(ctx.Tp, ctx.Hq, ctx.D, DT[p["q_dtype"]]))
    ctx.iq.copy_(ctx.new_rows(ctx.Tp, ctx.Hi, ctx.Di, DT[p["iq_dtype"]], index=True))
    notes = [n for n, _ in live] + [f"left-out:{x}" for x in skipped]
    if p["graph_update"]:
        kind, vals = correction(ctx, rng, p["kv2"])
        new_kv.copy_(torch.tensor(vals, dtype=torch.int32))
        with env(M3_EAGLE_KERNELS="torch"):
            ctx.meta_r.on_update_kv_lens(new_kv.clone())
        notes.append(kind)
    sel_static.copy_(ctx.random_selection())
    graph.replay()
    sync(ctx)
    worst = 0.0
    for (name, _), out in zip(live, outs):
        what = f"graph:{name}"
        if name == "on_update_kv_lens":
            a, b = meta_fields(ctx.meta), meta_fields(ctx.meta_r)
            for f in a:
                if not torch.equal(a[f].cpu(), b[f].cpu()):
                    raise Mismatch(f"{what}: {f} differs after replay")
        elif name == "dense_attention":
            worst = max(worst, compare_attention(out, reference(what, ctx.ref_dense), ctx.T, attn_tol(p), what))
        elif name == "sparse_attention":
            worst = max(worst, compare_attention(out, reference(what, ctx.ref_sparse, sel_static), ctx.T,
                                                 attn_tol(p), what))
        elif name == "select_blocks_paged":
            check_selection(ctx, out, what, ref=reference(what, ctx.ref_select))
        else:
            worst = max(worst, compare_layer_output(ctx, out, ctx.q, ctx.iq, what)[0])
    return worst, ",".join(notes)


# ----- running one case --------------------------------------------------------------------------

def sync(ctx):
    if ctx.dev.type == "cuda":
        torch.cuda.synchronize()


def context_poisoned() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.synchronize()
        x = torch.ones(4, device="cuda")
        return float((x + 1).sum().item()) != 8.0
    except Exception:  # noqa: BLE001
        return True


def classify(exc) -> tuple[str, str]:
    name = type(exc).__name__
    text = " ".join(str(exc).split())[:700]
    if isinstance(exc, Mismatch):
        return "fail", " ".join(str(exc.args[0]).split())[:900]
    if isinstance(exc, REFUSALS):
        return "refused", f"{name}: {text}"
    if isinstance(exc, torch.OutOfMemoryError):
        return "skipped", f"OOM: {text[:200]}"
    if isinstance(exc, AttributeError) and "'StepMeta' object" in text:  # only the kernels take the bench's
        return "skipped", f"torch reference needs MsaDecodeMetadata: {text[:200]}"  # metadata
    tb = traceback.extract_tb(exc.__traceback__)
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in tb[-3:])
    return "fail", f"{name}: {text} [at {where}]"


def run_case(p, dev, emit, only=None):
    """Run every check of case `p`; `emit(result dict)` per check. Raises Poisoned after a CUDA error."""
    for k, v in p["env"].items():
        os.environ[k] = v
    if dev.type == "cpu":
        os.environ["M3_EAGLE_PDL"] = "0"  # no PDL in the interpreter anyway
    t0, compiled0 = time.time(), COMPILED["secs"]
    try:
        ctx = Ctx(p, dev)
    except Exception as exc:  # noqa: BLE001
        status, msg = classify(exc)
        emit({"kernel": "setup", "status": "skipped" if status != "fail" else "fail", "msg": msg, "err": None})
        if context_poisoned():
            raise Poisoned("setup")
        return

    def attempt(name, fn, *args):
        if only and not any(name.startswith(o) for o in only):
            return
        t = time.time()
        try:
            err, note = fn(ctx, *args)
            res = {"kernel": name, "status": "pass", "err": err, "msg": note}
        except Exception as exc:  # noqa: BLE001
            status, msg = classify(exc)
            err = exc.args[1] if isinstance(exc, Mismatch) and len(exc.args) > 1 else None
            res = {"kernel": name, "status": status, "err": err, "msg": msg}
            if status != "refused" and context_poisoned():
                res["msg"] += " [CUDA context poisoned]"
                res["secs"] = round(time.time() - t, 2)
                emit(res)
                raise Poisoned(name)
        res["secs"] = round(time.time() - t, 2)
        emit(res)

    attempt("on_update_kv_lens", do_on_update)
    attempt("write_step_kv", do_write)
    if p["shrink"]:
        try:
            ctx.shrink_kind = apply_shrink(ctx)
        except Exception as exc:  # noqa: BLE001
            status, msg = classify(exc)
            emit({"kernel": "on_update_kv_lens", "status": status if status != "pass" else "fail",
                  "msg": "shrink before the attentions: " + msg, "err": None})
            if context_poisoned():
                raise Poisoned("shrink")
            return
    selectable = p["unmapped"] is None
    if selectable:
        attempt("select_blocks_paged", do_select)
    attempt("sparse_attention", do_sparse)
    attempt("dense_attention", do_dense)
    if selectable:
        attempt("sparse_layer_attention", do_layer)
        attempt("sparse_verify_step", do_step)
    attempt("sparse_verify_attention", do_variants)
    if p["replay"]:
        attempt("replay:dense_attention", do_replay, "dense")
        if selectable:
            attempt("replay:sparse_layer_attention", do_replay, "layer")
    if p["graph"] and dev.type == "cuda":
        attempt("graph", do_graph)
    emit({"kernel": "_case", "status": "done", "secs": round(time.time() - t0, 2),
          "compile_secs": round(COMPILED["secs"] - compiled0, 2)})


def worker_main(args):
    dev_kind = args.device
    _setup_runtime(dev_kind)
    dev = torch.device("cuda" if dev_kind == "cuda" else "cpu")
    if dev.type == "cuda" and args.mem_fraction:
        torch.cuda.set_per_process_memory_fraction(args.mem_fraction)
    out = sys.stdout

    def tell(line):
        out.write(line + "\n")
        out.flush()
    COMPILED["tell"] = tell
    print("@@READY", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        case = int(line)
        p = gen_case(args.seed, case, args.tiny, dev.type == "cuda")

        def emit(res):
            res["case"] = case
            out.write("@@R " + json.dumps(res) + "\n")
            out.flush()
        try:
            run_case(p, dev, emit, only=args.only)
        except Poisoned as exc:
            out.write(f"@@POISONED {case} {exc}\n")
            out.flush()
            os._exit(3)
        except Exception as exc:  # noqa: BLE001 - a bug of the fuzz itself: report, carry on
            emit({"kernel": "_harness", "status": "fail", "err": None,
                  "msg": f"fuzz harness error {type(exc).__name__}: {exc} {traceback.format_exc()[-600:]}"})
            if context_poisoned():
                os._exit(3)
        out.write(f"@@DONE {case}\n")
        out.flush()
    return 0


# ============================================================================================
# Parent side: scheduling, watchdog, report
# ============================================================================================

class Worker:
    def __init__(self, args, idx, env_vars):
        self.idx = idx
        self.errf = tempfile.NamedTemporaryFile(prefix=f"fuzz33_w{idx}_", suffix=".err", delete=False)
        cmd = [sys.executable, SCRIPT, "--worker", "--seed", str(args.seed), "--device", args.device,
               "--mem-fraction", str(args.mem_fraction)]
        if args.tiny:
            cmd.append("--tiny")
        for o in args.only or []:
            cmd += ["--only", o]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errf,
                                     env=env_vars, bufsize=0)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = b""
        self.ready = False
        self.case = None
        self.case_start = None
        self.compile_secs, self.compiles, self.compiling_since = 0.0, 0, None

    def send(self, case):
        self.case = case
        self.case_start = time.time()
        self.compile_secs, self.compiles, self.compiling_since = 0.0, 0, None
        self.proc.stdin.write(f"{case}\n".encode())
        self.proc.stdin.flush()

    def compiled(self, now, secs=None):
        """A compile ended after `secs` (the worker's clock), or a check did: a compile that raised
        tells no end, and is counted to `now`."""
        if self.compiling_since is not None:
            self.compile_secs += now - self.compiling_since if secs is None else secs
            self.compiles += 1
            self.compiling_since = None

    def lines(self):
        try:
            chunk = self.proc.stdout.read()
        except (BlockingIOError, ValueError):
            chunk = None
        if chunk:
            self.buf += chunk
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(line.decode(errors="replace"))
        return out, chunk == b""

    def compiling_secs(self, now):
        return self.compile_secs + (now - self.compiling_since if self.compiling_since is not None else 0.0)

    def running_secs(self, now):
        """Seconds of the case in flight outside Triton's compiler (its timeout's clock)."""
        return now - self.case_start - self.compiling_secs(now)

    def timing(self, now):
        return (f"{now - self.case_start:.1f}s, {self.compiling_secs(now):.1f}s of it compiling "
                f"{self.compiles} kernels" + (" and one more now" if self.compiling_since is not None else ""))

    def stderr_tail(self, n=1500):
        try:
            with open(self.errf.name, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()   # this worker's own pid
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self):
        self.kill()
        try:
            os.unlink(self.errf.name)
        except OSError:
            pass


class Report:
    def __init__(self, args):
        self.args = args
        self.stats = {}
        self.failures = []
        self.refusals = {}
        self.cases_done = 0
        self.case_failed = set()
        self.unfinished = []

    def repro(self, case):
        extra = " --tiny" if self.args.tiny else ""
        return f"python scripts/kernel_fuzz.py --seed {self.args.seed} --case {case}{extra}"

    def add(self, res):
        k = res["kernel"]
        if k == "_case":
            return
        st = self.stats.setdefault(k, {"run": 0, "pass": 0, "refused": 0, "fail": 0, "skipped": 0, "worst": 0.0})
        st["run"] += 1
        st[res["status"]] = st.get(res["status"], 0) + 1
        if res.get("err") is not None:
            st["worst"] = max(st["worst"], float(res["err"]))
        if res["status"] == "refused":
            key = res["msg"][:110]
            self.refusals.setdefault(k, {}).setdefault(key, 0)
            self.refusals[k][key] += 1
        if res["status"] == "fail":
            self.case_failed.add(res["case"])
            p = gen_case(self.args.seed, res["case"], self.args.tiny, self.args.device == "cuda")
            line = (f"FAIL kernel={k} case={res['case']} seed={self.args.seed} :: {res['msg']}\n"
                    f"     params={json.dumps(compact(p), separators=(',', ':'))}\n"
                    f"     repro: {self.repro(res['case'])}")
            self.failures.append(line)
            print(line, flush=True)
        elif self.args.verbose:
            print(f"{res['status'].upper():8s} case={res['case']} {k} err={res.get('err')} {res.get('msg', '')[:200]}",
                  flush=True)

    def table(self):
        print()
        print(f"{'kernel':32s} {'run':>5s} {'pass':>5s} {'refused':>7s} {'failed':>6s} {'skipped':>7s} {'worst rel err':>13s}")
        order = [g for g in GROUPS + ["setup", "_harness"] if g in self.stats] + \
                sorted(k for k in self.stats if k not in GROUPS + ["setup", "_harness"])
        for k in order:
            s = self.stats[k]
            print(f"{k:32s} {s['run']:5d} {s['pass']:5d} {s['refused']:7d} {s['fail']:6d} {s['skipped']:7d} "
                  f"{s['worst']:13.3e}")


def compact(p):
    """Case parameters for a failure line (long length lists summarised)."""
    q = dict(p)
    for key in ("qo", "kv", "kv2"):
        v = q[key]
        if len(v) > 12:
            q[key] = f"{len(v)} x [min {min(v)}, max {max(v)}, sum {sum(v)}] first {v[:6]}"
    return q


def parent_main(args):
    start = time.time()
    env_vars = dict(os.environ)
    if args.device == "cpu":
        env_vars["TRITON_INTERPRET"] = "1"
    env_vars.setdefault("M3_EAGLE_PLUGIN", "off")
    report = Report(args)
    print(f"kernel_fuzz: device={args.device} workers={args.workers} seconds={args.seconds} seed={args.seed} "
          f"tiny={args.tiny} case-timeout={args.case_timeout}s", flush=True)
    workers = [Worker(args, i, env_vars) for i in range(args.workers)]
    sel = selectors.DefaultSelector()
    for w in workers:
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
    next_case = args.start
    deadline = start + args.seconds
    hard_stop = deadline + args.grace
    stop_assigning = False

    def assign(w):
        nonlocal next_case
        if not w.ready or w.case is not None:
            return
        if stop_assigning or time.time() >= deadline or (args.max_cases and next_case >= args.start + args.max_cases):
            return
        w.send(next_case)
        next_case += 1

    def replace(w, why):
        sel.unregister(w.proc.stdout)
        w.close()
        nw = Worker(args, w.idx, env_vars)
        workers[workers.index(w)] = nw
        sel.register(nw.proc.stdout, selectors.EVENT_READ, nw)
        return nw

    for w in workers:
        assign(w)
    while True:
        now = time.time()
        busy = [w for w in workers if w.case is not None]
        if not busy and (now >= deadline or (args.max_cases and next_case >= args.start + args.max_cases)):
            break
        if now >= hard_stop:
            for w in busy:
                report.unfinished.append((w.case, w.timing(now)))
            break
        for key, _ in sel.select(timeout=0.5):
            w = key.data
            lines, eof = w.lines()
            for line in lines:
                if line.startswith("@@READY"):
                    w.ready = True
                    assign(w)
                elif line.startswith("@@COMPILING"):
                    w.compiled(time.time())
                    w.compiling_since = time.time()
                elif line.startswith("@@COMPILED "):
                    w.compiled(time.time(), float(line.split()[1]))
                elif line.startswith("@@R "):
                    w.compiled(time.time())
                    report.add(json.loads(line[4:]))
                elif line.startswith("@@DONE"):
                    report.cases_done += 1
                    w.case = None
                    assign(w)
                elif line.startswith("@@POISONED"):
                    print(f"NOTE worker {w.idx}: CUDA context poisoned during case {w.case}; restarting the worker",
                          flush=True)
                    report.cases_done += 1
                    w.case = None
                    w.poisoned = True
            if eof or (w.proc.poll() is not None and not lines):
                case = w.case
                if case is not None and not getattr(w, "poisoned", False):
                    report.add({"kernel": "_worker", "status": "fail", "case": case, "err": None,
                                "msg": f"worker died (rc={w.proc.poll()}) during the case; stderr tail: "
                                       f"{' '.join(w.stderr_tail().split())[-900:]}"})
                    report.cases_done += 1
                elif case is None and not getattr(w, "poisoned", False) and time.time() < deadline:
                    print(f"NOTE worker {w.idx} exited idle (rc={w.proc.poll()}): "
                          f"{' '.join(w.stderr_tail().split())[-600:]}", flush=True)
                replace(w, "exit")
                break
        for w in list(workers):
            now = time.time()
            if w.case is not None and w.running_secs(now) > args.case_timeout:
                report.add({"kernel": "_timeout", "status": "fail", "case": w.case, "err": None,
                            "msg": f"case ran past {args.case_timeout}s outside the compiler ({w.timing(now)}; "
                                   f"hang? e.g. a spinning hand-off/flag wait); worker killed; "
                                   f"stderr tail: {' '.join(w.stderr_tail(600).split())[-400:]}"})
                report.cases_done += 1
                replace(w, "timeout")
    for w in workers:
        try:
            if w.proc.poll() is None and w.case is None:
                w.proc.stdin.write(b"quit\n")
                w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
    for w in workers:
        w.close()
    elapsed = time.time() - start
    print(f"\nkernel_fuzz done: {report.cases_done} cases in {elapsed:.0f}s (cases {args.start}..{next_case - 1}), "
          f"{len(report.case_failed)} with failures, {len(report.failures)} failure lines, "
          f"{len(report.unfinished)} unfinished", flush=True)
    report.table()
    if report.refusals:
        print("\nrefusals (clear, documented errors), most common per kernel:")
        for k, d in sorted(report.refusals.items()):
            for msg, n in sorted(d.items(), key=lambda x: -x[1])[:3]:
                print(f"  {k}: {n} x {msg}")
    if report.unfinished:
        print("\nunfinished at the hard stop (no verdict; rerun with --case):")
        for case, timing in report.unfinished:
            print(f"  case {case} running {timing}: {report.repro(case)}")
    if report.failures:
        print("\nfailing cases: " + " ".join(str(c) for c in sorted(report.case_failed)))
    checked = sum(s["pass"] + s["refused"] + s["fail"] for s in report.stats.values())
    if not report.cases_done:
        print("\nno case finished: nothing was checked")
    elif not checked:
        print("\nno check reached a verdict: nothing was checked" + (f" (--only {' '.join(args.only)})"
                                                                     if args.only else ""))
    return 1 if report.failures or report.unfinished or not report.cases_done or not checked else 0


def single_case(args):
    """`--case N`: run in this process, print every check."""
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    _setup_runtime(args.device)
    dev = torch.device(args.device)
    p = gen_case(args.seed, args.case, args.tiny, dev.type == "cuda")
    print("params:", json.dumps(compact(p) if not args.full else p, separators=(",", ":")))
    failed, verdicts = [], []

    def emit(res):
        if res["kernel"] == "_case":
            print(f"case done in {res['secs']}s, {res['compile_secs']}s of it compiling")
            return
        print(f"{res['status'].upper():8s} {res['kernel']:30s} err={res.get('err')} "
              f"({res.get('secs', '')}s) {res.get('msg', '')}")
        if res["status"] == "fail":
            failed.append(res)
        if res["status"] in ("pass", "refused", "fail"):
            verdicts.append(res)
    try:
        run_case(p, dev, emit, only=args.only)
    except Poisoned as exc:
        print(f"CUDA context poisoned in {exc}")
        return 3
    if not verdicts:  # as a whole run: a case whose checks never ran here (graph: on CPU) is not a pass
        print("no check reached a verdict: nothing was checked" + (f" (--only {' '.join(args.only)})"
                                                                   if args.only else ""))
        return 1
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300, help="time to keep starting new cases (default 300)")
    ap.add_argument("--grace", type=float, default=40, help="extra seconds for cases in flight at the end")
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("--case", type=int, default=None, help="run only this case, in-process, verbosely")
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--max-cases", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workers", type=int, default=0, help="worker processes (default: 6 on a GPU, 1 on CPU)")
    ap.add_argument("--case-timeout", type=float, default=0, help="seconds before a case counts as hung "
                    "(default 150 GPU / 240 CPU)")
    ap.add_argument("--mem-fraction", type=float, default=0.0, help="per-worker CUDA memory fraction")
    ap.add_argument("--only", action="append", help="run only checks whose name starts with this (repeatable)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--full", action="store_true", help="with --case: print the full parameters")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [o for o in args.only or [] if not any(g.startswith(o) for g in GROUPS)]
    if unknown:
        ap.error(f"--only {' '.join(unknown)} names no check (checks: {', '.join(GROUPS)})")
    if args.device == "auto":
        import torch as _t
        args.device = "cuda" if _t.cuda.is_available() else "cpu"
    if args.worker:
        return worker_main(args)
    if args.case is not None:
        return single_case(args)
    if not args.workers:
        args.workers = 6 if args.device == "cuda" else 1
    if not args.case_timeout:
        args.case_timeout = 150 if args.device == "cuda" else 240
    if args.device == "cuda" and not args.mem_fraction:
        import torch as _t
        total = _t.cuda.get_device_properties(0).total_memory
        args.mem_fraction = min(0.9, (38 * 2 ** 30 / args.workers) / total)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
