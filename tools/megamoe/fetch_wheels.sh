#!/usr/bin/env bash
# tools/megamoe/fetch_wheels.sh [--compat] -- here, on the machine with a package index: fill .whl/ (git-ignored)
# with the wheels tools/megamoe/run_anchor.sh installs on the offline H200 (Python 3.12, x86-64, --no-deps):
#   nvshmem4py-cu13==0.4.1                      symmring's GPU layer (as tools/gpu_common.sh installs it)
#   sgl-deep-gemm==0.2.5                        DeepGEMM's SM90 MegaMoE (its _C.so + headers, ~5 MB)
#   tokenspeed-deepgemm==2.5.0.post20260424     symmring's DeepGEMM engine (run in a process of its own)
# --compat also builds .megamoe/libtorch211_compat.so (the fallback the H200 uses when it has no c++) against
# torch 2.11.0+cu130's headers and libs, from its wheel (530 MB, downloaded to a temporary directory).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
PLAT=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d .whl nvshmem4py-cu13==0.4.1 sgl-deep-gemm==0.2.5 tokenspeed-deepgemm==2.5.0.post20260424
ls -la .whl
if [[ "${1:-}" == --compat ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$tmp" torch==2.11.0
  (cd "$tmp" && unzip -q torch-2.11.0-*.whl 'torch/lib/*' 'torch/include/*')
  mkdir -p .megamoe
  T="$tmp/torch"
  c++ -std=c++17 -O2 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI=1 -I"$T/include" tools/megamoe/torch211_compat.cpp \
    -o .megamoe/libtorch211_compat.so -L"$T/lib" -lc10 -ltorch_cpu -lc10_cuda \
    -Wl,--version-script=tools/megamoe/torch211_compat.map
  ls -la .megamoe
  rm -rf "$tmp"
fi
