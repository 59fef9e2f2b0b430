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
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none CUDA_MODULE_LOADING=EAGER SYMMRING_TIMEOUT_S="${SYMMRING_TIMEOUT_S:-10}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export SYMMRING_CACHE_DIR="${SYMMRING_CACHE_DIR:-$PWD/.symcache}"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"  # absolute: mpirun's ranks get it too
N="${1:-$(nvidia-smi -L | wc -l)}"
LAUNCH=("$PY" -m symmring.launch -n "$N" --)
summary=()

step() {  # step NAME LIMIT_S CMD...: bounded, logged to $OUT/NAME.log, tail printed
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -aE "passed|failed|bench stream:|pull," "$OUT/$name.log" | tail -n 1)")")
  tail -n 25 "$OUT/$name.log"
}

if ! "$PY" -c "import nvshmem" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
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
