#!/usr/bin/env bash
# astrai-attention on a CUDA machine, in one go: the standalone kernel tests (built with the
# command in their headers), the plugin build, tests/gpu/test_attention_gpu.py, the
# benchmark, and compute-sanitizer (memcheck + racecheck) over a reduced sweep.
#
#   tests/gpu/run_attention.sh                                  standalone build test bench
#   STAGES="build sanitize" tests/gpu/run_attention.sh          any subset, in this order
#
# Logs and the benchmark JSON land in $OUT (default /tmp/astrai-gpu); a summary prints last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/astrai-gpu}
mkdir -p "$OUT"
STAGES=${STAGES:-"standalone build test bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTHONPATH="$PWD/packages/astrai/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export ASTRAI_CUDA_ARCHS=${ASTRAI_CUDA_ARCHS:-90a} CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-8}
P=packages/astrai-attention
NVCC=(nvcc -std=c++17 -I "$P/csrc" -I packages/cuda-common/include -gencode=arch=compute_90a,code=sm_90a
      -O3 --use_fast_math --expt-relaxed-constexpr -Xptxas -v -Xcompiler -fopenmp)
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

if has standalone; then
  for t in attn_test attn_paged_test; do
    "${NVCC[@]}" "$P/csrc/tests/$t.cu" -o "/tmp/$t" >"/tmp/ptxas_$t.log" 2>&1 &
  done
fi
if has build; then
  start=$(date +%s)
  if python3 -m pip install -q -v --no-build-isolation --no-deps --no-cache-dir "./$P" >"$OUT/build-attention.log" 2>&1; then
    summary+=("build: ok in $(( $(date +%s) - start )) s")
  else
    tail -30 "$OUT/build-attention.log"; summary+=("build: FAILED")
  fi
fi
wait
if has standalone; then
  cat /tmp/ptxas_attn_test.log /tmp/ptxas_attn_paged_test.log >"$OUT/ptxas-standalone.log"
  for t in attn_test attn_paged_test; do
    if [ -x "/tmp/$t" ]; then
      "/tmp/$t" ${BENCH_STANDALONE:-} >"$OUT/$t.log" 2>&1; rc=$?
      summary+=("$t: rc=$rc, $(grep 'cases passed' "$OUT/$t.log")")
    else
      tail -20 "/tmp/ptxas_$t.log"; summary+=("$t: did not compile")
    fi
  done
fi
if has test; then
  python3 -m pytest tests/gpu/test_attention_gpu.py -m gpu -q -p no:cacheprovider -W error >"$OUT/tests-attention.log" 2>&1
  summary+=("pytest: $(tail -1 "$OUT/tests-attention.log")")
fi
if has bench; then
  python3 tests/gpu/bench_attention.py --json "$OUT/bench_attention.json" ${BENCH_ARGS:-} >"$OUT/bench-attention.log" 2>&1
  summary+=("bench: rc=$?")
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    args=(); [ "$tool" = racecheck ] && args=(--small)
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu/sanitize_attention.py "${args[@]}" \
      >"$OUT/sanitize-$tool.log" 2>&1
    summary+=("sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -1)")
  done
fi
echo "== details =="
for f in "$OUT"/attn_test.log "$OUT"/attn_paged_test.log; do [ -f "$f" ] && grep -E "FAIL|passed|us " "$f"; done
[ -f "$OUT/tests-attention.log" ] && grep -E "FAILED|Error|assert" "$OUT/tests-attention.log" | head -30
[ -f "$OUT/bench-attention.log" ] && cat "$OUT/bench-attention.log"
echo "== summary =="
printf '%s\n' "${summary[@]}"
