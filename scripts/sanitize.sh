#!/usr/bin/env bash
# The C++ test suite under AddressSanitizer and UndefinedBehaviorSanitizer: a CPU-only build
# (host code: the C ABI, validation, the ref and cpu backends, the planner and cache parsers) in
# build-sanitize/, then ctest. Any report fails its test (-fno-sanitize-recover). The CUDA
# kernels get compute-sanitizer on the GPU machine instead (bench/run_device.sh sanitize).
# Environment: BUILD_DIR (default build-sanitize), JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/packages.sh
BUILD_DIR=${BUILD_DIR:-build-sanitize}
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFMLP_CUDA=OFF \
  -DFMLP_BUILD_TESTS=ON -DFMLP_BUILD_CLI=ON "-DCMAKE_CXX_FLAGS=$san" "-DCMAKE_EXE_LINKER_FLAGS=$san" \
  "-DCMAKE_SHARED_LINKER_FLAGS=$san" >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
# clang_format checks text, and the installed-package consumer build would rebuild unsanitized.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${JOBS:-$(nproc)}" -E "clang_format|consumer"
