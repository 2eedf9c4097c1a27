"""Jobs that really span hosts (the namespace rig of collectives.testing.hosts): torchrun's
c10d rendezvous (zmq, gloo and the collectives backend) and MPICH's mpiexec with a host
file, 2 hosts x 2 ranks, each training examples/ddp.py to the result of the same
launcher's 4 ranks on one host.

Slow: every case starts 4 torch processes twice."""

from __future__ import annotations

import json
import secrets
import shutil
import sys

import pytest

from collectives.testing.hosts import HostRig, rig_unavailable
from collectives.testing.hosts_launch import (run_mpiexec, run_torchrun,
                                              summary)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(rig_unavailable() is not None, reason=rig_unavailable() or ""),
]

# The zmq secret every rank of a multi-host job should share (else trust on first use).
ENV = {"COLLECTIVES_SECRET": secrets.token_hex(32)}
DDP = ["examples/ddp.py", "--epochs", "2"]


@pytest.fixture(scope="module")
def rig():
    with HostRig(2) as r:
        yield r


def _same_training(one_host: dict, two_hosts: dict) -> None:
    assert two_hosts["world_size"] == one_host["world_size"] == 4
    assert (two_hosts["final_acc"], two_hosts["final_loss"]) == \
        (one_host["final_acc"], one_host["final_loss"]), (one_host, two_hosts)


@pytest.mark.parametrize("backend", ["zmq", "gloo", "collectives"])
def test_torchrun_across_hosts_trains_like_one_host(rig, backend):
    """``collectives``: our group through torch.distributed's "collectives" backend, with
    shm underneath on one host and hier (shm in each host, zmq between) on two (which
    init_process_group logs at info)."""
    argv = DDP + ["--backend", backend]
    env = dict(ENV, COLLECTIVES_LOG_LEVEL="info") if backend == "collectives" else ENV
    one_host = run_torchrun(rig, argv, nproc_per_node=4, hosts=["host0"], env=env)
    two_hosts = run_torchrun(rig, argv, nproc_per_node=2, env=env)
    one, two = summary(one_host), summary(two_hosts)
    assert two["backend"] == backend
    _same_training(one, two)
    if backend == "collectives":
        hier = "spans several hosts: backend hier"
        assert not any(hier in o.stderr for o in one_host), one_host[0].stderr[-2000:]
        # (each host's torchrun output holds its two ranks' lines)
        assert all(o.stderr.count(hier) == 2 for o in two_hosts), two_hosts[0].stderr[-2000:]


def test_torchrun_across_hosts_torch_backend_collectives(rig):
    """torch's DistributedDataParallel over dist.init_process_group("collectives") (zmq
    transport) on examples/ddp.py's model: every rank ends with the same parameters, equal
    to gloo's within float rounding and bit for bit to the one-host run's."""
    argv = ["tests/scripts/torch_backend_job.py", "ddp"]
    env = {**ENV, "COLLECTIVES_BACKEND": "zmq"}

    def digests(outputs) -> set:
        rows = [json.loads(line) for o in outputs for line in o.stdout.splitlines()
                if line.startswith("{")]
        assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
        assert all(r["backend"] == "collectives" and r["transport"] == "zmq" for r in rows)
        assert all(r["None/max_diff"] < 1e-5 and r["None/moved"] > 1e-3 for r in rows)
        return {r["None/digest"] for r in rows}

    one = digests(run_torchrun(rig, argv, nproc_per_node=4, hosts=["host0"], env=env))
    two = digests(run_torchrun(rig, argv, nproc_per_node=2, env=env))
    assert len(two) == 1 and two == one


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpich)")
def test_mpiexec_across_hosts_trains_like_one_host(rig, tmp_path):
    # each rank writes where it runs to a file of its own (the ranks' output interleaves)
    run_mpiexec(rig, [sys.executable, "-c", "import os, socket, sys; open(os.path.join("
                      "sys.argv[1], os.environ['PMI_RANK']), 'w').write(socket.gethostname())",
                      str(tmp_path)])
    placed = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert placed == {"0": "host0", "1": "host0", "2": "host1", "3": "host1"}
    one = summary(run_mpiexec(rig, [sys.executable] + DDP, per_host=4, hosts=["host0"]))
    two = summary(run_mpiexec(rig, [sys.executable] + DDP))
    assert two["backend"] == "mpi"
    _same_training(one, two)


def test_shm_across_hosts_becomes_hierarchical_and_trains_like_one_host(rig):
    """shm cannot reach another host's memory: asked for across hosts, the world is built
    by ``hier`` (shm inside each host, zmq between them) and trains as on one host."""
    argv = DDP + ["--backend", "shm"]
    one = summary(run_torchrun(rig, argv, nproc_per_node=4, hosts=["host0"], env=ENV))
    two = summary(run_torchrun(rig, argv, env=ENV))
    assert (one["backend"], two["backend"]) == ("shm", "hier")
    _same_training(one, two)
