#!/usr/bin/env bash
# Build .whl/ (git-ignored): the wheels the GPU image lacks, for its Python 3.12 on linux x86_64, then check them.
#
#   bash benchmarks/gpu_wheels.sh          # here, with network; then name .whl in the device call's carry
#
# The set (benchmarks/_third_party.py, CARRIED): megatron-core, liger-kernel, cut-cross-entropy, verl (without its
# dependencies) and the pure-Python packages verl's modules use (tensordict, pyvers, omegaconf, codetiming). Never torch or
# triton: the image has them. The check: exactly that set, pure wheels where they should be, no requirement on
# torch / triton that the image's torch 2.11 / triton 3.6 misses, under 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mapfile -t WANT < <("$PY" benchmarks/_third_party.py --requirements)
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WANT[@]}"
"$PY" benchmarks/_third_party.py --check-wheels .whl
du -sh .whl
