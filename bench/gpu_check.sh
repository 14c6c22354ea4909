#!/usr/bin/env bash
# One-command GPU check of spdsl's kernels (about 6 minutes on one H200):
#   1. the kernel tests on CUDA: every gpu-marked case in bf16/fp16 plus the CPU-only tests;
#   2. bench/kernel_bench.py: fwd+bwd TFLOP/s or GB/s vs SDPA and torch.compile'd references.
# Usage, from anywhere:  bash bench/gpu_check.sh   (env: PYTEST_TIMEOUT=240 BENCH_TIMEOUT=330)
# Nothing heavy is installed: torch must be there; triton is installed only if missing.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET            # the interpreter would replace the GPU compiler
export SPDSL_KERNELS=auto
PY=${PYTHON:-python}
status=0

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! $PY -c "import triton" 2>/dev/null; then
    echo "triton missing: pip install triton==3.8.0"
    $PY -m pip install -q triton==3.8.0 || echo "pip install triton failed"
fi
$PY - <<'PY' || { echo "no usable CUDA torch: stopping"; exit 1; }
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, "
      f"cuda {torch.version.cuda}, device {torch.cuda.get_device_name()}")
assert torch.cuda.is_available()
PY

echo "== kernel tests on CUDA"
# -m: the gpu cases plus the plain CPU tests; interpreter-only and slow (sm_90 compile-only
# check, redundant on a real GPU) cases are left out.
timeout "${PYTEST_TIMEOUT:-240}" $PY -m pytest tests/kernels -m "gpu or not (interpret or slow)" \
    -q -rs -p no:cacheprovider --durations=10 || { echo "kernel tests: FAILED ($?)"; status=1; }

echo "== kernel benchmark (bf16)"
timeout "${BENCH_TIMEOUT:-330}" $PY bench/kernel_bench.py || { echo "bench: FAILED ($?)"; status=1; }

echo "== gpu_check exit status $status"
exit $status
