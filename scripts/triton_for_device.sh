#!/usr/bin/env bash
# Pack, here, another Triton for the GPU machine, whose image has Triton 3.6 (python 3.12, torch 2.11), so that the
# GPU tests and host probes run there on the Tritons newer torch releases install (session 40: 3.7, 3.8, 3.9).
#
#   bash scripts/triton_for_device.sh 3.9.0      ->  .cache/triton39-cp312.tar.xz (~50 MB; .cache is git-ignored)
#
# The wheel (~285 MB) is too large to carry (a device call carries 64 MiB), so what a CUDA run does not use is left
# out: the AMD code generator's library (its Python files stay: Triton's backend discovery imports them), CUPTI and
# proton (profiling), the instrumentation library, cuobjdump / nvdisasm, and the ptxas this Triton does not use for
# sm_90 (3.9 compiles it with the CUDA 13 `ptxas-blackwell`, 3.7 and 3.8 with `ptxas`); libtriton.so is stripped of
# its symbol tables; then xz -9. On the device, first on PYTHONPATH, over the image's Triton:
#
#   mkdir -p /tmp/t39 && tar -xJf .cache/triton39-cp312.tar.xz -C /tmp/t39 &&
#   PYTHONPATH=/tmp/t39 TESTS_S=300 WORKERS=14 bash scripts/device_round.sh tests    # carry: [".cache/triton39-cp312.tar.xz"]
set -euo pipefail
version="${1:?usage: triton_for_device.sh VERSION (e.g. 3.9.0)}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
short="$(echo "$version" | awk -F. '{print $1 $2}')"
out="$root/.cache/triton${short}-cp312.tar.xz"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work/wheel" "triton==$version"
mkdir "$work/pkg"
(cd "$work/pkg" && unzip -q "$work"/wheel/*.whl)
t="$work/pkg/triton"
rm -rf "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" "$t/instrumentation" \
  "$t/_C/libproton.so" "$t/backends/amd/lib/libtriton_amd_codegen.so" \
  "$t/backends/nvidia/bin/cuobjdump" "$t/backends/nvidia/bin/nvdisasm"
if grep -q "if arch < 90" "$t/backends/nvidia/compiler.py"; then
  rm -f "$t/backends/nvidia/bin/ptxas"               # sm_90 takes ptxas-blackwell
else
  rm -f "$t/backends/nvidia/bin/ptxas-blackwell"     # only for sm_100 and later
fi
strip --strip-unneeded "$t/_C/libtriton.so"
mkdir -p "$root/.cache"
(cd "$work/pkg" && tar -cf - triton triton-*.dist-info | xz -9 -T0 > "$out")
ls -la "$out"
