#!/usr/bin/env bash
# Create (once) a virtual environment under .venvs/NAME for tests or the check command, on a fresh machine.
#
#   scripts/env.sh core                      torch 2.13.0 (CPU build), triton, test deps, this package (editable)
#   scripts/env.sh NAME PIP_ARGS...          a toolkit environment layered on `core`: it sees core's packages
#                                            through a .pth file and installs PIP_ARGS on top (its own copies
#                                            win), so torch is installed once and toolkit versions stay apart.
#   scripts/env.sh NAME --on BASE PIP_ARGS...
#                                            layered on the environment BASE instead (itself built first, with
#                                            the pip arguments tests/suites.tsv gives it), and through it on core.
# Prints the environment's python path on the last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="$1"; shift || true
py="${PYTHON:-python3}"
venv="$root/.venvs/$name"
stamp="$venv/.ready-$(printf '%s ' "$@" | md5sum | cut -c1-12)"
base=""
if [ "${1:-}" = "--on" ]; then
  base="$2"; shift 2
  base_line="$(awk -F'\t' -v env="$base" '$2 == env {print "+" $4; exit}' "$root/tests/suites.tsv")"
  if [ -z "$base_line" ]; then echo "env.sh: no suite in tests/suites.tsv uses the environment '$base' (--on)" >&2; exit 2; fi
  base_args="${base_line#+}"
  # shellcheck disable=SC2086
  base_py="$(bash "$root/scripts/env.sh" "$base" $base_args | tail -n 1)"
fi
if [ "$name" != core ]; then
  core_py="$(bash "$root/scripts/env.sh" core | tail -n 1)"
fi
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if [ "$name" = core ]; then
    "$venv/bin/python" -m pip install -q torch==2.13.0 triton==3.9.0 "safetensors>=0.4" "pytest>=8" "hypothesis>=6.100" numpy
    "$venv/bin/python" -m pip install -q --no-deps -e "$root"
  else
    core_site="$("$core_py" -c 'import site; print(site.getsitepackages()[0])')"
    own_site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
    if [ -n "$base" ]; then
      # the base's own .pth files (its link to core, the editable install) are read through addsitedir;
      # its packages come after this environment's own and before core's
      base_site="$("$base_py" -c 'import site; print(site.getsitepackages()[0])')"
      echo "import site; site.addsitedir('$base_site')" > "$own_site/_flash_maxsim_base.pth"
    fi
    echo "$core_site" > "$own_site/_flash_maxsim_core.pth"
    # core's editable install hook lives in core_site; .pth files there are not processed from a .pth path
    for f in "$core_site"/__editable__*flash_maxsim*.pth "$core_site"/_flash_maxsim_src.pth; do
      [ -f "$f" ] && cp "$f" "$own_site/"
    done
    if [ "$#" -gt 0 ]; then "$venv/bin/python" -m pip install -q "$@"; fi
  fi
  touch "$stamp"
fi
echo "$venv/bin/python"
