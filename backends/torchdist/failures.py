"""How a torch group finds out what went wrong, and says it with this library's errors.

gloo tells a peer's death only to the ranks connected to it in the current operation (the
others wait for the whole group timeout), and its timeouts do not say who never arrived.
So in a gloo group the members on one host exchange their process ids when it is built
(:class:`Failures`), and a blocking wait is taken in slices that look for a member whose
process has ended, or for an abort (``Failures.wait``); after a timeout, the ranks report
theirs in the store, and those that do not within ``_TIMEOUT_REPORT_GRACE`` are named as
missing (``timed_out_with``). ``translate`` turns torch's ``RuntimeError`` into
:class:`~collectives.errors.PeerError`, :class:`~collectives.errors.CollectiveTimeout` or
:class:`~collectives.errors.CollectiveError` naming the operation and the rank.

A :class:`~backends.torchdist.backend.TorchBackend` holds one :class:`Failures`; kept
apart because it is about failures, not collectives. Also here: how torch words a closed
connection (``_PEER_GONE``) and an operation the build lacks (``unsupported``), and
``keep_forever`` for the torch objects of a group given up on.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import socket
import time
from typing import Any, NoReturn

from collectives.errors import CollectiveError, CollectiveTimeout, PeerError
from collectives.lifetime import process_alive

from .meeting import first_line

#: After a timeout, how long to wait for the other ranks to report theirs (the ranks
#: that do not are named as missing).
_TIMEOUT_REPORT_GRACE = 1.0

_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "connection refused",
              "connection closed", "end of file", "socket closed")

#: How often a blocking wait on gloo looks for peers that died on this host (gloo tells
#: only the ranks connected to the dead one in the current operation; the others would
#: wait for the whole group timeout) and whether the group was aborted.
WATCH_INTERVAL = datetime.timedelta(seconds=0.5)


def is_watch_timeout(exc: RuntimeError) -> bool:
    """Whether ``exc`` is the end of one ``wait(WATCH_INTERVAL)`` slice, not a real error.

    gloo words it per op: a collective's work says "Operation timed out!", a send or a
    receive "Timed out waiting 500ms for recv operation to complete" (torch 2.13), with
    the slice's length in milliseconds; the group timeout names its own, longer, length.
    """
    text = str(exc)
    return ("Operation timed out!" in text
            or f"Timed out waiting {round(WATCH_INTERVAL.total_seconds() * 1000)}ms" in text)


class Failures:
    """What went wrong in one torch backend, said with this library's errors. Reads the
    backend's ``rank``, ``size``, ``timeout``, ``name``, ``describe_call``, ``aborted``
    and ``store`` (None once closed); ``prefix`` is the backend's key prefix in the
    store.

    Two ranks, rank 1 killed: rank 0's ``backend.failures.wait(work, "all_reduce", 3)``
    raises ``PeerError: [rank 0/2] all_reduce (seq 3): rank 1 died (its process ...)``.
    """

    @property
    def knows_pids(self) -> bool:
        """Whether the members exchange process ids (gloo; not NCCL, whose waits are not
        watched)."""
        return self._backend.name == "gloo"

    def __init__(self, backend: Any, prefix: str) -> None:
        self._backend = backend
        self._prefix = prefix
        #: Group rank -> process id of the members on this host (see ``dead_peers``).
        self.local_pids: dict[int, int] = self._exchange_pids()

    def _exchange_pids(self) -> dict[int, int]:
        """Every member publishes ``host pid`` in the store; returns group rank -> pid
        of the other members on this host (empty for a world of one, or where not
        ``knows_pids``). Lets a rank name a peer that died (``dead_peers``)."""
        b = self._backend
        if b.size == 1 or not self.knows_pids or b.store is None:
            return {}
        key = f"{self._prefix}collectives-pid/"
        host = socket.gethostname()
        b.store.set(f"{key}{b.rank}", f"{host} {os.getpid()}")
        pids = {}
        for r in range(b.size):
            if r != b.rank:
                peer_host, _, pid = b.store.get(f"{key}{r}").decode().rpartition(" ")
                if peer_host == host:
                    pids[r] = int(pid)
        return pids

    def dead_peers(self) -> list[int]:
        """Group ranks on this host whose process has ended."""
        return [r for r, pid in self.local_pids.items() if not process_alive(pid)]

    def wait(self, w: Any, op: str, seq: int, peer: int = -1) -> None:
        """``w.wait()``, raising :class:`PeerError` as soon as a member of the group on
        this host dies, and ``CollectiveError`` once the backend was aborted (both
        checked every ``WATCH_INTERVAL``).

        A send or receive (``seq < 0``, ``peer >= 0``) is waited on whole: a sliced wait
        on one that times out closes gloo's connection (see :class:`TorchWork`). Its
        peer's death still ends it at once, as a closed connection (``translate`` names
        the rank); an abort ends it by aborting torch's group (``TorchBackend.abort``).

        Only gloo's are watched so: NCCL's are waited on whole (its ``wait(timeout)``
        that runs out aborts the communicator), and so are those of the ``collectives``
        backend, whose group underneath bounds every wait by its own timeout and names a
        dead peer itself.
        """
        b = self._backend
        if (seq < 0 and peer >= 0) or b.name != "gloo":
            # (NCCL's wait(timeout) that runs out aborts its communicator: not sliced)
            w.wait()
            return
        while True:
            if b.aborted:
                keep_forever(w)   # torch may still hold its tensors (see below)
                raise CollectiveError(f"{b.describe_call(op, seq)}: the group was aborted")
            try:
                w.wait(WATCH_INTERVAL)
                return
            except RuntimeError as exc:
                if not is_watch_timeout(exc):
                    raise  # gloo's own error (or its group timeout): see translate
                dead = self.dead_peers()
                if dead:
                    # gloo still runs it and holds its tensors: if its thread dropped the
                    # last reference while the interpreter exits, the process would abort.
                    keep_forever(w)
                    raise PeerError(f"{b.describe_call(op, seq)}: rank {dead[0]} died "
                                    f"(its process {self.local_pids[dead[0]]} has ended)",
                                    peer=dead[0]) from None

    def timed_out_with(self, seq: int) -> list[int]:
        """After a timeout in collective ``seq``: the ranks that did not report a timeout
        in it too within ``_TIMEOUT_REPORT_GRACE`` (they never arrived). Through the
        store; empty when the store cannot be reached."""
        b = self._backend
        store = b.store
        if store is None or b.size == 1:
            return []
        key = f"{self._prefix}collectives-timeout/{seq}/"
        try:
            store.set(f"{key}{b.rank}", "1")
            deadline = time.monotonic() + _TIMEOUT_REPORT_GRACE
            while True:
                missing = [r for r in range(b.size) if not store.check([f"{key}{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except RuntimeError:  # the store's host is gone
            return []

    def translate(self, exc: BaseException, op: str, seq: int, peer: int = -1) -> BaseException:
        """A typed error of this library for a torch/gloo/NCCL error of operation ``op``."""
        if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
            return exc
        b = self._backend
        where = b.describe_call(op, seq)
        detail = first_line(exc)
        low = detail.lower()
        if b.aborted:
            error: BaseException = CollectiveError(f"{where}: the group was aborted "
                                                   f"({detail})")
            error.__cause__ = exc
            return error
        dead = self.dead_peers()
        if not dead and self.local_pids and any(s in low for s in _PEER_GONE):
            # The kernel closes a killed process's sockets before it has ended: give it
            # a moment, so that the error names the rank.
            deadline = time.monotonic() + 0.5
            while not dead and time.monotonic() < deadline:
                time.sleep(0.01)
                dead = self.dead_peers()
        missing = self.timed_out_with(seq) if not dead and seq >= 0 and (
            "timed out" in low or "timeout" in low) and "pair closure" not in low else []
        if dead:
            error = PeerError(
                f"{where}: rank {dead[0]} died (its process {self.local_pids[dead[0]]} "
                f"has ended): {detail}", peer=dead[0])
        elif missing:
            names = ", ".join(map(str, missing))
            error = CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {b.timeout:g} s: "
                f"rank{'s' if len(missing) > 1 else ''} {names} did not arrive ({detail})",
                op=op, seq=seq, missing=missing)
        elif "pair closure" in low:
            error = CollectiveTimeout(
                f"{where}: an earlier operation of this group timed out and gloo closed its "
                f"connections; the group cannot be used any more ({detail})",
                op=op, seq=seq)
        elif any(s in low for s in _PEER_GONE):
            error = PeerError(f"{where}: a peer closed its connection (did a rank exit or "
                              f"crash?): {detail}", peer=peer)
        elif "timed out" in low or "timeout" in low:
            error = CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {b.timeout:g} s"
                f"{f'; rank {peer} did not answer' if peer >= 0 else ''} ({detail})",
                op=op, seq=seq, missing=(peer,) if peer >= 0 else ())
        else:
            error = CollectiveError(f"{where}: {detail}")
        error.__cause__ = exc
        return error

    def reraise(self, exc: RuntimeError, op: str, seq: int, peer: int = -1) -> NoReturn:
        error = self.translate(exc, op, seq, peer)
        if error is exc:
            raise exc
        raise error from exc


def keep_forever(obj: Any) -> None:
    """Leak one reference to ``obj`` on purpose, so that it is never destroyed, not even
    when the interpreter exits: for torch objects whose destructor would block on (or
    abort in) a gloo thread stuck on a dead peer."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def unsupported(exc: BaseException) -> bool:
    low = str(exc).lower()
    return "not supported" in low or "does not support" in low or "unsupported" in low
