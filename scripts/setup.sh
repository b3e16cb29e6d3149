#!/usr/bin/env bash
# Installs the build dependencies (Debian packages) and builds fusedmlp into ./build.
# Idempotent: packages already present are not reinstalled; the build is incremental.
# Environment: BUILD_DIR (default build), FMLP_CUDA (AUTO|ON|OFF, default AUTO), JOBS,
# FMLP_CMAKE_ARGS (more CMake arguments; docs/tuning.md lists the options).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/packages.sh

# The CUDA toolkit is optional; when it sits in the usual place but is not on PATH, use it.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFMLP_CUDA="${FMLP_CUDA:-AUTO}" \
  -DFMLP_BUILD_TESTS=ON -DFMLP_BUILD_CLI=ON ${FMLP_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
