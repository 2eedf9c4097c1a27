"""What the ranks of a :class:`~faults.world.FaultWorld` run: ``task(group, *args)``.

Each task catches the error it provokes and returns a summary (type, message, the
error's fields, seconds until it came), so that the test measures the backend, not the
launcher's own failure handling.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

import numpy as np

from collectives import CollectiveError, ReduceOp
from collectives.group import ProcessGroup

#: Every collective a rank can be killed in. ``gather``/``scatter``/``broadcast``/
#: ``reduce`` use root 0.
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "barrier")
#: Elements (float32) per rank in the collectives a rank is killed in: large enough
#: that one call takes milliseconds, so the kill lands inside one.
ELEMENTS = 1 << 20


def tcp_inodes(state: str) -> dict[str, int]:
    """socket inode -> local port of the TCP sockets on this host in ``state`` (the
    kernel's hex code: ``"0A"`` listening, ``"01"`` established)."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == state:
                        out[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
        except OSError:
            pass
    return out


def listening_inodes() -> dict[str, int]:
    """socket inode -> port of the TCP sockets on this host that listen."""
    return tcp_inodes("0A")


def listening_ports(group: ProcessGroup) -> list[int]:
    """The TCP ports this rank's process listens on (its own sockets only)."""
    listening = listening_inodes()
    ports = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            port = listening.get(target[8:-1])
            if port is not None:
                ports.append(port)
    return sorted(set(ports))


#: Ops of these tasks that are a collective under another name: the name errors use.
OP_NAMES = {"all_reduce_symmetric": "all_reduce", "all_reduce_small": "all_reduce",
            "all_reduce_single_copy": "all_reduce"}


def _call(group: ProcessGroup, op: str) -> Callable[[], None]:
    """A closure running collective ``op`` on buffers made once (root 0);
    ``all_reduce_symmetric`` is an all_reduce of a buffer from ``alloc_symmetric``
    (shm reads the peers' buffers in place), ``all_reduce_small`` one of 64 bytes,
    ``all_reduce_single_copy`` the plain one with ``COLLECTIVES_SHM_CMA=1`` (shm reads
    and writes the peers' arrays through the kernel whatever its speed, where it can)."""
    n = group.size
    a = np.ones(ELEMENTS, np.float32)
    if op == "all_reduce_symmetric":  # (a collective: every rank makes the same closure)
        sym = group.alloc_symmetric(a.nbytes).view(np.float32)
        sym[:] = 1.0
        return lambda: group.all_reduce(sym)
    if op == "all_reduce_small":      # one phase (shm: one call of the compiled core)
        small = np.ones(16, np.float32)
        return lambda: group.all_reduce(small)
    if op == "all_reduce_single_copy":
        os.environ["COLLECTIVES_SHM_CMA"] = "1"   # (read at the group's first large call)
        return lambda: group.all_reduce(a)
    big = np.ones(ELEMENTS * n, np.float32)
    root = group.rank == 0
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: group.all_reduce(a),
        "broadcast": lambda: group.broadcast(a, src=0),
        "reduce": lambda: group.reduce(a, dst=0),
        "all_gather": lambda: group.all_gather(big, a),
        "gather": lambda: group.gather(a, big if root else None, dst=0),
        "scatter": lambda: group.scatter(a, big if root else None, src=0),
        "reduce_scatter": lambda: group.reduce_scatter(a, big),
        "all_to_all": lambda: group.all_to_all(big, big.copy()),
        "barrier": lambda: group.barrier(),
    }
    return calls[op]


def summary(exc: BaseException, t0: float) -> dict:
    """What the test needs to know of an error raised ``time.time() - t0`` s after t0."""
    return {"type": type(exc).__name__, "message": str(exc),
            "peer": getattr(exc, "peer", None), "op": getattr(exc, "op", None),
            "seq": getattr(exc, "seq", None),
            "missing": list(getattr(exc, "missing", ()) or ()),
            "after_s": time.time() - t0}


def kill_in_collective(group: ProcessGroup, op: str, victim: int, limit: float,
                       delay: float = 0.05) -> dict:
    """Every rank runs ``op`` in a loop; ``victim`` SIGKILLs itself ``delay`` s after
    the start (inside a call). A survivor returns how it learned of it: the error's
    summary, with ``after_s`` counted from the kill; or ``{"type": None}`` if the loop
    ran ``limit`` seconds without an error."""
    run = _call(group, op)
    run()  # connections and buffers warm: the kill hits a collective, not set-up
    group.barrier()
    t0 = time.time()
    if group.rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    calls = 0
    try:
        while time.time() - t0 < limit:
            run()
            calls += 1
    except CollectiveError as exc:
        out = summary(exc, t0 + delay)
        out["calls"] = calls
        return out
    return {"type": None, "calls": calls}


def kill_during_recv(group: ProcessGroup, how: str, victim: int, receiver: int,
                     limit: float, delay: float = 0.05) -> dict:
    """``victim`` SIGKILLs itself ``delay`` s after a barrier while ``receiver`` waits to
    receive from it (``how``: ``"recv"``, or ``"irecv"`` and the Work's wait); the
    receiver returns its error's summary (``after_s`` from the kill), or
    ``{"type": None}`` if nothing failed; every other rank returns at once."""
    buf = np.empty(16, np.float32)
    group.barrier()
    if group.rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        time.sleep(limit)
    if group.rank != receiver:
        return {"type": None}
    t0 = time.time()
    try:
        if how == "recv":
            group.recv(buf, src=victim)
        else:
            group.irecv(buf, src=victim).wait()
    except CollectiveError as exc:
        return summary(exc, t0 + delay)
    return {"type": None}


def sleep_in_collective(group: ProcessGroup, op: str, sleeper: int, sleep: float) -> dict:
    """Every rank but ``sleeper`` calls ``op`` (after one warm-up call); ``sleeper``
    sleeps ``sleep`` s in user code and never makes the call. Returns the error's
    summary with ``after_s`` counted from the call, or ``{"type": None}``; also the
    ``seq`` the call had."""
    run = _call(group, op)
    run()
    group.barrier()
    expected_seq = group._seq  # the next collective's sequence number on this group
    if group.rank == sleeper:
        time.sleep(sleep)
        return {"type": None, "slept": sleep}
    t0 = time.time()
    try:
        run()
        out: dict = {"type": None}
    except CollectiveError as exc:
        out = summary(exc, t0)
    out["expected_seq"] = expected_seq
    return out


def mismatch(group: ProcessGroup, kind: str, odd: int) -> dict:
    """Rank ``odd`` makes a call that differs from the others' by ``kind`` ("op":
    broadcast instead of all_reduce, "shape", "dtype", "root"); every rank reports the
    error it got (a summary) or ``{"type": None}``. Runs on a fresh sub-group over every
    rank, so one world serves several kinds."""
    g = group.new_group(list(range(group.size)))
    me = group.rank == odd
    t0 = time.time()
    try:
        if kind == "op":
            if me:
                g.broadcast(np.ones(16, np.float32), src=0)
            else:
                g.all_reduce(np.ones(16, np.float32))
        elif kind == "shape":
            g.all_reduce(np.ones(24 if me else 16, np.float32))
        elif kind == "dtype":
            g.all_reduce(np.ones(16, np.int32 if me else np.float32))
        elif kind == "root":
            g.broadcast(np.ones(16, np.float32), src=1 if me else 0)
        elif kind == "symmetric op":   # in symmetric memory, past the one-phase size
            sym = g.alloc_symmetric(1 << 20).view(np.float32)
            g.all_reduce(sym, ReduceOp.MAX if me else ReduceOp.SUM)
        else:
            raise ValueError(f"mismatch: unknown kind {kind!r}")
        g.barrier()  # a rank that returned early learns of the mismatch here
        out: dict = {"type": None}
    except CollectiveError as exc:
        out = summary(exc, t0)
    return out


def _caught(fn: Callable[[], Any], t_abort: list) -> dict:
    """Run ``fn``; what it raised (None: nothing), and how long after the abort (the
    time in ``t_abort[0]``, once set) it came."""
    try:
        fn()
        return {"type": None}
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        now = time.monotonic()
        return {"type": type(exc).__name__, "message": str(exc),
                "after_abort_s": now - t_abort[0] if t_abort else None}


def abort_in_collective(group: ProcessGroup, how: str, victim: int = 1,
                        after: float = 0.6) -> dict:
    """Rank 0 waits in an all_reduce of ``group`` (and a thread of it in one of a
    sub-group) that ``victim`` does not join: ``victim`` is asleep (``how="asleep"``),
    stopped by rank 0 with SIGSTOP (``"stopped"``) or SIGKILLed by rank 0 (``"dead"``),
    and ``after`` seconds in, a third thread of rank 0 calls ``group.abort()``. Rank 0
    returns what each pending call raised and how long after the abort, how long
    ``abort()`` took, what later calls raise, and its listening TCP ports before and
    after; the other ranks what their own all_reduce ended in (bounded by the group's
    timeout)."""
    pids = group.all_gather_object(os.getpid())
    sub = group.new_group(list(range(group.size)))
    ports_before = listening_ports(group)
    group.barrier()
    x = np.ones(1000, np.float32)
    if group.rank == victim:
        time.sleep(after + 1.5)   # (stopped or killed meanwhile, or just late)
        return {"late": _caught(lambda: group.all_reduce(x), [time.monotonic()])}
    if group.rank != 0:
        return {"other": _caught(lambda: group.all_reduce(x), [time.monotonic()])}
    if how == "stopped":
        os.kill(pids[victim], signal.SIGSTOP)
    elif how == "dead":
        os.kill(pids[victim], signal.SIGKILL)
    t_abort: list = []
    took: list = []

    def abort() -> None:
        t0 = time.monotonic()
        t_abort.append(t0)
        group.abort()
        took.append(time.monotonic() - t0)

    sub_result: list = []
    in_sub = threading.Thread(target=lambda: sub_result.append(
        _caught(lambda: sub.all_reduce(x.copy()), t_abort)))
    in_sub.start()
    timer = threading.Timer(after, abort)
    timer.start()
    out = {"pending": _caught(lambda: group.all_reduce(x), t_abort)}
    timer.join()
    in_sub.join(10.0)
    out["sub"] = sub_result[0] if sub_result else {"type": "still waiting"}
    out["abort_s"] = took[0] if took else None
    out["later"] = _caught(group.barrier, t_abort)["type"]
    out["later_sub"] = _caught(sub.barrier, t_abort)["type"]
    out["later_send"] = _caught(lambda: group.send(x, dst=victim), t_abort)["type"]
    time.sleep(0.5)   # (libzmq closes its sockets in its own thread)
    out["ports"] = (ports_before, listening_ports(group))
    if how == "stopped":
        os.kill(pids[victim], signal.SIGCONT)
    group.close()   # (nothing more to do: idempotent after abort)
    return out
