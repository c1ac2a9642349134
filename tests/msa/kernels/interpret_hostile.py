"""Run the hostile-kernel cases against the Triton kernels themselves on CPU, through Triton's
interpreter. Launched by `test_interpreter.py` in a subprocess with TRITON_INTERPRET=1 (the
variable is read when `triton.jit` decorates, so it cannot be set inside a running suite).

Prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import functools
import inspect
import sys

import m3_eagle_plugin.msa as msa
from m3_eagle_plugin.msa.kernels.dense_verify import dense_verify_attention
from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify
from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention
from tests.reliability import test_hostile_kernels as cases


class TritonKernels:
    """The kernel entry points with the dispatcher's signatures (the dispatcher itself picks the
    torch references on CPU); the sparse attention in its default (per-token) layout."""

    @staticmethod
    def select_blocks_paged(index_q, index_k_cache, meta, *, topk, **kw):
        return select_blocks_verify(index_q, index_k_cache, meta, topk=topk, **kw)

    sparse_attention = staticmethod(sparse_verify_attention)
    dense_attention = staticmethod(dense_verify_attention)


class TritonUnionKernels(TritonKernels):
    """The same with the sparse attention's union layout."""

    sparse_attention = staticmethod(functools.partial(sparse_verify_attention, layout="union"))


def main() -> int:
    failed = 0
    for kernels in (TritonKernels, TritonUnionKernels):
        cases._mods = lambda device, kernels=kernels: (msa, kernels)
        failed += run_cases(kernels.__name__)
    return 1 if failed else 0


def run_cases(label: str) -> int:
    failed = 0
    for name in sorted(n for n in dir(cases) if n.startswith("test_")):
        fn = getattr(cases, name)
        marks = {m.name for m in getattr(fn, "pytestmark", [])}
        params = [p for m in getattr(fn, "pytestmark", []) if m.name == "parametrize" for p in m.args[1]]
        runs_on_cpu = any(getattr(p, "values", (p,))[0] == "cpu" for p in params)
        if list(inspect.signature(fn).parameters) != ["device"] or "parametrize" not in marks or not runs_on_cpu:
            continue  # CUDA-only cases (device tables, graph capture) need a real device
        try:
            fn("cpu")
            print("PASS", label, name)
        except Exception as exc:  # noqa: BLE001 - report every case
            failed += 1
            print("FAIL", label, name, f"{type(exc).__name__}: {exc}"[:400])
    return failed


if __name__ == "__main__":
    sys.exit(main())
