#!/usr/bin/env bash
# tools/megamoe/build.sh [SITE] -- make DeepGEMM's SM90 FP8 MegaMoE importable as `megamoe_dg` (SITE default
# /tmp/megamoe-site; put it on PYTHONPATH) next to the installed torch, for
# `python -m symmring bench moe --anchor megamoe`. A tool, never a dependency of the symmring package.
#
# Needs .megamoe/ (git-ignored; tools/megamoe/fetch_wheels.sh --megamoe fills it here):
#   megamoe-src.tar.xz      DeepGEMM's host code (csrc/) and kernel headers (include/deep_gemm) from
#                           deepseek-ai/DeepGEMM refs/pull/323/head 8ddf7f9, with the cutlass (f3fde58) and fmt
#                           (553ec11) its submodules pin; SOURCE inside says so
#   _C.cpython-312-x86_64-linux-gnu.so   that host code + tools/megamoe/megamoe_bind.cpp, built against
#                           torch 2.11.0+cu130 (optional: without it, or when it does not import, this
#                           script compiles it here, about two minutes on one core)
# Compiled with DeepGEMM's pinned fmt (553ec11) FIRST on the include path and -DFMT_HEADER_ONLY. torch's include
# dir carries fmt headers of torch's own version; behind them, DeepGEMM's code was compiled against torch's fmt,
# and a _C built here (H100, g++ 13.3, torch 2.11) segfaulted at the first MegaMoE call inside
# IncludeParser::get_hash_value's formatting (std::regex taken out by patch_src.py; before it, inside std::regex,
# -Wl,-Bsymbolic and -static-libstdc++ alike). With the pinned fmt first it ran (2026-12-06: the quick check,
# 2 rows, 0 not ok); a later run of the same build on the same image crashed there again (own_libstdcxx.sh
# says why; build.sh refuses such a _C). patch_src.py (std::regex out of include_parser.hpp and compiler.hpp
# for plain scans with the same matches, checked on CPU: tools/megamoe/check_patch.sh) stays applied: the run
# that passed had it, and a run without it was not made.
# MEGAMOE_SEGV_BACKTRACE=1 at run time prints the native frames of a crash inside _C (megamoe_bind.cpp).
# Why not the sgl-deep-gemm 0.2.5 wheel: its _C.so was built against torch 2.14 (eight libtorch symbols
# missing in 2.11, c10::TensorImpl's fields 8 bytes further on, DispatchKey::CUDA one value lower), and its
# source (October 2026) is in no stored snapshot of sgl-project/DeepGEMM; PR 323's tree is the newest stored
# source of the SM90 kernel. Its kernels are JIT-compiled by nvcc at the first call (DG_JIT_CACHE_DIR).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SITE="${1:-/tmp/megamoe-site}"
PY="${PYTHON:-python3}"
SO=_C.cpython-312-x86_64-linux-gnu.so
[[ -f .megamoe/megamoe-src.tar.xz ]] || { echo "build.sh: .megamoe/megamoe-src.tar.xz missing (carry .megamoe)"; exit 3; }
SRC=/tmp/megamoe-src
rm -rf "$SRC" && tar -xJf .megamoe/megamoe-src.tar.xz -C /tmp || exit 4
cat "$SRC/SOURCE"
"$PY" tools/megamoe/patch_src.py "$SRC" || exit 4
PKG="$SITE/megamoe_dg"
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$SRC/include" "$PKG/" && cp tools/megamoe/megamoe_dg_init.py "$PKG/__init__.py" || exit 5
check() { PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import megamoe_dg as m; \
print('megamoe_dg:', m.__version__, '| token alignment', m._C.get_token_alignment_for_sm90_mega_moe())"; }
# _C must take libstdc++ from the process (torch loaded it first), never carry a copy of its own
# (own_libstdcxx.sh says why). Two runs of one build on one H100 image went either way (2026-12-06: a segfault
# at the first number IncludeParser's hash writes to a std::ostream, frames inside _C named
# std::ostream::_M_insert and std::codecvt); -l:libstdc++.so.6 below binds every libstdc++ symbol to the shared
# library, even where the toolchain would link libstdc++.a.
if [[ -f ".megamoe/$SO" ]]; then
  cp ".megamoe/$SO" "$PKG/" && ! bash tools/megamoe/own_libstdcxx.sh "$PKG/$SO" && check \
    && { echo "build.sh: the carried _C imports"; exit 0; }
  echo "build.sh: the carried _C does not import here; compiling it"
fi
eval "$("$PY" - <<'PYEOF'
import glob, os, sysconfig, torch
t = os.path.dirname(torch.__file__)
print(f"TORCH_DIR={t}")
print(f"PYINC={sysconfig.get_paths()['include']}")
print(f"ABI={int(torch.compiled_with_cxx11_abi())}")
site = os.path.dirname(t)
inc = sorted(set(glob.glob(os.path.join(site, 'nvidia', '*', 'include')) + glob.glob(os.path.join(site, 'nvidia', '*', '*', 'include'))))
lib = sorted(set(glob.glob(os.path.join(site, 'nvidia', '*', 'lib')) + glob.glob(os.path.join(site, 'nvidia', '*', '*', 'lib'))))
print("NVINC='" + " ".join("-I" + d for d in inc) + "'")
print("NVLIB='" + " ".join("-L" + d for d in lib) + "'")
PYEOF
)"
CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}"
echo "torch at $TORCH_DIR, python headers $PYINC, CUDA_HOME $CUDA_HOME"
t0=$SECONDS
# DeepGEMM's pinned fmt first and header-only: torch ships fmt headers of its own version in its include dir.
${CXX:-c++} -std=c++17 -O2 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -I"$SRC/fmt/include" -DFMT_HEADER_ONLY \
  -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$PYINC" \
  -I"$CUDA_HOME/include" -I"$CUDA_HOME/include/cccl" $NVINC \
  -I"$SRC/csrc" -I"$SRC/include" \
  tools/megamoe/megamoe_bind.cpp -o "$PKG/$SO" \
  -L"$TORCH_DIR/lib" -L"$CUDA_HOME/lib64" $NVLIB \
  -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda -l:libcudart.so.13 -l:libnvrtc.so.13 \
  -l:libcublasLt.so.13 -l:libcublas.so.13 -l:libstdc++.so.6 -Wl,-t >"$SRC/link.log" \
  || { echo "build.sh: compiling _C failed"; exit 6; }
echo "build.sh: compiled _C in $((SECONDS - t0)) s with $(${CXX:-c++} --version | head -n 1)"
# Where libstdc++ came from (the link trace: libstdc++.so.6, or members of a libstdc++.a).
grep -a 'libstdc++' "$SRC/link.log" | sort -u | sed 's/^/build.sh: linked /'
if bash tools/megamoe/own_libstdcxx.sh "$PKG/$SO"; then rm -f "$PKG/$SO"; exit 8; fi
check || exit 7
