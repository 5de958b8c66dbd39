#!/usr/bin/env bash
# Pack the newest Triton for the lent GPU machine (Python 3.12, no network) in two carries of < 64 MiB:
# the wheel is 272 MiB (Triton 3.9.0); without the AMD backend's libraries, the CUPTI profiling libraries
# and the Blackwell ptxas (a link to ptxas is made on the device: Triton looks the file up even for sm_90),
# xz-compressed, it is ~104 MiB. Writes .tri1/ and .tri2/ (git-ignored, ~52 MiB each); on one warm machine
# (carried folders stay there between calls; one call carries at most 64 MiB with the tree):
#   call 1: carry .whl   -> `bash scripts/device_run.sh peers` (FLA, mlstm_kernels into .site) and other work
#   call 2: carry .tri1  -> other work
#   call 3: carry .tri2  -> `bash scripts/device_run.sh tri39 newest` (assembles .site39/, checks its SHA-256,
#           then tests and benches with PYTHONPATH=.site39 first).
# Checked on the CPU host with the same stripping of the local cp311 Triton 3.9 (compile_stats.py compiles
# every simple GLA kernel for sm_90 with it).
set -euo pipefail
VERSION=${1:-3.9.0}
work=$(mktemp -d)
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$work" "triton==$VERSION" >/dev/null
(cd "$work" && mkdir x && cd x && python -m zipfile -e ../triton-"$VERSION"-*.whl . \
  && rm -rf triton/backends/amd/lib triton/backends/nvidia/lib/cupti triton/backends/nvidia/lib/cupti-blackwell \
            triton/backends/nvidia/bin/ptxas-blackwell triton/instrumentation/libGPUInstrumentationTestLib.so \
            triton/plugins/libTritonPluginsTestLib.so \
  && tar -cf - triton triton-"$VERSION".dist-info | xz -T2 -6 > ../triton.tar.xz)
rm -rf .tri1 .tri2 && mkdir -p .tri1 .tri2
size=$(stat -c %s "$work/triton.tar.xz")
half=$(( (size + 1) / 2 ))
head -c "$half" "$work/triton.tar.xz" > .tri1/part0
tail -c +"$(( half + 1 ))" "$work/triton.tar.xz" > .tri2/part1
sha256sum "$work/triton.tar.xz" | cut -d' ' -f1 > .tri1/SHA256
echo "$VERSION" > .tri1/VERSION
cp .tri1/SHA256 .tri1/VERSION .tri2/
ls -la .tri1 .tri2
rm -rf "$work"
