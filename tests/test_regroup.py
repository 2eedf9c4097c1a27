"""Re-forming a group without restarting anyone, on every transport that can
(:mod:`collectives.regroup`): a rank of a spawned world is SIGKILLed from outside, the
survivors ``shrink`` (renumbered in order, the old group aborted) and run collectives
on the new group; then a fresh process joins them (``grow`` / ``join_group``) under the
next generation. ``mpi`` refuses with a ``NotImplementedError`` naming ULFM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import collectives
from collectives.backend import Backend
from collectives.work import Work
from faults import regroup_tasks
from faults.world import FaultWorld
from test_faults import _param

TIMEOUT = 10.0
REGROUP_BACKENDS = ("shm", "zmq", "gloo", "collectives")
HERE = os.path.dirname(os.path.abspath(__file__))


def _expect(result: dict, rank: int, size: int, generation: int) -> None:
    assert (result["rank"], result["size"], result["generation"]) == (rank, size, generation)
    assert result["sum"] == size * (size + 1) / 2 and result["sum_uniform"], result
    assert result["broadcast"] == [float(size - 1)] * 3, result
    assert result["gathered"] == [10 * r for r in range(size)], result


def _kill(world: FaultWorld, rank: int) -> None:
    os.kill(world.pids[rank], signal.SIGKILL)
    time.sleep(0.2)   # gone before the survivors are asked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, dead", [_param(b, d) for b in REGROUP_BACKENDS
                                           for d in (0, 2)])
def test_shrink_after_sigkill(backend, dead):
    with FaultWorld(backend, 4, timeout=TIMEOUT) as world:
        _kill(world, dead)
        outcomes = world.call(regroup_tasks.shrink_and_check, [dead], limit=60.0)
    survivors = [r for r in range(4) if r != dead]
    for new_rank, old_rank in enumerate(survivors):
        got = outcomes[old_rank]
        assert isinstance(got, dict), outcomes
        _expect(got, new_rank, 3, 1)
        assert got["old"] == "GroupAborted", got
    assert not world.leftovers, world.leftovers


def _joiner(world: FaultWorld, rank: int, size: int, generation: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world.n),
               LOCAL_WORLD_SIZE=str(world.n), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(world.master_port), COLLECTIVES_JOB_ID=world.job_id,
               COLLECTIVES_SPAWNED="1", COLLECTIVES_BACKEND=world.backend,
               COLLECTIVES_TIMEOUT=str(TIMEOUT * 3), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "scripts", "join_group.py"),
                             str(rank), str(size), str(generation)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", [_param(b) for b in REGROUP_BACKENDS])
def test_fresh_process_joins_survivors(backend):
    """3 ranks, rank 1 killed: the two survivors shrink (generation 1), then grow back to
    3 with a fresh process (generation 2), which meets them as rank 2."""
    with FaultWorld(backend, 3, timeout=TIMEOUT * 3) as world:
        _kill(world, 1)
        shrunk = world.call(regroup_tasks.shrink_and_keep, [1], limit=60.0)
        joiner = _joiner(world, 2, 3, 2)
        try:
            grown = world.call(regroup_tasks.grow_kept, 3, limit=90.0)
            out, err = joiner.communicate(timeout=60)
        finally:
            if joiner.poll() is None:
                joiner.kill()
                joiner.wait()
    for new_rank, old_rank in enumerate((0, 2)):
        assert isinstance(shrunk[old_rank], dict), shrunk
        _expect(shrunk[old_rank], new_rank, 2, 1)
        assert isinstance(grown[old_rank], dict), (grown, err[-3000:])
        _expect(grown[old_rank], new_rank, 3, 2)
        assert grown[old_rank]["old"] == "GroupAborted", grown
    assert joiner.returncode == 0, err[-3000:]
    _expect(json.loads(out.strip().splitlines()[-1]), 2, 3, 2)
    assert not world.leftovers, world.leftovers


@pytest.mark.timeout(120)
def test_mpi_refuses_naming_ulfm():
    pytest.importorskip("mpi4py")
    with FaultWorld("mpi", 2, timeout=TIMEOUT) as world:
        outcomes = world.call(regroup_tasks.refused, limit=60.0)
    for got in outcomes:
        assert got["type"] == "NotImplementedError", outcomes
        assert "ULFM" in got["message"] and "shrink" in got["message"], got


class _Loopback(Backend):
    """A world of one that declares no ``regroups``."""

    name = "loopback-noregroup"

    def isend(self, array, dst, tag) -> Work:
        raise AssertionError("unused")

    def irecv(self, array, src, tag) -> Work:
        raise AssertionError("unused")

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def test_backend_without_regroups_is_refused_and_bad_arguments_are_named():
    pg = collectives.ProcessGroup(_Loopback(0, 1, 5.0))
    with pytest.raises(NotImplementedError, match=r"\[rank 0/1\] reform: .*regroups"):
        pg.shrink([])
    world = collectives.init_process_group("shm")
    try:
        with pytest.raises(ValueError, match=r"shrink: argument `exclude` names this rank"):
            world.shrink([0])
        with pytest.raises(ValueError, match=r"shrink: argument `exclude` holds 3"):
            world.shrink([3])
        with pytest.raises(ValueError, match=r"grow: argument `world_size`"):
            world.grow(0)
        with pytest.raises(ValueError, match=r"reform: argument `generation`"):
            world.reform(0, 1, 0)
        same = world.shrink([])          # a world of one re-formed as itself
        t = np.ones(3)
        same.all_reduce(t)
        assert (same.rank, same.size, same.generation) == (0, 1, 1) and t.tolist() == [1.0] * 3
        same.close()
    finally:
        world.close()


def test_nccl_refuses_naming_why():
    """Without a GPU to run NCCL on, the refusal is checked on a group over an
    unconnected NcclBackend: ``reform`` asks the backend before anything else."""
    nccl = pytest.importorskip("backends.torchdist.nccl")
    backend = nccl.NcclBackend.__new__(nccl.NcclBackend)
    Backend.__init__(backend, 0, 1, 5.0)
    pg = collectives.ProcessGroup(backend)
    for call in (lambda: pg.shrink([]), lambda: pg.grow(2), lambda: pg.reform(0, 1, 1)):
        with pytest.raises(NotImplementedError,
                           match=r"\[rank 0/1\] reform: the nccl backend cannot re-form a "
                                 r"group .*ncclCommAbort.*use gloo"):
            call()
