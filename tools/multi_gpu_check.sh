#!/usr/bin/env bash
# Issue 7 (multi-gpu): the GPU suites and benchmarks with one PE per GPU over real NVLink. Logs and JSON
# under $OUT (default ./out).
#
#   tools/multi_gpu_check.sh [N]        N PEs, one per GPU (default: every GPU nvidia-smi lists)
#
# NOT YET RUN: no machine with several GPUs was lent (2026-11-29; the device tool listed only
# nvidia-h200). Every step below ran on one H200 with several PEs under CUDA MPS; here the same commands
# run without --mps, one PE per GPU (python -m symmring.launch maps local rank i to GPU i).
#
#   env       GPUs, NVLink topology (nvidia-smi topo -m), packages; nvshmem4py from .whl/ if missing
#   compile   python -m symmring.jit: every device/ module + the test kernels into $SYMMRING_CACHE_DIR
#   tests     pytest tests/gpu on N PEs (ring, soak, runtime, host Ring on NVSHMEM, batch and streamed MoE)
#   protocol  bench protocol: publish->observe across GPUs, slot pull vs the peer-to-peer copy of the
#             same bytes (bench_protocol.json)
#   stream    bench stream, eager and from CUDA graphs, 4096 and 16384 tokens per rank, three shapes
#             (bench_stream.json, bench_stream_graph.json, timeline.png)
#
# NVLink multicast stays off everywhere (NVSHMEM_DISABLE_NVLS, NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_...).
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
export SYMMRING_TIMEOUT_S="${SYMMRING_TIMEOUT_S:-10}"
N="${1:-$(nvidia-smi -L | wc -l)}"
LAUNCH=("$PY" -m symmring.launch -n "$N" --)

install_nvshmem4py
{ nvidia-smi -L; nvidia-smi topo -m; "$PY" -m symmring info; } >"$OUT/env.log" 2>&1
cat "$OUT/env.log"
[ "$N" -ge 2 ] || { echo "multi_gpu_check: $N GPU(s); this check needs at least 2"; exit 2; }

step compile 200 "$PY" -m symmring.jit tests/gpu/user_kernels.cu=user_kernels
step tests 400 "${LAUNCH[@]}" "$PY" -m mpi4py -m pytest tests/gpu -q -p no:cacheprovider -rfEs --color=no \
  --timeout 300 -m "not slow"
step protocol 200 "${LAUNCH[@]}" "$PY" -m symmring bench protocol --json "$OUT/bench_protocol.json"
STREAM=(--tokens 4096,16384 --tokens-per-slot 1024,2048,4096 --num-slots 2,call --windows 1,all --repeats 10)
step stream 500 "${LAUNCH[@]}" "$PY" -m symmring bench stream "${STREAM[@]}" --ack early,conservative \
  --json "$OUT/bench_stream.json" --timeline "$OUT/timeline.png"
step stream_graph 400 "${LAUNCH[@]}" "$PY" -m symmring bench stream "${STREAM[@]}" --ack early --graph \
  --json "$OUT/bench_stream_graph.json"

echo "=== summary ($N PEs, one per GPU)"
printf '%s\n' "${summary[@]}"
