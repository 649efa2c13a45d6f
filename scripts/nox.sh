#!/usr/bin/env bash
# Run nox (noxfile.py: the test suites and the check command) with uv as its installer; the first time, install
# both into .venvs/nox with pip. Arguments go to nox:
#   bash scripts/nox.sh -s check          verify flash_maxsim on this machine (builds its environment first)
#   bash scripts/nox.sh -l                list the sessions
# PYTHON (default python3, >= 3.10) makes the environments; where it has torch, the check session reuses it.
# Downloads go to uv's cache (UV_CACHE_DIR, default ~/.cache/uv); environments under .nox/ link to it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
tools=("nox==2026.10.20" "uv==0.13.10")
venv="$root/.venvs/nox"
stamp="$venv/.installed-$(printf '%s ' "${tools[@]}" | md5sum | cut -c1-12)"

if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "scripts/nox.sh: needs Python >= 3.10 as '$py' (set PYTHON=/path/to/python3.X)" >&2
  exit 2
fi
if [ ! -f "$stamp" ]; then
  echo "scripts/nox.sh: installing ${tools[*]} into .venvs/nox"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${tools[@]}"
  touch "$stamp"
fi
FLASH_MAXSIM_PYTHON="$("$py" -c 'import sys; print(sys.executable)')"
export FLASH_MAXSIM_PYTHON
cd "$root"
exec "$venv/bin/nox" "$@"
