#!/usr/bin/env bash
# tools/megamoe/check_patch.sh -- on a CPU machine with .megamoe/megamoe-src.tar.xz, torch (its headers) and CUDA's
# cuda.h/cuda_runtime.h: tools/megamoe/patch_src.py's include scanner against DeepGEMM's std::regex on every header
# of the tree and on random texts (tools/megamoe/patch_check.cpp; about a minute of g++). No GPU, no libtorch link.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY="${PYTHON:-python3}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xJf .megamoe/megamoe-src.tar.xz -C "$tmp"
"$PY" tools/megamoe/patch_src.py "$tmp/megamoe-src"
TORCH_DIR=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")
CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}"
[[ -f "$CUDA_HOME/include/cuda.h" ]] || CUDA_HOME=/usr/local/cuda
# DeepGEMM's utils/exception.hpp includes <cublasLt.h> for one macro the check never expands.
mkdir -p "$tmp/stub" && printf '#pragma once\ntypedef int cublasStatus_t;\n' >"$tmp/stub/cublasLt.h"
${CXX:-c++} -std=c++17 -O2 -w -D_GLIBCXX_USE_CXX11_ABI=1 -I"$tmp/stub" -I"$CUDA_HOME/include" \
  -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$tmp/megamoe-src/csrc" \
  -I"$tmp/megamoe-src/fmt/include" tools/megamoe/patch_check.cpp -o "$tmp/patch_check"
"$tmp/patch_check" "$tmp/megamoe-src"
