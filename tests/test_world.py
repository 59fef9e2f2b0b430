"""Which ranks `symmring.init` joins (`symmring.world`): never a world of one inside a launcher's world of
several, and the exit's report wait (`symmring.collective.Collectives.await_reports`) on its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from symmring import world
from symmring.collective import Collectives
from symmring.errors import BackendError, ConfigError, PeerTimeout, ProtocolTimeout


def test_comm_and_group_together_are_refused():
    with pytest.raises(ConfigError, match="give one of them"):
        world.resolve(comm=object(), group=object(), timeout_s=1.0)


def test_a_world_of_one_under_an_mpi_launcher_of_several_is_refused(monkeypatch):
    """An mpi4py built for another MPI than the launcher's starts each rank as its own world of one."""
    class One:
        def Get_size(self):  # noqa: N802
            return 1

    class Namespace:
        COMM_WORLD = One()

    from symmring import mpi
    monkeypatch.setattr(mpi, "load", lambda: Namespace)
    monkeypatch.setenv("PMI_SIZE", "3")
    with pytest.raises(BackendError, match="one of 3 ranks of its launcher"):
        world.resolve(timeout_s=1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_torchrun_rank_whose_peers_never_come_names_a_timeout(tmp_path):
    """torchrun's variables for 2 ranks, and only rank 0 starts: symmring.init joins the world (it does not run
    as a job of one) and, bounded by the host bound, raises PeerTimeout."""
    pytest.importorskip("torch", reason='needs torch (pip install "symmring[cpu]")')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               TORCHELASTIC_RUN_ID="test", SYMMRING_HOST_TIMEOUT_S="3")
    code = ("import symmring, time\n"
            "start = time.monotonic()\n"
            "try:\n    symmring.init('host')\nexcept symmring.PeerTimeout as exc:\n"
            "    print('PeerTimeout', round(time.monotonic() - start, 1), exc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert run.stdout.startswith("PeerTimeout"), run.stdout + run.stderr
    assert float(run.stdout.split()[1]) < 3 * 3, run.stdout


class _Marks:
    """A wire whose exit marks are set by the test."""

    def __init__(self, marks):
        self.marks, self.mine = marks, None

    def mark_exit(self, suspects):
        self.mine = list(suspects)

    def exit_marks(self):
        return dict(self.marks)


def _channel(marks, rank=0, world_size=3):
    chan = Collectives(None, 5.0)
    chan.rank, chan.world_size, chan._wire = rank, world_size, _Marks(marks)
    return chan


def test_report_wait_ends_once_every_survivor_reported():
    stall = ProtocolTimeout("route_ready", rank=0, peer=2, slot=0, chunk=1, expected=3, observed=1, timeout_s=0.3)
    chan = _channel({1: [2]})  # rank 1 reported, naming rank 2 (the stalled one)
    start_s = time.monotonic()
    assert chan.await_reports(stall) == set() and time.monotonic() - start_s < 0.2
    assert chan._wire.mine == [2]


def test_report_wait_never_counts_its_own_suspicion():
    """Rank 0 waited for rank 1, which waited for rank 2: until rank 1 reports, rank 0 waits (up to the bound)."""
    indirect = ProtocolTimeout("combine", rank=0, peer=1, slot=0, chunk=1, expected=3, observed=1, timeout_s=0.3)
    chan = _channel({})
    start_s = time.monotonic()
    assert chan.await_reports(indirect) == {1, 2} and time.monotonic() - start_s >= 0.3
    assert _channel({1: [2]}).await_reports(indirect) == set()


def test_report_wait_skips_the_ranks_a_collective_missed():
    gone = PeerTimeout("forward: argument check", rank=0, world_size=3, missing_ranks=[2], timeout_s=0.3)
    assert _channel({1: [2]}).await_reports(gone) == set()
    start_s = time.monotonic()
    assert _channel({}).await_reports(gone) == {1} and time.monotonic() - start_s >= 0.3
