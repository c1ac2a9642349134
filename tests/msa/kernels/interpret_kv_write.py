"""Run the fused cache write's checks (`test_kv_write.py`) on CPU through Triton's interpreter.
Launched by `test_kv_write.test_kernel_in_the_interpreter` in a subprocess with TRITON_INTERPRET=1.

Prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import sys

import torch

from tests._interpreter import case_name, run_cases
from tests.msa.kernels import test_kv_write as cases


def main() -> int:
    torch.set_num_threads(1)
    return 1 if run_cases([(case_name(fn, kw), fn, kw) for fn, kw in cases.INTERPRETER_CASES]) else 0


if __name__ == "__main__":
    sys.exit(main())
