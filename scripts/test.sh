#!/usr/bin/env bash
# Run every test suite on a fresh machine (no GPU needed): builds the environments it needs under .venvs/,
# then runs each suite listed in tests/suites.tsv in its own environment. GPU tests skip without CUDA.
#
#   bash scripts/test.sh            all suites
#   bash scripts/test.sh core       only the suites whose name starts with "core"
#
# Disk: the environments take ~11.5 GB in all (core 2 GB: torch 2.13 CPU build and triton; torch-2.14 5.3 GB:
# the CUDA build with its CUDA libraries, run on the CPU; each toolkit environment 0.2-0.8 GB, layered on one
# of those). With under FLASH_MAXSIM_KEEP_ENVS_MB (default 20000) MB free at the start, each environment but
# core is deleted after the last suite that needs it, and pip keeps no cache: the peak is then core +
# torch-2.14 + one toolkit environment (8.3 GB measured). FLASH_MAXSIM_KEEP_ENVS=1 keeps them all,
# =0 always deletes.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
only="${1:-}"
mkdir -p .cache/junit
rm -f .cache/junit/*.xml
# compiled kernels (Triton, TorchInductor) stay inside this checkout: deleting it frees them
export TRITON_CACHE_DIR="$root/.cache/triton" TORCHINDUCTOR_CACHE_DIR="$root/.cache/inductor"

free_mb() { df -Pm "$root" | awk 'NR==2 {print $4}'; }
start_free="$(free_mb)"
keep="${FLASH_MAXSIM_KEEP_ENVS:-auto}"
if [ "$keep" = auto ]; then
  if [ "${start_free:-0}" -ge "${FLASH_MAXSIM_KEEP_ENVS_MB:-20000}" ]; then keep=1; else keep=0; fi
fi
echo "free disk under $root: ${start_free} MB; $([ "$keep" = 1 ] && echo "keeping every environment" \
  || echo "deleting each environment but core after its last suite, no pip cache")"
if [ "$keep" != 1 ]; then export PIP_NO_CACHE_DIR=1; fi
if [ "${start_free:-0}" -lt 9000 ]; then
  echo "warning: under 9 GB free; building the largest environments may fail (No space left on device)"
fi

# the suites to run, and for each environment the last of them that needs it (as its own or as its --on base)
names=(); envs=(); paths=(); args=()
declare -A last_use=()
while IFS=$'\t' read -r name envname path pipargs; do
  case "$name" in ''|\#*) continue ;; esac
  [ -n "$only" ] && [[ "$name" != "$only"* ]] && continue
  i=${#names[@]}
  names+=("$name"); envs+=("$envname"); paths+=("$path"); args+=("$pipargs")
  last_use[$envname]=$i
  # env.sh takes "--on BASE" as the first arguments only
  if [[ "$pipargs" == "--on "* ]]; then
    rest="${pipargs#--on }"; last_use[${rest%% *}]=$i
  fi
done < tests/suites.tsv

status=0; env_failed=()
for i in "${!names[@]}"; do
  name="${names[$i]}"; envname="${envs[$i]}"
  echo "=== suite $name (env $envname) ==="
  # one more try on failure (a download cut off by the network): env.sh rebuilds an unfinished environment afresh
  # shellcheck disable=SC2086
  if py="$(bash scripts/env.sh "$envname" ${args[$i]} | tail -n 1)" || {
       echo "suite $name: environment failed ($(free_mb) MB free); trying once more"
       py="$(bash scripts/env.sh "$envname" ${args[$i]} | tail -n 1)"; }; then
    # shellcheck disable=SC2086  (the tests column may name several paths)
    "$py" -m pytest ${paths[$i]} -q -p no:cacheprovider --junitxml=".cache/junit/$name.xml" -o junit_suite_name="$name"
    rc=$?
    if [ "$rc" -ne 0 ]; then echo "suite $name: pytest exited $rc"; status=1; fi
  else
    # a half-built environment only holds disk: the next build starts it afresh anyway
    echo "suite $name: environment failed ($(free_mb) MB free)"; status=1; env_failed+=("$name")
    [ "$envname" != core ] && rm -rf ".venvs/$envname"
  fi
  if [ "$keep" != 1 ]; then
    for e in "${!last_use[@]}"; do
      if [ "${last_use[$e]}" = "$i" ] && [ "$e" != core ] && [ -d ".venvs/$e" ]; then
        rm -rf ".venvs/$e"; echo "deleted .venvs/$e ($(free_mb) MB free)"
      fi
    done
  fi
done
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
if [ "${#env_failed[@]}" -gt 0 ]; then echo "not run, their environment failed: ${env_failed[*]}"; fi
exit $status
