#!/usr/bin/env bash
# On a machine with one CUDA GPU (H100/H200 class): the GPU-marked tests, the decode CUDA-graph
# benchmark and a quick kernel benchmark, in about five minutes. Outputs go to $OUT (default gpu-out/);
# the figures belong in docs/benchmarks.md.
# Either kvpager is installed there (`bash scripts/install.sh --test` with a CUDA build of torch), or
# the machine has torch, Triton and transformers but no package index: then run
# `bash scripts/gpu_wheels.sh` beforehand where pip works, bring .whl/ along, and this script installs
# those wheels over the image's own and runs the checkout in place.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export TRITON_INTERPRET=0  # compiled kernels (the test suite's default is the interpreter)
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/kvpager-site
  echo "[gpu] installing .whl/ into $site (no index)" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || exit 2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, whether installed or not
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
  || exit 2
status=0
echo "[gpu] tests -m gpu" >&2
# The GPU test files by name: collecting the whole directories would build the C++ CPU kernels and
# import what only the CPU tests need.
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_gpu.py \
  tests/executor/test_cuda_graphs.py 2>&1 | tee "$out/gpu-tests.log" || status=1
echo "[gpu] decode CUDA graphs vs eager" >&2
timeout 150 "$PY" benchmarks/decode_graphs_gpu.py --json > "$out/decode_graphs_gpu.json" || status=1
echo "[gpu] kernels (quick)" >&2
timeout 150 "$PY" benchmarks/kernels_gpu.py --quick --json > "$out/kernels_gpu_quick.json" || status=1
exit $status
