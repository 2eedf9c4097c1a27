"""Starting the ranks: one job per launcher, every implementation of that launcher in it
(or, under an outside launcher, running as one of its ranks: :func:`run_rank`).

Implementations that need MPI's launcher (our ``mpi`` backend and the ``mpi4py`` peer)
run in one ``mpiexec`` job; the others (``shm``, ``zmq``, ``gloo``, ``torch-gloo``, ...)
in one :func:`collectives.spawn` job. Inside a job every rank opens each implementation's
group and runs the sweep of :func:`collectives.bench.measure.measure_many` through them,
so ours and a peer of the same launcher (and, with ``memcpy``, the single-process copy)
take turns iteration by iteration on the same buffers.

The ``mpiexec`` job re-executes ``python -m collectives.bench --worker SPEC`` (a hidden
flag): ``SPEC`` is a JSON :class:`JobSpec`; rank 0 writes the rows to the spec's
``out`` file, and a failing rank writes its traceback next to it before exiting (which
makes ``mpiexec`` stop the others), so the parent raises :class:`SpawnError` naming that
rank, as ``collectives.spawn`` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import settings
from ..launch import Rendezvous
from ..mpiexec import MpiexecUnavailable, find_mpiexec, own_session_dying_with_parent
from ..spawn import SpawnError, free_port, sigterm_raises, spawn
from .measure import GroupRunner, MemcpyRunner, Runner, measure_many

#: Implementations whose ranks must be started by ``mpiexec``.
MPIEXEC_IMPLS = frozenset({"mpi", "p2p:mpi", "mpi4py"})
#: The repository root, so that ranks started by mpiexec import this checkout.
_ROOT = str(Path(__file__).resolve().parents[2])


class LauncherMissing(RuntimeError):
    """An implementation's launcher or library is missing here; the message says which."""


@dataclass
class JobSpec:
    """Everything a rank needs: which implementations, ops, sizes and how long."""

    impls: list[str]
    ops: list[str]
    sizes: list[int]
    dtype: str = "float32"
    iters: int = 50
    warmup: int = 5
    byte_budget: int = 512 << 20
    #: Seconds every blocking wait of a group may last.
    timeout: float = 120.0
    #: Where the torch-gloo peer's ranks meet (a free port chosen by the parent; 0 under
    #: an outside launcher: rank 0 chooses, see :func:`run_rank`).
    torch_port: int = 0
    torch_addr: str = "127.0.0.1"
    #: Also time a single-process copy of each size (rows of impl ``memcpy``).
    memcpy: bool = False
    #: mpiexec jobs: the file rank 0 writes its rows to.
    out: str = ""
    #: Time our backend's all_reduce / all_gather / reduce_scatter as persistent
    #: requests (``start(); wait()`` of one ``*_init`` per case), the peers unchanged.
    persistent: bool = False
    #: Our backend's all_reduce on buffers from ``pg.alloc_symmetric`` (the peers and
    #: memcpy in the same job use them too; the other ops are skipped).
    symmetric: bool = False
    #: all_to_all with uneven split sizes (``cases.uneven_splits``), for every
    #: implementation alike.
    uneven: bool = False


def _open(impl: str, spec: JobSpec, rank: int, size: int) -> Runner:
    """Connect this rank to ``impl``'s group."""
    if impl == "mpi4py":
        from .peers import Mpi4pyRunner
        return Mpi4pyRunner()
    if impl == "torch-gloo":
        from .peers import TorchGlooRunner
        return TorchGlooRunner(rank, size, spec.torch_addr, spec.torch_port, spec.timeout)
    from ..world import init_process_group
    ours = impl == spec.impls[0]
    return GroupRunner(init_process_group(impl, timeout=spec.timeout), impl,
                       persistent=spec.persistent and ours, symmetric=spec.symmetric and ours)


def run_rank(spec: JobSpec) -> tuple[list[dict], list[str]]:
    """One rank of a job: open every implementation, run the sweep, close them. Rank 0
    returns the rows and the notes on skipped ops; the others return empty lists.

    Started by an outside launcher (torchrun, mpiexec, srun: ``python -m
    collectives.bench`` run as one of its ranks), ``spec.torch_port`` is 0: the ranks
    then agree on where the torch-gloo peer meets through our own group, opened first."""
    from ..launch import detect_rendezvous

    where = detect_rendezvous()
    runners: list[Runner] = []
    try:
        for impl in spec.impls:
            if impl == "torch-gloo" and not spec.torch_port:
                spec = _agree_torch_meeting(spec, runners[0], where)
            runners.append(_open(impl, spec, where.rank, where.world_size))
        if spec.memcpy:
            runners.append(MemcpyRunner(runners[0]))
        skipped: list[str] = []
        rows = measure_many(runners, spec.ops, spec.sizes, spec.dtype, spec.iters,
                            spec.warmup, spec.byte_budget, skipped, uneven=spec.uneven)
    finally:
        for runner in reversed(runners):
            runner.close()
    return (rows, skipped) if where.rank == 0 else ([], [])


def _agree_torch_meeting(spec: JobSpec, ours: Runner, where: Rendezvous) -> JobSpec:
    """Rank 0 picks a free port on its host and tells the others through our group:
    an outside launcher's ranks have no parent to choose one for them. Rank 0 is
    reached at ``MASTER_ADDR`` (its host under torchrun and srun), at 127.0.0.1 when
    every rank is on one host, else at its host name."""
    if not isinstance(ours, GroupRunner):
        raise TypeError(f"torch-gloo peer: expected our backend's group first, got "
                        f"{type(ours).__name__}")
    meeting = None
    if where.rank == 0:
        one_host = where.local_world_size == where.world_size
        addr = "127.0.0.1" if one_host else (where.master_addr or socket.gethostname())
        meeting = (addr, free_port())
    addr, port = ours.pg.broadcast_object(meeting, 0)
    return dataclasses.replace(spec, torch_addr=addr, torch_port=port)


def run_spawned(spec: JobSpec, nproc: int, job_timeout: float) -> tuple[list[dict], list[str]]:
    """Run ``spec`` on ``nproc`` ranks started by :func:`collectives.spawn` (a failing rank
    raises :class:`SpawnError`)."""
    spec = dataclasses.replace(spec, torch_port=free_port())
    return spawn(run_rank, nproc, args=(spec,), timeout=spec.timeout,
                 join_timeout=job_timeout)[0]


def mpiexec_program() -> str:
    """The ``mpiexec`` to use (see :func:`collectives.mpiexec.find_mpiexec`);
    :class:`LauncherMissing` if there is none or mpi4py is missing."""
    try:
        return find_mpiexec()
    except MpiexecUnavailable as exc:
        raise LauncherMissing(str(exc)) from None


def run_mpiexec(spec: JobSpec, nproc: int, job_timeout: float) -> tuple[list[dict], list[str]]:
    """Run ``spec`` on ``nproc`` ranks started by ``mpiexec`` (:class:`LauncherMissing`
    without one; :class:`SpawnError` naming the rank when a rank fails)."""
    program = mpiexec_program()
    with tempfile.TemporaryDirectory(prefix="collectives-bench-") as tmp:
        spec = dataclasses.replace(spec, torch_port=free_port(),
                                   out=os.path.join(tmp, "rows.json"))
        spec_path = os.path.join(tmp, "spec.json")
        Path(spec_path).write_text(json.dumps(dataclasses.asdict(spec)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                     settings.JOB_ID.name, settings.SPAWNED.name):
            env.pop(name, None)  # the ranks' identity must come from mpiexec
        env.setdefault("OMP_NUM_THREADS", "1")
        extra = settings.MPIEXEC_ARGS.get()
        command = [program, "-n", str(nproc), *extra, sys.executable, "-m",
                   "collectives.bench", "--worker", spec_path]
        log_path = os.path.join(tmp, "mpiexec.log")
        before = _mpich_segments()
        with open(log_path, "w+") as log:
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    preexec_fn=own_session_dying_with_parent)
            code: Optional[int]
            try:
                with sigterm_raises():
                    code = proc.wait(job_timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                code = None
            except BaseException:  # Ctrl-C or SIGTERM: take the ranks down with us
                _stop(proc)
                _remove_orphans(_mpich_segments() - before)
                raise
            log.seek(0)
            output = log.read()
        if code != 0:
            _remove_orphans(_mpich_segments() - before)
        failure = _rank_failure(tmp, nproc)
        if failure is not None:
            raise failure
        if code != 0 or not os.path.exists(spec.out):
            state = (f"still running after {job_timeout:g} s; stopped it" if code is None
                     else f"exited with code {code}")
            tail = "\n".join(output.rstrip().splitlines()[-30:])
            raise SpawnError(f"{' '.join(command)}: {state}; its output ends with:\n{tail}",
                             rank=0, exitcode=code)
        result = json.loads(Path(spec.out).read_text())
        return result["rows"], result["skipped"]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to mpiexec's session (its ranks included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(3.0)
            return
        except subprocess.TimeoutExpired:
            continue


_SHM_DIR = "/dev/shm"


def _mpich_segments() -> set[str]:
    try:
        return {n for n in os.listdir(_SHM_DIR) if n.startswith("mpich_shm_")}
    except OSError:  # no /dev/shm: not Linux
        return set()


def _remove_orphans(names: set[str], wait: float = 5.0) -> None:
    """Remove MPICH's shared-memory segments that appeared during a failed job once no
    process maps them: a rank that exits without MPI_Finalize leaves them behind (README,
    "mpi"). Ranks that are still dying get ``wait`` seconds; a segment that stays mapped
    (another job's) is left alone."""
    deadline = time.monotonic() + wait
    while names:
        mapped = _mapped(names)
        for name in names - mapped:
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:
                pass
        names = mapped
        if not names or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _mapped(names: set[str]) -> set[str]:
    """Which of ``names`` some process maps. Processes this user may not inspect are
    skipped: their segments are not ours to remove either (``/dev/shm`` is sticky)."""
    mapped: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except OSError:  # gone, or not ours to inspect
            continue
        mapped |= {n for n in names if n in text}
    return mapped


def _rank_failure(tmp: str, nproc: int) -> Optional[SpawnError]:
    """The first rank that wrote a traceback, as a :class:`SpawnError`."""
    for rank in range(nproc):
        path = os.path.join(tmp, f"error-{rank}.txt")
        if os.path.exists(path):
            tb = Path(path).read_text()
            last = tb.rstrip().splitlines()[-1] if tb.strip() else "unknown error"
            return SpawnError(f"rank {rank} failed: {last}\n\n--- traceback of rank {rank} "
                              f"---\n{tb.rstrip()}", rank=rank, remote_traceback=tb)
    return None


def worker(spec_path: str) -> int:
    """The body of a rank started by ``mpiexec`` (``python -m collectives.bench --worker``)."""
    spec = JobSpec(**json.loads(Path(spec_path).read_text()))
    from ..launch import detect_rendezvous
    rank = detect_rendezvous().rank
    try:
        rows, skipped = run_rank(spec)
        if rank == 0:
            Path(spec.out).write_text(json.dumps({"rows": rows, "skipped": skipped}))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        Path(os.path.dirname(spec.out), f"error-{rank}.txt").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        # Without MPI_Finalize: mpiexec then stops the other ranks at once instead of
        # leaving them waiting for this one in a collective.
        os._exit(1)
    return 0
