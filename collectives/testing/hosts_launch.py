"""Starting one job across the hosts of a :class:`~collectives.testing.hosts.HostRig` the way
a cluster does: torchrun on every host meeting through its c10d rendezvous, mpiexec with a
host file (its ssh replaced by a script that enters the host), or plain processes with
torchrun's variables.

Each function waits for the whole job (at most ``timeout`` seconds: then every process of
the job is killed and :class:`JobFailed` raised with what each host printed) and returns one
:class:`HostOutput` per host. :func:`summary` finds an example's closing JSON line.

Two hosts, two ranks each::

    with HostRig(2) as rig:
        outs = run_torchrun(rig, ["examples/ddp.py", "--backend", "zmq"], nproc_per_node=2)
        summary(outs)["final_acc"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .hosts import HostRig, kill_session

__all__ = ["HostOutput", "JobFailed", "RDZV_PORT", "run_mpiexec", "run_ranks",
           "run_torchrun", "summary"]

#: Where torchrun's c10d rendezvous meets, on the rig's first host.
RDZV_PORT = 29400


@dataclass(frozen=True)
class HostOutput:
    """What the job's process(es) on one host printed, and how they ended."""

    host: str
    returncodes: tuple
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)


class JobFailed(RuntimeError):
    """A job on the rig failed or ran out of time; ``outputs`` holds every host's."""

    def __init__(self, message: str, outputs: Sequence[HostOutput]) -> None:
        tails = "".join(f"\n--- {o.host} (status {list(o.returncodes)}):\n"
                        f"{_tail(o.stdout)}{_tail(o.stderr)}" for o in outputs)
        super().__init__(message + tails)
        self.outputs = list(outputs)


def _tail(text: str, lines: int = 25) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "".join(f"    {line}\n" for line in kept)


def _wait(started: Sequence[tuple], timeout: float, what: str) -> list[HostOutput]:
    """Wait for ``started`` (host, Popen, output stem) and gather each host's output."""
    deadline = time.monotonic() + timeout
    timed_out = False
    for _, proc, _ in started:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for _, proc, _ in started:
            if proc.poll() is None:
                kill_session(proc)
        for _, proc, _ in started:
            proc.wait()
    by_host: dict[str, list] = {}
    for host, proc, stem in started:
        with open(stem + ".out") as out, open(stem + ".err") as err:
            by_host.setdefault(host, []).append((proc.returncode, out.read(), err.read()))
    outputs = [HostOutput(host, tuple(r for r, _, _ in runs), "".join(o for _, o, _ in runs),
                          "".join(e for _, _, e in runs)) for host, runs in by_host.items()]
    if timed_out:
        raise JobFailed(f"{what}: not finished within {timeout:g} s; every process was "
                        f"killed", outputs)
    if not all(o.ok for o in outputs):
        raise JobFailed(f"{what}: failed", outputs)
    return outputs


def _start(rig: HostRig, host: str, argv: Sequence[str], env: Mapping[str, str],
           stem: str) -> subprocess.Popen:
    with open(stem + ".out", "w") as out, open(stem + ".err", "w") as err:
        return rig.popen(host, list(argv), env=env, stdout=out, stderr=err)


def run_torchrun(rig: HostRig, script_argv: Sequence[str], *, nproc_per_node: int = 2,
                 hosts: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
                 timeout: float = 300.0) -> list[HostOutput]:
    """``torchrun --nnodes H --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint
    HOST0:29400 SCRIPT...`` on each of ``hosts`` (default: all), at once."""
    hosts = list(rig.names if hosts is None else hosts)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts[0]}:{RDZV_PORT}", "--rdzv-id", "rig",
            *script_argv]
    with tempfile.TemporaryDirectory(prefix="collectives-rig-job-") as folder:
        started = [(h, _start(rig, h, argv, env or {}, os.path.join(folder, h)),
                    os.path.join(folder, h)) for h in hosts]
        return _wait(started, timeout, f"torchrun on {', '.join(hosts)}")


def run_mpiexec(rig: HostRig, argv: Sequence[str], *, per_host: int = 2,
                hosts: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
                timeout: float = 300.0) -> list[HostOutput]:
    """MPICH's ``mpiexec -f HOSTFILE -n H*N -ppn N ARGV`` started on the first of ``hosts``,
    reaching the others through :meth:`HostRig.launcher_script` as Hydra's ssh."""
    hosts = list(rig.names if hosts is None else hosts)
    with tempfile.TemporaryDirectory(prefix="collectives-rig-job-") as folder:
        hostfile = rig.hostfile(per_host, os.path.join(folder, "hostfile"), hosts)
        cmd = ["mpiexec", "-launcher", "ssh", "-launcher-exec", rig.launcher_script(),
               "-f", hostfile, "-n", str(per_host * len(hosts)), "-ppn", str(per_host),
               *argv]
        stem = os.path.join(folder, hosts[0])
        started = [(hosts[0], _start(rig, hosts[0], cmd, env or {}, stem), stem)]
        return _wait(started, timeout, f"mpiexec across {', '.join(hosts)}")


def run_ranks(rig: HostRig, argv: Sequence[str], *, per_host: int = 2, master_port: int = 29500,
              hosts: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
              timeout: float = 300.0) -> list[HostOutput]:
    """``per_host`` processes of ``argv`` on each of ``hosts``, with torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` = the
    first host, ``MASTER_PORT``): a launcher with no agent of its own, ranks numbered host
    by host."""
    hosts = list(rig.names if hosts is None else hosts)
    size = per_host * len(hosts)
    with tempfile.TemporaryDirectory(prefix="collectives-rig-job-") as folder:
        started = []
        for rank in range(size):
            host = hosts[rank // per_host]
            rank_env = {**(env or {}), "RANK": str(rank), "WORLD_SIZE": str(size),
                        "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host),
                        "MASTER_ADDR": hosts[0], "MASTER_PORT": str(master_port),
                        "OMP_NUM_THREADS": "1"}
            stem = os.path.join(folder, f"rank{rank}")
            started.append((host, _start(rig, host, argv, rank_env, stem), stem))
        return _wait(started, timeout, f"{size} ranks on {', '.join(hosts)}")


def summary(outputs: Sequence[HostOutput]) -> dict:
    """The closing JSON object an example's rank 0 prints (on whichever host rank 0 ran:
    torchrun's rendezvous may make any host the first); ValueError if none printed one."""
    for out in outputs:
        for line in reversed(out.stdout.strip().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
    raise ValueError("summary: no host printed a JSON line" + "".join(
        f"\n--- {o.host}:\n{_tail(o.stdout)}" for o in outputs))
