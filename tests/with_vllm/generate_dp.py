"""tests/with_vllm/generate.py's greedy prompts over vLLM data-parallel ranks with expert parallelism (CPU): vLLM's
offline data-parallel launch, one process per DP rank (``VLLM_DP_RANK``, ``VLLM_DP_SIZE``, a local master port),
each rank generating its share of the prompts (``generate.dp_share``) as one batch with its engine core in its own
process; prints one ``RESULT`` JSON line with every prompt's tokens and candidates, in the prompts' order (what
tests/with_vllm/test_vllm_e2e.py's comparison reads; its reference is one-rank vLLM on the same shares,
``generate.py --dp-shares N``), and, with symmring's experts, each rank's prompts, symmring calls and the host
exchanges its context made during the generation (``ranks``).

    SYMMRING_VLLM=1 python tests/with_vllm/generate_dp.py MODEL_DIR 2
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from multiprocessing import Process, Queue
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: exchanges

from exchanges import ExchangeCounter  # noqa: E402
from generate import ENGINE_ARGS, dp_share, greedy_rows  # noqa: E402


def rank_main(rank: int, size: int, port: int, path: str, queue: Queue) -> None:
    # The engine core runs in this process: symmring's workspace is here to read.
    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import LLM
    from symmring.integrations.vllm.experts import made_workspace
    llm = LLM(model=path, **ENGINE_ARGS, enable_expert_parallel=True, distributed_executor_backend="uni")
    ws = made_workspace()
    calls = None if ws is None else ws.calls
    with contextlib.nullcontext() if ws is None else ExchangeCounter(ws.ctx) as counter:
        # A rank with no prompt of its own still steps with the others (vLLM runs dummy batches on idle DP ranks).
        rows = greedy_rows(llm, dp_share(rank, size))
    stats = None if ws is None else dict(rank=rank, ep_size=ws.world_size, prompts=dp_share(rank, size),
                                         moe_calls=ws.calls - calls, host_exchanges=counter.count,
                                         what=counter.what[:5])
    queue.put((rows, stats))


def main(path: str, size: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue: Queue = Queue()
    procs = [Process(target=rank_main, args=(r, size, port, path, queue)) for r in range(size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=400) for _ in procs]
    rows = sorted(row for rank_rows, _ in results for row in rank_rows)
    ranks = sorted((stats for _, stats in results if stats is not None), key=lambda s: s["rank"])
    print("RESULT " + json.dumps(dict(tokens=[r[1] for r in rows], top2=[r[2] for r in rows], ranks=ranks)),
          flush=True)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():  # a DP rank's engine that does not shut down by itself once its results are in
            p.terminate()
            p.join(timeout=10)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
