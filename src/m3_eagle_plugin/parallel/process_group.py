"""Starting a local process group and choosing where its tensors must live.

The same code runs two CPU processes over gloo (tests, CI) and two GPUs over NCCL. For NCCL on
a single host, NVLink multicast (NVLS) is turned off (``NCCL_NVLS_ENABLE=0``) unless the caller
set it: NVLS needs multicast-capable fabric setup that the shared GPU machines do not offer, and
it only speeds up large all-reduces, which a TP2 decode step does not have.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_local_group", "comm_device"]


def init_local_group(rank: int, world_size: int, port: int, *, backend: str | None = None,
                     timeout_s: float = 60.0) -> str:
    """Join a ``world_size`` group rendezvousing on 127.0.0.1:``port``; returns the backend.

    ``backend`` defaults to NCCL when every rank has its own GPU, else gloo. With NCCL, rank ``r``
    uses ``cuda:r``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        # checked here: torch's own failure (no CUDA build, bad ordinal) does not name the cause
        raise ValueError(f"backend 'nccl' gives every rank its own GPU (rank r uses cuda:r), but "
                         f"{torch.cuda.device_count()} CUDA devices are visible for {world_size} ranks")
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{int(port)}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors handed to ``group``'s collectives must live (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
