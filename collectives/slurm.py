"""Slurm's ``srun``: which task of which step this process is, and where the step meets.

``srun -n 4 python train.py`` starts four tasks and tells each who it is through its
environment (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``SLURM_STEP_NODELIST``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID`` ...). :func:`slurm_task` reads
them for :func:`collectives.launch.detect_rendezvous`.

Who is a task. A job's batch script (``sbatch``) and an ``salloc`` shell carry Slurm
variables too, without being tasks of a step: the batch script sees ``SLURM_PROCID=0``
and ``SLURM_NTASKS=N`` (the job's task count, not a world it belongs to), and the
``salloc`` shell sees ``SLURM_NTASKS=N`` with no ``SLURM_PROCID``. The rule:

* a process is a task of a step when srun's step variables are set (``SLURM_STEP_ID``,
  which srun exports to every task, or ``SLURM_STEP_NODELIST``/``SLURM_STEP_NUM_TASKS``);
* without them, a process of a job (``SLURM_JOB_ID`` set) that is the batch script
  (``ENVIRONMENT=BATCH``) or has no ``SLURM_PROCID`` (the ``salloc`` shell) is no task:
  :func:`slurm_task` returns None and the process is a world of one, which may spawn its
  own ranks (``python examples/ddp.py --nproc 4`` in a batch script works as on a laptop);
* a task whose world has more than one rank but no ``SLURM_PROCID`` (a wrapper that lost
  it, or a hand-made environment) is a :class:`ValueError`, never N separate worlds.

Where the step meets: ``MASTER_ADDR`` defaults to the first host of the step's node list
(:func:`collectives.launch.expand_nodelist`), where srun puts task 0, and ``MASTER_PORT``
to :func:`slurm_port`; both are used only where the variables are not set.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from .environment import first_env_int as _first
from .nodelist import expand_nodelist

__all__ = ["SlurmTask", "slurm_task", "slurm_port", "tasks_on_node", "PORT_BASE"]

_log = logging.getLogger("collectives.launch")

#: The lowest port :func:`slurm_port` gives; ports run up to ``PORT_BASE + 9999``,
#: above the privileged ports and below Linux's ephemeral range (32768 and up), so a
#: step's port is not taken by some other program's outgoing connection.
PORT_BASE = 20000

_STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS")
_ANY_VARS = _STEP_VARS + ("SLURM_PROCID", "SLURM_NTASKS")


@dataclass(frozen=True)
class SlurmTask:
    """One task of a Slurm step, as srun describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: The step's hosts, in order (empty when no node list is set).
    hosts: tuple[str, ...]
    job: Optional[int]
    step: Optional[int]

    @property
    def job_id(self) -> Optional[str]:
        """What names the step on every task alike (shm names its segments after it);
        two steps of one job running side by side differ."""
        if self.job is None:
            return None
        return f"SLURM_JOB_ID={self.job}.{self.step if self.step is not None else 0}"

    @property
    def master_addr(self) -> Optional[str]:
        """The first host of the step: srun places task 0 there."""
        return self.hosts[0] if self.hosts else None

    @property
    def master_port(self) -> Optional[int]:
        return None if self.job is None else slurm_port(self.job, self.step or 0)


def slurm_port(job: int, step: int = 0) -> int:
    """The default ``MASTER_PORT`` of step ``step`` of job ``job``:
    ``PORT_BASE + (job % 1000) * 10 + step % 10``, between 20000 and 29999.

    Every task computes the same port with no exchange; 1000 consecutive jobs (and ten
    steps of a job) get different ports, so jobs sharing a node do not collide. A group
    re-formed by ``collectives.regroup`` meets at the port plus its generation.

    >>> slurm_port(123456, 2)
    24562
    """
    return PORT_BASE + (job % 1000) * 10 + step % 10


def tasks_on_node(counts: str, node: int) -> int:
    """How many tasks node ``node`` runs, from Slurm's ``SLURM_STEP_TASKS_PER_NODE``
    syntax (``2(x3),1``: three nodes with two tasks, then one with one).

    >>> [tasks_on_node("2(x3),1", n) for n in range(4)]
    [2, 2, 2, 1]
    """
    per_node: list[int] = []
    for item in counts.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={counts!r} is not a list like "
                             f"2(x3),1")
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node < len(per_node):
        raise ValueError(f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={counts!r} "
                         f"names {len(per_node)} nodes")
    return per_node[node]


def slurm_task(env: Mapping[str, str]) -> Optional[SlurmTask]:
    """This process as a task of a Slurm step, or None when it is not one (no Slurm, or
    a job's batch script or ``salloc`` shell: see the module docstring).

    >>> slurm_task({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
    ...             "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]"}).master_addr
    'n1'
    """
    if not any(env.get(name) for name in _ANY_VARS):
        return None
    in_step = any(env.get(name) for name in _STEP_VARS)
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    rank = _first(env, "SLURM_PROCID")
    if not in_step and job is not None and (env.get("ENVIRONMENT") == "BATCH" or rank is None):
        _log.debug("Slurm job %s, but no task of a step (the batch script or an salloc "
                   "shell): a world of one; srun starts the tasks of a world", job)
        return None
    size = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if rank is None:
        if size is not None and size > 1:
            raise ValueError(
                f"init_process_group: Slurm's SLURM_NTASKS={size} says this is one task of "
                f"{size}, but SLURM_PROCID (which task) is not set; every task would make "
                f"a world of its own. Start the tasks with srun (which sets it), or "
                f"export SLURM_PROCID to each")
        rank = 0
    if size is None:
        raise ValueError(f"init_process_group: SLURM_PROCID={rank} is set but neither "
                         f"SLURM_NTASKS nor SLURM_STEP_NUM_TASKS; srun sets both")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or \
        env.get("SLURM_NODELIST")
    hosts = tuple(expand_nodelist(nodelist)) if nodelist else ()
    node = _first(env, "SLURM_NODEID") or 0
    local_rank = _first(env, "SLURM_LOCALID")
    return SlurmTask(rank=rank, world_size=size,
                     local_rank=rank if local_rank is None else local_rank,
                     local_world_size=_local_world_size(env, size, node, hosts),
                     hosts=hosts, job=job, step=_first(env, "SLURM_STEP_ID", "SLURM_STEPID"))


def _local_world_size(env: Mapping[str, str], size: int, node: int,
                      hosts: tuple[str, ...]) -> int:
    """Tasks on this node: srun's per-node counts, else an even block distribution."""
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if counts:
        return tasks_on_node(counts, node)
    per_node = _first(env, "SLURM_NTASKS_PER_NODE")
    if per_node is not None:
        return per_node
    nodes = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") or max(len(hosts), 1)
    # srun's default block distribution: the first size % nodes nodes get one more.
    return size // nodes + (1 if node < size % nodes else 0)
