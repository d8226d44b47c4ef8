#!/usr/bin/env bash
# Before scripts/gpu_checks.sh runs on a GPU machine that cannot reach a package index (a lent
# device with its own CUDA torch, Triton and transformers, as /work/.library/device describes):
# downloads, here, the wheels our code needs beyond that image into .whl/ (git-ignored), for the
# target's Python (default 3.12). gpu_checks.sh installs them with --no-index when .whl/ exists.
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]
# Pinned to the versions installed here: the generated stubs (kvpager/v1) refuse an older grpcio or
# protobuf runtime than the one that generated them, and an image's own may be older.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pyver=${1:-3.12}
# grpc + the stubs' runtime, the services' health/reflection, and the logging every module imports.
names=(grpcio grpcio-health-checking grpcio-reflection protobuf structlog)
specs=()
for n in "${names[@]}"; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n")
  specs+=("$n==$v")
done
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
echo "[gpu-wheels] ${specs[*]} for CPython $pyver" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d .whl "${specs[@]}"
ls -l .whl >&2
du -sh .whl >&2
