#!/usr/bin/env bash
# One batch on the CUDA machine: (re)build the standalone test and the C library if the
# carried ones do not run there, then the requested steps. Logs land in $OUT.
#   packages/astrai-fp8/csrc/gemm/sm90/tests/device_run.sh quick sanitize bench configs full
set -uo pipefail
cd "$(dirname "$0")/../../../../../.."
OUT=${OUT:-/tmp/sm90-out}
mkdir -p "$OUT" build/sm90
SRC=packages/astrai-fp8/csrc/gemm/sm90
FLAGS="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I $SRC"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if ! ldd build/sm90/sm90_gemm_test >/dev/null 2>&1 || ! build/sm90/sm90_gemm_test probe 2>&1 | grep -q "probe ok"; then
  echo "building on the device"
  nvcc $FLAGS $SRC/tests/sm90_gemm_test.cu -o build/sm90/sm90_gemm_test &
  nvcc $FLAGS -Xcompiler -fPIC -shared $SRC/capi.cu -o build/sm90/libastrai_fp8_sm90.so &
  wait
fi
for step in "$@"; do
  case $step in
    quick|full|configs)
      timeout ${T_STEP:-60} build/sm90/sm90_gemm_test "$step" --json "$OUT/$step.jsonl" 2>&1 | tee "$OUT/$step.log" ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        timeout ${T_SAN:-25} compute-sanitizer --tool $tool --error-exitcode 9 build/sm90/sm90_gemm_test sanitize \
          >"$OUT/sanitize-$tool.log" 2>&1
        echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -1)"
      done ;;
    bench)
      timeout ${T_STEP:-60} python3 tests/gpu/bench_fp8_sm90.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    bench-quick)
      timeout ${T_STEP:-60} python3 tests/gpu/bench_fp8_sm90.py --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    plugin-bg)  # build + install the plugin (wgmma path included) while the GPU steps run
      (ASTRAI_CUDA_ARCHS=90a CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation \
        --no-deps --no-cache-dir ./packages/astrai-fp8 >"$OUT/plugin-build.log" 2>&1; echo "rc=$?" >>"$OUT/plugin-build.log") &
      PLUGIN_PID=$! ;;
    plugin-test)
      wait ${PLUGIN_PID:-} 2>/dev/null; tail -1 "$OUT/plugin-build.log"
      PYTHONPATH=$PWD/packages/astrai/src timeout ${T_STEP:-60} python3 -m pytest tests/gpu/test_fp8_sm90_gpu.py -k plugin \
        tests/gpu/test_fp8_gpu.py -m gpu -q -x -p no:cacheprovider -o addopts="" -W error 2>&1 | tee "$OUT/plugin-test.log" | tail -8 ;;
    pytest)
      timeout ${T_STEP:-60} python3 -m pytest tests/gpu/test_fp8_sm90_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -W error 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
  esac
done
