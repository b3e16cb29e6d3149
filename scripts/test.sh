#!/usr/bin/env bash
# Sets up (packages + build) and runs the whole test suite: ctest, then the Python package's
# pytest suite; each prints its summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
# Say up front why the CUDA tests will skip, if they do (ctest only prints "Skipped").
if [ -x "$BUILD_DIR/tools/fusedmlp" ]; then
  "$BUILD_DIR/tools/fusedmlp" info | grep -E "^(build|gpus):|^  cuda " || true
fi
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${JOBS:-$(nproc)}"

# Python package (pyproject.toml: scikit-build-core + nanobind, libfusedmlp linked in statically).
# A system Python (Debian 12) needs its headers and pip, and pip's leave to install outside a venv.
if ! python3 -m pip --version >/dev/null 2>&1 ||
   [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then
  echo "setup: installing python3-dev python3-pip" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-dev python3-pip >/dev/null
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)}
# ml_dtypes gives numpy bfloat16 and float8_e4m3fn, so the fp8 tests run instead of skipping.
python3 -m pip install -q pytest numpy scikit-build-core nanobind ml_dtypes
# torch and transformers: the torch.library ops (opcheck, torch.compile(fullgraph=True)), the
# FusedMLP / FusedMoE modules and patch() on tiny Hugging Face models are tested only where they
# import, so a fresh machine needs them (~111 tests skip without them). Pinned: torch as on the GPU
# machine (2.11), transformers as last checked with it (PyPI's torch wheel is the CUDA build; on
# a machine without a GPU its CPU path is what the tests use).
python3 -m pip install -q torch==2.11.0 transformers==5.24.0
# Without build isolation the build directory (build-python/) stays valid, so reruns are incremental.
CMAKE_ARGS="-DFMLP_CUDA=${FMLP_CUDA:-AUTO}" python3 -m pip install -q --no-build-isolation .
python3 -m pytest -q -rs python/tests
