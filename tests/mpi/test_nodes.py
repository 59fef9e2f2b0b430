"""The job's node count and node-local ranks as the nvshmem backend reads them, on the ranks of this one
node: `count_nodes` over every rank's host says 1, and each rank's place among the ranks of its host is the
one the launcher's variables name (`symmring.launch.node_local_rank`: Hydra's ``MPI_LOCALRANKID`` under
mpiexec, torchrun's ``LOCAL_RANK``), not the world rank alone. No GPU: both run before NVSHMEM (and
`symmring.backends.nvshmem` imports no CUDA module).

Run: ``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_nodes.py -q -p no:cacheprovider``.
"""

from __future__ import annotations

import socket

import pytest

from symmring.backends.nvshmem import count_nodes
from symmring.launch import node_local_rank
from symmring.world import local_rank


@pytest.mark.mpi
def test_one_node_and_the_launchers_local_rank(ctx, comm, check):
    hosts = ctx.collectives.allgather(socket.gethostname(), what="test: hosts")
    mine = local_rank(hosts, ctx.rank)
    nodes = count_nodes(mine, ctx.collectives)
    launcher = node_local_rank()
    ok = nodes == 1 and (launcher[0] == mine if launcher is not None else comm.Get_size() == 1)
    check(comm, ok, f"nodes {nodes}, local rank {mine} of hosts {hosts}, launcher's {launcher}")
