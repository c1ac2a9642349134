"""Double of `tensorrt_llm/llmapi/mpi_session.py` on a multi-device build.

`MpiPoolSession` spawns its workers through `MPIPoolExecutor` (mpi4py's in the host, a recorder
here) and passes the driver's `TRTLLM*` / `TLLM*` variables as `env`, as newer hosts do; older
ones pass no `env` at all. Either way the workers start from the environment the driver had when
MPI started, so nothing set in the driver later reaches them except through `env`.
"""
import os
import sys


class MPIPoolExecutor:
    """Records what mpi4py would be given."""

    def __init__(self, max_workers=None, initializer=None, initargs=(), **kwargs):
        self.max_workers = max_workers
        self.kwargs = kwargs

    def worker_environ(self, started_with):
        """A worker's `os.environ` once mpi4py applied `env` over the environment it started with."""
        return {**started_with, **(self.kwargs.get("env") or {})}


class MpiPoolSession:
    def __init__(self, n_workers):
        self.n_workers = n_workers
        self.mpi_pool = None
        self._start_mpi_pool()

    def _start_mpi_pool(self):
        env = {k: v for k, v in os.environ.items() if k.startswith(("TRTLLM", "TLLM"))}
        self.mpi_pool = MPIPoolExecutor(max_workers=self.n_workers, path=sys.path, env=env)
