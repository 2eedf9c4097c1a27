"""How a torch group finds out what went wrong, and says it with this library's errors.

gloo tells a peer's death only to the ranks connected to it in the current operation (the
others wait for the whole group timeout), and its timeouts do not say who never arrived.
So in a gloo group the members on one host exchange their process ids when it is built
(``_exchange_pids``), and a blocking wait is taken in slices that look for a member whose
process has ended (``_wait``); after a timeout, the ranks report theirs in the store, and
those that do not within ``_TIMEOUT_REPORT_GRACE`` are named as missing
(``_timed_out_with``). ``_translate`` turns torch's ``RuntimeError`` into
:class:`~collectives.errors.PeerError`, :class:`~collectives.errors.CollectiveTimeout` or
:class:`~collectives.errors.CollectiveError` naming the operation and the rank.

These are methods of :class:`~backends.torchdist.TorchGroup`, through the mixin
:class:`_FailureDiagnosis`; kept apart because they are about failures, not collectives.
Also here: how torch words a closed connection (``_PEER_GONE``) and an operation the build
lacks (``_unsupported``), and ``_keep_forever`` for the torch objects of a group given up on.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
from typing import Any, NoReturn

from collectives.errors import CollectiveError, CollectiveTimeout, PeerError
from collectives.lifetime import process_alive

from .torch_meeting import _first_line
from .torch_work import _WATCH_INTERVAL, _is_watch_timeout

#: After a timeout, how long to wait for the other ranks to report theirs (the ranks
#: that do not are named as missing).
_TIMEOUT_REPORT_GRACE = 1.0

_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "connection refused",
              "connection closed", "end of file", "socket closed")


class _FailureDiagnosis:
    """The failure diagnosis of :class:`~backends.torchdist.TorchGroup` (a mixin, before
    ``ProcessGroup`` among its bases so that ``_translate`` overrides the base class's).
    Uses the group's ``rank``, ``size``, ``timeout``, ``backend`` and ``_describe``, and
    the ``_store``, ``_prefix`` and ``_local_pids`` that TorchGroup sets."""

    def _exchange_pids(self) -> dict[int, int]:
        """Every member publishes ``host pid`` in the store; returns group rank -> pid
        of the other members on this host (empty for a world of one or NCCL, whose
        waits are not watched). Lets a rank name a peer that died (`_dead_peers`)."""
        if self.size == 1 or self.backend != "gloo" or self._store is None:
            return {}
        key = f"{self._prefix}collectives-pid/"
        host = socket.gethostname()
        self._store.set(f"{key}{self.rank}", f"{host} {os.getpid()}")
        pids = {}
        for r in range(self.size):
            if r != self.rank:
                peer_host, _, pid = self._store.get(f"{key}{r}").decode().rpartition(" ")
                if peer_host == host:
                    pids[r] = int(pid)
        return pids

    def _dead_peers(self) -> list[int]:
        """Group ranks on this host whose process has ended."""
        return [r for r, pid in self._local_pids.items() if not process_alive(pid)]

    def _wait(self, w: Any, op: str, seq: int, peer: int = -1) -> None:
        """``w.wait()``, raising :class:`PeerError` as soon as a member of the group on
        this host dies (checked every ``_WATCH_INTERVAL``).

        A send or receive (``seq < 0``, ``peer >= 0``) is waited on whole: a sliced wait on one that
        times out closes gloo's connection (see :class:`TorchWork`). Its peer's death
        still ends it at once, as a closed connection (``_translate`` names the rank).
        """
        if not self._local_pids or (seq < 0 and peer >= 0):
            w.wait()
            return
        while True:
            try:
                w.wait(_WATCH_INTERVAL)
                return
            except RuntimeError as exc:
                if not _is_watch_timeout(exc):
                    raise  # gloo's own error (or its group timeout): see _translate
                dead = self._dead_peers()
                if dead:
                    # gloo still runs it and holds its tensors: if its thread dropped the
                    # last reference while the interpreter exits, the process would abort.
                    _keep_forever(w)
                    raise PeerError(f"{self._describe(op, seq)}: rank {dead[0]} died "
                                    f"(its process {self._local_pids[dead[0]]} has ended)",
                                    peer=dead[0]) from None

    def _timed_out_with(self, seq: int) -> list[int]:
        """After a timeout in collective ``seq``: the ranks that did not report a timeout
        in it too within ``_TIMEOUT_REPORT_GRACE`` (they never arrived). Through the
        store; empty when the store cannot be reached."""
        store = self._store
        if store is None or self.size == 1:
            return []
        key = f"{self._prefix}collectives-timeout/{seq}/"
        try:
            store.set(f"{key}{self.rank}", "1")
            deadline = time.monotonic() + _TIMEOUT_REPORT_GRACE
            while True:
                missing = [r for r in range(self.size) if not store.check([f"{key}{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except RuntimeError:  # the store's host is gone
            return []


    def _translate(self, exc: BaseException, op: str, seq: int, peer: int = -1) -> BaseException:
        """A typed error of this library for a torch/gloo/NCCL error of operation ``op``."""
        if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
            return exc
        where = self._describe(op, seq)
        detail = _first_line(exc)
        low = detail.lower()
        dead = self._dead_peers()
        if not dead and self._local_pids and any(s in low for s in _PEER_GONE):
            # The kernel closes a killed process's sockets before it has ended: give it
            # a moment, so that the error names the rank.
            deadline = time.monotonic() + 0.5
            while not dead and time.monotonic() < deadline:
                time.sleep(0.01)
                dead = self._dead_peers()
        missing = self._timed_out_with(seq) if not dead and seq >= 0 and (
            "timed out" in low or "timeout" in low) and "pair closure" not in low else []
        if dead:
            error: BaseException = PeerError(
                f"{where}: rank {dead[0]} died (its process {self._local_pids[dead[0]]} "
                f"has ended): {detail}", peer=dead[0])
        elif missing:
            names = ", ".join(map(str, missing))
            error = CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {self.timeout:g} s: "
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
                f"{where}: did not complete within the group timeout of {self.timeout:g} s"
                f"{f'; rank {peer} did not answer' if peer >= 0 else ''} ({detail})",
                op=op, seq=seq, missing=(peer,) if peer >= 0 else ())
        else:
            error = CollectiveError(f"{where}: {detail}")
        error.__cause__ = exc
        return error

    def _reraise(self, exc: RuntimeError, op: str, seq: int, peer: int = -1) -> NoReturn:
        error = self._translate(exc, op, seq, peer)
        if error is exc:
            raise exc
        raise error from exc


def _keep_forever(obj: Any) -> None:
    """Leak one reference to ``obj`` on purpose, so that it is never destroyed, not even
    when the interpreter exits: for torch objects whose destructor would block on (or
    abort in) a gloo thread stuck on a dead peer."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _unsupported(exc: BaseException) -> bool:
    low = str(exc).lower()
    return "not supported" in low or "does not support" in low or "unsupported" in low
