#!/usr/bin/env bash
# One device call: GPU tests (bf16 kernels, engine on CUDA), then the benchmark. Logs and results under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_kernels.py \
    tests/unit/test_engine_tiny.py tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -40
timeout "${BENCH_S:-330}" python3 bench/engine_gpu.py --out "$OUT/engine-gpu-h200.md" --budget-s "${BUDGET_S:-200}" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -100
