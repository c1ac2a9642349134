"""Patch `forward-env-to-mpi-pool`: TensorRT-LLM's MPI pool workers receive the plugin's settings.

Why: without `mpirun`, tensor parallelism runs in workers that `MpiPoolSession` spawns through
mpi4py's `MPIPoolExecutor`. They start from the environment the driver had when MPI started (its
first `tensorrt_llm` import), plus only the `TRTLLM*` / `TLLM*` variables newer hosts pass as
`env`. What the `m3_eagle_plugin:` config key exports later (or any `M3_EAGLE_*` variable set in
the process) never reaches them, so the workers would build the model without the plugin while
the driver runs with it.
How: while installed, `tensorrt_llm.llmapi.mpi_session.MPIPoolExecutor` is a subclass whose
constructor adds the driver's `M3_EAGLE_*` variables to `env` (the host's own entries win).
mpi4py applies `env` in each worker before its first task; the worker's bootstrap defers its
decision in MPI processes until `tensorrt_llm` is imported (`_bootstrap.py`), so it sees them.
A host built without multi-device support binds no `MPIPoolExecutor` there, and then this
changes nothing. Not a contract symbol: the name is bound only on multi-device builds, and its
absence must not refuse activation.
Upstream: none (the plugin's own need; `MpiPoolSession(env_overrides=...)` in newer hosts is not
reachable from the config path).
Remove when: the host forwards a plugin's variables to its MPI pool workers itself.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable

PATCH_ID = "forward-env-to-mpi-pool"
HOST_MODULE = "tensorrt_llm.llmapi.mpi_session"
NAME = "MPIPoolExecutor"
PREFIX = "M3_EAGLE_"


def plugin_environ(environ) -> dict[str, str]:
    """The variables forwarded: every `M3_EAGLE_*` of `environ`."""
    return {k: v for k, v in environ.items() if k.startswith(PREFIX)}


def forwarding_executor(original: type) -> type:
    """A subclass of `original` that adds the plugin's variables to the workers' `env`."""

    class MPIPoolExecutor(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            forwarded = plugin_environ(os.environ)
            if forwarded:
                kwargs["env"] = {**forwarded, **(kwargs.get("env") or {})}
            super().__init__(*args, **kwargs)

    MPIPoolExecutor.__module__ = original.__module__
    MPIPoolExecutor.__qualname__ = original.__qualname__
    MPIPoolExecutor.__wrapped__ = original
    return MPIPoolExecutor


def forward_env_to_mpi_pool() -> Callable[[], None]:
    """An install step (`host.trtllm.install` runs it after the patches): rebind the executor, return the undo."""
    try:
        module = importlib.import_module(HOST_MODULE)
    except Exception:  # noqa: BLE001 - no loadable MPI session, no pool to forward to: not worth refusing activation
        return lambda: None
    original = vars(module).get(NAME)
    if not isinstance(original, type):  # a single-device build binds none
        return lambda: None
    replacement = forwarding_executor(original)
    setattr(module, NAME, replacement)

    def undo() -> None:
        if vars(module).get(NAME) is replacement:
            setattr(module, NAME, original)

    return undo
