"""``collectives.spawn``: run a function on N local ranks and collect what they return.

Each rank is forked from a warm fork server that has imported the heavy modules once, or
is a fresh interpreter with ``COLLECTIVES_START_METHOD=spawn`` (:mod:`collectives.warm_start`
says how and why), with the environment a launcher would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``COLLECTIVES_JOB_ID``). If one rank
raises or dies, the others are stopped, everything the job allocated is removed, and the
parent raises :class:`SpawnError` naming the rank and carrying its traceback, once.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from . import flight_signals, lifetime, settings, warm_start
from .errors import CollectiveError, CollectiveTimeout, PeerError
from .validation import timeout_seconds
from .outer_launcher import refuse_under_launcher
from .registry import check_backend_name
from .shm_names import remove_job_segments

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
_TERMINATE_GRACE = 2.0
#: After the first failure, how long to wait for the root cause to be reported by
#: another rank (a killed peer's neighbours report PeerError; we prefer the original).
_ROOT_CAUSE_GRACE = 1.0

class SpawnError(CollectiveError):
    """A rank of a spawned job failed. ``rank``, ``exitcode`` and ``remote_traceback``
    say which and how; ``__cause__`` is the rank's own exception when it could be sent."""

    def __init__(self, message: str, *, rank: int, exitcode: Optional[int] = None,
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


#: Lowest port `free_port` draws from (below it lie well-known and registered services).
_LOWEST_DRAWN_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (to ``bind(port 0)`` and to the source
    of every outgoing connection)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_is_free(family: int, address: str, port: int) -> bool:
    """Whether a listening socket could bind ``address:port`` now (no ``SO_REUSEADDR``, so
    a port with a connection still in TIME_WAIT counts as taken)."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((address, port))
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _ipv6_works() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return socket.has_ipv6


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on every address of this machine (checked on
    ``host`` and on the IPv4 and IPv6 wildcards, where a store or rank 0 may listen),
    drawn from outside the kernel's ephemeral range.

    Why not ``bind(port 0)``: that port comes from the ephemeral range, and the moment it
    is released the kernel may hand it to any process's next ``bind(port 0)`` or outgoing
    connection (the ranks of the very job about to listen there bind their own data
    sockets that way), so rank 0's listen could fail with "Address already in use". A
    port outside the range is taken only by an explicit bind. Falls back to ``port 0``
    where the range leaves no room (fewer than 1000 ports below and above it).
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    address = sockaddr[0]
    checks = [(family, address), (socket.AF_INET, "0.0.0.0")]
    if _ipv6_works():
        checks.append((socket.AF_INET6, "::"))
    low, high = _ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST_DRAWN_PORT, low), (high + 1, 65536)) if b - a >= 1000]
    rng = secrets.SystemRandom()
    for _ in range(64 if spans else 0):
        a, b = rng.choices(spans, weights=[b - a for a, b in spans])[0]
        port = rng.randrange(a, b)
        if all(_port_is_free(f, addr, port) for f, addr in checks):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the launching process dies (no orphans)."""
    lifetime.prctl(lifetime.PR_SET_PDEATHSIG, signal.SIGKILL)


#: Prefix of a rank's process name (``/proc/PID/comm``): ``coll-rank3`` is rank 3.
RANK_PROCESS_PREFIX = "coll-rank"


def name_rank_process(rank: int) -> None:
    """Name this process ``coll-rank<rank>`` (``/proc/PID/comm``, what ``ps -o comm``,
    ``top`` and ``pgrep -x`` show) so that a tool outside the job finds rank ``rank``.

    Why: a rank forked from the warm fork server gets ``RANK`` in ``os.environ`` only;
    ``/proc/PID/environ`` shows the environment the kernel gave the fork server when it
    was executed, which has no ``RANK``, and a process cannot grow that block. The name
    it can set. Linux only; elsewhere nothing happens.
    """
    name = f"{RANK_PROCESS_PREFIX}{rank}".encode()[:15]
    lifetime.prctl(lifetime.PR_SET_NAME, name)


def _rank_main(method: str, fn: Callable[..., Any], args: tuple,
               conn: multiprocessing.connection.Connection) -> None:
    # `method` is what warm_start.RankSetup became when this rank unpickled it: the
    # rank's environment and streams are in place.
    die_with_parent()
    name_rank_process(int(os.environ.get("RANK", "0")))
    # The parent handles Ctrl-C for the whole job and stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = fn(*args)
        message: tuple = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        tb = traceback.format_exc()
        try:
            pickle.dumps(exc)
            carried: Any = exc
        except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
            carried = None
        message = ("error", type(exc).__name__, str(exc), tb, carried)
    # Plain pickle, not the connection's: once torch is imported, multiprocessing's
    # pickler sends tensors as shared-memory handles that die with this process.
    try:
        payload = pickle.dumps(message)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
        payload = pickle.dumps(("error", type(exc).__name__,
                                f"could not send the result to the parent: {exc}",
                                traceback.format_exc(), None))
    conn.send_bytes(payload)
    conn.close()
    warm_start.run_exit_handlers(method)


def _is_secondary(error_name: str) -> bool:
    """Errors that usually follow another rank's failure rather than cause one."""
    return error_name in (PeerError.__name__, CollectiveTimeout.__name__, "SpawnError")


def spawn(fn: Callable[..., Any], nproc: int, *, args: Sequence[Any] = (),
          backend: Optional[str] = None, timeout: Optional[float] = None,
          join_timeout: Optional[float] = None,
          env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks and return their results in rank order.

    ``fn`` must be importable by name (defined at module level). Inside, it calls
    :func:`collectives.init_process_group`, which finds its rank, the world size, the
    ``backend`` chosen here and the group ``timeout`` (seconds or a ``timedelta``) in its
    environment. ``join_timeout`` bounds the whole job. Bad arguments are refused here,
    before any rank starts: ``TypeError``/``ValueError`` naming ``spawn`` and the argument
    (an unknown ``backend`` lists those available). Example with two ranks:

    >>> import numpy as np, collectives
    >>> def work():
    ...     pg = collectives.init_process_group()
    ...     t = np.array([pg.rank + 1.0]); pg.all_reduce(t); pg.close()
    ...     return float(t[0])
    >>> collectives.spawn(work, 2)
    [3.0, 3.0]

    Under torchrun or mpirun this process is one rank of a world already, and spawning
    would start a separate local world inside every rank: ``spawn`` refuses with a
    ``RuntimeError`` that says so. Call ``fn`` directly there
    (``collectives.detect_rendezvous().launcher`` is ``"single"`` without a launcher).
    """
    refuse_under_launcher(nproc)
    args, seconds = _check_arguments(fn, nproc, args, backend, timeout, join_timeout, env)
    method = warm_start.start_method()
    ctx = warm_start.context(method)
    job_id = secrets.token_hex(6)
    base_env = {
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        settings.JOB_ID.name: job_id, settings.SPAWNED.name: "1",
    }
    base_env[settings.SECRET.name] = secrets.token_hex(32)  # authenticates network backends
    if backend is not None:
        base_env[settings.BACKEND.name] = backend
    if seconds is not None:
        base_env[settings.TIMEOUT.name] = str(seconds)
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        base_env["OMP_NUM_THREADS"] = "1"  # as torchrun does: N ranks x all cores crawls
    base_env.update(env or {})

    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    job = SpawnedJob(procs, conns, job_id,
               base_env.get(settings.BACKEND.name, settings.BACKEND.get()))
    with sigterm_raises():
        try:
            for rank in range(nproc):
                reader, writer = ctx.Pipe(duplex=False)
                rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                setup = warm_start.RankSetup(dict(os.environ, **rank_env), method)
                p = ctx.Process(target=_rank_main, args=(setup, fn, args, writer),
                                name=f"collectives-rank{rank}", daemon=False)
                # Under spawn the environment must be in place when the interpreter
                # starts, before it imports torch (which reads OMP_NUM_THREADS once).
                with warm_start.environment(rank_env):
                    p.start()
                writer.close()
                procs.append(p)
                conns.append(reader)
            results = job.collect(join_timeout)
        except BaseException:
            # On the way out already (Ctrl-C, SIGTERM, a failed rank): another Ctrl-C
            # during the clean-up would only repeat the request, and must not cut it short.
            with _signals_deferred(deliver=False):
                job.stop()
            raise
        with _signals_deferred(deliver=True):
            job.stop()
        return results


#: Backends whose library may abort the process (gloo's C++ ``terminate``, MPI's error
#: handler) when the ranks' calls do not match, instead of raising.
_ABORTING_BACKENDS = ("gloo", "mpi", "torch", "nccl")


def describe_exit(code: Optional[int], backend: Optional[str] = None) -> str:
    """How a process ended, for an error message: ``"exited with code 3"``, ``"was
    killed by signal 9 (SIGKILL)"``; for SIGABRT under a backend whose library aborts on
    mismatched calls, how to have the mismatch named instead.

    >>> describe_exit(-6, "gloo").split(";")[0]
    'was killed by signal 6 (SIGABRT)'
    """
    if code is None:
        return "ended without an exit code"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    text = f"was killed by signal {-code}{name}"
    if -code == signal.SIGABRT and (backend or "").split(":")[-1] in _ABORTING_BACKENDS:
        text += (f"; under {backend} a call that does not match the other ranks' (another "
                 f"op, size, dtype or root) can abort inside the library: run with "
                 f"{settings.DEBUG.name}=1 to have the mismatch named (CollectiveMismatch)")
    return text


def _check_arguments(fn: Any, nproc: Any, args: Any, backend: Any, timeout: Any,
                     join_timeout: Any, env: Any) -> tuple[tuple, Optional[float]]:
    """Refuse bad arguments of :func:`spawn` in the parent, before any rank starts (a
    rank would fail with a message that names neither spawn nor the argument). Returns
    ``args`` as a tuple and the group timeout in seconds (or None)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"spawn: argument `nproc` must be a positive int, got {nproc!r}")
    if not callable(fn):
        raise TypeError(f"spawn: argument `fn` must be callable, got {type(fn).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Iterable):
        raise TypeError(f"spawn: argument `args` must be a tuple or list of the arguments "
                        f"of `fn`, got {type(args).__name__} {args!r}")
    if backend is not None:
        check_backend_name(backend, where="spawn", what="argument `backend`")
    seconds = None if timeout is None else timeout_seconds(timeout, 0.0, where="spawn")
    timeout_seconds(join_timeout, 0.0, where="spawn", arg="join_timeout")
    if env is not None:
        if not isinstance(env, Mapping):
            raise TypeError(f"spawn: argument `env` must be a dict of environment "
                            f"variables (str to str), got {type(env).__name__} {env!r}")
        bad = [(k, v) for k, v in env.items() if not isinstance(k, str)
               or not isinstance(v, str)]
        if bad:
            raise TypeError(f"spawn: argument `env` must map str to str; not "
                            f"{bad[0][0]!r}: {bad[0][1]!r}")
    return tuple(args), seconds


class SpawnedJob:
    """The parent's view of the spawned ranks: results, failures, and clean-up."""

    def __init__(self, procs: list, conns: list, job_id: str,
                 backend: Optional[str] = None) -> None:
        self.procs, self.conns, self.job_id = procs, conns, job_id
        self.backend = backend  # names the library in the message of a rank that aborted
        self.reported: set[int] = set()

    def collect(self, join_timeout: Optional[float]) -> list[Any]:
        n = len(self.procs)
        results: list[Any] = [None] * n
        done = [False] * n
        failures: list[tuple[int, str, str, str, Any, Optional[int]]] = []
        deadline = None if join_timeout is None else time.monotonic() + join_timeout
        first_failure_at: Optional[float] = None
        while not all(done):
            now = time.monotonic()
            if first_failure_at is not None and (now - first_failure_at > _ROOT_CAUSE_GRACE):
                break
            if deadline is not None and now > deadline:
                running = [r for r in range(n) if not done[r]]
                raise SpawnError(f"spawn: ranks {running} still running after "
                                 f"join_timeout={join_timeout} s; stopped them",
                                 rank=running[0])
            waitables = [self.conns[r] for r in range(n) if not done[r]] + \
                        [self.procs[r].sentinel for r in range(n) if not done[r]]
            ready = multiprocessing.connection.wait(waitables, timeout=0.2)
            for r in range(n):
                if done[r]:
                    continue
                conn, proc = self.conns[r], self.procs[r]
                message = None
                if conn in ready or proc.sentinel in ready:
                    try:
                        if conn.poll():
                            message = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        message = None
                    if message is None and proc.sentinel not in ready:
                        continue
                    if message is None:
                        proc.join(0.1)
                        failures.append((r, "died", f"rank {r} "
                                         f"{describe_exit(proc.exitcode, self.backend)} "
                                         f"without a result", "", None, proc.exitcode))
                    elif message[0] == "ok":
                        results[r] = message[1]
                    else:
                        _, name, text, tb, exc = message
                        failures.append((r, name, text, tb, exc, None))
                    done[r] = True
                    self.reported.add(r)
                    if failures and first_failure_at is None:
                        first_failure_at = time.monotonic()
        if failures:
            raise self._error(failures)
        return results

    @staticmethod
    def _error(failures: list) -> SpawnError:
        primary = next((f for f in failures if not _is_secondary(f[1])), failures[0])
        rank, name, text, tb, exc, exitcode = primary
        others = [f"rank {f[0]}: {f[1]}" for f in failures if f is not primary]
        message = f"rank {rank} failed: {name}: {text}"
        if tb:
            message += f"\n\n--- traceback of rank {rank} ---\n{tb.rstrip()}"
        if others:
            message += "\n\n(after it, " + "; ".join(others) + ")"
        error = SpawnError(message, rank=rank, exitcode=exitcode, remote_traceback=tb)
        error.__cause__ = exc if isinstance(exc, BaseException) else None
        return error

    def stop(self) -> None:
        """Stop every rank still running (SIGTERM, then SIGKILL) and remove the job's
        shared-memory segments."""
        # Ranks that reported are on their way out: let their finalizers run.
        deadline = time.monotonic() + _TERMINATE_GRACE
        for r, p in enumerate(self.procs):
            if r in self.reported:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.close() if p.exitcode is not None else None
        remove_job_segments(self.job_id)


class sigterm_raises:
    """While ranks run, turn SIGTERM into SystemExit in the parent's main thread (as Ctrl-C
    raises KeyboardInterrupt), so the ``finally`` that stops the ranks runs. Left alone
    where SIGTERM already has a handler. Also used by the bench while it waits for
    mpiexec."""

    def __enter__(self) -> None:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGTERM)
            # The flight recorder's handler (it writes the records, then acts as the
            # default would) counts as the default here.
            if current in (signal.SIG_DFL, None) or (
                    flight_signals.is_ours(current) and
                    flight_signals.previous_handler(signal.SIGTERM) in (signal.SIG_DFL,
                                                                       None)):
                self._previous = signal.signal(signal.SIGTERM, _raise_terminated)

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _raise_terminated(signum: int, frame: Any) -> None:
    flight_signals.dump_open_groups(signal.Signals(signum).name)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_deferred(deliver: bool) -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the duration of the block (in the main thread;
    a no-op elsewhere) and, with ``deliver``, act on the first after it: stopping the
    ranks and removing the job's segments takes a few seconds at most and must not be
    cut short half-way, leaving ranks or segments behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught and deliver:  # now, with the previous handlers: KeyboardInterrupt, ...
            signal.raise_signal(caught[0])
