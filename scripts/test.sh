#!/usr/bin/env bash
# Run every test suite on a fresh machine (no GPU needed): builds the environments it needs under .venvs/,
# then runs each suite listed in tests/suites.tsv in its own environment. GPU tests skip without CUDA.
#
#   bash scripts/test.sh            all suites
#   bash scripts/test.sh core       only the suites whose name starts with "core"
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
only="${1:-}"
mkdir -p .cache/junit
rm -f .cache/junit/*.xml
# compiled kernels (Triton, TorchInductor) stay inside this checkout: deleting it frees them
export TRITON_CACHE_DIR="$root/.cache/triton" TORCHINDUCTOR_CACHE_DIR="$root/.cache/inductor"
# the environments take ~11 GB: torch 2.13 (CPU build) and triton in core, each toolkit layered on it, and
# torch 2.14.1 (the CUDA build, 5.3 GB with its CUDA libraries, run on the CPU) in torch-2.14
free_mb=$(df -Pm "$root" | awk 'NR==2 {print $4}')
echo "free disk under $root: ${free_mb} MB"
if [ "${free_mb:-0}" -lt 12000 ]; then echo "warning: under 12 GB free; building the environments may fail (No space left on device)"; fi
status=0
while IFS=$'\t' read -r name envname path pipargs; do
  case "$name" in ''|\#*) continue ;; esac
  [ -n "$only" ] && [[ "$name" != "$only"* ]] && continue
  echo "=== suite $name (env $envname) ==="
  # shellcheck disable=SC2086
  py="$(bash scripts/env.sh "$envname" $pipargs | tail -n 1)" || { echo "suite $name: environment failed"; status=1; continue; }
  "$py" -m pytest "$path" -q -p no:cacheprovider --junitxml=".cache/junit/$name.xml" -o junit_suite_name="$name"
  rc=$?
  if [ "$rc" -ne 0 ]; then echo "suite $name: pytest exited $rc"; status=1; fi
done < tests/suites.tsv
python3 - <<'PY'
import glob, xml.etree.ElementTree as ET
t = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in sorted(glob.glob(".cache/junit/*.xml")):
    for s in ET.parse(f).getroot().iter("testsuite"):
        for k in t:
            t[k] += int(s.get(k, 0))
passed = t["tests"] - t["failures"] - t["errors"] - t["skipped"]
print(f"all suites: {passed} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped")
PY
exit $status
