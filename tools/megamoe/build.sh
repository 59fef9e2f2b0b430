#!/usr/bin/env bash
# tools/megamoe/build.sh -- make DeepGEMM's SM90 MegaMoE (sgl-deep-gemm 0.2.5) importable next to the
# installed torch 2.11, for `python -m symmring bench moe --anchor megamoe`. A tool, not a dependency.
#
#   tools/megamoe/build.sh [SITE]      (SITE default /tmp/megamoe-site)
#
# 1. installs .whl/sgl_deep_gemm-0.2.5-*.whl into SITE (--no-deps, no index);
# 2. builds SITE/deep_gemm/libtorch211_compat.so from tools/megamoe/torch211_compat.cpp against the installed
#    torch's headers (c++, -std=c++17; seconds); without a compiler it copies .megamoe/libtorch211_compat.so
#    (carried; built elsewhere against torch 2.11.0+cu130's headers) when the installed torch is 2.11;
# 3. checks that every symbol _C.so needs from libtorch resolves (torch's libs + the compat library) and
#    imports deep_gemm through tools/megamoe/load.py.
# Why a compat library and not a rebuilt _C.so: the 0.2.5 wheel's _C.so was built against torch >= 2.13 and
# its source (csrc/torch_library_api.cpp and the csrc tree of October 2026) is in no stored snapshot of
# sgl-project/DeepGEMM (newest: June 2026, no torch_library_api.cpp at any ref), so it cannot be rebuilt
# for 2.11; eight libtorch symbols are missing, and each has a 2.11 equivalent (see the .cpp).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SITE="${1:-/tmp/megamoe-site}"
PY="${PYTHON:-python3}"
mkdir -p "$SITE"
whl=$(ls .whl/sgl_deep_gemm-0.2.5-*.whl 2>/dev/null | head -n 1)
if [[ -z "$whl" ]]; then echo "build.sh: .whl/sgl_deep_gemm-0.2.5-*.whl missing (carry .whl)"; exit 3; fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$whl" || exit 4
TORCH_DIR=$("$PY" -c "import torch, os; print(os.path.dirname(torch.__file__))") || exit 5
TORCH_VER=$("$PY" -c "import torch; print(torch.__version__)")
echo "torch $TORCH_VER at $TORCH_DIR"
out="$SITE/deep_gemm/libtorch211_compat.so"
# Built here when a compiler is at hand (2 s; matches this machine's glibc); else the carried build.
abi=$("$PY" -c "import torch; print(int(torch.compiled_with_cxx11_abi()))")
if ${CXX:-c++} -std=c++17 -O2 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$TORCH_DIR/include" \
    tools/megamoe/torch211_compat.cpp -o "$out" -L"$TORCH_DIR/lib" -lc10 -ltorch_cpu -lc10_cuda \
    -Wl,--version-script=tools/megamoe/torch211_compat.map -Wl,-rpath,"$TORCH_DIR/lib"; then
  echo "compat library: built $out"
elif [[ -f .megamoe/libtorch211_compat.so && "$TORCH_VER" == 2.11.* ]]; then
  cp .megamoe/libtorch211_compat.so "$out" && echo "compat library: carried .megamoe/libtorch211_compat.so"
else
  echo "build.sh: compat library neither built nor carried"; exit 6
fi
# Every undefined symbol of _C.so that is not in libc/libstdc++/CUDA must be defined by torch or the compat lib.
defs=$(mktemp)
for f in "$TORCH_DIR"/lib/lib{c10,c10_cuda,torch,torch_cpu,torch_cuda}.so "$out"; do
  nm -D --defined-only "$f" | awk '{print $NF}'
done | sort -u >"$defs"
missing=$(nm -D --undefined-only "$SITE/deep_gemm/_C.so" | awk '{print $NF}' | grep -E 'c10|caffe2|torch|^_ZN(K|R)?2at|aoti' \
  | sort -u | comm -23 - "$defs")
rm -f "$defs"
if [[ -n "$missing" ]]; then echo "build.sh: symbols still missing:"; echo "$missing" | c++filt; exit 7; fi
echo "symbols: every libtorch symbol of _C.so resolves"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" tools/megamoe/load.py || exit 8
