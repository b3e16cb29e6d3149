#!/usr/bin/env bash
# One device run: build (CUDA on), GPU test suite, sanitizers, our benchmark, PyTorch peers.
# Usage on the GPU machine, from the repo root: bash bench/run_device.sh [steps...]
#   steps: build test sanitize bench peers (default: these); prefill (M = 1..8192 sweep of our
#   kernels and the PyTorch peers, for the planner's crossover table) and ops (linear + softmax
#   bench and peers), fp8 (the fp8 decode table with the bf16 peers), moe (moe bench + PyTorch
#   moe peers), suite (the batched-decode suite: bench/results/decode_suite_<gpu>.*) and odd
#   (odd sizes against their aligned neighbours, every entry timed: bench/odd_suite.txt and
#   fusedmlp_ops_bench --odd) run when named. Logs and JSON go to $OUT (or ./out).
# A git-ignored .device/fmt (headers + libfmt + cmake config) is used when the machine lacks fmt.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=${*:-build test sanitize bench peers}
export PATH=/usr/local/cuda/bin:$PATH
B=${BUILD_DIR:-/tmp/fmlp-build}
extra=()
if [ -d .device/fmt ]; then
  extra+=(-DCMAKE_PREFIX_PATH=$PWD/.device/fmt)
  export LD_LIBRARY_PATH=$PWD/.device/fmt/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
has() { [[ " $steps " == *" $1 "* ]]; }

if has build; then
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFMLP_CUDA=ON -DFMLP_BUILD_CLI=OFF \
    -DFMLP_BUILD_TESTS=ON "-DFMLP_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a" "${extra[@]}" \
    >"$OUT/build.log" 2>&1 && ninja -C "$B" -j"$(nproc)" >>"$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log"; exit 1; }
  echo "build ok"
fi
if has test; then
  ctest --test-dir "$B" -j8 --output-on-failure -E clang_format >"$OUT/ctest.log" 2>&1
  echo "ctest rc=$?"; grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | head -20
fi
if has sanitize; then
  # synccheck: shuffles and barriers whose mask names lanes that are not there (a full-mask
  # shuffle in a warp-divergent loop can hang a kernel in one run and pass in others, so the
  # plain tests do not catch it).
  timeout 240 compute-sanitizer --tool synccheck --print-limit 10 "$B/tests/test_mlp_vs_ref" \
    --gtest_filter='*VectorFriendly/mlp_decode_sm*:*Layout/mlp_decode_sm*' >"$OUT/synccheck.log" 2>&1
  echo "synccheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/synccheck.log" | head -3
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --print-limit 10 "$B/tests/test_mlp_vs_ref" \
      --gtest_filter='*VectorFriendly/mlp_decode_sm80_*:*VectorFriendly/mlp_decode_sm90_cluster:*Layout/mlp_decode_sm80_stream:*Layout/mlp_decode_sm90_cluster:*Shapes/mlp_decode_sm90_splitk:*Epilogue/mlp_decode_sm90_splitk:*Fp8/mlp_decode_sm90_splitk:*Epilogue/mlp_decode_sm80_stream:*Epilogue/mlp_decode_sm90_cluster:*NonFinite/mlp_decode_sm90_cluster' \
      >"$OUT/$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool.log" | head -4
    timeout 240 compute-sanitizer --tool $tool --print-limit 10 "$B/tests/test_moe" \
      --gtest_filter='MoeCuda.DeviceIds*:MoeCuda.Graph*:MoeCuda.Bad*' >"$OUT/${tool}_moe.log" 2>&1
    echo "$tool moe rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/${tool}_moe.log" | head -2
  done
fi
if has bench; then
  "$B/bench/fusedmlp_cuda_bench" --json "$OUT/ours.json" 2>&1 | tee "$OUT/bench.log" | tail -22
  for k in ${ALSO_KERNELS:-}; do  # the same M=1 shapes on other kernels, for the planner's table
    "$B/bench/fusedmlp_cuda_bench" --skip-matrix --kernel "$k" --ms 1 \
      --json "$OUT/ours_$k.json" 2>&1 | tee "$OUT/bench_$k.log" | tail -6
  done
fi
if has peers; then
  PYTHONUNBUFFERED=1 timeout ${PEERS_TIMEOUT:-420} python3 bench/peers.py --json "$OUT/peers.json" \
    2>&1 | tee "$OUT/peers.log" | tail -20
fi
if has prefill; then
  "$B/bench/fusedmlp_cuda_bench_prefill" --json "$OUT/ours_prefill.json" ${PREFILL_ARGS:-} 2>&1 |
    tee "$OUT/bench_prefill.log" | tail -30
  PYTHONUNBUFFERED=1 timeout ${PEERS_TIMEOUT:-420} python3 bench/peers_prefill.py \
    --json "$OUT/peers_prefill.json" ${PEERS_PREFILL_ARGS:-} 2>&1 | tee "$OUT/peers_prefill.log" |
    tail -20
  python3 bench/report.py prefill --ours "$OUT/ours_prefill.json" --peers "$OUT/peers_prefill.json" \
    --out "$OUT/cuda_prefill" >"$OUT/prefill_table.md" 2>&1 || tail -5 "$OUT/prefill_table.md"
fi
if has ops; then  # linear + softmax: our bench, then the PyTorch peers with the speedup table
  "$B/bench/fusedmlp_ops_bench" --json "$OUT/ops.json" 2>&1 | tee "$OUT/ops_bench.log" | tail -70
  PYTHONUNBUFFERED=1 timeout ${PEERS_TIMEOUT:-420} python3 bench/peers_ops.py \
    --json "$OUT/peers_ops.json" --ours "$OUT/ops.json" 2>&1 | tee "$OUT/peers_ops.log" | tail -70
fi
if has fp8; then  # the fp8 decode table: the planner's picks, the bf16 peers in the same call
  "$B/bench/fusedmlp_cuda_bench" --skip-matrix --wdtype f8 --ms 1,2,4,16 \
    --shapes gpt2-small,seed-4096,llama3-8b,llama3-70b --json "$OUT/ours_f8.json" 2>&1 |
    tee "$OUT/bench_f8.log" | tail -20
  PYTHONUNBUFFERED=1 timeout ${PEERS_TIMEOUT:-420} python3 bench/peers.py \
    --shapes gpt2-small,seed-4096,llama3-8b,llama3-70b --ms 1,2,4,16 --json "$OUT/peers_f8.json" \
    2>&1 | tee "$OUT/peers_f8.log" | tail -20
  python3 bench/report.py cuda --wdtype f8 --ours "$OUT/ours_f8.json" --peers "$OUT/peers_f8.json" \
    --out "$OUT/cuda_decode_fp8" >"$OUT/fp8_table.md" 2>&1 || tail -5 "$OUT/fp8_table.md"
fi
if has suite; then  # the batched-decode suite (bench/decode_suite.txt): ours, PyTorch, the report
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
  nvcc --version | tail -1 >>"$OUT/gpu.txt"
  timeout ${SUITE_TIMEOUT:-300} "$B/bench/fusedmlp_decode_suite_bench" --entries ${ENTRIES:-all} \
    --json "$OUT/ours_suite.json" >"$OUT/suite.log" 2>&1; tail -3 "$OUT/suite.log"
  PYTHONUNBUFFERED=1 timeout ${PEERS_TIMEOUT:-420} python3 bench/peers_suite.py \
    --json "$OUT/peers_suite.json" >"$OUT/peers_suite.log" 2>&1; tail -3 "$OUT/peers_suite.log"
  python3 bench/report.py decode-suite --ours "$OUT/ours_suite.json" \
    --peers "$OUT/peers_suite.json" --gpu-info "$OUT/gpu.txt" \
    --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    --out "$OUT/decode_suite" | tail -30
fi
if has odd; then  # odd sizes: each odd layer beside its aligned neighbour, every entry timed
  timeout ${ODD_TIMEOUT:-200} "$B/bench/fusedmlp_decode_suite_bench" --suite bench/odd_suite.txt \
    --ms 1,4,16,64 --entries all --json "$OUT/ours_odd.json" >"$OUT/odd.log" 2>&1
  echo "odd mlp rc=$?"; grep -E "dispatch|PASSED|FAIL" "$OUT/odd.log" | head -40
  timeout ${ODD_TIMEOUT:-200} "$B/bench/fusedmlp_ops_bench" --only linear --odd \
    --json "$OUT/linear_odd.json" >"$OUT/linear_odd.log" 2>&1
  echo "odd linear rc=$?"; grep "odd/aligned" "$OUT/linear_odd.log" | head -40
fi
if has moe; then  # moe op: our bench (fast and deterministic mode), then the PyTorch peers
  "$B/bench/fusedmlp_moe_bench" --json "$OUT/moe.json" 2>&1 | tee "$OUT/moe_bench.log" | tail -12
  "$B/bench/fusedmlp_moe_bench" --deterministic --ts 64,512 --json "$OUT/moe_det.json" 2>&1 |
    tee "$OUT/moe_bench_det.log" | tail -6
  for k in moe_sm80_grouped moe_sm80_chunked; do  # both entries on the same shapes: the crossover
    "$B/bench/fusedmlp_moe_bench" --kernel $k --ts 16,32,64,128,256,512 --json "$OUT/moe_$k.json" \
      2>&1 | tee "$OUT/moe_bench_$k.log" | grep -v skipped | tail -12
  done
  PYTHONUNBUFFERED=1 timeout ${PEERS_TIMEOUT:-420} python3 bench/peers_moe.py \
    --json "$OUT/peers_moe.json" --ours "$OUT/moe.json" 2>&1 | tee "$OUT/peers_moe.log" | tail -14
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
nvcc --version | tail -1 >>"$OUT/gpu.txt"
