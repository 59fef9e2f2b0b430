#!/usr/bin/env bash
# GPU checks of the MoE batch-ready layer, in one device call (logs under $OUT, each step bounded).
#
#   tools/gpu_moe_check.sh [quick|full]
#
# quick: compile, the 1-PE test file, a two-size benchmark.  full: the 1-PE tests, 2 and 4 PEs under MPS,
# and the benchmark sweep. Logs under $OUT (default ./out). The environment, nvshmem4py from .whl/ and
# `step` come from tools/gpu_common.sh.
set -u
mode=${1:-quick}
source "$(dirname "$0")/gpu_common.sh"
out=$OUT
# Fail fast: a hung wait becomes a ProtocolTimeout after 5 s instead of 60.
export SYMMRING_TIMEOUT_S=${SYMMRING_TIMEOUT_S:-5}
install_nvshmem4py
nvidia-smi -L
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"

# Compile every module in parallel into the cache (load_module then hits it).
step compile 120 "$PY" -m symmring.jit

step test_1pe 60 "$PY" -m pytest tests/gpu/test_moe_batch.py -q -p no:cacheprovider --timeout 120 -rs

if [ "$mode" = quick ]; then
    step bench 150 "$PY" -m symmring.bench.moe --shapes qwen3-30b-a3b,mixtral --tokens 128,4096 --repeats 10 \
        --json "$out/bench.json"
    echo "=== summary"
    printf '%s\n' "${summary[@]}"
    exit 0
fi

step bench 60 "$PY" -m symmring.bench.moe --tokens "${BENCH_TOKENS:-128,1024,4096,16384}" --repeats 10 \
    --json "$out/bench.json"
step test_2pe 60 "$PY" -m symmring.launch -n 2 --mps -- "$PY" -m mpi4py -m pytest tests/gpu/test_moe_batch.py \
    -q -p no:cacheprovider --timeout 60 --maxfail 2
step test_4pe 70 "$PY" -m symmring.launch -n 4 --mps -- "$PY" -m mpi4py -m pytest tests/gpu/test_moe_batch.py \
    -q -p no:cacheprovider --timeout 60 --maxfail 2
echo "=== summary"
printf '%s\n' "${summary[@]}"
