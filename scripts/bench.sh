#!/usr/bin/env bash
# Sets up (packages + build) and runs `fusedmlp bench` on the best available backend with the
# built-in default workloads. Extra arguments go to fusedmlp bench (e.g. --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
exec "$BUILD_DIR/tools/fusedmlp" bench "$@"
