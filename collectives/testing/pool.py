"""A world of worker processes started once and fed many cases.

Starting ``n`` interpreters and connecting them costs seconds; running one collective
costs milliseconds. :class:`WorldPool` pays the first once: it starts a world of
``world_size`` workers for one backend (each calls :func:`collectives.init_process_group`
with the environment a launcher gives) and then sends them work through pipes::

    with WorldPool("shm", 4) as pool:
        pool.check(CollectiveCase("all_reduce", (5,), "float32", reduce_op="SUM"))
        pool.call(my_module.my_check, 3)      # my_check(group, 3) on every rank

If a worker dies or a call outlives ``timeout``, :class:`PoolError` says which ranks and
what they were doing, the world is stopped, and the next call starts a fresh one.
:func:`~collectives.testing.check_backend` runs the whole hypothesis conformance sweep
in one call, :func:`~collectives.testing.check_algorithm` a collective of your own.

How workers are started is pluggable (:mod:`collectives.testing.launchers`): the default
starts them with ``multiprocessing``; MPI workers are started by ``mpiexec``. Tasks and
initializers travel by name; one defined in the script that runs the pool (``__main__``)
travels as a :class:`~collectives.testing.functions.FunctionRef`, so it works under every
launcher.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import secrets
import time
import weakref
from typing import Any, Optional, Sequence

from .. import settings
from ..errors import CollectiveError
from ..shm_names import remove_job_segments
from ..spawn import free_port
from .execution import CaseResult, compare, run_case
from .functions import as_task
from .launchers import (LaunchedWorld, Launcher, LauncherUnavailable, launcher_for,
                        resolve_launcher, spawn_launcher)
from .strategies import CollectiveCase
from .workers import PRELOAD_VARIABLE, Task, serve

__all__ = ["LaunchedWorld", "Launcher", "LauncherUnavailable", "PRELOAD_VARIABLE", "PoolError",
           "RemoteError", "RemoteErrors", "Task", "WorldPool", "launcher_for", "live_pools",
           "resolve_launcher", "serve", "spawn_launcher"]

#: Exceptions after which a world is kept: argument errors, raised before any message.
_ARGUMENT_ERRORS = ("TypeError", "ValueError")
#: Seconds a call may run past ``timeout`` (the group's own timeout) before the pool
#: stops the world: long enough for a CollectiveTimeout to arrive and name the culprit.
_GRACE = 5.0
#: Seconds a world may take to start (interpreters, imports, rendezvous) at the least: a
#: busy machine can be slow here while collectives themselves are fast.
_START_TIMEOUT = 60.0


class PoolError(CollectiveError):
    """The world of a :class:`WorldPool` failed: a worker died, hung, or could not start.
    The world is stopped; the next call starts a fresh one (unless the start failed)."""


class RemoteError(Exception):
    """The exception a worker raised, as seen in the parent: ``rank``, ``type_name``,
    ``message``, ``remote_traceback`` and, when it could be pickled, ``exception``."""

    def __init__(self, rank: int, type_name: str, message: str, remote_traceback: str,
                 exception: Optional[BaseException] = None) -> None:
        super().__init__(f"rank {rank}: {type_name}: {message}")
        self.rank, self.type_name, self.message = rank, type_name, message
        self.remote_traceback, self.exception = remote_traceback, exception

    def __reduce__(self) -> tuple:
        return (RemoteError, (self.rank, self.type_name, self.message,
                              self.remote_traceback, self.exception))

    def describe(self) -> str:
        """The message and the worker's traceback."""
        return f"{self}\n--- traceback of rank {self.rank} ---\n{self.remote_traceback.rstrip()}"


class RemoteErrors(CollectiveError):
    """:meth:`WorldPool.call` failed on some ranks. ``errors[r]`` is rank r's
    :class:`RemoteError` or None; ``results[r]`` its return value where it succeeded."""

    def __init__(self, errors: list[Optional[RemoteError]], results: list[Any]) -> None:
        failed = [e for e in errors if e is not None]
        super().__init__("\n\n".join(e.describe() for e in failed))
        self.errors, self.results = errors, results


# --------------------------------------------------------------------------------- pool
_live_pools: "weakref.WeakSet[WorldPool]" = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close(check_leaks=False)


def live_pools() -> list["WorldPool"]:
    """Pools of this process whose world is running (for leak checks)."""
    return [p for p in _live_pools if p.running]


class WorldPool:
    """``world_size`` workers of ``backend``, started once, fed many calls.

    ``timeout`` (seconds) is the group's timeout inside the workers and bounds every call
    (plus a few seconds' grace, so that the group's own ``CollectiveTimeout`` naming the
    missing ranks arrives first). ``initializer`` (a module-level callable or
    ``"module:function"``) runs in each worker before it joins the world: register a
    backend of your own there. ``preload`` names modules each worker imports while the
    world starts (``("torch",)``: seconds that would otherwise count against the first
    call's timeout). ``env`` adds environment variables. ``launcher`` is a launcher, or
    the name of one (``"spawn"``, ``"mpiexec"``: see
    :func:`~collectives.testing.launchers.resolve_launcher`); by default
    :func:`launcher_for(backend) <launcher_for>`.
    """

    def __init__(self, backend: str, world_size: int, *, timeout: float = 60.0,
                 launcher: "Launcher | str | None" = None,
                 initializer: Optional[Task] = None,
                 preload: Sequence[str] = (), env: Optional[dict[str, str]] = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"WorldPool: world_size must be a positive int, got {world_size!r}")
        if not isinstance(backend, str):
            raise TypeError(f"WorldPool: backend must be a name, got {type(backend).__name__}")
        self.backend, self.world_size, self.timeout = backend, world_size, float(timeout)
        self.launcher = resolve_launcher(launcher, backend, where="WorldPool")
        self.initializer = as_task(initializer)
        self.env = {PRELOAD_VARIABLE: ",".join(preload), **(env or {})}
        self.starts = 0
        self.job_id: Optional[str] = None
        self._world: Optional[LaunchedWorld] = None
        self._broken: Optional[str] = None

    def __repr__(self) -> str:
        state = "broken" if self._broken else "running" if self.running else "stopped"
        return f"<WorldPool {self.backend} x{self.world_size} {state}>"

    @property
    def running(self) -> bool:
        return self._world is not None

    def __enter__(self) -> "WorldPool":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(check_leaks=exc[0] is None)

    # ----------------------------------------------------------------------- lifetime
    def start(self) -> None:
        """Start the world if it is not running (``PoolError`` if it cannot start; the
        pool is then broken and every later call fails at once with the same reason)."""
        if self._broken:
            raise PoolError(f"{self!r}: {self._broken}")
        if self._world is not None:
            return
        self.job_id = secrets.token_hex(6)
        base = {"WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                settings.JOB_ID.name: self.job_id, settings.SPAWNED.name: "1",
                settings.BACKEND.name: self.backend,
                settings.TIMEOUT.name: str(self.timeout), "OMP_NUM_THREADS": "1",
                # as collectives.spawn does: network backends authenticate with it (zmq
                # would otherwise write a key file under the temp directory)
                settings.SECRET.name: secrets.token_hex(32), **self.env}
        envs = [dict(base, RANK=str(r), LOCAL_RANK=str(r)) for r in range(self.world_size)]
        self._world = self.launcher(envs, self.initializer)
        self.starts += 1
        _live_pools.add(self)
        try:
            replies = self._replies("starting the world", max(self.timeout, _START_TIMEOUT))
        except PoolError as exc:
            self._broken = f"the world could not start: {exc}"
            raise
        failed = [r for r in replies if isinstance(r, RemoteError)]
        if failed:
            self._stop()
            self._broken = "the world could not start:\n" + "\n".join(e.describe() for e in failed)
            raise PoolError(f"{self!r}: {self._broken}")
        ranks = [r[0] for r in replies]
        if ranks != list(range(self.world_size)):
            self._stop()
            self._broken = f"workers joined as ranks {ranks}, expected 0..{self.world_size - 1}"
            raise PoolError(f"{self!r}: {self._broken}")

    def restart(self) -> None:
        """Stop the world (by force) and start a fresh one."""
        self._stop()
        self.start()

    def close(self, check_leaks: bool = True) -> None:
        """Close every worker's group, stop the workers and remove the job's shared-memory
        segments. With ``check_leaks``, raise ``PoolError`` if a worker failed to close
        or did not exit, or a world that closed cleanly left segments behind."""
        world = self._world
        if world is None:
            return
        problems: list[str] = []
        try:
            for conn in world.conns:
                conn.send(("close",))
            replies = self._replies("closing the world", self.timeout + _GRACE)
            problems += [e.describe() for e in replies if isinstance(e, RemoteError)]
            deadline = time.monotonic() + 10.0
            while world.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if world.alive():
                problems.append(f"workers {world.alive()} did not exit after closing")
            leaked = remove_job_segments(self.job_id) if self.job_id else []
            if leaked:
                problems.append(f"shared-memory segments left in /dev/shm: {leaked}")
        except (PoolError, OSError) as exc:
            problems.append(str(exc))
        finally:
            self._stop()
        if problems and check_leaks:
            raise PoolError(f"{self!r}: closing the world: " + "\n".join(problems))

    def _stop(self) -> None:
        world, self._world = self._world, None
        _live_pools.discard(self)
        if world is not None:
            world.stop()

    # ---------------------------------------------------------------------- messages
    def _replies(self, what: str, limit: float) -> list[Any]:
        """Every rank's reply: its value, or a :class:`RemoteError`. A death or a reply
        missing after ``limit`` seconds stops the world and raises ``PoolError``."""
        world = self._world
        assert world is not None
        n = self.world_size
        replies: list[Any] = [None] * n
        pending = set(range(n))
        deadline = time.monotonic() + limit
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(what, f"no reply within {limit:g} s from ranks {sorted(pending)}",
                           replies, pending)
            sentinels = [world.sentinels[r] for r in pending] if world.sentinels else []
            ready = multiprocessing.connection.wait(
                [world.conns[r] for r in pending] + sentinels, timeout=remaining)
            for r in sorted(pending):
                conn = world.conns[r]
                died = world.sentinels and world.sentinels[r] in ready
                if conn not in ready and not died:
                    continue
                try:
                    if not conn.poll():
                        raise EOFError
                    message = conn.recv()
                except (EOFError, OSError):
                    self._fail(what, f"rank {r} died ({world.exit_description(r)})",
                               replies, pending - {r})
                pending.discard(r)
                if message[0] == "ok":
                    replies[r] = message[1]
                elif message[0] == "ready":
                    replies[r] = message[1:]
                else:
                    replies[r] = RemoteError(r, *message[1:])
        return replies

    def _fail(self, what: str, reason: str, replies: list[Any], pending: set[int]) -> None:
        errors = [e.describe() for e in replies if isinstance(e, RemoteError)]
        detail = "".join(f"\n\n{e}" for e in errors)
        if pending:
            detail += f"\n\nranks {sorted(pending)} had not replied"
        self._stop()
        detail += "\n\nThe world was stopped."
        raise PoolError(f"{self!r} while {what}: {reason}{detail}")

    def call(self, task: Task, *args: Any, timeout: Optional[float] = None,
             raise_errors: bool = True) -> list[Any]:
        """Run ``task(group, *args)`` on every rank and return the values in rank order.
        ``timeout`` (seconds) bounds this call instead of the pool's.

        If a rank raises, :class:`RemoteErrors` carries every rank's outcome (or, with
        ``raise_errors=False``, the list holds :class:`RemoteError` in that rank's place).
        After an exception other than ``TypeError``/``ValueError`` (which the contract
        raises before any message) the world's state is unknown: it is restarted.
        """
        self.start()
        world = self._world
        task = as_task(task)
        for conn in world.conns:
            conn.send(("call", task, args))
        replies = self._replies(f"calling {getattr(task, '__qualname__', task)}",
                                self.timeout + _GRACE if timeout is None else timeout)
        errors = [r if isinstance(r, RemoteError) else None for r in replies]
        if any(e is not None and e.type_name not in _ARGUMENT_ERRORS for e in errors):
            self._stop()  # the next call starts a fresh world
        if raise_errors and any(errors):
            raise RemoteErrors(errors, [None if e else r for e, r in zip(errors, replies)])
        return replies

    def run(self, case: CollectiveCase, *, task: Task = run_case,
            args: Sequence[Any] = ()) -> list[CaseResult]:
        """Run ``case`` on every rank (``task(group, *args, case)``, by default the public
        API's :func:`~collectives.testing.run_case`): each rank's :class:`CaseResult`
        (with ``error`` set where the rank raised)."""
        replies = self.call(task, *args, case, raise_errors=False)
        return [CaseResult(r, error=x) if isinstance(x, RemoteError) else x
                for r, x in enumerate(replies)]

    def check(self, case: CollectiveCase, *, task: Task = run_case, args: Sequence[Any] = (),
              name: str = "", reproduce: str = "") -> list[CaseResult]:
        """Run ``case`` (as :meth:`run`) and raise ``AssertionError`` describing every
        difference from the reference (outputs, untouched inputs, bitwise-equal all_reduce
        results, memory outside strided views, errors), titled with ``name`` and ending
        with the ``reproduce`` line; return the results when it passed."""
        results = self.run(case, task=task, args=args)
        problems = compare(case, self.world_size, results)
        if problems:
            raise AssertionError(
                f"{name + ' as ' if name else ''}{case.op} on backend {self.backend!r} with "
                f"{self.world_size} ranks: {len(problems)} problem(s)\n  case: {case!r}\n  - "
                + "\n  - ".join(p.replace("\n", "\n    ") for p in problems)
                + "\n  reproduce: "
                + (reproduce or f"WorldPool({self.backend!r}, {self.world_size}).check(case)"))
        return results
