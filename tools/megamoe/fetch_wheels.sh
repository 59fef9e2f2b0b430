#!/usr/bin/env bash
# tools/megamoe/fetch_wheels.sh -- here, on the machine with a package index: fill .whl/ (git-ignored, about
# 15 MB) with the wheels tools/megamoe/run_anchor.sh installs on the offline H200 (Python 3.12, x86-64, --no-deps):
#   nvshmem4py-cu13==0.4.1                      symmring's GPU layer (as tools/gpu_common.sh installs it)
#   tokenspeed-deepgemm==2.5.0.post20260424     symmring's DeepGEMM engine (run in a process of its own)
# MegaMoE itself is not a wheel here: tools/megamoe/prepare_src.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
PLAT=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d .whl nvshmem4py-cu13==0.4.1 tokenspeed-deepgemm==2.5.0.post20260424
ls -la .whl
