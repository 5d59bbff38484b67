#!/usr/bin/env bash
# Issue 4's GPU work in as few device calls as possible (each call is at most 10 minutes):
#
#   bash benchmarks/gpu_suite.sh tests      # GPU tests + the kernel tests on the GPU   (~3 min)
#   bash benchmarks/gpu_suite.sh kernels    # benchmarks/kernels.py timing               (~3 min)
#   bash benchmarks/gpu_suite.sh decode     # benchmarks/decode.py --device cuda, 1B     (~6 min)
#
# Results and logs go to $OUT (the device tool's folder) or benchmarks/results/gpu. The
# device image brings its own torch and triton and has no network, so the project is
# installed without dependencies and without build isolation (nothing is downloaded).
set -uo pipefail
stage=${1:?usage: gpu_suite.sh tests|kernels|decode}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/$stage.log"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  case "$stage" in
    tests)
      python3 -m pytest -q -p no:warnings -m gpu tests
      python3 -m pytest -q -p no:warnings tests/test_codegen_kernels.py ;;
    kernels)
      python3 benchmarks/kernels.py --json "$out/kernels.json" ;;
    decode)
      python3 benchmarks/decode.py --device cuda --model llama-1b --batch 1 --prompt 128 \
        --new 128 --repeat 3 --json "$out/decode.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
} 2>&1 | tee "$log"
