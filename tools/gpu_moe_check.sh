#!/usr/bin/env bash
# GPU checks of the MoE batch-ready layer, in one device call (logs under $OUT, each step bounded).
#
#   tools/gpu_moe_check.sh [quick|full]
#
# quick: compile, the 1-PE test file, a two-size benchmark.  full: the 1-PE tests, 2 and 4 PEs under MPS,
# and the benchmark sweep. Run from the repository root on the GPU machine, after the wheel prefix:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
set -u
mode=${1:-quick}
out=${OUT:-/tmp/moe_out}
mkdir -p "$out"
export NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1
export SYMMRING_CACHE_DIR=${SYMMRING_CACHE_DIR:-/tmp/symmring-cache}
# Fail fast: a hung wait becomes a ProtocolTimeout after 5 s instead of 60.
export SYMMRING_TIMEOUT_S=${SYMMRING_TIMEOUT_S:-5}

step() {  # step NAME SECONDS CMD...: run bounded, log to $out/NAME.log, print the tail
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log"
}

# Absolute interpreter: mpirun's ranks may not have the same PATH (they found /usr/bin/python3).
PY=$(command -v python3)
nvidia-smi -L
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"

# Compile every module in parallel into the cache (load_module then hits it).
step compile 120 "$PY" -m symmring.jit

step test_1pe 60 "$PY" -m pytest tests/gpu/test_moe_batch.py -q -p no:cacheprovider --timeout 120 -rs

if [ "$mode" = quick ]; then
    step bench 150 "$PY" -m symmring.bench.moe --shapes qwen3-30b-a3b,mixtral --tokens 128,4096 --repeats 10 \
        --json "$out/bench.json"
    exit 0
fi

step bench 60 "$PY" -m symmring.bench.moe --tokens "${BENCH_TOKENS:-128,1024,4096,16384}" --repeats 10 \
    --json "$out/bench.json"
step test_2pe 60 "$PY" -m symmring.launch -n 2 --mps -- "$PY" -m mpi4py -m pytest tests/gpu/test_moe_batch.py \
    -q -p no:cacheprovider --timeout 60 --maxfail 2
step test_4pe 70 "$PY" -m symmring.launch -n 4 --mps -- "$PY" -m mpi4py -m pytest tests/gpu/test_moe_batch.py \
    -q -p no:cacheprovider --timeout 60 --maxfail 2
