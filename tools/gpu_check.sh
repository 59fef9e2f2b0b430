#!/usr/bin/env bash
# tools/gpu_check.sh -- everything symmring checks on a GPU machine, in one command.
#
#   tools/gpu_check.sh [stage ...]      (default: all stages, in this order)
#
# stages: env compile pe1 blocking pe2 pe4 blocking2 bench
#   env       GPU, driver, nvcc, Python packages
#   compile   JIT-compile every device/ module and tests/gpu/user_kernels.cu into $SYMMRING_CACHE_DIR
#   pe1       pytest tests/gpu with one PE
#   blocking  CUDA_LAUNCH_BLOCKING=1, one PE: the two-stream tests complete when serialized
#   pe2, pe4  tests/gpu with 2 and 4 PEs on the GPU(s) under CUDA MPS (python -m symmring.launch --mps)
#   blocking2 CUDA_LAUNCH_BLOCKING=1 with 2 PEs (serialized kernels on every PE still complete)
#   bench     python -m symmring bench protocol, 1 PE and 2 PEs (MPS); JSON under $OUT
#
# Logs go to $OUT/gpu_check.log (OUT defaults to ./out); a summary table is printed last.
# nvshmem4py is installed from .whl/ into /tmp/site when it is not importable (the device machine has no
# package index). Each stage runs under its own `timeout`.
set -uo pipefail
# OUT, PY, the GPU environment (symmring.env.GPU_ENV), PYTHONPATH, SYMMRING_CACHE_DIR, install_nvshmem4py.
source "$(dirname "$0")/gpu_common.sh"
LOG="$OUT/gpu_check.log"
install_nvshmem4py
# The GPU tests of the runtime (GPU_TESTS overrides, e.g. GPU_TESTS=tests/gpu for every GPU test).
read -r -a TESTS <<<"${GPU_TESTS:-tests/gpu/test_runtime.py tests/gpu/test_kernels.py tests/gpu/test_soak.py tests/gpu/test_ring_gpu.py}"
# -o faulthandler_timeout: a test that hangs dumps every thread's stack into the log before the stage limit.
PYTEST_OPTS=(-q -s -p no:cacheprovider -rfEs -W ignore::DeprecationWarning --color=no -o faulthandler_timeout=100)
PYTEST=("$PY" -m pytest "${PYTEST_OPTS[@]}")
MPI_PYTEST=("$PY" -m mpi4py -m pytest "${PYTEST_OPTS[@]}")

stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS first
  echo "=== $name: $*" | tee -a "$LOG"
  first=$(($(wc -l <"$LOG") + 1))
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
    timeout --signal=TERM --kill-after=15 "$limit" bash -c "$(declare -f "$1"); PY='$PY'; $1" >>"$LOG" 2>&1
  else
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  fi
  local rc=$?
  local line
  line=$(tail -n "+$first" "$LOG" | grep -aE "passed|failed|error|skipped" | tail -n 1)
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$line")")
  echo "--- $name rc=$rc ($((SECONDS - t0)) s)" | tee -a "$LOG"
  tail -n 15 "$LOG"
}

run_env() {
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2
  "$PY" -c "import sys, cupy, torch, mpi4py, nvshmem, numpy; from importlib import metadata as m; \
print(sys.version.split()[0], 'cupy', cupy.__version__, 'torch', torch.__version__, 'mpi4py', mpi4py.__version__, \
'nvshmem4py', m.version('nvshmem4py-cu13'), 'nvidia-nvshmem', m.version('nvidia-nvshmem-cu13'))"
  "$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
  command -v nvidia-cuda-mps-control mpirun
}

run_compile() {  # every module, in parallel, into the cache (the tests and benchmarks then load them)
  "$PY" -m symmring.jit tests/gpu/user_kernels.cu=user_kernels
}

stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(env compile pe1 blocking pe2 pe4 blocking2 bench)
for s in "${stages[@]}"; do
  case "$s" in
    env) stage env 60 run_env ;;
    compile) stage compile 200 run_compile ;;
    pe1) stage pe1 150 "${PYTEST[@]}" "${TESTS[@]}" ;;
    blocking) CUDA_LAUNCH_BLOCKING=1 stage blocking 90 "${PYTEST[@]}" tests/gpu/test_kernels.py -k "two_streams or random_delays" ;;
    pe2) stage pe2 170 "$PY" -m symmring.launch -n 2 --mps -- "${MPI_PYTEST[@]}" "${TESTS[@]}" ;;
    pe4) stage pe4 170 "$PY" -m symmring.launch -n 4 --mps -- "${MPI_PYTEST[@]}" "${TESTS[@]}" ;;
    blocking2) CUDA_LAUNCH_BLOCKING=1 stage blocking2 90 "$PY" -m symmring.launch -n 2 --mps -- "${MPI_PYTEST[@]}" tests/gpu/test_kernels.py -k "two_streams" ;;
    bench)
      stage bench1 60 "$PY" -m symmring.bench.protocol --json "$OUT/bench_1pe.json"
      stage bench2 60 "$PY" -m symmring.launch -n 2 --mps -- "$PY" -m symmring.bench.protocol --json "$OUT/bench_2pe.json" ;;
    *) echo "unknown stage $s" >&2 ;;
  esac
done
echo
echo "==================== gpu_check summary ($(date -u +%FT%TZ))"
printf '%s\n' "${summary[@]}"
grep -ahE "^(soak|graph replay)|publish->observe|pull, |copy \(D2D" "$LOG" | sort -u
