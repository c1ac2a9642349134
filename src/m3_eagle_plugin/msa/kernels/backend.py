"""Backend chooser: FlashInfer's MSA ops where eligible and measured faster, Triton kernels on
capable CUDA devices, the pure-torch references elsewhere.

Why: every caller (reference host, TensorRT-LLM adapter, bench) asks one place which
implementation runs, and `backend_report()` tells a human (via `m3-eagle doctor`/`bench`) why.
`M3_EAGLE_KERNELS=auto|triton|torch|flashinfer` overrides the choice: `triton` raises if Triton
cannot run and never uses FlashInfer; `flashinfer` sends `sparse_attention` and
`select_blocks_paged` to FlashInfer and raises (naming the cause) where it is not eligible, the
other kernels behaving as under `auto`. Under `auto` those two go to FlashInfer only when
`flashinfer_msa.eligibility` holds and the measured table (`kernel_table`) says it is faster at
the nearest measured shape. Dense attention has no FlashInfer route: FlashInfer's prefill wrapper
leads at 3 of the shipped table's 18 dense shapes, by 1.6-4.4%, and only in the form planned for
one step's own lengths, which an engine re-plans every step (on an H200 at B8/4K `plan()` +
`run()` took 134-328 us eagerly, `run()` alone 31) or, under CUDA graphs, replaces by the fixed-buffer form,
up to 1.5x slower at the q4 rows. The table's verdicts are reported for it all the same.

Shapes the kernels do not take (head dim or block under 16 or not a power of two, a GQA group or
index-head count they cannot tile, queries or K/V or index-K caches in a dtype they do not read, such
as float64) run the torch references even on CUDA, whatever the mode; so do tiles past the device's
shared memory (`KernelTooLargeError`) under `auto` (and `flashinfer`'s unrouted kernels), once warned,
while a forced `triton` raises it.
With fp8 scales, which only the kernels take, each raises naming why the kernel did not run. The
references loop over requests on the host, so a CUDA graph of them replays the lengths it was
captured with: capture them only with lengths staged at capacity (`host/reference/cuda_graphs`).
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch

from . import flashinfer_msa as fim
from . import kernel_table
from m3_eagle_plugin.log import get_logger

from ._common import (CACHE_DTYPES, MAX_TILE_ROWS, QUERY_DTYPES, KernelInputError, KernelTooLargeError, check_switches,
                      env_value, is_pow2, selection_counts, triton_available, triton_importable)

ENV_VAR = "M3_EAGLE_KERNELS"
MODES = ("auto", "triton", "torch", "flashinfer")
KERNELS = ("select_blocks_paged", "sparse_attention", "dense_attention", "on_update_kv_lens", "write_step_kv")


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here."""


def requested_backend() -> str:
    mode = env_value(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise KernelInputError(f"{ENV_VAR} must be auto, triton, torch or flashinfer, got {mode!r}")
    return mode


def check_backend(device: torch.device | str) -> str:
    """The requested mode, checked now against `device` (a forced `triton` or `flashinfer` that
    cannot run there raises `KernelBackendError`), so a host can refuse it before it starts. The
    kernels' other switches (`SWITCHES`: hand-off, PDL, replay) are checked too, and the table
    `M3_EAGLE_KERNEL_TABLE` names is read and validated (`KernelTableError` naming the file; in
    any mode: the variable names a wrong file whatever the mode) and kept for the choices to come."""
    check_switches()
    mode = requested_backend()
    kernel_table.check_override()
    refused = forced_refusal(device, mode)
    if refused is not None:
        raise KernelBackendError(refused)
    return mode


def forced_refusal(device: torch.device | str, mode: str) -> str | None:
    """Why a forced `mode` cannot run on `device` at all (every call it governs would raise
    `KernelBackendError`), in `check_backend`'s words; None where it can, or nothing is forced."""
    if mode == "triton" and not triton_available(device):
        return f"{ENV_VAR}=triton but Triton kernels cannot run on {device}"
    if mode == "flashinfer":
        why = fim.device_refusal(device)
        if why is None and not fim.flashinfer_available():
            why = fim.flashinfer_status()
        if why is not None:
            return f"{ENV_VAR}=flashinfer but FlashInfer cannot run here: {why}"
    return None


def use_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels serve tensors on `device` under the current override."""
    mode = requested_backend()
    if mode == "torch":
        return False
    ok = triton_available(device)
    if mode == "triton" and not ok:
        raise KernelBackendError(f"{ENV_VAR}=triton but Triton kernels cannot run on {device}")
    return ok


def backend_report(device: torch.device | str | None = None) -> dict[str, Any]:
    """Which implementation each kernel uses on `device` (default: cuda if present, else cpu) and why;
    `error` where the forced backend cannot run there at all (`check_backend` refuses it)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    mode = requested_backend()
    check_switches()  # a bad one would fail every kernel call: `doctor` must say so
    report: dict[str, Any] = {
        "device": str(device),
        "requested": mode,
        "triton_installed": triton_importable(),
        "cuda_available": torch.cuda.is_available(),
    }
    if triton_importable():
        report["triton_version"] = importlib.import_module("triton").__version__
    if device.type == "cuda" and torch.cuda.is_available():
        report["device_name"] = torch.cuda.get_device_name(device)
        report["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    ok = triton_available(device)
    chosen = "triton" if ok and mode != "torch" else "torch"
    if chosen == "triton":
        reason = "triton installed and CUDA device with compute capability >= 8.0"
    elif mode == "torch":
        reason = f"{ENV_VAR}=torch"
    elif not triton_importable():
        reason = "triton is not installed"
    elif device.type != "cuda" or not torch.cuda.is_available():
        reason = f"device {device} is not a CUDA device"
    else:
        reason = "CUDA device compute capability < 8.0"
    refused = forced_refusal(device, mode)
    if refused is not None:  # `check_backend` (`m3-eagle run`) refuses it: say so, not what auto would run
        report["error"] = refused
        if mode == "triton":  # every kernel call raises, none runs the references
            chosen, reason = "triton", f"{refused} ({reason}): every kernel call raises"
    report["backend"] = chosen
    report["reason"] = reason
    report["kernels"] = {name: "flashinfer" if mode == "flashinfer" and name in fim.ROUTED_KERNELS else chosen
                         for name in KERNELS}  # forced: those calls run FlashInfer (Triton) or raise
    report.update(_flashinfer_report(device, mode))
    return report


def _flashinfer_report(device: torch.device, mode: str) -> dict[str, Any]:
    """FlashInfer's status, the table in force and the table's verdict per measured shape."""
    policy = {
        "auto": "per shape: FlashInfer where eligible and faster in the nearest measured table row, else ours",
        "flashinfer": f"{ENV_VAR}=flashinfer: FlashInfer for {', '.join(fim.ROUTED_KERNELS)}; "
                      "an ineligible call raises",
    }.get(mode, f"off ({ENV_VAR}={mode})")
    section: dict[str, Any] = {"status": fim.flashinfer_status(), "device": fim.device_refusal(device) or "SM90: ok",
                               "routes": list(fim.ROUTED_KERNELS), "policy": policy}
    out: dict[str, Any] = {"flashinfer": section}
    try:
        table = kernel_table.load_table()
    except kernel_table.KernelTableError as exc:
        out["kernel_table"] = {"error": str(exc)}
        return out
    here = fim.device_name(device)
    info = table.describe()
    info["applies"] = ("yes" if kernel_table.names_match(table.device, here)
                       else f"no: this device is {here} (ours everywhere until re-measured here)")
    out["kernel_table"] = info
    verdicts: dict[str, list[str]] = {}
    for name, measured in kernel_table.DISPATCH_ROWS.items():
        if name == kernel_table.STEP:
            continue
        lines = [(f"{r.kernel} " if r.kernel != measured[0] else "") + r.verdict()
                 for r in table.rows if r.kernel in measured]
        if name not in fim.ROUTED_KERNELS:
            faster = sum(r.flashinfer_us is not None and r.ours_us <= r.flashinfer_us for r in table.rows
                         if r.kernel in measured)
            lines.append(f"decision: ours (no FlashInfer route; ours faster in {faster} of {len(lines)} "
                         "measured shapes)")
        verdicts[name] = lines
    steps = table.verdicts("sparse_step")
    verdicts["sparse_step"] = steps + ["decision: where both halves could run on FlashInfer, the whole step it "
                                       "says is faster (ours or FlashInfer's), else each half by its own rows"
                                       ] if steps else []
    out["table_verdicts"] = verdicts
    return out


def _step_shape(meta) -> tuple[int, int]:
    """(requests, context) of a step from host values: the staged longest kv length when the
    metadata keeps it (the graph capacity under CUDA graphs), else the block-table width."""
    context = getattr(meta, "max_kv_len", None)
    if not isinstance(context, int) or context < 1:
        context = int(meta.block_tables.shape[1]) * int(meta.block_size)
    return int(meta.kv_lens.shape[0]), int(context)


def flashinfer_route(kernel: str, device: torch.device, meta, num_tokens: int, max_qo_len: int | None,
                     eligible: Callable[[], tuple[bool, str]]) -> int | None:
    """The q_len to call FlashInfer with when it runs `kernel` for this call, else None (ours).
    Host-side only: `eligible()` reads shapes, strides and pointers; the table verdict is cached."""
    mode = requested_backend()
    if mode in ("triton", "torch"):
        return None
    ok, why = eligible()
    if mode == "flashinfer" and not ok:
        raise KernelBackendError(f"{ENV_VAR}=flashinfer but FlashInfer cannot run {kernel} here: {why}")
    if not ok:
        return None
    q_len, _ = fim.host_q_len(meta, num_tokens, max_qo_len)
    if mode == "auto":
        batch, context = _step_shape(meta)
        choice = kernel_table.choose(kernel, batch=batch, context=context, q_len=q_len,
                                     device_name=fim.device_name(device), eligible=(ok, why))
        if choice.backend != "flashinfer":
            return None
    return q_len


#: Smallest head dim and block size the kernels tile (tl.dot needs 16-wide operands).
MIN_KERNEL_DIM = 16


def _tile_refusal(x: torch.Tensor, k_cache: torch.Tensor | None, block_size: int, padded_rows: int = 0) -> str | None:
    """Why the kernels cannot tile `x` (queries over `k_cache`'s KV heads, or index queries when
    `k_cache` is None) on pages of `block_size`, in words; None when they can. Tiny test models
    (head dim 16, block 4) and head counts no M3 geometry has (GQA 16, one index head a rank) stay on
    the torch references: the heads of a tile must be a power of two, or at most `padded_rows` (the
    per-token sparse layout pads its rows)."""
    kind = "queries" if k_cache is not None else "index queries"
    if x.dim() != 3:  # the reference names the shape it expects
        return f"{kind} of shape {tuple(x.shape)}: the kernels take [tokens, heads, dim]"
    dim, block = int(x.shape[-1]), int(block_size)
    if x.dtype not in QUERY_DTYPES:
        return f"{kind} in {x.dtype}: the kernels take float32, float16 or bfloat16"
    if not all(n >= MIN_KERNEL_DIM and is_pow2(n) for n in (dim, block)):
        return f"head dim {dim} and block {block} must be powers of two >= {MIN_KERNEL_DIM}"
    if k_cache is None:
        return None if is_pow2(int(x.shape[1])) else f"{x.shape[1]} index heads: their count must be a power of two"
    group = int(x.shape[1]) // max(int(k_cache.shape[1]), 1)
    if group <= padded_rows or is_pow2(group):
        return None
    return (f"{x.shape[1]} query heads over {k_cache.shape[1]} KV heads: the group must be a power of two"
            + (f" or at most {padded_rows}" if padded_rows else ""))


def _cache_refusal(**caches: torch.Tensor) -> str | None:
    """Why the kernels cannot read one of `caches` (named by keyword), in words; None when they can."""
    for name, cache in caches.items():
        if cache.dtype not in CACHE_DTYPES:
            return f"{name} in {cache.dtype}: the kernels read float32, float16, bfloat16 or fp8 caches"
    return None


def _kernel_refusal(x: torch.Tensor, k_cache: torch.Tensor | None, block_size: int, padded_rows: int = 0, /,
                    **caches: torch.Tensor) -> str | None:
    """Why the kernels cannot take this call: `_tile_refusal`, else `_cache_refusal` of `caches`
    (positional-only: a cache may be named `k_cache` among them)."""
    return _tile_refusal(x, k_cache, block_size, padded_rows) or _cache_refusal(**caches)


def _reference_instead(error: KernelTooLargeError, *scales: Any) -> None:
    """Re-raise `error` unless `auto` may run the torch reference in the kernel's place (it takes
    no fp8 scales); say so once per refusal. `flashinfer` forces only its routed kernels (which
    raise before reaching here): the others fall back as under `auto`."""
    mode = requested_backend()
    if mode not in ("auto", "flashinfer") or any(scale is not None for scale in scales):
        raise error
    if str(error) not in _FELL_BACK:
        _FELL_BACK.add(str(error))
        get_logger().warning("%s; running the torch reference instead (%s=%s)", error, ENV_VAR, mode)


#: Refusals already reported by `_reference_instead`.
_FELL_BACK: set[str] = set()


def _fp8_scales_refused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                        padded_rows: int = 0) -> KernelBackendError:
    """fp8 scales on a call the kernels did not take (only they read scales), naming why."""
    why = _kernel_refusal(q, k_cache, meta.block_size, padded_rows, k_cache=k_cache, v_cache=v_cache)
    if why is None:
        why = f"the Triton backend does not run here ({backend_report(q.device).get('reason') or 'requested: torch'})"
    return KernelBackendError(f"fp8 KV scales need the Triton kernels: {why}")


def on_first_argument_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run dispatcher `fn` with its first argument's CUDA device current (a tensor, or metadata
    with a `device`). Triton and FlashInfer launch on the current device, torch ops on their
    tensors': tensors on cuda:1 while cuda:0 is current would otherwise have kernels launched on
    cuda:0 with cuda:1 addresses. One comparison when the device is already current."""
    first_name = next(iter(inspect.signature(fn).parameters))  # keywords come in the caller's order

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get(first_name)
        if first is None:  # not given: `fn` raises its own TypeError
            return fn(*args, **kwargs)
        return run_on_device_of(first, fn, *args, **kwargs)
    return call


def run_on_device_of(first: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with `first`'s CUDA device current (a tensor, or an object with a
    `device`); as it is when that device is current already or `first` is not on CUDA."""
    if isinstance(first, torch.Tensor):
        index = first.get_device()  # -1 off CUDA; a C call, where torch.device() costs microseconds
    else:
        device = torch.device(first.device)
        index = device.index if device.type == "cuda" and device.index is not None else -1
    # CUDA is initialised once a CUDA tensor exists: the C getter skips current_device()'s init check
    if index >= 0 and index != torch._C._cuda_getDevice():
        with torch.cuda.device(index):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def _reference(name: str) -> Callable[..., Any]:
    msa = importlib.import_module("m3_eagle_plugin.msa")
    fn = getattr(msa, name, None)
    if fn is None:
        raise KernelBackendError(f"torch reference m3_eagle_plugin.msa.{name} is not available")
    return fn


@on_first_argument_device
def select_blocks_paged(index_q, index_k_cache, meta, *, topk, local_blocks=1, init_blocks=0,
                        max_qo_len: int | None = None):
    """Dispatching twin of `msa.select_blocks_paged`."""
    q_len = flashinfer_route(fim.INDEX, index_q.device, meta, index_q.shape[0], max_qo_len, lambda: fim.eligibility(
        fim.INDEX, index_q, index_k_cache, meta, topk=topk, max_qo_len=max_qo_len))
    if q_len is not None:
        return fim.select_blocks(index_q, index_k_cache, meta, topk=topk, q_len=q_len, local_blocks=local_blocks,
                                 init_blocks=init_blocks)
    if use_triton(index_q.device) and _kernel_refusal(index_q, None, meta.block_size,
                                                      index_k_cache=index_k_cache) is None:
        from .index_select import select_blocks_verify

        try:
            return select_blocks_verify(index_q, index_k_cache, meta, topk=topk, local_blocks=local_blocks,
                                        init_blocks=init_blocks, max_qo_len=max_qo_len)
        except KernelTooLargeError as error:
            _reference_instead(error)
    return _reference("select_blocks_paged")(index_q, index_k_cache, meta, topk=topk,
                                             local_blocks=local_blocks, init_blocks=init_blocks)


@on_first_argument_device
def sparse_attention(q, k_cache, v_cache, meta, selection, *, scale, k_scale=None, v_scale=None,
                     max_qo_len: int | None = None):
    """Dispatching twin of `msa.sparse_attention` (fp8 scales handled by the kernels only).

    `selection` rows must be in the form the selectors write: ascending block ids, no duplicates,
    -1 only as trailing padding. The kernels walk each row's leading valid entries; checking that
    on the device would cost a host sync per layer, so it is the caller's contract."""
    q_len = flashinfer_route(fim.SPARSE, q.device, meta, q.shape[0], max_qo_len, lambda: fim.eligibility(
        fim.SPARSE, q, k_cache, v_cache, meta, selection, k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len))
    if q_len is not None:
        return fim.sparse_attention(q, k_cache, v_cache, meta, selection, scale=scale, q_len=q_len,
                                    k_scale=k_scale, v_scale=v_scale)
    if use_triton(q.device) and _kernel_refusal(q, k_cache, meta.block_size, MAX_TILE_ROWS, k_cache=k_cache,
                                                v_cache=v_cache) is None:
        from .sparse_verify import sparse_verify_attention

        try:
            return sparse_verify_attention(q, k_cache, v_cache, meta, selection, scale=scale, k_scale=k_scale,
                                           v_scale=v_scale, max_qo_len=max_qo_len)
        except KernelTooLargeError as error:
            _reference_instead(error, k_scale, v_scale)
    if k_scale is not None or v_scale is not None:
        raise _fp8_scales_refused(q, k_cache, v_cache, meta, MAX_TILE_ROWS)
    return _reference("sparse_attention")(q, k_cache, v_cache, meta, selection, scale=scale)


@on_first_argument_device
def sparse_layer_attention(q, k_cache, v_cache, index_q, index_k_cache, meta, *, topk, scale, local_blocks=1,
                           init_blocks=0, k_scale=None, v_scale=None, max_qo_len: int | None = None):
    """A sparse layer's block selection then sparse attention. Where both halves could run on
    FlashInfer and the table has a whole-step row (`_whole_step_backend`), that row decides: our
    whole step in one call (`verify_step`) or FlashInfer's (both halves). Otherwise our whole step
    when neither half goes to FlashInfer, else `select_blocks_paged` then `sparse_attention`, each
    routed by its own row."""
    kw = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, max_qo_len=max_qo_len)
    attend = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len)
    if (use_triton(q.device)
            and _kernel_refusal(q, k_cache, meta.block_size, MAX_TILE_ROWS, k_cache=k_cache, v_cache=v_cache) is None
            and _kernel_refusal(index_q, None, meta.block_size, index_k_cache=index_k_cache) is None):
        selection_counts(topk, local_blocks, init_blocks)  # named before a placeholder selection is sized by topk
        # Each half's eligibility, computed at most once (the route and the whole-step rule both ask).
        checks = {fim.INDEX: functools.cache(lambda: fim.eligibility(
                      fim.INDEX, index_q, index_k_cache, meta, topk=topk, max_qo_len=max_qo_len)),
                  fim.SPARSE: functools.cache(lambda: fim.eligibility(  # the selection does not exist yet: its shape
                      fim.SPARSE, q, k_cache, v_cache, meta,                # (one row per index head)
                      q.new_empty((index_q.shape[1], q.shape[0], topk), dtype=torch.int32),
                      k_scale=k_scale, v_scale=v_scale, max_qo_len=max_qo_len))}
        # The whole-step row decides first (README, doctor); without one, each half by its own row.
        whole = _whole_step_backend(q.device, meta, q.shape[0], max_qo_len, checks.values())
        if whole is None and not any(flashinfer_route(name, q.device, meta, q.shape[0], max_qo_len, check)
                                     is not None for name, check in checks.items()):
            whole = "triton"
        if whole == "triton":
            from .verify_step import sparse_verify_step

            try:
                return sparse_verify_step(index_q, index_k_cache, q, k_cache, v_cache, meta, scale=scale,
                                          k_scale=k_scale, v_scale=v_scale, **kw)[1]
            except KernelTooLargeError as error:  # each half then by its own dispatcher
                _reference_instead(error, k_scale, v_scale)
        if whole == "flashinfer":  # both halves, as that row measured them (not one of each)
            fim.decode_scales(scale, k_scale, v_scale)  # refused before the selection runs, not after
            q_len, _ = fim.host_q_len(meta, q.shape[0], max_qo_len)
            selection = fim.select_blocks(index_q, index_k_cache, meta, topk=topk, q_len=q_len,
                                          local_blocks=local_blocks, init_blocks=init_blocks)
            return fim.sparse_attention(q, k_cache, v_cache, meta, selection, scale=scale, q_len=q_len,
                                        k_scale=k_scale, v_scale=v_scale)
    selection = select_blocks_paged(index_q, index_k_cache, meta, **kw)
    return sparse_attention(q, k_cache, v_cache, meta, selection, **attend)


def _whole_step_backend(device, meta, num_tokens: int, max_qo_len: int | None, checks) -> str | None:
    """Under `auto`, with both halves FlashInfer-eligible: which whole step the table's nearest
    `sparse_step` row (our step as one call against FlashInfer's scoring, top-k and attention)
    measured faster, "triton" (ours at or below) or "flashinfer"; None without such a row or
    outside `auto`. The halves' own rows cannot say it: our step overlaps its halves, and a mix
    of one half each was never measured."""
    if requested_backend() != "auto" or not all(check()[0] for check in checks):
        return None
    q_len, _ = fim.host_q_len(meta, num_tokens, max_qo_len)
    batch, context = _step_shape(meta)
    choice = kernel_table.choose(kernel_table.STEP, batch=batch, context=context, q_len=q_len,
                                 device_name=fim.device_name(device), eligible=(True, ""))
    if choice.row is None or choice.row.flashinfer_us is None:
        return None
    return choice.backend


@on_first_argument_device
def dense_attention(q, k_cache, v_cache, meta, *, scale, k_scale=None, v_scale=None,
                    max_qo_len: int | None = None):
    """Dispatching twin of `msa.dense_attention`."""
    if use_triton(q.device) and _kernel_refusal(q, k_cache, meta.block_size, k_cache=k_cache,
                                                v_cache=v_cache) is None:
        from .dense_verify import dense_verify_attention

        try:
            return dense_verify_attention(q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale,
                                          v_scale=v_scale, max_qo_len=max_qo_len)
        except KernelTooLargeError as error:
            _reference_instead(error, k_scale, v_scale)
    if k_scale is not None or v_scale is not None:
        raise _fp8_scales_refused(q, k_cache, v_cache, meta)
    return _reference("dense_attention")(q, k_cache, v_cache, meta, scale=scale)


@on_first_argument_device
def on_update_kv_lens(meta, kv_lens=None) -> None:
    """`meta.on_update_kv_lens(kv_lens)` in one fused launch on CUDA, the metadata's torch path elsewhere."""
    if use_triton(meta.device):
        from .kv_lens_update import on_update_kv_lens_fused

        on_update_kv_lens_fused(meta, kv_lens)
    else:
        meta.on_update_kv_lens(kv_lens)


@on_first_argument_device
def write_step_kv(k_cache, v_cache, slots, k, v, index_k_cache=None, index_k=None) -> None:
    """A step's K/V (and a sparse layer's index-K) into the paged caches: one fused launch on CUDA
    (`kv_write`), the torch writers `msa.write_kv` / `msa.write_index_k` elsewhere. The index-K
    cache and rows come together on both paths (one without the other would leave index-K unwritten)."""
    if (index_k_cache is None) != (index_k is None):
        raise KernelInputError("pass index_k_cache and index_k together (one without the other leaves index-K "
                               "unwritten)")
    if use_triton(k.device):
        from .kv_write import write_step_kv_fused

        write_step_kv_fused(k_cache, v_cache, slots, k, v, index_k_cache, index_k)
        return
    if index_k_cache is not None:  # checked before K/V are written: all or nothing, as the fused writer
        _check_index_k(k_cache, index_k_cache, slots, index_k)
    _reference("write_kv")(k_cache, v_cache, slots, k, v)
    if index_k_cache is not None:
        _reference("write_index_k")(index_k_cache, slots, index_k)


def _check_index_k(k_cache, index_k_cache, slots, index_k) -> None:
    """`msa.write_index_k`'s own checks (`msa.write_kv` checks its arguments before it writes, but
    the index-K ones would only fail after it), and that the block sizes agree, as the fused writer
    requires: one slot names one token in both caches."""
    from m3_eagle_plugin.msa.blocks import MsaInputError
    from m3_eagle_plugin.msa.cache_write import check_index_k

    check_index_k(index_k_cache, slots, index_k, name="index_k")
    if k_cache.dim() == 4 and index_k_cache.shape[1] != k_cache.shape[2]:
        raise MsaInputError(f"index-K block size {index_k_cache.shape[1]} differs from the K/V block size "
                            f"{k_cache.shape[2]}")
