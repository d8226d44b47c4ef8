#!/usr/bin/env bash
# On a machine with one CUDA GPU (H100/H200 class), after `bash scripts/install.sh --test` with a CUDA
# build of torch: the GPU-marked tests, the decode CUDA-graph benchmark and a quick kernel benchmark,
# in about five minutes. Outputs go to $OUT (default gpu-out/); the figures belong in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export TRITON_INTERPRET=0  # compiled kernels (the test suite's default is the interpreter)
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
  || exit 2
status=0
echo "[gpu] tests -m gpu" >&2
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/executor 2>&1 | tee "$out/gpu-tests.log" \
  || status=1
echo "[gpu] decode CUDA graphs vs eager" >&2
timeout 150 "$PY" benchmarks/decode_graphs_gpu.py --json > "$out/decode_graphs_gpu.json" || status=1
echo "[gpu] kernels (quick)" >&2
timeout 150 "$PY" benchmarks/kernels_gpu.py --quick --json > "$out/kernels_gpu_quick.json" || status=1
exit $status
