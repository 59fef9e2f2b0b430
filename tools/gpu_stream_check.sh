#!/usr/bin/env bash
# GPU checks of the STREAMED MoE layer (symmring.moe.gpu_streamed), with the batch layer's tests (they share
# device/dispatch.cu): two device calls (presets). Logs under $OUT.
#
#   tools/gpu_stream_check.sh [step|preset ...]       (default: the preset "tests")
#
# presets (each sized to fit one 600 s device call; every call starts a bare machine, so each re-runs
# env and compile):
#   tests     env compile pe1 blocking pe2 pe4           (call 1)
#   bench     env compile bench1 graph1 bench4           (call 2)
#   soak      env compile slow                           (optional: the 1000-replay graph test)
#
#   env       GPU, packages; installs nvshmem4py from .whl/ into /tmp/site when it is not importable
#   compile   python -m symmring.jit: every device/ module (sm_90) into $SYMMRING_CACHE_DIR
#   pe1       pytest tests/gpu/test_moe_streamed.py and test_moe_batch.py, 1 PE
#   blocking  CUDA_LAUNCH_BLOCKING=1, 1 PE: the schedules tests and two token counts (serialized kernels)
#   pe2, pe4  both test files with 2 and 4 PEs on the GPU under CUDA MPS
#   slow      the 1000-replay graph test (-m slow), 1 PE
#   bench1    python -m symmring bench stream, 1 PE: side-by-side ratios, policy table, timeline PNG,
#             spin check
#   graph1    the same sweep (smaller) timed from CUDA graph replays
#   bench4    4 PEs under MPS at 4096 and 16384 tokens per rank (the issue's figure)
#
# Every step is bounded by `timeout`; a hung wait becomes a ProtocolTimeout after SYMMRING_TIMEOUT_S (5 s
# here). Device `run` tool: carry [".whl"],
#   command: bash tools/gpu_stream_check.sh tests      then      bash tools/gpu_stream_check.sh bench
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
export SYMMRING_TIMEOUT_S="${SYMMRING_TIMEOUT_S:-5}"
TEST=(tests/gpu/test_moe_streamed.py tests/gpu/test_moe_batch.py)
PYTEST_OPTS=(-q -p no:cacheprovider -rfEs -W ignore::DeprecationWarning --color=no -o faulthandler_timeout=100)

run_env() {
  nvidia-smi -L
  install_nvshmem4py
  "$PY" -c "import torch, cupy, nvshmem, mpi4py; print('torch', torch.__version__, 'cupy', cupy.__version__, \
'mpi4py', mpi4py.__version__)"
}


steps=()
for a in "${@:-tests}"; do
  case $a in
    tests) steps+=(env compile pe1 blocking pe2 pe4) ;;
    bench) steps+=(env compile bench1 graph1 bench4) ;;
    soak) steps+=(env compile slow) ;;
    *) steps+=("$a") ;;
  esac
done
for s in "${steps[@]}"; do
  case $s in
    env) echo "=== env"; run_env 2>&1 | tee "$OUT/env.log" ;;
    compile) echo "=== compile"; t0=$SECONDS; timeout 150 "$PY" -m symmring.jit >"$OUT/compile.log" 2>&1; rc=$?
             summary+=("compile   rc=$rc $((SECONDS - t0))s"); tail -n 8 "$OUT/compile.log" ;;
    pe1) step pe1 150 "$PY" -m pytest "${PYTEST_OPTS[@]}" "${TEST[@]}" --timeout 120 -m "not slow" ;;
    blocking) step blocking 90 env CUDA_LAUNCH_BLOCKING=1 "$PY" -m pytest "${PYTEST_OPTS[@]}" --timeout 120 -m "not slow" \
                tests/gpu/test_moe_streamed.py -k "schedules or token_counts[300] or token_counts[1000]" ;;
    pe2) step pe2 120 "$PY" -m symmring.launch -n 2 --mps -- "$PY" -m mpi4py -m pytest "${PYTEST_OPTS[@]}" "${TEST[@]}" -m "not slow" \
           --timeout 120 --maxfail 3 ;;
    pe4) step pe4 150 "$PY" -m symmring.launch -n 4 --mps -- "$PY" -m mpi4py -m pytest "${PYTEST_OPTS[@]}" "${TEST[@]}" -m "not slow" \
           --timeout 120 --maxfail 3 ;;
    slow) step slow 300 "$PY" -m pytest "${PYTEST_OPTS[@]}" tests/gpu/test_moe_streamed.py --timeout 280 -m slow ;;
    bench1) step bench 300 "$PY" -m symmring bench stream --tokens "${BENCH_TOKENS:-1024,4096,16384}" \
             --tokens-per-slot "${BENCH_TPS:-512,1024,2048,4096}" --num-slots 2,call --windows 1,all \
             --repeats 10 --spin-check --json "$OUT/bench_stream.json" --timeline "$OUT/timeline.png" ;;
    graph1) step graph1 200 "$PY" -m symmring bench stream --graph --tokens "${BENCH_TOKENS:-1024,4096,16384}" \
             --tokens-per-slot "${BENCH_TPS:-512,1024,2048,4096}" --num-slots call --windows 1,all --ack early \
             --repeats 10 --json "$OUT/bench_stream_graph.json" ;;
    bench4) # The expert pool is sized for every rank's tokens (world_size * tokens * topk rows per PE), so
            # 4 PEs x DeepSeek-V3-like x 16384 tokens do not fit in one GPU's memory: 4096 only there.
            step bench4 150 "$PY" -m symmring.launch -n 4 --mps -- "$PY" -m symmring bench stream \
              --shapes qwen3-30b-a3b,mixtral --tokens 4096,16384 \
              --tokens-per-slot 2048,4096 --num-slots call --windows 1,all --ack early --repeats 5 --no-recheck \
              --json "$OUT/bench_stream_4pe.json"
            step bench4ds 120 "$PY" -m symmring.launch -n 4 --mps -- "$PY" -m symmring bench stream \
              --shapes deepseek-v3 --tokens 4096 \
              --tokens-per-slot 1024,2048 --num-slots call --windows 1,all --ack early --repeats 5 --no-recheck \
              --json "$OUT/bench_stream_4pe_deepseek.json" ;;
    *) echo "unknown step $s (expected env compile pe1 blocking pe2 pe4 slow bench1 graph1 bench4, or a preset)"; exit 2 ;;
  esac
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
