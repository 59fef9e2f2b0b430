"""The job's node count and node-local ranks as the nvshmem backend reads them, on the ranks of this one
node: `count_nodes` over an MPI shared-memory split says 1, and the split's rank is the one the launcher's
variables name (`symmring.launch.node_local_rank`: Hydra's ``MPI_LOCALRANKID`` here), not the world rank
alone. No GPU: both run before NVSHMEM (and `symmring.backends.nvshmem` imports no CUDA module).

Run: ``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_nodes.py -q -p no:cacheprovider``.
"""

from __future__ import annotations

import pytest

from symmring import mpi
from symmring.backends.nvshmem import count_nodes
from symmring.launch import node_local_rank


@pytest.mark.mpi
def test_one_node_and_the_launchers_local_rank(ctx, comm, check):
    local = comm.Split_type(mpi.namespace_of(comm).COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        nodes = count_nodes(local.Get_rank(), ctx.collectives)
        launcher = node_local_rank()
        ok = nodes == 1 and local.Get_size() == comm.Get_size() and (
            launcher[0] == local.Get_rank() if launcher is not None else comm.Get_size() == 1)
        check(comm, ok, f"nodes {nodes}, split rank {local.Get_rank()}/{local.Get_size()}, launcher's {launcher}")
    finally:
        local.Free()
