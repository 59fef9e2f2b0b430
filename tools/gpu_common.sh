# Sourced by every GPU script under tools/ (gpu_check.sh and
# multi_gpu_check.sh): the environment every GPU step runs in, the nvshmem4py install from .whl/ (the
# device machine has no package index), and `step`.
# Sets OUT (default ./out), PY (absolute: mpirun's ranks get it too) and the summary array.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"
# The GPU environment policy, symmring.env.GPU_ENV (NVLink multicast off in NVSHMEM, NCCL and torch;
# no remote transport; eager module loading), from the package through the launcher ($PY -m
# symmring.launch --print-env). Values set by the caller are kept.
eval "$(SYMMRING_PYTHON="$PY" bash launch/symmring-mpirun --print-env)"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export SYMMRING_CACHE_DIR="${SYMMRING_CACHE_DIR:-$PWD/.symcache}"
summary=()

install_nvshmem4py() {  # from .whl/ into /tmp/site, when nvshmem4py is not importable
  if ! "$PY" -c "import nvshmem" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  fi
}

step() {  # step NAME LIMIT_S CMD...: bounded, logged to $OUT/NAME.log, tail printed, a summary line kept
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local line
  line=$(grep -aE "passed|failed|error|skipped|bench stream:|pull," "$OUT/$name.log" | tail -n 1)
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$line")")
  echo "--- $name rc=$rc ($((SECONDS - t0)) s)"
  tail -n 30 "$OUT/$name.log"
}
