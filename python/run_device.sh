#!/usr/bin/env bash
# One GPU-machine run for the Python package: build + install the extension for the
# machine's own python3 (the one holding torch), the Python GPU/torch/transformers tests, and the
# end-to-end decode benchmark. Usage, from the repo root: bash python/run_device.sh [steps...]
#   steps: build test host e2e (default: all). host: bench/host_overhead.py on the GPU (bf16,
#   the C++ ops against the Python ones); E2E_ARGS passes options to bench/e2e_decode.py (e.g.
#   "--models gpt2" to split the run, "--modes graph,eager"). Logs and JSON go to $OUT (or ./out).
# Needs on that machine: nvcc, cmake, ninja, scikit-build-core and nanobind (all in its image);
# fmt from a git-ignored .device/fmt when the machine lacks it (as bench/run_device.sh).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=${*:-build test host e2e}
has() { [[ " $steps " == *" $1 "* ]]; }
export PATH=/usr/local/cuda/bin:$PATH PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONUNBUFFERED=1
SITE=${SITE:-/tmp/fmlp-site}
cmake_args="-DFMLP_CUDA=ON -DFMLP_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a"
if [ -d .device/fmt ]; then
  cmake_args+=" -DCMAKE_PREFIX_PATH=$PWD/.device/fmt"
  export LD_LIBRARY_PATH=$PWD/.device/fmt/lib/x86_64-linux-gnu:$PWD/.device/fmt/lib:${LD_LIBRARY_PATH:-}
fi
export PYTHONPATH=$SITE:${PYTHONPATH:-}

if has build; then
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
  CMAKE_ARGS="$cmake_args" timeout 540 python3 -m pip install -q --no-build-isolation --no-deps \
    --no-index --target "$SITE" --upgrade . >"$OUT/py_build.log" 2>&1 ||
    { tail -40 "$OUT/py_build.log"; exit 1; }
  # The module needs libcudart/libcublasLt .so.13; torch brings its own copies when imported
  # first. Without torch they come from the loader's path: add the toolkit's when that fails.
  if ! python3 -c 'import fusedmlp' 2>"$OUT/py_import.log"; then
    cat "$OUT/py_import.log"
    export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
    echo "import without torch failed; retrying with LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  fi
  python3 -c 'import fusedmlp; print(fusedmlp.build_info()); print(fusedmlp.devices())'
fi
if has test; then
  python3 -c 'import transformers; print("transformers", transformers.__version__)' ||
    echo "transformers missing: test_patch.py and the patch tests in test_gpu.py will skip"
  timeout 420 python3 -m pytest -q -rs -p no:cacheprovider python/tests 2>&1 |
    tee "$OUT/py_tests.log" | tail -30
fi
if has host; then
  python3 -c 'import fusedmlp.torch as ft; print("torch ops:", ft.ops_implementation())'
  timeout 300 python3 bench/host_overhead.py --device cuda --dtype bfloat16 \
    --compare "python ops=FMLP_TORCH_OPS=python" --out "$OUT/host_overhead_gpu" 2>&1 |
    tee "$OUT/host_overhead.log" | tail -12
fi
if has e2e; then
  timeout 540 python3 bench/e2e_decode.py --json "$OUT/e2e_decode.json" ${E2E_ARGS:-} 2>&1 |
    tee "$OUT/e2e_decode.log" | tail -40
fi
