#!/usr/bin/env bash
# Everything that needs a GPU, in one device call (the lent H200 has torch, Triton, transformers,
# pytest and pluggy but no network): the whole test suite (its CUDA tests run there and skip in
# CI), then the kernel suite and the end-to-end bench, whose tables come last.
#   run tool: bash scripts/gpu-check.sh     (results in $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
out="${OUT:-/tmp/m3-gpu-check}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -m pytest -q -p no:cacheprovider -rfE tests 2>&1 | tail -25 | tee "$out/pytest-tail.txt"
python -m m3_eagle_plugin.cli bench --e2e --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" | tail -60
