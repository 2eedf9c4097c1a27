"""Workers of a :class:`~collectives.testing.pool.WorldPool` started by ``mpiexec``: the
pool's launcher for the ``mpi`` backend (and ``p2p:mpi``).

:func:`mpiexec_launcher` listens on a local TCP port (``multiprocessing.connection``,
authenticated with a random key) and runs::

    mpiexec -n N python -m collectives.testing.mpi_launch

Each worker connects back, says its MPI rank and pid, receives the environment the pool
made for that rank (``RANK``, ``WORLD_SIZE``, ``COLLECTIVES_BACKEND``, ...) and the
initializer and the pool's ``sys.path`` (tasks travel pickled by name), and runs
:func:`collectives.testing.pool.serve` on the connection, exactly as
a spawned worker does on its pipe. So the conformance suite runs on ``mpi`` with no
backend-specific test code; :func:`collectives.testing.pool.launcher_for` returns this
launcher for ``mpi`` (``MpiexecUnavailable`` when ``mpiexec`` or ``mpi4py`` is missing).

A worker that dies makes ``mpiexec`` stop the whole job (MPI's rule); the pool sees end of
file on the connections and reports ``mpiexec``'s exit status and the end of its output.
``mpiexec`` runs in a session of its own, gets SIGTERM if the pool's process dies, and
:meth:`MpiexecWorld.stop` ends it (SIGTERM, then SIGKILL to its process group).
``MPIEXEC`` names another launcher program; ``COLLECTIVES_MPIEXEC_ARGS`` adds arguments.

MPICH maps a per-node file ``/dev/shm/mpich_shm_*`` in ``MPI_Init``; a job that is stopped
by force, or whose ranks never got as far as the ``mpi`` backend (which unlinks it), leaves
it behind. :meth:`MpiexecWorld.stop` removes every such file that appeared since the job
started and that no live process maps any more (:func:`remove_dead_mpich_files`), so a
failed start leaves nothing in /dev/shm either.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from .. import settings
from ..mpiexec import MpiexecUnavailable, find_mpiexec, own_session_dying_with_parent
from ..spawn import describe_exit
from .workers import Task, serve

#: Seconds to wait for every worker to connect back.
_CONNECT_TIMEOUT = 60.0
#: Seconds between SIGTERM and SIGKILL when stopping mpiexec.
_TERMINATE_GRACE = 3.0
_ADDR_VAR, _KEY_VAR = settings.POOL_ADDRESS.name, settings.POOL_AUTHKEY.name
#: The repository root, so that workers import this checkout of the library.
_ROOT = str(Path(__file__).resolve().parents[2])


def mpiexec_program() -> str:
    """The path of ``mpiexec`` (see :func:`collectives.mpiexec.find_mpiexec`);
    :class:`~collectives.mpiexec.MpiexecUnavailable` if there is none or mpi4py is
    missing (``launchers.mpiexec`` turns it into ``LauncherUnavailable``)."""
    return find_mpiexec()



MPICH_PREFIX = "mpich_shm_"
_SHM_DIR = "/dev/shm"


def mpich_files() -> set[str]:
    """The names of MPICH's shared-memory files in /dev/shm."""
    try:
        return {n for n in os.listdir(_SHM_DIR) if n.startswith(MPICH_PREFIX)}
    except FileNotFoundError:
        return set()


def _mapped_shm_files() -> set[str]:
    """The names of the /dev/shm files some live process maps."""
    names = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.rsplit("/", 1)[1].strip() for line in f
                             if f" {_SHM_DIR}/" in line)
        except OSError:
            pass
    return names


def remove_dead_mpich_files(before: set[str]) -> list[str]:
    """Remove MPICH's files created since ``before`` that no live process maps (a job
    that ended left them; one still mapped belongs to a job that runs). Returns the names
    removed."""
    gone = sorted(mpich_files() - before - _mapped_shm_files())
    for name in gone:
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except FileNotFoundError:
            pass
    return gone


class MpiexecWorld:
    """The :class:`~collectives.testing.pool.LaunchedWorld` of one ``mpiexec`` job.
    ``mpich_removed`` lists the MPICH files :meth:`stop` removed."""

    def __init__(self, proc: subprocess.Popen, conns: list, pids: list[int],
                 log: Any, mpich_before: Optional[set[str]] = None) -> None:
        self.proc, self.conns, self.pids, self._log = proc, conns, pids, log
        self._mpich_before = mpich_files() if mpich_before is None else mpich_before
        self.mpich_removed: list[str] = []
        #: Empty: a worker's death shows as end of file on its connection.
        self.sentinels: list = []

    def exit_description(self, rank: int) -> str:
        try:
            code = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            code = None
        state = "mpiexec " + ("still running" if code is None else describe_exit(code))
        tail = self.output_tail()
        return state + (f"; its output ends with:\n{tail}" if tail else "")

    def output_tail(self, lines: int = 15) -> str:
        try:
            self._log.flush()
            with open(self._log.name, errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip()
        except (OSError, ValueError):
            return ""

    def alive(self) -> list[int]:
        pids = [pid for pid in self.pids if _exists(pid)]
        if self.proc.poll() is None:
            pids.append(self.proc.pid)
        return pids

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            try:  # workers that were told to close exit by themselves
                self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGTERM)
                try:
                    self.proc.wait(_TERMINATE_GRACE)
                except subprocess.TimeoutExpired:
                    pass
        _signal_group(self.proc, signal.SIGKILL)  # whatever is left of the job
        try:
            self.proc.wait(_TERMINATE_GRACE)
        except subprocess.TimeoutExpired:
            pass
        try:
            self._log.close()
            os.unlink(self._log.name)
        except OSError:
            pass
        self.mpich_removed += remove_dead_mpich_files(self._mpich_before)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie waiting for its parent (Hydra's proxy) to reap it has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # mpiexec's own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def mpiexec_launcher(envs: list[dict[str, str]],
                     initializer: Optional[Task] = None) -> MpiexecWorld:
    """Start ``len(envs)`` workers with ``mpiexec``; worker of MPI rank r gets ``envs[r]``
    and runs :func:`~collectives.testing.pool.serve`. Raises ``RuntimeError`` when they
    do not all connect back within a minute (with mpiexec's output)."""
    program = mpiexec_program()
    n = len(envs)
    authkey = secrets.token_bytes(16)
    listener = multiprocessing.connection.Listener(("127.0.0.1", 0), backlog=max(n, 8),
                                                   authkey=authkey)
    env = dict(os.environ)
    env[_ADDR_VAR] = "%s:%d" % listener.address
    env[_KEY_VAR] = authkey.hex()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
    # The job's own variables must come from the pool, not from a launcher around us.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    extra = settings.MPIEXEC_ARGS.get()
    command = [program, "-n", str(n), *extra, sys.executable, "-m", __name__]
    log = tempfile.NamedTemporaryFile("w+", prefix="collectives-mpiexec-", suffix=".log",
                                      delete=False)
    mpich_before = mpich_files()
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT,
                            preexec_fn=own_session_dying_with_parent)
    conns: list = [None] * n
    pids: list[int] = [0] * n
    world = MpiexecWorld(proc, conns, pids, log, mpich_before)
    accepted: list = []
    failure: list = []

    def accept_all() -> None:
        try:
            while len(accepted) < n:
                accepted.append(listener.accept())
        except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
            failure.append(exc)

    thread = threading.Thread(target=accept_all, name="mpiexec-pool-accept", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + _CONNECT_TIMEOUT
        while thread.is_alive() and proc.poll() is None and time.monotonic() < deadline:
            thread.join(0.05)
        if len(accepted) < n:
            reason = (f"mpiexec exited with code {proc.returncode}" if proc.poll() is not None
                      else f"only {len(accepted)} of {n} workers connected within "
                           f"{_CONNECT_TIMEOUT:g} s" if not failure else
                      f"accepting workers failed: {failure[0]}")
            raise RuntimeError(f"{' '.join(command)}: {reason}; output:\n"
                               f"{world.output_tail(30)}")
        for conn in accepted:
            if not conn.poll(_CONNECT_TIMEOUT):
                raise RuntimeError("a worker connected but did not say its rank")
            rank, pid = conn.recv()
            conns[rank], pids[rank] = conn, pid
        # As multiprocessing's spawn: our sys.path too. The initializer goes pickled on
        # its own, to be unpickled once that path is in place (it is found by name).
        initializer_bytes = pickle.dumps(initializer)
        for rank, conn in enumerate(conns):
            conn.send((envs[rank], initializer_bytes, list(sys.path)))
    except BaseException:
        for conn in accepted:
            conn.close()
        world.stop()
        raise
    finally:
        listener.close()
    return world


# -------------------------------------------------------------------------- the worker
def _mpi_rank() -> int:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = os.environ.get(name)
        if value:
            return int(value)
    from mpi4py import MPI  # a launcher without rank variables: ask MPI
    return MPI.COMM_WORLD.Get_rank()


def _worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops us; Ctrl-C is its job
    host, _, port = os.environ[_ADDR_VAR].rpartition(":")
    conn = multiprocessing.connection.Client((host, int(port)),
                                             authkey=bytes.fromhex(os.environ[_KEY_VAR]))
    conn.send((_mpi_rank(), os.getpid()))
    env, initializer_bytes, path = conn.recv()
    os.environ.update(env)
    sys.path[:0] = [p for p in path if p not in sys.path]  # tasks are pickled by name
    serve(conn, pickle.loads(initializer_bytes))
    # Skip the interpreter's slow shutdown, but end MPI properly: a rank that exits
    # without MPI_Finalize makes mpiexec kill the whole job.
    import atexit
    atexit._run_exitfuncs()  # e.g. backends.mpi closes groups the tests left open
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker()
