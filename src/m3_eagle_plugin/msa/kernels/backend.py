"""Backend chooser: Triton kernels on capable CUDA devices, the pure-torch references elsewhere.

Why: every caller (reference host, TensorRT-LLM adapter, bench) asks one place which
implementation runs, and `backend_report()` tells a human (via `m3-eagle doctor`/`bench`) why.
`M3_EAGLE_KERNELS=auto|triton|torch` overrides the choice (`triton` raises if unavailable).
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import torch

from ._common import KernelInputError, triton_available, triton_importable

ENV_VAR = "M3_EAGLE_KERNELS"
KERNELS = ("select_blocks_paged", "sparse_attention", "dense_attention", "on_update_kv_lens")


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here."""


def requested_backend() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "torch"):
        raise KernelInputError(f"{ENV_VAR} must be auto, triton or torch, got {mode!r}")
    return mode


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
    """Which implementation each kernel uses on `device` (default: cuda if present, else cpu) and why."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    mode = requested_backend()
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
    report["backend"] = chosen
    report["reason"] = reason
    report["kernels"] = {name: chosen for name in KERNELS}
    return report


#: Smallest head dim and block size the kernels tile (tl.dot needs 16-wide operands).
MIN_KERNEL_DIM = 16


def _kernel_shape_ok(head_dim: int, block_size: int) -> bool:
    """Tiny test models (head dim 16, block 4) stay on the torch references."""
    return all(n >= MIN_KERNEL_DIM and n & (n - 1) == 0 for n in (int(head_dim), int(block_size)))


def _reference(name: str) -> Callable[..., Any]:
    msa = importlib.import_module("m3_eagle_plugin.msa")
    fn = getattr(msa, name, None)
    if fn is None:
        raise KernelBackendError(f"torch reference m3_eagle_plugin.msa.{name} is not available")
    return fn


def select_blocks_paged(index_q, index_k_cache, meta, *, topk, local_blocks=1, init_blocks=0,
                        max_qo_len: int | None = None):
    """Dispatching twin of `msa.select_blocks_paged`."""
    if use_triton(index_q.device) and _kernel_shape_ok(index_q.shape[-1], meta.block_size):
        from .index_select import select_blocks_verify

        return select_blocks_verify(index_q, index_k_cache, meta, topk=topk, local_blocks=local_blocks,
                                    init_blocks=init_blocks, max_qo_len=max_qo_len)
    return _reference("select_blocks_paged")(index_q, index_k_cache, meta, topk=topk,
                                             local_blocks=local_blocks, init_blocks=init_blocks)


def sparse_attention(q, k_cache, v_cache, meta, selection, *, scale, k_scale=None, v_scale=None,
                     max_qo_len: int | None = None):
    """Dispatching twin of `msa.sparse_attention` (fp8 scales handled by the kernel only)."""
    if use_triton(q.device) and _kernel_shape_ok(q.shape[-1], meta.block_size):
        from .sparse_verify import sparse_verify_attention

        return sparse_verify_attention(q, k_cache, v_cache, meta, selection, scale=scale, k_scale=k_scale,
                                       v_scale=v_scale, max_qo_len=max_qo_len)
    if k_scale is not None or v_scale is not None:
        raise KernelBackendError("fp8 KV scales need the Triton backend")
    return _reference("sparse_attention")(q, k_cache, v_cache, meta, selection, scale=scale)


def dense_attention(q, k_cache, v_cache, meta, *, scale, k_scale=None, v_scale=None,
                    max_qo_len: int | None = None):
    """Dispatching twin of `msa.dense_attention`."""
    if use_triton(q.device) and _kernel_shape_ok(q.shape[-1], meta.block_size):
        from .dense_verify import dense_verify_attention

        return dense_verify_attention(q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale,
                                      v_scale=v_scale, max_qo_len=max_qo_len)
    if k_scale is not None or v_scale is not None:
        raise KernelBackendError("fp8 KV scales need the Triton backend")
    return _reference("dense_attention")(q, k_cache, v_cache, meta, scale=scale)


def on_update_kv_lens(meta, kv_lens=None) -> None:
    """`meta.on_update_kv_lens(kv_lens)` in one fused launch on CUDA, the metadata's torch path elsewhere."""
    if use_triton(meta.device):
        from .kv_lens_update import on_update_kv_lens_fused

        on_update_kv_lens_fused(meta, kv_lens)
    else:
        meta.on_update_kv_lens(kv_lens)
