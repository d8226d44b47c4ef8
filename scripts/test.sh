#!/usr/bin/env bash
# Install what the tests need and run the whole suite (CPU; Triton kernels
# under TRITON_INTERPRET=1; GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec "${PYTHON:-python3}" -m pytest -q -m "not slow" "$@"
