"""How the workers of a :class:`~collectives.testing.WorldPool` are started.

A *launcher* takes one environment per rank and returns a :class:`LaunchedWorld` whose
connections lead to workers running :func:`~collectives.testing.workers.serve`.
:func:`spawn_launcher` (``multiprocessing`` "spawn" context, pipes) is the default;
:func:`collectives.testing.mpi_launch.mpiexec_launcher` starts them with ``mpiexec``
(MPI ranks must be started by their launcher). :func:`launcher_for` picks one by backend
name; :func:`resolve_launcher` also takes a launcher's name (``"spawn"``, ``"mpiexec"``)
for a backend of your own that needs one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from .. import settings
from ..mpiexec import MpiexecUnavailable
from ..registry import P2P_ONLY_PREFIX
from ..spawn import SpawnedJob, describe_exit
from .workers import Task, _spawned_worker


class LaunchedWorld(Protocol):
    """What a launcher returns: ``conns[r]`` leads to rank r's worker (running
    :func:`serve`); ``sentinels`` become ready when a worker exits (may be empty: then a
    death shows as end of file on its connection); ``alive()`` lists the pids still
    running; ``stop()`` ends every worker, by force if needed; ``exit_description(r)``
    says how rank r ended ('' if unknown)."""

    conns: Sequence[multiprocessing.connection.Connection]
    sentinels: Sequence[Any]

    def exit_description(self, rank: int) -> str: ...

    def stop(self) -> None: ...

    def alive(self) -> list[int]: ...


#: ``launcher(envs, initializer) -> LaunchedWorld``: start ``len(envs)`` workers, worker r
#: with ``envs[r]`` added to its environment, each running ``serve(conn, initializer)``.
Launcher = Callable[[list[dict[str, str]], Optional[Task]], LaunchedWorld]


class _SpawnedWorld:
    def __init__(self, procs: list, conns: list, job_id: str) -> None:
        self.procs, self.conns = procs, conns
        self.sentinels = [p.sentinel for p in procs]
        self._job = SpawnedJob(procs, conns, job_id)

    def exit_description(self, rank: int) -> str:
        p = self.procs[rank]
        p.join(0.5)
        code = p.exitcode
        if code is None:
            return "still running"
        return describe_exit(code, settings.BACKEND.get())

    def alive(self) -> list[int]:
        return [p.pid for p in self.procs if p.is_alive()]

    def stop(self) -> None:
        self._job.stop()  # SIGTERM, SIGKILL after a grace, close pipes, remove segments


def spawn_launcher(envs: list[dict[str, str]], initializer: Optional[Task] = None, *,
                   start_method: str = "spawn") -> _SpawnedWorld:
    """Start one ``multiprocessing`` process per environment (the default launcher;
    ``start_method="forkserver"`` forks them from a server that already imported what
    ``multiprocessing.set_forkserver_preload`` named). Workers die with the pool's
    process (``PR_SET_PDEATHSIG``). Each worker's environment is this process's at the
    call plus its entry of ``envs``, whichever the start method (a fork server's own
    environment is the one it started with)."""
    ctx = multiprocessing.get_context(start_method)
    procs, conns = [], []
    job_id = envs[0].get(settings.JOB_ID.name, "") if envs else ""
    try:
        for env in envs:
            ours, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_spawned_worker, args=({**os.environ, **env}, theirs,
                                                          initializer),
                            name=f"collectives-pool-rank{env.get('RANK', '?')}", daemon=False)
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
    except BaseException:
        SpawnedJob(procs, conns, job_id).stop()
        raise
    return _SpawnedWorld(procs, conns, job_id)


class LauncherUnavailable(RuntimeError):
    """No launcher can start workers of this backend here."""


def launcher_for(backend: str) -> Launcher:
    """The launcher that starts workers of ``backend``: :func:`spawn_launcher` for every
    backend whose ranks meet through the launcher's environment (shm, zmq, gloo, third
    parties). ``mpi`` and ``p2p:mpi`` need their workers started by ``mpiexec``
    (connecting back to the pool and running ``serve``):
    :func:`collectives.testing.mpi_launch.mpiexec_launcher`, or
    :class:`LauncherUnavailable` where ``mpiexec`` or ``mpi4py`` is missing. A backend of
    your own that needs ``mpiexec`` says so with ``launcher="mpiexec"``
    (:func:`resolve_launcher`): the choice never depends on how its name is spelled."""
    base = backend.removeprefix(P2P_ONLY_PREFIX)
    return mpiexec() if base == "mpi" else spawn_launcher


def mpiexec() -> Launcher:
    """:func:`collectives.testing.mpi_launch.mpiexec_launcher`, or
    :class:`LauncherUnavailable` (with the reason) where it cannot run here."""
    from .mpi_launch import mpiexec_launcher, mpiexec_program
    try:
        mpiexec_program()
    except MpiexecUnavailable as exc:
        raise LauncherUnavailable(f"the mpi backend {exc}") from None
    return mpiexec_launcher


#: Launchers by name, for ``launcher="..."``.
LAUNCHERS: dict[str, Callable[[], Launcher]] = {"spawn": lambda: spawn_launcher,
                                                 "mpiexec": mpiexec}


def resolve_launcher(launcher: Union[Launcher, str, None], backend: str,
                     where: str = "WorldPool") -> Launcher:
    """The launcher ``launcher`` names: None picks :func:`launcher_for(backend)
    <launcher_for>`; ``"spawn"`` is :func:`spawn_launcher`; ``"mpiexec"`` starts the
    workers with ``mpiexec`` (for a backend of your own built on MPI); a callable
    ``launcher(envs, initializer) -> LaunchedWorld`` is used as it is. ``TypeError`` or
    ``ValueError`` naming ``where`` for anything else.

    >>> resolve_launcher("spawn", "mine") is spawn_launcher
    True
    """
    if launcher is None:
        return launcher_for(backend)
    if isinstance(launcher, str):
        if launcher not in LAUNCHERS:
            raise ValueError(f"{where}: argument `launcher`: unknown launcher {launcher!r}; "
                             f"one of {sorted(LAUNCHERS)}, or a callable "
                             f"launcher(envs, initializer)")
        return LAUNCHERS[launcher]()
    if not callable(launcher):
        raise TypeError(f"{where}: argument `launcher` must be a launcher's name "
                        f"({', '.join(map(repr, sorted(LAUNCHERS)))}) or a callable "
                        f"launcher(envs, initializer), got {type(launcher).__name__}")
    return launcher
