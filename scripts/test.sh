#!/usr/bin/env bash
# Run the test suites (noxfile.py: one environment each, GPU tests skip without CUDA), then print one closing
# line over all of them. Exits non-zero if a suite fails, its environment cannot be built, or no test ran.
#   bash scripts/test.sh                      every suite
#   bash scripts/test.sh colpali              the suites with that tag (core, pylate, colpali, sentence-transformers)
#   bash scripts/test.sh -s pylate-1.6        any nox arguments (-- passes pytest arguments: -- -k quantize)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
args=("$@")
if [ "$#" -gt 0 ] && [[ "$1" != -* ]]; then args=(-t "$@"); fi
mkdir -p .cache/junit
rm -f .cache/junit/*.xml
start=$SECONDS
bash scripts/nox.sh "${args[@]}"
status=$?
echo "test suites: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
.venvs/nox/bin/python - "$status" <<'PY' || status=1
import glob
import sys
import xml.etree.ElementTree as ET

total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sorted(glob.glob(".cache/junit/*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in total:
            total[key] += int(suite.get(key, 0))
passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
if total["tests"] == 0 and sys.argv[1] == "0":
    print("no test ran")
print(f"{passed} passed, {total['failures'] + total['errors']} failed, {total['skipped']} skipped")
sys.exit(total["tests"] == 0)
PY
exit $status
