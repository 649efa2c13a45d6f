#!/usr/bin/env bash
# The kernel owner's round on the GPU machine (device tool), after any kernel change:
#   core GPU tests, one medium case of every kernel path under compute-sanitizer memcheck, the benchmark.
# Logs and results go to $OUT. Usage: bash scripts/device_round.sh [tests|sanitizer|bench|int8|all]
# (int8: issue 7's rows, today's int8 path against the int8 x int8 products it may switch to; not in "all")
# Tests run on WORKERS pytest-xdist processes (default 8): compilation-bound, ~70 s for the core GPU suite.
set -uo pipefail
what="${1:-all}"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$PWD/.cache/triton"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv | tee "$out/gpu.txt"
if [[ "$what" == tests || "$what" == all ]]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -n "${WORKERS:-8}" tests/core/test_gpu.py tests/core/test_quantization.py \
    tests/core/test_interpreter.py tests/core/test_backward_variants.py tests/core/test_autocast.py \
    tests/core/test_errors.py -q -p no:cacheprovider -rfEs \
    > "$out/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 15 "$out/gpu_tests.txt"
fi
if [[ "$what" == sanitizer || "$what" == all ]]; then
  timeout "${SANITIZER_S:-150}" compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitizer_case.py \
    > "$out/sanitizer.txt" 2>&1; echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|sanitizer case|BAD" "$out/sanitizer.txt"
fi
if [[ "$what" == int8 ]]; then
  timeout "${INT8_S:-300}" python3 benchmarks/kernel_check.py --int8 --no-train --no-forward --skip-correctness \
    > "$out/int8_sweep.txt" 2>&1; echo "int8 sweep rc=$?"; grep -E "^int8" "$out/int8_sweep.txt"
fi
if [[ "$what" == bench || "$what" == all ]]; then
  python3 benchmarks/bench.py --no-sweeps --budget-s "${BENCH_S:-300}" --out "$out" > "$out/bench_log.txt" 2>&1
  echo "bench rc=$?"; tail -n 60 "$out/bench_log.txt"
fi
