#!/usr/bin/env bash
# Sets up (packages + build) and runs the whole test suite; ctest prints the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
# Say up front why the CUDA tests will skip, if they do (ctest only prints "Skipped").
if [ -x "$BUILD_DIR/tools/fusedmlp" ]; then
  "$BUILD_DIR/tools/fusedmlp" info | grep -E "^(build|gpus):|^  cuda " || true
fi
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${JOBS:-$(nproc)}"
