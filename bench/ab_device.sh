#!/usr/bin/env bash
# A/B of code variants in one GPU run, the way docs/*.md report them: every variant built from
# this tree plus a patch, then each command run for every variant in turn, ROUNDS times, so drift
# between machines and over the run hits all variants alike. Run on the GPU machine from the
# repo root; logs go to $OUT/ab (OUT defaults to ./out) as <variant>.<name>.<round>.log, and
# commands may write JSON to $OUT/ab/<variant>.<name>.<round>.json (the path is in $J). After
# every command the folder is packed into $OUT/ab.tgz as well: a device call returns only a few
# files, so take the tarball (tar xzf ab.tgz -C DIR; bench/ab_compare.py DIR).
#
#   bash bench/ab_device.sh -v base= -v pp=.device/pp.patch -t "fusedmlp_ops_bench test_linear" \
#     -c 'ops=$B/bench/fusedmlp_ops_bench --only linear --json $J' \
#     -c 'test=$B/tests/test_linear' [-r ROUNDS] [-e VAR=VALUE]
#
#   -v NAME=PATCH  a variant: this tree with PATCH applied (patch -p1; empty: the tree as it is)
#   -t TARGETS     the ninja targets to build (once per variant, builds in parallel)
#   -c NAME=CMD    a command, run with B (the variant's executables: $B/bench/..., $B/tests/...),
#                  V (its name), R (the round)
#                  and J set; commands named test* run in round 1 only
#   -e VAR=VALUE   an environment variable for every command (repeatable)
#   -r ROUNDS      rounds of the benchmark commands (default 2)
# bench/ab_compare.py turns the JSON of fusedmlp_ops_bench / fusedmlp_cuda_bench runs into a table.
set -uo pipefail
TOP=${OUT:-$PWD/out}
OUT=$TOP/ab
mkdir -p "$OUT"
variants=() commands=() envs=() targets="" rounds=2
while getopts "v:t:c:e:r:" opt; do
  case $opt in
    v) variants+=("$OPTARG") ;;
    t) targets=$OPTARG ;;
    c) commands+=("$OPTARG") ;;
    e) envs+=("$OPTARG") ;;
    r) rounds=$OPTARG ;;
    *) sed -n 2,18p "$0"; exit 2 ;;
  esac
done
[ ${#variants[@]} -gt 0 ] && [ -n "$targets" ] || { sed -n 2,18p "$0"; exit 2; }
export PATH=/usr/local/cuda/bin:$PATH
extra=()
if [ -d .device/fmt ]; then  # headers + libfmt for a machine without them (bench/run_device.sh)
  extra+=(-DCMAKE_PREFIX_PATH=$PWD/.device/fmt)
  export LD_LIBRARY_PATH=$PWD/.device/fmt/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
# One source copy and one build directory: each variant is the tree plus its patch (the previous
# one reverted), built incrementally (only what the patches touch recompiles) with a static
# libfusedmlp, and its executables copied to $AB_DIR/bin-<variant>/{bench,tests}. The build
# directory starts empty each run: the fresh copy's files keep their old times, so a build left by
# an earlier run (objects of its last variant) would look up to date to ninja.
AB_DIR=${AB_DIR:-/tmp/ab}
src=$AB_DIR/src bld=$AB_DIR/build
rm -rf "$src" "$bld" "$AB_DIR"/bin-* && mkdir -p "$src"
tar --exclude='./build*' --exclude=./.git --exclude=./out -cf - . | tar -xf - -C "$src"
t0=$(date +%s)
cmake -S "$src" -B "$bld" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFMLP_CUDA=ON -DFMLP_BUILD_CLI=OFF \
  -DFMLP_BUILD_TESTS=ON -DFMLP_BUILD_SHARED=OFF \
  "-DFMLP_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a" "${extra[@]}" >"$OUT/cmake.log" 2>&1 ||
  { tail -20 "$OUT/cmake.log"; exit 1; }
prev=""
for v in "${variants[@]}"; do
  name=${v%%=*} patch=${v#*=}
  if [ -n "$prev" ]; then (cd "$src" && patch -R -p1 -s <"$prev") || exit 1; fi
  prev=""
  if [ -n "$patch" ]; then
    prev=$(realpath "$patch") || exit 1
    (cd "$src" && patch -p1 -s <"$prev") || { echo "$name: $patch does not apply"; exit 1; }
  fi
  ninja -C "$bld" -j"$(nproc)" $targets >"$OUT/$name.build.log" 2>&1 ||
    { echo "$name: build failed"; tail -20 "$OUT/$name.build.log"; exit 1; }
  for t in $targets; do
    exe=$(find "$bld" -maxdepth 2 -type f -name "$t" -perm -u+x | head -1)
    [ -n "$exe" ] || continue
    dir=$AB_DIR/bin-$name/$(basename "$(dirname "$exe")")
    mkdir -p "$dir" && cp "$exe" "$dir/"
  done
  echo "$name built ($(($(date +%s) - t0)) s)"
done
for r in $(seq 1 "$rounds"); do
  for c in "${commands[@]}"; do
    cname=${c%%=*} cmd=${c#*=}
    [[ $cname == test* && $r -gt 1 ]] && continue
    for v in "${variants[@]}"; do
      name=${v%%=*}
      log=$OUT/$name.$cname.$r.log
      (export B=$AB_DIR/bin-$name V=$name R=$r J=$OUT/$name.$cname.$r.json
       for e in "${envs[@]}"; do export "${e?}"; done
       eval "$cmd") >"$log" 2>&1
      echo "$name $cname round $r: rc=$? ($(($(date +%s) - t0)) s) $(grep -E 'PASSED|FAILED' "$log" | tail -1)"
      tar czf "$TOP/ab.tgz" -C "$OUT" .
    done
  done
done
