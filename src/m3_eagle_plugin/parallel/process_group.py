"""Starting a local process group and choosing where its tensors must live.

The same code runs two CPU processes over gloo (tests, CI) and two GPUs over NCCL. For NCCL on
a single host, NVLink multicast (NVLS) is turned off (``NCCL_NVLS_ENABLE=0``) unless the caller
set it: NVLS needs multicast-capable fabric setup that the shared GPU machines do not offer, and
it only speeds up large all-reduces, which a TP2 decode step does not have. Gloo is pinned to
the loopback interface by its name on this host (``lo`` on Linux, ``lo0`` on macOS and the BSDs)
unless the caller chose one: gloo refuses an interface name the host lacks.
"""
from __future__ import annotations

import datetime
import numbers
import os
import socket

import torch
import torch.distributed as dist

from m3_eagle_plugin._ints import as_int

__all__ = ["init_local_group", "comm_device"]

_MAX_TIMEOUT_S = 1e9  # about 31.7 years: "no timeout" for any run


def init_local_group(rank: int, world_size: int, port: int, *, backend: str | None = None,
                     timeout_s: float = 60.0) -> str:
    """Join a ``world_size`` group rendezvousing on 127.0.0.1:``port``; returns the backend.

    ``backend`` defaults to NCCL when every rank has its own GPU, else gloo. With NCCL, rank ``r``
    uses ``cuda:r``.
    """
    rank, world_size, port = (as_int(name, value) for name, value in
                              (("rank", rank), ("world_size", world_size), ("port", port)))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    # torch counts whole milliseconds: under one it timed out at once blaming the socket, NaN failed converting;
    # its deadlines are int64 nanoseconds: past about 9.2e9 s they wrap and it timed out at once too
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
            or not 1e-3 <= timeout_s <= _MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s must be a finite number of seconds >= 0.001 and <= 1e9, got {timeout_s!r}")
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
    elif "GLOO_SOCKET_IFNAME" not in os.environ and (loopback := _loopback_interface()) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def _loopback_interface() -> str | None:
    """The loopback interface's name, where the host has one of the usual ones (else gloo picks)."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors handed to ``group``'s collectives must live (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
