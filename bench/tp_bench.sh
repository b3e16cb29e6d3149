#!/usr/bin/env bash
# Tensor-parallel mlp on 2 GPUs (issue #9): llama3-70b (8192 -> 28672 swiglu, bf16) at M = 1 and
# M = 4096, one process per GPU, against the single-GPU op measured in the same run.
# Targets: M = 1 tp/single <= 0.55; M = 4096 speedup >= 1.8. Every M is timed with the one-shot
# p2p all-reduce and with NCCL's in the same run (ALLREDUCE=both, the default; or p2p / nccl);
# each row names the all-reduce its message took ("allreduce") and why ("allreduce_detail").
# Usage, from the repo root after a build (bench/run_device.sh build, or BUILD_DIR=...):
#   bash bench/tp_bench.sh            # writes $OUT/tp_llama3-70b.json (+ logs), OUT defaults ./out
# Env: BUILD_DIR (default /tmp/fmlp-build), SHAPE, MS (default 1,4096), RANKS (default 2),
#      REDUCE (all|scatter), ALLREDUCE (both|p2p|nccl), PYCHECK=1 also runs bench/tp_python_check.py under torchrun (needs
#      the fusedmlp package built from this tree: bash python/run_device.sh build, into $SITE).
#      MOE=1 (default) also runs fusedmlp_tp_moe: the Mixtral-like expert-parallel moe with sharded
#      tokens (all-to-all, fmlp_tp_moe_a2a) vs replicated tokens (fmlp_tp_moe) vs one GPU, at
#      MOE_TS tokens per rank (default 1,16,256), MOE_CAPACITY slots per pair of ranks (default:
#      no drop); writes $OUT/tp_moe_mixtral.json. MOE_ONLY=1 skips the mlp part.
set -uo pipefail
OUT=${OUT:-$PWD/out}
B=${BUILD_DIR:-/tmp/fmlp-build}
SHAPE=${SHAPE:-llama3-70b}
MS=${MS:-1,4096}
RANKS=${RANKS:-2}
REDUCE=${REDUCE:-all}
ALLREDUCE=${ALLREDUCE:-both}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # never NVLink SHARP / multicast on these machines
if [ -d .device/fmt ]; then
  export LD_LIBRARY_PATH=$PWD/.device/fmt/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
MOE=${MOE:-1}
MOE_TS=${MOE_TS:-1,16,256}
MOE_CAPACITY=${MOE_CAPACITY:--1}

# One process per rank; rank 0 last (it writes the id the others wait for). $1: a log prefix,
# then the binary and its arguments (rank 0 also gets the ones in RANK0_ARGS).
launch() {
  local tag=$1; shift
  local id pids=() r rc=0 extra
  id=$(mktemp -u /tmp/fmlp_tp_id.XXXXXX)
  for ((r = RANKS - 1; r >= 0; r--)); do
    extra=()
    [ "$r" = 0 ] && extra=("${RANK0_ARGS[@]}")
    timeout 900 "$@" --rank "$r" --size "$RANKS" --id-file "$id" "${extra[@]}" \
      >"$OUT/${tag}_rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  rm -f "$id"
  cat "$OUT/${tag}_rank0.log"
  [ $rc = 0 ] || { echo "$tag failed (rc=$rc); other ranks:"; tail -5 "$OUT"/${tag}_rank[1-9]*.log; }
  return $rc
}

if [ "$MOE" = 1 ]; then
  moe_exe=$B/fusedmlp_tp_moe
  if [ -x "$moe_exe" ]; then
    RANK0_ARGS=(--json "$OUT/tp_moe_mixtral.json")
    launch tp_moe "$moe_exe" --t "$MOE_TS" --capacity "$MOE_CAPACITY" || moe_rc=$?
  else
    echo "no $moe_exe: build with NCCL found"; moe_rc=1
  fi
  [ "${MOE_ONLY:-0}" = 1 ] && exit "${moe_rc:-0}"
fi

exe=$B/fusedmlp_tp_mlp
if [ ! -x "$exe" ]; then
  echo "no $exe: build with NCCL found (cmake prints 'fusedmlp: NCCL ON'; set NCCL_ROOT or"
  echo "pip install nvidia-nccl-cu13)"; exit 1
fi
id=$(mktemp -u /tmp/fmlp_tp_id.XXXXXX)
pids=()
for ((r = RANKS - 1; r >= 0; r--)); do  # rank 0 last: it writes the id the others wait for
  extra=()
  [ "$r" = 0 ] && extra=(--json "$OUT/tp_$SHAPE.json")
  timeout 900 "$exe" --rank "$r" --size "$RANKS" --id-file "$id" --shape "$SHAPE" --m "$MS" \
    --reduce "$REDUCE" --allreduce "$ALLREDUCE" "${extra[@]}" >"$OUT/tp_rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
rm -f "$id"
cat "$OUT/tp_rank0.log"
[ $rc = 0 ] || { echo "tp_mlp failed (rc=$rc); other ranks:"; tail -5 "$OUT"/tp_rank[1-9]*.log; }
if [ -f "$OUT/tp_$SHAPE.json" ]; then
  python3 - "$OUT/tp_$SHAPE.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["results"]:
    m, ratio, speedup = row["M"], row["tp_over_single"], row["speedup"]
    ar = f"all-reduce {row.get('allreduce', 'nccl')}"
    if m == 1:
        print(f"target M=1 ({ar}): tp/single {ratio:.3f} <= 0.55: {'met' if ratio <= 0.55 else 'MISSED'}")
    elif m >= 4096:
        print(f"target M={m} ({ar}): speedup {speedup:.2f}x >= 1.8: {'met' if speedup >= 1.8 else 'MISSED'}")
PY
fi
if [ "${PYCHECK:-0}" = 1 ]; then
  PYTHONPATH=${SITE:-/tmp/fmlp-site}:${PYTHONPATH:-} timeout 600 torchrun --nproc-per-node "$RANKS" \
    bench/tp_python_check.py --json "$OUT/tp_python.json" 2>&1 | tee "$OUT/tp_python.log" | tail -8
fi
[ "${moe_rc:-0}" = 0 ] || rc=${moe_rc}
exit $rc
