"""Run a function on N local ranks (spawned processes rendezvousing on 127.0.0.1) with a hard deadline."""
from __future__ import annotations

import json
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, backend: str, args: tuple) -> None:
    from m3_eagle_plugin.parallel.process_group import init_local_group

    torch.set_num_threads(1)
    init_local_group(rank, world_size, port, backend=backend, timeout_s=60.0)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, backend: str = "gloo") -> None:
    """``fn(rank, world_size, *args)`` on every rank; a failing rank's error is raised here."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout_s} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


def ranks_evidence(worker, tiny_pair, tmp_path_factory, stem: str, *, timeout_s: float = 180.0) -> list[dict]:
    """Run `worker` on two gloo ranks with the tiny pair; what each rank wrote to `<stem>_rank<r>.json`
    up to a crash (an empty dict where a rank wrote nothing) is the evidence the tests read."""
    out = tmp_path_factory.mktemp(stem)
    try:
        run_ranks(worker, 2, str(tiny_pair[0]), str(tiny_pair[1]), str(out), timeout_s=timeout_s)
    finally:
        seen = [json.loads(p.read_text()) if p.exists() else {} for p in (out / f"{stem}_rank0.json",
                                                                          out / f"{stem}_rank1.json")]
    return seen
