"""A fresh world of worker processes for one fault, and what it left behind.

A fault (a rank SIGKILLed, a rank that sleeps, ranks that call different collectives)
breaks the world it happens in, so each fault test gets a world of its own: a
:class:`FaultWorld` starts ``n`` workers with the launcher the test kit uses for that
backend (``collectives.testing.pool.launcher_for``: ``mpiexec`` for ``mpi``) or, for the
others, from a fork server that imported torch and the backends once (a fresh
interpreter per rank would pay ~2 s of imports per world; the suite starts dozens).

Unlike :class:`~collectives.testing.pool.WorldPool`, whose first dead worker stops the
world, :meth:`FaultWorld.call` lets the survivors finish and collects every rank's
outcome: its return value, the exception it raised (:class:`RemoteError`), or
:class:`Died` (with how and when it died). :meth:`FaultWorld.close` stops what is left and
returns :class:`Leftovers`: segments of the job in /dev/shm (seen before the launcher's
own clean-up could hide them), and processes still alive and TCP ports the ranks
listened on still bound once the launcher stopped the job.

    with FaultWorld("shm", 3, timeout=12) as world:
        for ports in world.call(tasks.listening_ports):
            world.note_ports(ports)
        outcomes = world.call(tasks.kill_in_collective, "all_reduce", 1, 11.0)
    # outcomes[1] is Died(...), the others the PeerError each survivor caught
    assert not world.leftovers
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from collectives.shm_names import PREFIX, SHM_DIR, job_digest, remove_job_segments
from collectives.spawn import describe_exit, free_port
from collectives.testing.mpi_launch import mpich_files, remove_dead_mpich_files
from collectives.testing.pool import (PRELOAD_VARIABLE, RemoteError, launcher_for,
                                      spawn_launcher)

#: Modules the fork server imports once, so that forked ranks start in milliseconds.
_FORKSERVER_PRELOAD = ["numpy", "torch", "torch.distributed", "zmq", "collectives",
                       "collectives.testing.pool", "backends.shm", "backends.zeromq",
                       "backends.torchdist", "faults.tasks", "faults.world"]
#: Seconds a world may take to start (rendezvous of 4 ranks on 2 busy cores; mpiexec).
START_TIMEOUT = 60.0


@dataclass
class Died:
    """A rank that ended without answering: ``how`` (exit status), ``after_s`` (seconds
    from the start of the call until the parent saw it end)."""

    rank: int
    how: str
    after_s: float


@dataclass
class Leftovers:
    """What a world left behind after it ended; empty (falsy) when nothing."""

    shm: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.shm or self.processes or self.ports)


def _job_segments(job_id: str) -> list[str]:
    stems = [f"{PREFIX}{job_digest(k)}-" for k in (job_id, f"COLLECTIVES_JOB_ID={job_id}")]
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(tuple(stems)))
    except FileNotFoundError:
        return []


def mpich_segments() -> set[str]:
    """MPICH's own shared-memory files in /dev/shm."""
    return mpich_files()


def remove_dead_mpich_segments(before: set[str]) -> list[str]:
    """Remove the MPICH segments created since ``before`` that no live process maps (see
    :func:`collectives.testing.mpi_launch.remove_dead_mpich_files`)."""
    return remove_dead_mpich_files(before)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie has exited already
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def port_bound(port: int) -> bool:
    """True when a TCP socket somewhere on this host still listens on (or holds) ``port``.
    SO_REUSEADDR, as servers set it: connections in TIME_WAIT do not count."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return True
    return False


def _forkserver_launcher(envs: list[dict[str, str]], initializer: Any = None) -> Any:
    """:func:`collectives.testing.pool.spawn_launcher`, but forking ranks from a server
    that imported torch and the backends once."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        _FORKSERVER_PRELOAD)  # takes effect only before the server starts
    return spawn_launcher(envs, initializer, start_method="forkserver")


class FaultWorld:
    """``n`` workers of ``backend`` with group timeout ``timeout`` (seconds), started at
    once; ``env`` adds variables (``COLLECTIVES_DEBUG``). Use as a context manager."""

    def __init__(self, backend: str, n: int, *, timeout: float,
                 env: Optional[dict[str, str]] = None) -> None:
        self.backend, self.n, self.timeout = backend, n, timeout
        self.job_id = secrets.token_hex(6)
        self.master_port = free_port()
        base = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.master_port), "COLLECTIVES_JOB_ID": self.job_id,
                "COLLECTIVES_SPAWNED": "1", "COLLECTIVES_BACKEND": backend,
                "COLLECTIVES_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1",
                PRELOAD_VARIABLE: "", **(env or {})}
        envs = [dict(base, RANK=str(r), LOCAL_RANK=str(r)) for r in range(n)]
        launcher = launcher_for(backend)
        if launcher.__name__ == "spawn_launcher":
            launcher = _forkserver_launcher
        #: MPICH segments before the job, and those of it removed after it (mpi only).
        self._mpich_before = mpich_segments() if backend == "mpi" else set()
        self.mpich_removed: list[str] = []
        self._world = launcher(envs, None)
        #: Process ids of the ranks (and of mpiexec's job), for the leak check.
        self.pids: list[int] = []
        self.ports: set[int] = {self.master_port}
        self.leftovers = Leftovers()
        self.slow_to_close: list[int] = []
        self._closed = False
        try:
            ready = self._collect(START_TIMEOUT)
        except BaseException:
            self.close()
            raise
        bad = [r for r in ready if not (isinstance(r, tuple) and r[0] == "ready")]
        if bad:
            self.close()
            raise RuntimeError(f"{backend} x{n}: the world did not start: {bad}")
        self.pids = [r[2] for r in ready]

    def __enter__(self) -> "FaultWorld":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self, limit: float, ranks: Optional[Sequence[int]] = None) -> list[Any]:
        """One message from each rank (a reply tuple), or :class:`Died`; ``None`` for a
        rank still silent after ``limit`` seconds."""
        world = self._world
        pending = set(range(self.n) if ranks is None else ranks)
        out: list[Any] = [None] * self.n
        start = time.monotonic()
        deadline = start + limit
        while pending and time.monotonic() < deadline:
            waitables = [world.conns[r] for r in pending]
            waitables += [world.sentinels[r] for r in pending] if world.sentinels else []
            ready = multiprocessing.connection.wait(
                waitables, timeout=max(0.0, deadline - time.monotonic()))
            for r in sorted(pending):
                conn = world.conns[r]
                died = bool(world.sentinels) and world.sentinels[r] in ready
                if conn not in ready and not died:
                    continue
                try:
                    if not conn.poll():
                        raise EOFError
                    out[r] = conn.recv()
                except (EOFError, OSError):
                    out[r] = Died(r, self._exit(r), time.monotonic() - start)
                pending.discard(r)
        return out

    def _exit(self, rank: int) -> str:
        procs = getattr(self._world, "procs", None)
        if procs is None:  # mpiexec: the ranks are not our children
            return "connection closed (mpiexec: " + self._world.exit_description(rank) + ")"
        procs[rank].join(1.0)
        code = procs[rank].exitcode
        return "still running" if code is None else describe_exit(code)

    def call(self, task: Any, *args: Any, limit: float = 30.0) -> list[Any]:
        """Run ``task(group, *args)`` on every rank; each rank's return value,
        :class:`RemoteError` or :class:`Died`, or ``None`` when it had not answered after
        ``limit`` seconds."""
        for conn in self._world.conns:
            try:
                conn.send(("call", task, args))
            except OSError:
                pass  # dead already: seen as Died below
        replies = self._collect(limit)
        out: list[Any] = []
        for r, reply in enumerate(replies):
            if isinstance(reply, tuple) and reply[0] == "ok":
                out.append(reply[1])
            elif isinstance(reply, tuple) and reply[0] == "error":
                out.append(RemoteError(r, *reply[1:]))
            else:
                out.append(reply)
        return out

    def note_ports(self, ports: Sequence[int]) -> None:
        """Ports the ranks listen on, checked by :meth:`close` once the job is over."""
        self.ports.update(int(p) for p in ports)

    def close(self, grace: float = 5.0) -> Leftovers:
        """End the job: survivors are asked to close their groups (``grace`` seconds),
        then the launcher stops what is left. Returns (and keeps in ``leftovers``) what
        the job left behind *before* the launcher's own clean-up of /dev/shm."""
        if self._closed:
            return self.leftovers
        self._closed = True
        world = self._world
        for conn in world.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        self._collect(grace)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_pid_alive(p) for p in self.pids):
            time.sleep(0.02)
        left = Leftovers(shm=_job_segments(self.job_id))
        #: Ranks still running ``grace`` s after being asked to close (information: the
        #: launcher stops them; a survivor's close() may wait for the group timeout).
        self.slow_to_close = [r for r, p in enumerate(self.pids) if _pid_alive(p)]
        world.stop()
        remove_job_segments(self.job_id)
        if self.backend == "mpi":
            self.mpich_removed = remove_dead_mpich_segments(self._mpich_before)
        left.processes = [p for p in self.pids if _pid_alive(p)]
        left.ports = sorted(p for p in self.ports if port_bound(p))
        self.leftovers = left
        return left
