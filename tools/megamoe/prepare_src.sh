#!/usr/bin/env bash
# tools/megamoe/prepare_src.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT -- here (not on the H200): write
# .megamoe/megamoe-src.tar.xz (git-ignored; about 1.3 MB) from bare git directories of deepseek-ai/DeepGEMM,
# NVIDIA/cutlass and fmtlib/fmt (e.g. the ones the `fetch` tool gives: /work/.mirror/<owner>+<name>/repo):
#   csrc/{apis,jit,jit_kernels,utils} and deep_gemm/include/deep_gemm of DeepGEMM refs/pull/323/head 8ddf7f9
#   (2026-07-02: SM90 FP8 MegaMoE, the newest stored tree with the SM90 kernel), include/{cute,cutlass} of
#   cutlass f3fde58 and include/ of fmt 553ec11 (that tree's submodule pins).
# With BUILD=1 and TORCH_DIR (torch 2.11.0+cu130's torch/ folder, unpacked from its wheel), PYINC (Python 3.12's
# include dir) and NVINC (a folder with cublas/cusparse/cusolver/nvrtc headers, e.g. nvidia/cu13/include of
# the nvidia-* wheels) it also builds .megamoe/_C.cpython-312-x86_64-linux-gnu.so (g++, about two minutes) on
# the tree as tools/megamoe/patch_src.py leaves it (the tarball itself stays upstream's source), as build.sh does.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DG=$1 CUT=$2 FMT=$3
DG_REV=8ddf7f9 CUT_REV=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8 FMT_REV=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
tmp=$(mktemp -d)
src="$tmp/megamoe-src"
mkdir -p "$src/csrc" "$src/include" "$src/fmt"
git --git-dir="$DG" archive "$DG_REV" csrc/apis csrc/jit csrc/jit_kernels csrc/utils deep_gemm/include/deep_gemm \
  | tar -x -C "$tmp"
mv "$tmp/csrc"/* "$src/csrc/" && mv "$tmp/deep_gemm/include/deep_gemm" "$src/include/"
git --git-dir="$CUT" archive "$CUT_REV" include/cute include/cutlass | tar -x -C "$src"
git --git-dir="$FMT" archive "$FMT_REV" include | tar -x -C "$src/fmt"
cat >"$src/SOURCE" <<TXT
csrc/, include/deep_gemm/: deepseek-ai/DeepGEMM refs/pull/323/head $DG_REV (2026-07-02)
include/cute, include/cutlass: NVIDIA/cutlass $CUT_REV (that tree's submodule pin)
fmt/include: fmtlib/fmt $FMT_REV (that tree's submodule pin)
TXT
mkdir -p .megamoe
tar -cJf .megamoe/megamoe-src.tar.xz -C "$tmp" megamoe-src
if [[ "${BUILD:-0}" == 1 ]]; then
  python3 tools/megamoe/patch_src.py "$src"
  g++ -std=c++17 -O2 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI=1 \
    -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -I"$src/fmt/include" -DFMT_HEADER_ONLY -I"$TORCH_DIR/include" \
    -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$PYINC" -I/usr/local/cuda/include -I/usr/local/cuda/include/cccl \
    -I"$NVINC" -I"$src/csrc" -I"$src/include" tools/megamoe/megamoe_bind.cpp \
    -o .megamoe/_C.cpython-312-x86_64-linux-gnu.so -L"$TORCH_DIR/lib" -L/usr/local/cuda/lib64 -L"$NVINC/../lib" \
    -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda -lcudart -l:libnvrtc.so.13 -l:libcublasLt.so.13 \
    -l:libcublas.so.13
fi
rm -rf "$tmp"
ls -la .megamoe
