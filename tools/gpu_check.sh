#!/usr/bin/env bash
# tools/gpu_check.sh -- everything symmring checks on a GPU machine (one node), stage by stage.
#
#   tools/gpu_check.sh [stage|preset ...]     (default: the preset "tests")
#
# presets (each sized for one device call of at most 10 minutes, with a warm kernel cache; every call starts a
# bare machine):
#   tests     env compile kernels pe1 pe2 pe4         every GPU test on 1, 2 and 4 PEs (MPS): four calls' worth,
#   kernels, tests1, tests2, tests4                   so also one preset per part (env compile kernels|peN)
#   extra     env compile slow blocking blocking2     1000 graph replays; serialized kernels
#   flat      env compile flat1                       10,000 cached calls: device memory flat (one PE)
#   bench     env compile gemm moe                    the fp8 GEMM sweep and the layer benchmark
#   stream    env compile stream stream_graph         streamed vs batch (eager, CUDA graphs)
#   torch     env compile torchrun2 torchrun3 launchers   the ranks under torchrun (issue 36)
# stages:
#   env       GPU, driver, nvcc, packages; nvshmem4py from .whl/ into /tmp/site when missing
#   compile   python -m symmring.jit: every device/ module and tests/gpu/user_kernels.cu (sm_90)
#   kernels   the pure-kernel files (test_fp8_kernels.py, test_fp8_small.py: Triton compiles every
#             configuration they cover, several minutes), one PE
#   pe1       pytest tests/gpu but those, one PE (-m "not slow")
#   pe2, pe4  the same under python -m symmring.launch -n 2|4 --mps (one GPU shared under CUDA MPS)
#   slow      the -m slow tests (1000 graph replays with fresh inputs, each bitwise equal to eager), but
#             test_moe_bounds.py's (the flat stages)
#   flat1, flat3  tests/gpu/test_moe_bounds.py -m slow on 1 PE, or 3 under MPS: 10,000 cached calls through a
#             2-graph cache, memory_allocated / split-K counters / workspace bytes flat ("[figure] bounds memory")
#   torchrun2, torchrun3   the workspace, device-count, serving-safety, modules-before-calls and vLLM adapter
#             tests under python -m symmring.launch -n 2|3 --mps --torchrun (the PEs a torch.distributed group)
#   launchers tests/gpu/test_launchers.py, one process (it starts the jobs): mpirun vs torchrun bitwise on 2
#             and 3 PEs; two groups of a 4-PE torchrun job vs 2-PE jobs
#   blocking  CUDA_LAUNCH_BLOCKING=1, one PE: two-stream ring kernels, schedules, graph replay, fp8 windows
#   blocking2 CUDA_LAUNCH_BLOCKING=1 with 2 PEs: the two-stream ring kernels
#   faults    tests/gpu/test_layer_faults.py: late/exiting/stalled PE jobs of 2 and 4 PEs (MPS), one process
#             (it starts the jobs); one json per case in $OUT/faults
#   protocol  python -m symmring bench protocol on 1 and 2 PEs (bench_protocol_*pe.json)
#   gemm      python -m symmring bench gemm (bench_gemm.json)
#   moe       python -m symmring bench moe, bf16 and fp8 engines (bench_moe.json, bench_moe.png)
#   decode    python -m symmring bench moe --decode, 1-128 tokens, small-batch vs general (bench_decode.json)
#   stream, stream_graph   python -m symmring bench stream, eager and from graphs (bench_stream*.json)
#   compare   tools/compare_prev.py against $PREV (a copy of an earlier commit's package: see its --help)
#
# One log, $OUT/gpu_check.log (OUT defaults to ./out); a summary table is printed last. Kernel caches
# (symmring's cubins, Triton's and DeepGEMM's JIT) live under $CACHE (default /tmp/symmring-gpu-cache); with
# CACHE_TGZ=path a tarball of them is restored before and written after, so a later call skips the
# compiles. Each stage runs under its own `timeout`; a hung wait becomes a ProtocolTimeout after
# SYMMRING_TIMEOUT_S (10 s here), a hung host collective a PeerTimeout after SYMMRING_HOST_TIMEOUT_S (300 s
# here: a PE's first Triton compile may keep the others waiting in the next exchange for minutes).
set -uo pipefail
# OUT, PY, the GPU environment (symmring.env.GPU_ENV), PYTHONPATH, SYMMRING_CACHE_DIR, install_nvshmem4py.
CACHE="${CACHE:-/tmp/symmring-gpu-cache}"
export SYMMRING_CACHE_DIR="${SYMMRING_CACHE_DIR:-$CACHE/symmring}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CACHE/triton}" DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-$CACHE/deep_gemm}"
source "$(dirname "$0")/gpu_common.sh"
export SYMMRING_TIMEOUT_S="${SYMMRING_TIMEOUT_S:-10}"
export SYMMRING_HOST_TIMEOUT_S="${SYMMRING_HOST_TIMEOUT_S:-300}"
LOG="$OUT/gpu_check.log"
install_nvshmem4py
if [[ -n "${CACHE_TGZ:-}" && -f "$CACHE_TGZ" ]]; then tar -xzf "$CACHE_TGZ" -C / 2>/dev/null || true; fi
# -o faulthandler_timeout: a test that hangs dumps every thread's stack into the log before the stage limit.
PYTEST_OPTS=(-q -s -p no:cacheprovider -rfEs -W ignore::DeprecationWarning --color=no -o faulthandler_timeout=120)
PYTEST=("$PY" -m pytest "${PYTEST_OPTS[@]}" --timeout 150)
MPI_PYTEST=("$PY" -m mpi4py -m pytest "${PYTEST_OPTS[@]}" --timeout 150 --maxfail 8)
LAUNCH=("$PY" -m symmring.launch --mps)

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
  line=$(tail -n "+$first" "$LOG" | grep -aE "passed|failed|error|skipped|measurements|problems|compare:" | tail -n 1)
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$line")")
  echo "--- $name rc=$rc ($((SECONDS - t0)) s)" | tee -a "$LOG"
  tail -n 12 "$LOG"
}

run_env() {
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2
  "$PY" -c "import sys, cupy, torch, triton, mpi4py, nvshmem, numpy; from importlib import metadata as m; \
print(sys.version.split()[0], 'cupy', cupy.__version__, 'torch', torch.__version__, 'triton', triton.__version__, \
'mpi4py', mpi4py.__version__, 'nvshmem4py', m.version('nvshmem4py-cu13'), 'nvidia-nvshmem', m.version('nvidia-nvshmem-cu13'))"
  "$PY" -c "from symmring.moe.engines import deepgemm; print('DeepGEMM:', deepgemm.deepgemm_status()[1])"
  command -v nvidia-cuda-mps-control mpirun
}

run_compile() {  # every module, in parallel, into the cache (the tests and benchmarks then load them)
  "$PY" -m symmring.jit --workers 8 tests/gpu/user_kernels.cu=user_kernels
}

steps=()
for a in "${@:-tests}"; do
  case $a in
    tests) steps+=(env compile kernels1 pe1 pe2 pe4) ;;
    tests1|tests2|tests4) steps+=(env compile "pe${a#tests}") ;;
    kernels) steps+=(env compile kernels1) ;;
    extra) steps+=(env compile slow blocking blocking2) ;;
    flat) steps+=(env compile flat1) ;;
    bench) steps+=(env compile gemm moe) ;;
    stream) steps+=(env compile stream stream_graph) ;;
    torch) steps+=(env compile torchrun2 torchrun3 launchers) ;;
    *) steps+=("$a") ;;
  esac
done
KERNEL_ONLY=(--ignore tests/gpu/test_fp8_kernels.py --ignore tests/gpu/test_fp8_small.py)
TORCHRUN_FILES=(tests/gpu/test_modules_before_calls.py tests/gpu/test_workspace.py tests/gpu/test_device_counts.py
                tests/gpu/test_serving_safety.py tests/gpu/test_vllm_adapter_gpu.py)
STREAM=(--tokens 1024,4096,16384 --tokens-per-slot 1024,2048,4096 --num-slots 2,call --windows 1,all --repeats 10)
for s in "${steps[@]}"; do
  case "$s" in
    env) stage env 60 run_env ;;
    compile) stage compile 200 run_compile ;;
    # The pure-kernel files (no peer) run on one PE only, in a stage of their own.
    kernels1) stage kernels 540 "${PYTEST[@]}" tests/gpu/test_fp8_kernels.py tests/gpu/test_fp8_small.py -m "not slow" ;;
    pe1) stage pe1 480 "${PYTEST[@]}" tests/gpu -m "not slow" "${KERNEL_ONLY[@]}" ;;
    pe2) stage pe2 480 "${LAUNCH[@]}" -n 2 -- "${MPI_PYTEST[@]}" tests/gpu -m "not slow" "${KERNEL_ONLY[@]}" ;;
    pe4) stage pe4 480 "${LAUNCH[@]}" -n 4 -- "${MPI_PYTEST[@]}" tests/gpu -m "not slow" "${KERNEL_ONLY[@]}" ;;
    slow) stage slow 200 "${PYTEST[@]}" tests/gpu -m slow --ignore tests/gpu/test_moe_bounds.py ;;
    flat1) stage flat1 540 "${PYTEST[@]}" --timeout 900 tests/gpu/test_moe_bounds.py -m slow ;;
    flat3) stage flat3 540 "${LAUNCH[@]}" -n 3 -- "${MPI_PYTEST[@]}" --timeout 900 tests/gpu/test_moe_bounds.py -m slow ;;
    torchrun2|torchrun3) stage "$s" 480 "${LAUNCH[@]}" --torchrun -n "${s#torchrun}" -- "${PYTEST[@]}" --maxfail 8 \
                           "${TORCHRUN_FILES[@]}" -m "not slow" ;;
    launchers) stage launchers 580 "${PYTEST[@]}" --timeout 560 tests/gpu/test_launchers.py ;;
    blocking) CUDA_LAUNCH_BLOCKING=1 stage blocking 120 "${PYTEST[@]}" -m "not slow" tests/gpu/test_kernels.py \
                tests/gpu/test_moe_streamed.py tests/gpu/test_moe_fp8.py \
                -k "two_streams or random_delays or schedules or token_counts or whole_window or graph_replay_matches" ;;
    blocking2) CUDA_LAUNCH_BLOCKING=1 stage blocking2 90 "${LAUNCH[@]}" -n 2 -- "${MPI_PYTEST[@]}" tests/gpu/test_kernels.py -k "two_streams" ;;
    faults) SYMMRING_FAULT_REPORT="$OUT/faults" stage faults 330 "${PYTEST[@]}" --timeout 300 \
              tests/gpu/test_layer_faults.py ;;
    protocol)
      stage protocol1 60 "$PY" -m symmring bench protocol --json "$OUT/bench_protocol_1pe.json"
      stage protocol2 60 "${LAUNCH[@]}" -n 2 -- "$PY" -m symmring bench protocol --json "$OUT/bench_protocol_2pe.json" ;;
    gemm) stage gemm 230 "$PY" -m symmring bench gemm --budget-s 190 --json "$OUT/bench_gemm.json" ;;
    moe) stage moe 330 "$PY" -m symmring bench moe --tokens "${MOE_TOKENS:-1,8,64,256,1024,4096,16384}" --repeats 5 \
           --json "$OUT/bench_moe.json" --plot "$OUT/bench_moe.png" ;;
    decode) stage decode 300 "$PY" -m symmring bench moe --decode --repeats 10 --json "$OUT/bench_decode.json" ;;
    stream) stage stream 300 "$PY" -m symmring bench stream "${STREAM[@]}" --ack early,conservative --spin-check \
              --json "$OUT/bench_stream.json" --timeline "$OUT/timeline.png" ;;
    stream_graph) stage stream_graph 250 "$PY" -m symmring bench stream "${STREAM[@]}" --ack early --graph \
                    --json "$OUT/bench_stream_graph.json" ;;
    compare) stage compare 240 "$PY" tools/compare_prev.py --prev "${PREV:?set PREV to the earlier package copy}" \
               --json "$OUT/compare.json" ;;
    *) echo "unknown stage $s (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [[ -n "${CACHE_TGZ:-}" ]]; then tar -czf "$OUT/$(basename "$CACHE_TGZ")" "$CACHE" 2>/dev/null || true; fi
echo
echo "==================== gpu_check summary ($(date -u +%FT%TZ))"
printf '%s\n' "${summary[@]}"
grep -ahE "^\[figure\]|^(soak|graph replay)|publish->observe|compare: |bitwise equal to the previous" "$LOG" | sort -u | head -40
