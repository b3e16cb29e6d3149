#!/usr/bin/env bash
# Prints the sm_90a SASS of the kernels in a CUDA object or executable whose demangled names match
# a pattern, with an opcode histogram of each, for reading what ptxas made of a loop without a GPU
# (the stream kernels' batch loops were sized this way: docs/linear-softmax.md).
#
#   bash scripts/sass.sh build/CMakeFiles/fusedmlp.dir/src/cuda/linear/sm80_stream.cu.o \
#     'linear_sm80_stream<__nv_bfloat16, __nv_bfloat16, 1, 4, false>' [ARCH]
#
# scripts/sass_compare.py compares every kernel of two builds (code that should only move).
# cuobjdump and nvdisasm come from the toolkit where it has them; otherwise from NVIDIA's PyPI
# wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), unpacked once into ~/.cache/fusedmlp-sass.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,9p "$0"; exit 2; }
obj=$1 pattern=$2 arch=${3:-sm_90a}
[ -f "$obj" ] || { echo "sass.sh: no file '$obj'; build it first (cmake --build build)" >&2; exit 1; }
export PATH=/usr/local/cuda/bin:$PATH
if ! command -v cuobjdump >/dev/null || ! command -v nvdisasm >/dev/null; then
  tools=${XDG_CACHE_HOME:-$HOME/.cache}/fusedmlp-sass
  if [ ! -x "$tools/nvidia/cu13/bin/nvdisasm" ]; then
    echo "sass.sh: fetching cuobjdump and nvdisasm wheels into $tools" >&2
    mkdir -p "$tools/wheels"
    pip download -q --no-deps -d "$tools/wheels" "nvidia-cuda-cuobjdump>=13,<14" \
      "nvidia-cuda-nvdisasm>=13,<14"
    for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
    chmod +x "$tools"/nvidia/cu13/bin/*
  fi
  export PATH=$tools/nvidia/cu13/bin:$PATH
fi
# One function per "Function :" header; the first match of each name (an object holds each arch's
# code once per instantiation).
cuobjdump -sass -arch "$arch" "$obj" | c++filt |
  awk -v pat="$pattern" '
    /Function :/ { keep = index($0, pat) > 0 && !seen[$0]++; if (keep) print; next }
    keep { sub(/[ \t]*\/\* 0x[0-9a-f]+ \*\//, ""); if ($0 !~ /^[ \t]*$/) print }' |
  tee >(sed -nE 's/^\s+\/\*[0-9a-f]{4,}\*\/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*).*/\2/p' |
        sort | uniq -c | sort -rn | head -25 | sed 's/^/# /' >&2)
