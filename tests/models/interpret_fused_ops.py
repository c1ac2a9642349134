"""Run the fused glue kernels' checks (`test_fused_ops.py`) on CPU through Triton's interpreter.
Launched by `test_fused_ops.test_kernels_in_the_interpreter` in a subprocess with TRITON_INTERPRET=1
(the variable is read when `triton.jit` decorates, so it cannot be set inside a running suite).

Prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from tests._interpreter import case_name, run_cases
from tests.models import test_fused_ops as cases


def main() -> int:
    torch.set_num_threads(1)
    runs = [(case_name(fn, kw), fn, kw) for fn, kw in cases.INTERPRETER_CASES]
    with tempfile.TemporaryDirectory() as tmp:
        def models(device, dtype):
            from m3_eagle_plugin.models.tiny import make_tiny

            make_tiny(Path(tmp), seed=3)
            cases.check_models_fused_vs_torch(device, dtype, Path(tmp), atol=1e-4, steps=(3,))

        runs.append(("check_models_fused_vs_torch(fp32)", models, dict(dtype=torch.float32)))
        failed = run_cases(runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
