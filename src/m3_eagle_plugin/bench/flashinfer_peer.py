"""FlashInfer's MiniMax sparse-attention (MSA) ops, timed beside our verify kernels on our inputs.

Why: the issue states goals against FlashInfer 0.7.4 (dense verify >= 5x faster than its paged
prefill wrapper; the sparse path measured against `flashinfer.msa_ops`), so `m3-eagle bench` times
FlashInfer in the same run, on the very inputs our kernels see. FlashInfer wants other layouts:
this module converts ours once per input set, outside any timed region, and hands back thunks to
time plus FlashInfer's outputs to check against the torch reference. FlashInfer is imported
lazily, so this module imports anywhere; the bench wraps every call so a failure becomes a
reported string, never a crash.

The contract read from the 0.7.4 wheel (flashinfer/msa_ops/{proxy_score,sparse_topk_select,
sparse_decode,sparse_prefill,_sm90_dispatch,cake_hopper_sm90}.py, flashinfer/prefill.py):

* `msa_proxy_score(q [T, Hi, 128], k [P, 1, 128, 128] paged, cu_seqlens_q [R+1], *, page_table
  [R, W] int32, seqused_k [R] int32, causal=True, max_seqlen_q, max_k_tiles, output)` -> float32
  `[Hi, max_k_tiles, T]`: per KV block, the max unscaled causal q.k (-inf past a token's extent).
  SM90: paged + causal only, q and the (contiguous, one-head) index cache of one dtype; bf16 only
  in the decode regime (uniform q_len <= 4).
* `msa_topk_select(max_score, 16, num_valid_pages=None | int | int32 [T], output, force_begin_blocks,
  force_end_blocks)` -> int32 `[T, Hi, 16]`, ascending block ids, -1 tail padded. topk must be 16.
* `msa_sparse_decode_attention(q [R*q_len, Hq, 128] bf16, k, v [P, Hkv, 128, 128], q2k_indices
  int32 [Hkv, T, 16] contiguous, *, page_table, seqused_k, seqlen_q, softmax_scale,
  v_global_scale)` -> `[T, Hq, 128]`. Token i of a request sits at seqused_k - seqlen_q + i.
  SM90: fp8 K/V that are the two halves of ONE interleaved `[P, Hkv, 128, 256]` cache, no K/V
  scale tensors (a K scale folds into softmax_scale, a V scale is v_global_scale), GQA group <= 16.
* `msa_sparse_attention(q, k, v, q2k_indices, cu_seqlens_q, causal=True, softmax_scale, page_table,
  seqused_k, v_global_scale, out)`: the prefill form (SM90: GQA groups 1-16, <= 4096 pages per
  request), used here when the decode form refuses a shape.
* `BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", use_cuda_graph, *index buffers)`, then
  `.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, Hq, Hkv, D,
  page_size, causal=True, sm_scale, q_data_type, kv_data_type, o_data_type)` and
  `.run(q, (k, v) each [P, Hkv, page, D], k_scale, v_scale, out)` (runtime page/head strides).
  With `use_cuda_graph=False` the plan fits the lengths it was given (an engine re-plans every
  step); with True it must serve any lengths within the fixed buffers, which can cost run time
  (B8/4K, 64/4 heads, q4 on H200: 40.6 us against 31.4). The bench's dense peer is the former,
  FlashInfer's fastest form at a fixed shape; the latter is timed beside it.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from m3_eagle_plugin.msa.kernels.flashinfer_msa import (  # shared with the dispatchers' FlashInfer route
    _import_status,
    _msa,
    device_capability,
    flashinfer_available,
    flashinfer_importable,
    flashinfer_status,
    interleave_kv,
    page_table,
    q2k_indices,
    selection_from_topk,
    short_error,
    split_interleaved,
)

from .step_meta import StepMeta

# Re-exported for the bench and its tests (they live in core so the dispatchers can use them).
__all__ = ["_import_status", "flashinfer_available", "flashinfer_importable", "flashinfer_status", "interleave_kv",
           "page_table", "q2k_indices", "selection_from_topk", "short_error", "split_interleaved",
           "FlashInferPeer", "PeerOp", "cuda_poisoned", "time_peer_us", "max_k_tiles", "uniform_q_len",
           "local_block_is_last_column", "paged_kv_layout", "index_cache", "nvp_probe", "parse_probe_output"]

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended prefill workspace


# --- CUDA health and timing (availability and the shared layout helpers: msa/kernels/flashinfer_msa.py) ---

def cuda_poisoned() -> str | None:
    """The sticky CUDA error left behind (e.g. an illegal memory access), or None if CUDA is fine."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        return short_error(exc)
    return None


def time_peer_us(thunks: list[Callable[[], Any]], device: torch.device) -> tuple[float, str, str | None]:
    """(us, "graph" | "eager" | "cpu", why not graph): graph-replayed like our kernels when capturable."""
    from . import timing

    if device.type != "cuda":
        return timing.time_cpu_us(thunks), "cpu", None
    try:
        return timing.time_graph_us(thunks), "graph", None
    except Exception as exc:
        poisoned = cuda_poisoned()
        if poisoned:
            raise RuntimeError(f"graph capture left CUDA unusable: {poisoned}") from exc
        return timing.time_eager_us(thunks), "eager", f"not graph-capturable ({short_error(exc)})"


# --- pure layout conversions (CPU-testable; interleave_kv, page_table, q2k_indices, ... come from core) --

def max_k_tiles(meta: StepMeta) -> int:
    return -(-int(meta.kv_lens.max()) // meta.block_size)


def uniform_q_len(meta: StepMeta) -> int:
    lens = set(meta.qo_lens.tolist())
    if len(lens) != 1:
        raise ValueError(f"FlashInfer's MSA decode needs one q_len for the batch, got {sorted(lens)}")
    return lens.pop()


def local_block_is_last_column(meta: StepMeta) -> bool:
    """True when every live token's local block is the last score column, so `force_end_blocks=1`
    without per-token `num_valid_pages` forces exactly our rule (each token's own local block)."""
    live = meta.valid_blocks[: int(meta.cu_qo_lens[-1])]
    return bool((live == max_k_tiles(meta)).all())


def paged_kv_layout(meta: StepMeta) -> dict[str, torch.Tensor]:
    """FlashInfer's ragged page list for `meta`, int32 on meta's device: `qo_indptr` [R+1],
    `paged_kv_indptr` [R+1], `paged_kv_indices` (each request's pages in order, concatenated) and
    `paged_kv_last_page_len` [R] (tokens in the last page, 1..page_size)."""
    block = meta.block_size
    kv = meta.kv_lens.cpu().to(torch.int64)
    pages = (kv + block - 1) // block
    indptr = torch.zeros(len(kv) + 1, dtype=torch.int64)
    indptr[1:] = pages.cumsum(0)
    tables = meta.block_tables.cpu().to(torch.int64)
    used = torch.arange(tables.shape[1])[None, :] < pages[:, None]
    out = {"qo_indptr": meta.cu_qo_lens.cpu(), "paged_kv_indptr": indptr, "paged_kv_indices": tables[used],
           "paged_kv_last_page_len": kv - (pages - 1) * block}
    return {k: v.to(device=meta.kv_lens.device, dtype=torch.int32).contiguous() for k, v in out.items()}


def index_cache(index_k: torch.Tensor) -> torch.Tensor:
    """Our index-K `[P, B, Di]` view as FlashInfer's contiguous one-head paged cache `[P, 1, B, Di]`."""
    return index_k.contiguous().unsqueeze(1)


# --- ops over bench steps ----------------------------------------------------------------------

def _fi():
    return importlib.import_module("flashinfer")


@dataclass
class PeerOp:
    run: Callable[[], Any]                               # the timed call; returns FlashInfer's output
    api: str                                             # what it calls, for the row
    selection: Callable[[], torch.Tensor] | None = None  # its selection in our layout, after run()
    note: str | None = None                              # how it differs from our kernel, if it does


class FlashInferPeer:
    """Builds FlashInfer ops over bench steps (`StepSet.step(...)` dicts). Converted inputs are
    memoised per cache / metadata object, so q_len 1 and 4 and every op share one conversion."""

    OPS = ("proxy_score", "topk_select", "index_select", "sparse_attn", "sparse_step", "dense_attn",
           "dense_attn_graph", "dense_attn_plan_run")

    def __init__(self) -> None:
        self._memo: dict[tuple[int, str], tuple[Any, Any]] = {}
        self.broken: str | None = None  # set once CUDA is unusable: every later call is skipped

    def clear(self) -> None:
        self._memo.clear()

    def broken_by(self, what: str) -> bool:
        """After a failed FlashInfer call (`what`): True, and the peer broken (every later call
        skipped), when the call left CUDA unusable."""
        poisoned = cuda_poisoned()
        if poisoned:
            self.broken = f"CUDA unusable after FlashInfer {what}: {poisoned}"
        return bool(poisoned)

    def _once(self, owner: Any, tag: str, make: Callable[[], Any]) -> Any:
        key = (id(owner), tag)
        if key not in self._memo:
            self._memo[key] = (owner, make())  # holding `owner` keeps its id from being reused
        return self._memo[key][1]

    def op(self, name: str, step: dict[str, Any]) -> PeerOp:
        if name not in self.OPS:
            raise ValueError(f"unknown FlashInfer op {name!r}; choose from {self.OPS}")
        return getattr(self, "_" + name)(step)

    # converted inputs
    def _paged(self, meta: StepMeta) -> dict[str, Any]:
        return self._once(meta, "paged", lambda: {
            "table": page_table(meta), "seqused_k": meta.kv_lens.to(torch.int32).contiguous(),
            "cu_q": meta.cu_qo_lens.to(torch.int32).contiguous(), "tiles": max_k_tiles(meta),
            "q_len": uniform_q_len(meta)})

    def _kv(self, cache) -> tuple[torch.Tensor, torch.Tensor]:
        def make():
            if (device_capability(cache.k.device) or (0, 0))[0] == 10:  # SM100/103: separate contiguous K, V
                return cache.k.contiguous(), cache.v.contiguous()
            return split_interleaved(interleave_kv(cache.k, cache.v))  # SM90 (and SM12x) layout
        return self._once(cache, "kv", make)

    # ops
    def _proxy_score(self, step) -> PeerOp:
        msa, meta, iq = _msa(), step["meta"], step["index_q"]
        m = self._paged(meta)
        k = self._once(step["cache"], "index", lambda: index_cache(step["cache"].index_k))
        out = torch.empty(iq.shape[1], m["tiles"], iq.shape[0], dtype=torch.float32, device=iq.device)

        def run():
            return msa.msa_proxy_score(iq, k, m["cu_q"], page_table=m["table"], seqused_k=m["seqused_k"],
                                       causal=True, max_seqlen_q=m["q_len"], max_k_tiles=m["tiles"], output=out)
        return PeerOp(run, "msa_proxy_score(paged, causal)")

    def _topk_on(self, meta: StepMeta, max_score: torch.Tensor, topk: int) -> PeerOp:
        """Top-k (the bench's k; FlashInfer refuses any but 16) on `max_score`, never with per-token
        `num_valid_pages` (an illegal memory access on SM90 in 0.7.4: only `nvp_probe` runs that
        form, in a child process)."""
        msa = _msa()
        heads, tiles, tokens = max_score.shape
        force_end = 1 if local_block_is_last_column(meta) and _masked_topk_safe(heads, tiles, tokens,
                                                                                  max_score.device) else 0
        out = torch.empty(tokens, heads, topk, dtype=torch.int32, device=max_score.device)

        def run():
            return msa.msa_topk_select(max_score, topk, output=out, force_end_blocks=force_end)
        note = None if force_end else "local block not forced: selection rule differs from ours"
        return PeerOp(run, f"msa_topk_select(force_end_blocks={force_end})",
                      selection=lambda: selection_from_topk(out), note=note)

    def _topk_select(self, step) -> PeerOp:
        score = self._proxy_score(step)
        max_score = score.run()  # eager, once: the scores the timed top-k reads
        return self._topk_on(step["meta"], max_score, step["selection"].shape[-1])

    def _index_select(self, step) -> PeerOp:
        score = self._proxy_score(step)
        topk = self._topk_on(step["meta"], score.run(), step["selection"].shape[-1])

        def run():
            score.run()
            return topk.run()
        return PeerOp(run, f"{score.api} + {topk.api}", selection=topk.selection, note=topk.note)

    def _sparse_attn(self, step) -> PeerOp:
        sel = self._once(step["selection"], "q2k", lambda: q2k_indices(step["selection"], step["cache"].k.shape[1]))
        return self._attention(step, lambda: sel)

    def _sparse_step(self, step) -> PeerOp:
        select = self._index_select(step)
        select.run()  # a real selection before the attention's eager trial reads it
        hkv = step["cache"].k.shape[1]
        attend = self._attention(step, lambda: q2k_indices(select.selection(), hkv))

        def run():
            select.run()
            return attend.run()
        return PeerOp(run, f"{select.api} + {attend.api}", selection=select.selection, note=select.note)

    def _attention(self, step, q2k: Callable[[], torch.Tensor]) -> PeerOp:
        """The decode form, else the prefill form when the decode form refuses (tried once, eagerly)."""
        msa, meta, cache, q = _msa(), step["meta"], step["cache"], step["q"]
        m = self._paged(meta)
        k, v = self._kv(cache)
        scale = cache.k_scale / math.sqrt(q.shape[-1])
        v_scale = None if cache.v_scale == 1.0 else float(cache.v_scale)
        sm90 = device_capability(q.device) == (9, 0)
        out = torch.empty_like(q) if sm90 else None  # only SM90 takes `out=` (else a memset per call)

        def decode():
            return msa.msa_sparse_decode_attention(q, k, v, q2k(), page_table=m["table"], seqused_k=m["seqused_k"],
                                                   seqlen_q=m["q_len"], causal=True, softmax_scale=scale,
                                                   v_global_scale=v_scale)

        def prefill():
            return msa.msa_sparse_attention(q, k, v, q2k(), m["cu_q"], causal=True, softmax_scale=scale,
                                            page_table=m["table"], seqused_k=m["seqused_k"],
                                            v_global_scale=v_scale, out=out)
        run, api, refused = _first_working([(decode, "msa_sparse_decode_attention"),
                                            (prefill, "msa_sparse_attention")])
        return PeerOp(run, api, note=refused)

    def _dense_attn(self, step) -> PeerOp:
        """The paged prefill wrapper planned once for this step's own lengths (`use_cuda_graph=False`):
        its fastest form for a fixed shape, the one an engine runs eagerly."""
        return self._prefill(step, graph_wrapper=False)

    def _dense_attn_graph(self, step) -> PeerOp:
        """The wrapper as engines capture it into CUDA graphs (`use_cuda_graph=True`, fixed index
        buffers): its plan must serve any lengths that fit them."""
        return self._prefill(step, graph_wrapper=True)

    def _dense_attn_plan_run(self, step) -> PeerOp:
        """`plan()` then `run()` on every call, as a step whose lengths changed needs (the index
        tensors on the device, as the metadata holds them: `plan` copies them to the host)."""
        return self._prefill(step, graph_wrapper=False, plan_each_call=True)

    def _prefill(self, step, *, graph_wrapper: bool, plan_each_call: bool = False) -> PeerOp:
        meta, cache, q = step["meta"], step["cache"], step["q"]
        lay = self._once(meta, "ragged", lambda: paged_kv_layout(meta))
        hkv, block, dim = cache.k.shape[1], cache.k.shape[2], cache.k.shape[3]
        fp8 = cache.k.element_size() == 1
        workspace = self._once(self, f"workspace {q.device}",  # shared: the wrappers run one at a time
                               lambda: torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device))
        index = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
        buffers = {f"{name}_buf": lay[name].clone() for name in index} if graph_wrapper else {}
        wrapper = _fi().BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", use_cuda_graph=graph_wrapper, **buffers)

        def plan():
            wrapper.plan(*(lay[name] for name in index), q.shape[1], hkv, dim, block, causal=True,
                         sm_scale=1.0 / math.sqrt(dim), q_data_type=q.dtype, kv_data_type=cache.k.dtype,
                         o_data_type=q.dtype)
        plan()
        out = torch.empty_like(q)
        scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if fp8 else {}
        mode = "use_cuda_graph" if graph_wrapper else "plan once"

        def run_on(kv):
            if plan_each_call:
                plan()
            return wrapper.run(q, kv, out=out, **scales)

        def copies():
            return self._once(cache, "kv_copy", lambda: (cache.k.contiguous(), cache.v.contiguous()))
        run, api, refused = _first_working([  # copied only if the views are refused
            (lambda: run_on((cache.k, cache.v)), f"BatchPrefillWithPagedKVCacheWrapper(HND, {mode}, pool views)"),
            (lambda: run_on(copies()), f"BatchPrefillWithPagedKVCacheWrapper(HND, {mode}, contiguous K/V copies)")])
        return PeerOp(run, ("plan + " if plan_each_call else "") + api, note=refused)


def _first_working(candidates: list[tuple[Callable[[], Any], str]]) -> tuple[Callable[[], Any], str, str | None]:
    """The first candidate whose eager trial call succeeds, its name, and why earlier ones were refused."""
    refused = []
    for fn, name in candidates:
        try:
            fn()
        except Exception as exc:
            poisoned = cuda_poisoned()
            if poisoned:
                raise RuntimeError(f"{name} left CUDA unusable: {poisoned}") from exc
            refused.append(f"{name}: {short_error(exc)}")
            continue
        return fn, name, ("; ".join(refused) or None)
    raise RuntimeError(" | ".join(refused))


def _masked_topk_safe(heads: int, tiles: int, tokens: int, device: torch.device) -> bool:
    """Whether `force_end_blocks > 0` without `num_valid_pages` is safe. On SM90 only the Cake
    programs take it: the CuTe fallback then reads its empty `num_valid_pages` tensor
    (cute_dsl/topk_select_sm90.py indexes `mNVP[col]` whenever any mask is on)."""
    if device_capability(device) != (9, 0):
        return True
    try:
        from flashinfer.msa_ops.cake_hopper_sm90 import topk_route_available

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return bool(topk_route_available(num_heads=heads, tiles=tiles, total_q=tokens, num_sms=sms,
                                         masked=True, nvp=False))
    except Exception:
        return False


# --- the num_valid_pages form, isolated in a child process ----------------------------------------

def nvp_probe(configs: list[tuple[int, int]], qo_lens: list[int], *, device: torch.device | str | None = None,
              timeout_s: int = 600) -> dict[tuple[int, int, int], dict[str, Any]]:
    """`msa_topk_select` with per-token `num_valid_pages` and `force_end_blocks=1` (exactly our
    selection rule) on the bench's index inputs, run in a child process on `device` (default: cuda):
    on SM90 it hit an illegal memory access, which would poison every later CUDA call of this
    process. Returns row fields per (batch, context, q_len): `flashinfer_nvp_us` +
    `flashinfer_nvp_check`, or `flashinfer_nvp_error`."""
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "m3_eagle_plugin.bench.flashinfer_peer", "--nvp-probe",
           ",".join(f"{b}x{c}" for b, c in configs), ",".join(map(str, qo_lens)), str(device or "cuda")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        stdout, ended = proc.stdout, f"exit code {proc.returncode}: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        stdout, ended = (out.decode() if isinstance(out, bytes) else out), f"timed out after {timeout_s} s"
    cases = [(b, c, q) for b, c in configs for q in qo_lens]
    return parse_probe_output(stdout, ended, cases)


def parse_probe_output(stdout: str, ended: str, cases: list[tuple[int, int, int]]
                       ) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Child lines are JSON: `{"case": [b, c, q], "started": true}` before a case, then its fields.
    A case that started without a result is where the child died; later ones never ran."""
    results: dict[tuple[int, int, int], dict[str, Any]] = {}
    for line in stdout.splitlines():
        try:
            item = json.loads(line)
            case = tuple(item.pop("case"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if item.pop("started", False):
            results.setdefault(case, {"flashinfer_nvp_error": f"child process died in this case ({ended})"})
        else:
            results[case] = item
    for case in cases:
        results.setdefault(case, {"flashinfer_nvp_error": f"not run: child process ended ({ended})"})
    return results


def _probe_child(configs: list[tuple[int, int]], qo_lens: list[int], device: str = "cuda") -> None:
    from . import torch_reference as ref
    from .inputs import Geometry
    from .kernel_suite import StepSet, selection_mismatch

    geo, device = Geometry(), torch.device(device)
    if device.index is not None:  # CUDA events and graph captures use the current device (as `m3-eagle bench`)
        torch.cuda.set_device(device)
    for batch, context in configs:
        steps = None
        for qo in qo_lens:
            case = [batch, context, qo]
            print(json.dumps({"case": case, "started": True}), flush=True)
            try:
                steps = steps or StepSet(batch, context, geo, kv_dtype=getattr(torch, "float8_e4m3fn", torch.bfloat16),
                                         index_dtype=torch.bfloat16, q_dtype=torch.bfloat16, device=device, num_sets=1)
                step = steps.step(0, qo)
                meta = step["meta"]
                max_score = FlashInferPeer()._proxy_score(step).run()
                out = torch.empty(max_score.shape[2], max_score.shape[0], geo.topk, dtype=torch.int32, device=device)
                nvp = meta.valid_blocks.to(torch.int32).contiguous()

                def run():
                    return _msa().msa_topk_select(max_score, geo.topk, num_valid_pages=nvp, output=out,
                                                  force_end_blocks=1)
                run()
                torch.cuda.synchronize()
                us, how, _ = time_peer_us([run], device)
                expect = ref.select_blocks(step["index_q"], step["cache"].index_k, meta, topk=geo.topk)
                fields = {"flashinfer_nvp_us": us, "flashinfer_nvp_timing": how,
                          "flashinfer_nvp_check": selection_mismatch(selection_from_topk(out), expect)}
            except Exception as exc:
                fields = {"flashinfer_nvp_error": short_error(exc)}
            print(json.dumps({"case": case, **fields}), flush=True)
            if cuda_poisoned():
                return
        del steps
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--nvp-probe":
        _probe_child([tuple(int(x) for x in c.split("x")) for c in sys.argv[2].split(",")],
                     [int(q) for q in sys.argv[3].split(",")], *sys.argv[4:])
    else:
        sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'flashinfer_peer'} --nvp-probe BxC,... Q,... "
                 "[DEVICE]")
