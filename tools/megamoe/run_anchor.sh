#!/usr/bin/env bash
# tools/megamoe/run_anchor.sh -- the MegaMoE anchor in ONE device call on the H200 (about 9 minutes at most):
#
#   OUT=$OUT bash tools/megamoe/run_anchor.sh [quick]
#
# needs .whl/ carried with nvshmem4py_cu13-0.4.1, sgl_deep_gemm-0.2.5 and (for the symmring DeepGEMM engine)
# tokenspeed_deepgemm-2.5.0.post20260424 wheels (tools/megamoe/fetch_wheels.sh fills it). Steps, each under
# `timeout`, logged to $OUT/<step>.log (tail printed), a summary last:
#   install  nvshmem4py -> /tmp/site; sgl-deep-gemm -> /tmp/megamoe-site (+ compat library, symbol check,
#            import: tools/megamoe/build.sh); tokenspeed-deepgemm -> /tmp/tsdg-site (both are `deep_gemm`,
#            so they never share a process)
#   warm     MegaMoE's JIT compiles for every shape and size, all sizes of a shape at once (16 cores); a broken
#            build shows here first (every process prints its error)
#   check    correctness: both shapes at 64 tokens, symmring builtin (batch) and MegaMoE vs the reference
#   anchor   the table: symmring builtin (batch, streamed) and MegaMoE, 1..8192 tokens (anchor.json)
#   dgengine symmring's DeepGEMM engine (tokenspeed-deepgemm) on the same seeded inputs, no MegaMoE
#            (anchor_dgengine.json)
# "quick" runs install and check (V4-Flash-like, 64 tokens: one JIT compile) only. Files under $OUT: run_anchor.log, the step logs, anchor*.json (<= 8).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/megamoe-jit}" SYMMRING_TIMEOUT_S="${SYMMRING_TIMEOUT_S:-10}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/megamoe-triton}"
PY="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"
# _C.so needs libnvrtc/libcublas(Lt)/libcudart .so.13: torch's own are loaded first; the toolkit's as a fallback.
if command -v nvcc >/dev/null; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$(dirname "$(command -v nvcc)")")/lib64"
fi
exec > >(tee -a "$OUT/run_anchor.log") 2>&1
T0=$SECONDS
summary=()
step() {  # step NAME LIMIT_S CMD... (CMD may be a function of this script: run in a child bash)
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  if declare -F "$1" >/dev/null; then
    timeout --signal=TERM --kill-after=10 "$limit" bash -c "$(declare -p ANCHOR PY 2>/dev/null); $(declare -f "$1"); \"\$@\"" \
      _ "$@" >"$OUT/$name.log" 2>&1
  else
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  fi
  local rc=$?
  summary+=("$(printf '%-9s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -aE 'rows,|NOT OK|Error|error|load.py|symbols' "$OUT/$name.log" | tail -n 1 | cut -c1-150)")")
  echo "--- $name rc=$rc ($((SECONDS - t0)) s)"
  tail -n 40 "$OUT/$name.log"
  return $rc
}
install() {
  set -e
  mkdir -p /tmp/site /tmp/tsdg-site
  nv=$(ls .whl/nvshmem4py_cu13-*.whl 2>/dev/null | head -n 1)
  if [[ -n "$nv" ]] && ! "$PY" -c "import nvshmem" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$nv"
  fi
  ts=$(ls .whl/tokenspeed_deepgemm-*.whl 2>/dev/null | head -n 1)
  if [[ -n "$ts" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tsdg-site "$ts"
  fi
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  command -v nvcc && nvcc --version | tail -n 1
  bash tools/megamoe/build.sh /tmp/megamoe-site
}
step install 120 install || echo "install failed: see $OUT/install.log"
MEGA="/tmp/megamoe-site:/tmp/site:$PWD"
# --max-tokens 8192 everywhere: it is part of MegaMoE's kernel template, so warm, check and anchor share compiles.
ANCHOR=(env PYTHONPATH="$MEGA" "$PY" -m symmring bench moe --anchor megamoe --max-tokens 8192)
warm() {  # all sizes of a shape at once (one process each: DeepGEMM's JIT runs nvcc in the calling thread)
  local shape pids=() n
  trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM INT
  for shape in "$@"; do
    pids=()
    for n in 1 8 64 512 4096 8192; do
      "${ANCHOR[@]}" --warm-only --engines none --shapes "$shape" --tokens "$n" &
      pids+=($!)
    done
    wait "${pids[@]}"
  done
}
if [[ "${1:-}" == quick ]]; then
  step check 300 "${ANCHOR[@]}" --shapes v4-flash --tokens 64 --engines builtin --modes batch --check-only \
    --json "$OUT/anchor_check.json"
else
  step warm 270 warm v4-flash deepseek-v3
  step check 90 "${ANCHOR[@]}" --tokens 64 --engines builtin --modes batch --check-only \
    --json "$OUT/anchor_check.json"
  left=$((525 - (SECONDS - T0)))
  if (( left > 60 )); then
    step anchor $((left - 40)) "${ANCHOR[@]}" --engines builtin --repeats 10 --json "$OUT/anchor.json"
  else
    echo "anchor: skipped, ${left}s left"
  fi
  left=$((555 - (SECONDS - T0)))
  if (( left > 30 )) && [[ -d /tmp/tsdg-site/deep_gemm ]]; then
    step dgengine "$left" env PYTHONPATH="/tmp/tsdg-site:/tmp/site:$PWD" "$PY" -m symmring bench moe \
      --anchor megamoe --max-tokens 8192 --engines deepgemm --no-megamoe --repeats 10 \
      --json "$OUT/anchor_dgengine.json"
  fi
fi
echo "=== summary ($((SECONDS - T0)) s)"
printf '%s\n' "${summary[@]}"
