#!/usr/bin/env bash
# Everything that needs a GPU (the lent H200 has torch, Triton, transformers, pytest and pluggy but
# no network): the test suite (its CUDA tests run there and skip in CI), then the kernel suite and
# the end-to-end bench, whose tables come last. A device call is capped at 600 s and the kernel
# tests alone take about 300 s on a cold machine (the other tests together took 450 s), so the work
# comes in parts, one call each:
#   bash scripts/gpu-check.sh kernels   tests/msa/kernels
#   bash scripts/gpu-check.sh host      tests/host and tests/reliability (the engines, soaks and fuzz)
#   bash scripts/gpu-check.sh rest      every other test
#   bash scripts/gpu-check.sh bench     m3-eagle bench --e2e (kernel suite + end to end)
#   bash scripts/gpu-check.sh           all four, for a machine without a per-call cap
# Results go to $OUT when set (the run tool's output folder), else /tmp/m3-gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out="${OUT:-/tmp/m3-gpu-check}"
part="${1:-all}"
usage="usage: $0 [kernels|host|rest|bench|all]"
case "$part" in kernels|host|rest|bench|all) ;; *) echo "$usage, got '$part'" >&2; exit 2 ;; esac
# one part a call: a second name ran nothing and passed
(( $# <= 1 )) || { echo "$usage, one part, got '$*'" >&2; exit 2; }
mkdir -p "$out"
# no GPU, or no torch/Triton/CUDA: stop here (else every CUDA test skipped, the bench ran its CPU smoke
# table and the check passed having checked nothing it is for)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "$0: nvidia-smi failed: no GPU" >&2; exit 1; }
python -c "import torch, triton; assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('torch', torch.__version__, 'triton', triton.__version__)" \
  || { echo "$0: torch with CUDA and Triton are needed" >&2; exit 1; }
status=0
if [[ $part == kernels || $part == all ]]; then
  python -m pytest -q -p no:cacheprovider -rfE tests/msa/kernels 2>&1 | tail -15 | tee "$out/pytest-kernels.txt"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $part == host || $part == all ]]; then
  python -m pytest -q -p no:cacheprovider -rfE tests/host tests/reliability 2>&1 | tail -25 | tee "$out/pytest-host.txt"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $part == rest || $part == all ]]; then
  python -m pytest -q -p no:cacheprovider -rfE --ignore=tests/msa/kernels --ignore=tests/host --ignore=tests/reliability \
    tests 2>&1 | tail -25 | tee "$out/pytest-rest.txt"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $part == bench || $part == all ]]; then
  python -m m3_eagle_plugin.cli bench --e2e --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" | tail -60
  status=$((status | PIPESTATUS[0]))
fi
exit "$status"
