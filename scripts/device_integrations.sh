#!/usr/bin/env bash
# The integrations' round on the GPU machine (device tool): GPU parity tests and the recipes' device tables for
# sentence-transformers, colpali-engine and PyLate. Needs `.whl` carried (bash ../shared/device/wheels.sh).
# Logs and JSON go to $OUT (7 files). Usage: bash scripts/device_integrations.sh [st|colpali|pylate|all|st63]...
# `st63` (not in `all`): the sentence-transformers suite again on 6.3 (kernel_config, use_kernels), from the wheels
# scripts/st63_wheels.sh put in .whl-st63 (carry it: `carry: [".whl-st63"]`).
# Tests run on WORKERS pytest-xdist processes (default 8; colpali-engine's on COLPALI_WORKERS, default 3 on an
# H200, 1 on an 80 GiB card): the suites are bound by Triton compilation, which parallel workers overlap.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="$PWD/.cache/triton"
parts="${*:-all}"
want() { [[ " $parts " == *" $1 "* || " $parts " == *" all "* ]]; }
pytest_q() { timeout "${TESTS_S:-200}" python3 -m pytest -n "${WORKERS:-8}" -q -p no:cacheprovider -rfEs "$@"; }

if want colpali || want pylate; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PWD/.site" \
    .whl/*.whl || exit 1
  export PYTHONPATH="$PWD/.site:$PWD/.whl/pkgs:$PWD/src:$PWD"
fi
if want colpali; then
  # each worker holds the unpatched library's B = 256 similarity tensors (~27-40 GB) at its peak: 3 fit an H200
  # (139 GiB), 1 an H100 (80 GiB: 3 ran out of memory there in session 35, 2 in session 46, at 40 + 33 GB)
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  default_workers=$([ "${gpu_mib:-0}" -gt 100000 ] && echo 3 || echo 1)
  ( WORKERS="${COLPALI_WORKERS:-$default_workers}" pytest_q tests/integrations/colpali/test_gpu.py; echo "colpali tests rc=$?"
    timeout "${TABLE_S:-150}" python3 benchmarks/colpali_step.py "$out/colpali_step.json"; echo "colpali table rc=$?"
  ) > "$out/colpali.log" 2>&1
  grep -E "rc=|passed|failed|error" "$out/colpali.log" | tail -n 6
fi
if want pylate; then
  ( pytest_q tests/integrations/pylate/test_pylate_gpu.py tests/integrations/pylate/test_pylate_scores.py \
      tests/integrations/pylate/test_pylate_enable.py tests/integrations/pylate/test_pylate_flash_backend.py
    echo "pylate tests rc=$?"
    timeout "${TABLE_S:-150}" python3 benchmarks/pylate_step.py "$out/pylate_step.json"; echo "pylate table rc=$?"
    timeout 120 python3 benchmarks/pylate_auto_fallback.py "$out/pylate_auto_fallback.json"
    echo "pylate fallback rc=$?"
  ) > "$out/pylate.log" 2>&1
  grep -E "rc=|passed|failed|error" "$out/pylate.log" | tail -n 6
fi

if want st; then
  # the image's own sentence-transformers 6.0.1: the carried ST 5.3.0 (for PyLate) stays off this path
  ( export PYTHONPATH="$PWD/src:$PWD"
    pytest_q tests/integrations/sentence_transformers; echo "st tests rc=$?"
    timeout "${TABLE_S:-150}" python3 benchmarks/st_similarity.py "$out/st_similarity.json"; echo "st table rc=$?"
  ) > "$out/st.log" 2>&1
  grep -E "rc=|passed|failed|error" "$out/st.log" | tail -n 6
fi

if [[ " $parts " == *" st63 "* ]]; then
  ( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PWD/.site-st63" \
      .whl-st63/*.whl || exit 1
    export PYTHONPATH="$PWD/.site-st63:$PWD/src:$PWD"
    python3 -c "import sentence_transformers, transformers, kernels; print('st', sentence_transformers.__version__, 'transformers', transformers.__version__, 'kernels', kernels.__version__)"
    pytest_q tests/integrations/sentence_transformers; echo "st63 tests rc=$?"
  ) > "$out/st63.log" 2>&1
  grep -E "rc=|passed|failed|error|^st " "$out/st63.log" | tail -n 6
fi
