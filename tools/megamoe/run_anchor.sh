#!/usr/bin/env bash
# tools/megamoe/run_anchor.sh -- the MegaMoE anchor in ONE device call on the H200 (about 9 minutes at most):
#
#   OUT=$OUT bash tools/megamoe/run_anchor.sh [quick|dgengine]
#
# needs .whl/ (nvshmem4py_cu13-0.4.1 and, for symmring's DeepGEMM engine, tokenspeed_deepgemm-2.5.0.post20260424
# wheels: tools/megamoe/fetch_wheels.sh) and .megamoe/ (DeepGEMM's MegaMoE source and its prebuilt _C:
# tools/megamoe/prepare_src.sh) carried. Steps, each under `timeout`, logged to $OUT/<step>.log (tail printed),
# a summary last:
#   install  nvshmem4py -> /tmp/site; tokenspeed-deepgemm -> /tmp/tsdg-site; MegaMoE -> /tmp/megamoe-site
#            (tools/megamoe/build.sh: the carried _C, or compiled there when it does not import)
#   jit      (before warm, in this log) symmring's device modules built ahead (python -m symmring.jit, several nvcc
#            at once), so the check's process does not build them one by one
#   warm     MegaMoE's JIT compiles for every shape and size, the sizes of a shape side by side (as many
#            processes as the free GPU memory holds); a broken build shows here first (every process prints
#            its error)
#   check    correctness: every shape at 64 tokens, symmring builtin (batch) and MegaMoE vs the reference
#   anchor   the table: symmring builtin (batch, streamed) and MegaMoE, 1..8192 tokens (anchor.json), each shape
#            and size in a process of its own (ANCHOR_SPLIT=size, the default; "shape": a process per shape;
#            "none": one process): a row's time depends on what ran before it in a process (the fused rows of a
#            second shape ran up to 1.7x slower, docs/PERFORMANCE.md "session 22"); the runs' results are merged
#            (bench moe --anchor --merge) after each
#   dgengine symmring's DeepGEMM engine (tokenspeed-deepgemm, a `deep_gemm` of its own) on the same seeded
#            inputs, no MegaMoE (anchor_dgengine.json), with the time left (at least 60 s); "dgengine" as the
#            argument runs install and this step alone with 480 s (a second call)
# "quick" runs install and check (V4-Flash-like, 64 tokens: one JIT compile) only. ANCHOR_ENGINES (default
# builtin; e.g. builtin,fused) and ANCHOR_MODES (default batch,streamed; e.g. batch,graph) choose the anchor's symmring
# rows, ANCHOR_SHAPES (default v4-flash,deepseek-v3) its shapes (warm, check and table), ANCHOR_TOKENS (default
# 1,8,64,512,4096,8192) its sizes (warm and table), ANCHOR_ARGS more options of the table (e.g. --timeline);
# ANCHOR_BUDGET_S (default 525) is when the anchor step must end, counted from this script's start; ANCHOR_DGENGINE=0
# leaves out the dgengine step. While the anchor step runs, nvidia-smi samples the SM clock and power once a second;
# run_anchor.log gets their range ("anchor clocks: ..."). Files under $OUT (8 at most): run_anchor.log, install.log, warm.log, check.log,
# anchor.log, dgengine.log, anchor.json, anchor_dgengine.json.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/megamoe-jit}" SYMMRING_TIMEOUT_S="${SYMMRING_TIMEOUT_S:-10}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/megamoe-triton}" SYMMRING_CACHE_DIR="${SYMMRING_CACHE_DIR:-/tmp/megamoe-symcache}"
PY="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"
# The project's GPU environment (symmring.env.GPU_ENV through the launcher, as tools/gpu_common.sh does).
eval "$(SYMMRING_PYTHON="$PY" bash launch/symmring-mpirun --print-env)"
# megamoe_dg's _C needs libcudart/libnvrtc/libcublas(Lt).so.13: torch's pip CUDA libraries first, the toolkit's
# after (a library torch already loaded is used as it is).
nvlibs=$("$PY" -c "import glob, os, torch; s = os.path.dirname(os.path.dirname(torch.__file__)); \
print(':'.join(sorted(glob.glob(s + '/nvidia/*/lib') + glob.glob(s + '/nvidia/*/*/lib'))))" 2>/dev/null)
if command -v nvcc >/dev/null; then nvlibs="$nvlibs:$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")/lib64"; fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nvlibs"
exec > >(tee -a "$OUT/run_anchor.log") 2>&1
T0=$SECONDS
summary=()
step() {  # step NAME LIMIT_S CMD... (CMD may be a function of this script: run in a child bash)
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  if declare -F "$1" >/dev/null; then
    timeout --signal=TERM --kill-after=10 "$limit" bash -c "$(declare -p ANCHOR PY TOKENS 2>/dev/null); $(declare -f "$1"); \"\$@\"" \
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
  ldd --version | head -n 1
  bash tools/megamoe/build.sh /tmp/megamoe-site
}
step install 200 install || echo "install failed: see $OUT/install.log"
MEGA="/tmp/megamoe-site:/tmp/site:$PWD"
# --max-tokens 8192 everywhere: it is part of MegaMoE's kernel template, so warm, check and anchor share compiles.
ANCHOR=(env PYTHONPATH="$MEGA" "$PY" -m symmring bench moe --anchor megamoe --max-tokens 8192)
warm() {  # the sizes of a shape side by side (one process each: DeepGEMM's JIT runs nvcc in the calling thread),
  # as many at once as the free GPU memory holds (each process holds the shape's fp8 experts: DeepSeek-V3-like
  # 11 GiB, and six of them ran out of an H100's 80 GB)
  local shape pids=() n jobs
  trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM INT
  for shape in "$@"; do
    jobs=$(PYTHONPATH="$PWD" "$PY" -c "import torch; from symmring.bench.moe_anchor import warm_processes; \
print(warm_processes('$shape', torch.cuda.mem_get_info()[0]))")
    echo "warm $shape: ${jobs:-1} processes at once"
    pids=()
    for n in ${TOKENS//,/ }; do
      "${ANCHOR[@]}" --warm-only --engines none --shapes "$shape" --tokens "$n" &
      pids+=($!)
      if (( ${#pids[@]} >= ${jobs:-1} )); then wait "${pids[@]}"; pids=(); fi
    done
    (( ${#pids[@]} )) && wait "${pids[@]}"
  done
  return 0
}
table() {  # table SPLIT SHAPES TOKENS JSON ROW_OPTIONS...: the table's rows in processes of their own (SPLIT: size,
  # shape or none), each writing its results beside the others, all of them merged into JSON before and after each
  # run. A run's file starts as a stub that says it is not complete, so a run that fails before its first row, or
  # that the step's limit cuts, leaves the merged results not complete (with its rows so far, where it wrote any).
  local split=$1 shapes=$2 tokens=$3 json=$4; shift 4
  local runs=() run s n i=0 rc=0 dir file
  case "$split" in
    size) for s in ${shapes//,/ }; do for n in ${tokens//,/ }; do runs+=("$s:$n"); done; done ;;
    shape) for s in ${shapes//,/ }; do runs+=("$s:$tokens"); done ;;
    none) runs=("$shapes:$tokens") ;;
    *) echo "ANCHOR_SPLIT=$split: expected size, shape or none"; return 2 ;;
  esac
  dir=$(mktemp -d)
  for run in "${runs[@]}"; do
    i=$((i + 1))
    file="$dir/$(printf %02d $i).json"
    printf '{"anchor": "megamoe", "rows": [], "megamoe": {}, "argv": [], "complete": false, "skipped": [{"shape": "%s", "impl": "*", "reason": "run %d of %d (--tokens %s) wrote no results: it failed before its first row or did not finish"}]}\n' \
      "${run%%:*}" "$i" "${#runs[@]}" "${run#*:}" > "$file"
    "${ANCHOR[@]}" --merge "$dir"/*.json --json "$json" >/dev/null
    echo "--- run $i of ${#runs[@]}: --shapes ${run%%:*} --tokens ${run#*:}"
    "${ANCHOR[@]}" --shapes "${run%%:*}" --tokens "${run#*:}" "$@" --json "$file" || rc=$?
    "${ANCHOR[@]}" --merge "$dir"/*.json --json "$json" >"$dir/table.txt"
  done
  cat "$dir/table.txt"  # the last merge's table: every run's rows
  rm -rf "$dir"
  return $rc
}
# Without MegaMoE (its build failed: install.log says why) the steps still give the symmring rows.
NOMEGA=()
if ! env PYTHONPATH="$MEGA" "$PY" -c "import megamoe_dg" >/dev/null 2>&1; then
  NOMEGA=(--no-megamoe)
  echo "MegaMoE does not import: symmring rows only (see $OUT/install.log)"
fi
if [[ "${1:-}" == dgengine ]]; then  # a call of its own: symmring's DeepGEMM engine with the whole budget
  step dgengine 480 env PYTHONPATH="/tmp/tsdg-site:/tmp/site:$PWD" "$PY" -m symmring bench moe \
    --anchor megamoe --max-tokens 8192 --engines deepgemm --no-megamoe --repeats 10 \
    --json "$OUT/anchor_dgengine.json"
elif [[ "${1:-}" == quick ]]; then
  step check 300 "${ANCHOR[@]}" --shapes v4-flash --tokens 64 --engines builtin --modes batch --check-only \
    "${NOMEGA[@]}"
else
  SHAPES="${ANCHOR_SHAPES:-v4-flash,deepseek-v3}"
  TOKENS="${ANCHOR_TOKENS:-1,8,64,512,4096,8192}"
  t=$SECONDS  # symmring's modules built ahead, several nvcc at once (its log not kept: at most 8 files come back)
  timeout 150 env PYTHONPATH="/tmp/site:$PWD" "$PY" -m symmring.jit --workers 8 >/dev/null 2>&1
  echo "=== jit: symmring's modules rc=$? ($((SECONDS - t)) s)"
  (( ${#NOMEGA[@]} )) || step warm 240 warm ${SHAPES//,/ }
  step check 150 "${ANCHOR[@]}" --shapes "$SHAPES" --tokens 64 --engines builtin --modes batch --check-only \
    "${NOMEGA[@]}"
  check_rc=$?
  # A MegaMoE call that never returned (symmring's row there, MegaMoE's not) would stall the table: leave it out.
  # One that crashed the process (rc 139) would end the table's process too.
  if (( check_rc == 124 || check_rc == 137 || check_rc == 139 )) \
      && grep -q "symmring builtin batch:" "$OUT/check.log" && ! grep -q " megamoe:" "$OUT/check.log"; then
    NOMEGA=(--no-megamoe)
    echo "MegaMoE did not return within the check (rc $check_rc): the table without it"
  fi
  left=$((${ANCHOR_BUDGET_S:-525} - (SECONDS - T0)))
  if (( left > 60 )); then
    # The card's SM clock and power once a second while the table runs (a long run at full load may slow the card:
    # the table's context), summarised into this log afterwards.
    clocks=$(mktemp)
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 1000 >"$clocks" 2>/dev/null &
    watcher=$!
    # shellcheck disable=SC2086  # ANCHOR_ARGS: extra options, split on spaces
    step anchor $((left - 40)) table "${ANCHOR_SPLIT:-size}" "$SHAPES" "$TOKENS" "$OUT/anchor.json" \
      --engines "${ANCHOR_ENGINES:-builtin}" --repeats 10 "${NOMEGA[@]}" ${ANCHOR_ARGS:-} \
      ${ANCHOR_MODES:+--modes "$ANCHOR_MODES"}
    kill "$watcher" 2>/dev/null
    wait "$watcher" 2>/dev/null
    sort -t, -k1,1n "$clocks" | awk -F', *' 'NF >= 2 && $1 ~ /^[0-9]/ { c[n++] = $1; p = ($2 > p ? $2 : p) }
      END { if (n) printf "anchor clocks: SM %d-%d MHz (median %d) over %d s, power up to %.0f W\n",
                         c[0], c[n - 1], c[int(n / 2)], n, p; else print "anchor clocks: no samples" }'
    rm -f "$clocks"
  else
    echo "anchor: skipped, ${left}s left"
  fi
  left=$((${ANCHOR_BUDGET_S:-525} + 30 - (SECONDS - T0)))
  if (( left > 60 )) && [[ -d /tmp/tsdg-site/deep_gemm && "${ANCHOR_DGENGINE:-1}" != 0 ]]; then
    step dgengine "$left" env PYTHONPATH="/tmp/tsdg-site:/tmp/site:$PWD" "$PY" -m symmring bench moe \
      --anchor megamoe --max-tokens 8192 --engines deepgemm --no-megamoe --repeats 10 \
      --json "$OUT/anchor_dgengine.json"
  fi
fi
rm -f "$OUT"/*.tmp  # an interrupted JSON write (at most 8 files come back)
echo "=== summary ($((SECONDS - T0)) s)"
printf '%s\n' "${summary[@]}"
