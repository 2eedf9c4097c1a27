"""Progress of the zmq engine: who reads the sockets, when, and how a call waits. There is
no thread of ours: a thread that waits takes the *progress token*, reads the ROUTER's
monitor (closed connections, mapped to ranks) and then the ROUTER, and hands each message
on by kind (a handshake to the :class:`~backends.zeromq.handshake.Handshake`, a tensor to
the :class:`~backends.zeromq.matching.Matcher`, an ABORT or a BYE to the matcher's failure
handling); the other waiters sleep on the engine's condition variable until it hands the
token over. A send waits here too, until libzmq released its zero-copy frames or its peer
is gone. Closing the engine takes the token for good.

:class:`Progress` owns the token, the reading of the sockets and the deadlines; what a
message means, and where its bytes go, is decided by the parts it holds. It is one class
because the token's rules (who may touch the sockets, who must be woken, and when) can
only be checked when read together.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

import zmq

from collectives.errors import CollectiveError, CollectiveTimeout

from . import wire
from .calls import Call, Recv
from .connections import Connections, Inbound
from .handshake import Handshake
from .liveness import LOST_GRACE_S, Liveness
from .matching import Matcher
from .sockets import EVENTS, NOBLOCK, POLLIN, RCVMORE, discard_rest
from .wire import Kind


#: Longest single sleep of a waiter (deadlines and closing are checked between).
SLICE_S = 0.1
#: How often a collective's start looks for a closed connection nobody waited on.
MONITOR_LOOK_S = 0.01
#: How long a send to a rank that closed its group cleanly waits for libzmq's release of
#: the frame (see ``Progress._released_after_bye``) before it calls the message lost.
BYE_RELEASE_GRACE_S = 2.0


class Progress:
    """The progress token of one engine, and every wait. ``cond`` is the condition
    variable over the engine's one lock; ``spin_s``, how long a waiter that found nothing
    yields the core and looks again before it sleeps in zmq_poll."""

    def __init__(self, cond: threading.Condition, rank: int, stats: dict,
                 connections: Connections, handshake: Handshake, matcher: Matcher,
                 liveness: Liveness, spin_s: float) -> None:
        self._cond = cond
        self._rank = rank
        self._stats = stats
        self._conns = connections
        self._handshake = handshake
        self._matcher = matcher
        self._liveness = liveness
        self._spin_s = spin_s
        self._token = False
        self.closed: Optional[str] = None   # "closed" or "aborted" once it is
        self._next_look = 0.0  # when a collective's start may next look at the monitor

    # ======================================================================= dispatch
    def _on_message(self, inb: Inbound, rid: bytes) -> None:
        sock = inb.sock
        if not sock.get(RCVMORE):
            self._stats["rejected"] += 1
            return
        peer = inb.rid_rank.get(rid)
        if peer is None:
            self._handshake.on_message(inb, rid)
            return
        data = sock.recv(NOBLOCK)  # a header (or an INLINE frame): small, copied
        h = wire.parse(data)
        if h is None or h.src != peer or h.dst != self._rank:
            self._conns.reject(sock)
            return
        if h.kind == Kind.DATA:
            self._matcher.on_data(sock, peer, h, None)
        elif h.kind == Kind.INLINE:
            self._matcher.on_data(sock, peer, h, data)
        elif h.kind == Kind.ABORT:
            text = sock.recv(zmq.NOBLOCK).decode("utf-8", "replace") if sock.getsockopt(zmq.RCVMORE) else ""
            discard_rest(sock)
            self._matcher.on_abort(peer, h.gid, text, left=h.tag == wire.ABORT_LEFT)
        elif h.kind == Kind.BYE:
            discard_rest(sock)
            with self._cond:
                self._matcher.peer_down(peer, "closed its process group")
        else:
            self._conns.reject(sock)

    # ======================================================================= progress
    def drain(self, limit: int = 4096) -> int:
        """Process what arrived (token held, or start-up): monitor events, then messages."""
        conns = self._conns
        conns.read_monitor()
        router, inb, n = conns.router, conns.inbound, 0
        on_message = self._on_message
        while n < limit and router.get(EVENTS) & POLLIN:
            try:
                rid = router.recv(NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                on_message(inb, rid)
            except zmq.Again:
                self._stats["rejected"] += 1
        if self._liveness.lost and n < limit:
            # Fail waits on a lost peer only once everything that arrived before has
            # been read (a long backlog can take longer than the grace to drain, and the
            # lost peer's last messages are at its end).
            for peer in self._liveness.overdue(time.monotonic()):
                with self._cond:
                    self._matcher.peer_down(peer, "died or lost its connection", died=True)
        return n

    def _progress(self, timeout: float) -> None:
        if self.drain():
            return
        if self._spin_s > 0:
            # A message usually follows within microseconds: yield the core (libzmq's I/O
            # threads need it) and look again, before paying for a sleep and a wake-up.
            router, until = self._conns.router, time.perf_counter() + min(self._spin_s, timeout)
            while time.perf_counter() < until:
                os.sched_yield()
                if router.get(EVENTS) & POLLIN:
                    self.drain()
                    return
        if timeout > 0:
            if self._liveness.lost:
                timeout = min(timeout, LOST_GRACE_S)
            self._conns.poll(max(1, int(timeout * 1000)))
            self.drain()

    def look_for_closed_connections(self) -> None:
        """Lock held: when a peer's connection closed and nobody waits to notice (a rank
        that only sends, e.g. gather to another root), read the sockets now, so that the
        calls after a death fail instead of sending on into a broken group. The monitor
        is asked at most once per MONITOR_LOOK_S (a look costs far more than the clock;
        waiters look anyway)."""
        if self._token:
            return
        if not self._liveness.lost:
            now = time.monotonic()
            if now < self._next_look:
                return
            self._next_look = now + MONITOR_LOOK_S
            if not self._conns.monitor_pending():
                return
        cond = self._cond
        self._token = True
        cond.release()
        try:
            self.drain()
        finally:
            cond.acquire()
            self._token = False
            cond.notify_all()

    def drain_if_free(self, also: Optional[Callable[[], bool]] = None) -> None:
        """Read what the sockets hold, unless another thread holds the progress token
        (or ``also()``, checked under the lock, says there is no reason to)."""
        cond = self._cond
        with cond:
            mine = not self._token and not self.closed and (also is None or also())
            if mine:
                self._token = True
        if mine:
            try:
                self.drain()
            finally:
                with cond:
                    self._token = False
                    cond.notify_all()

    # ========================================================================== waits
    def raise_if_closed(self, call: Call) -> None:
        if self.closed:
            raise CollectiveError(f"{call.where}: the group is {self.closed}")

    @staticmethod
    def _deadline(call: Call, timeout: Optional[float]) -> float:
        if timeout is not None:
            return time.monotonic() + timeout
        if call.deadline is not None:
            return call.deadline
        return time.monotonic() + call.timeout

    def wait_recv(self, req: Recv, timeout: Optional[float]) -> None:
        if req.done:
            return
        self._wait(req, self._deadline(req.call, timeout), timeout, None)

    def test_recv(self, req: Recv) -> bool:
        if not (req.done or req.error is not None):
            self.drain_if_free()
        return req.done or req.error is not None

    def iter_parts(self, req: Recv, timeout: Optional[float]) -> Iterator[tuple[int, Any]]:
        """The parts of a ``frames`` receive, in order, each as soon as it arrived."""
        deadline = self._deadline(req.call, timeout)
        frames, i = req.frames, 0
        while True:
            if i < len(frames):
                item, frames[i] = frames[i], None  # read once: libzmq's buffer is freed
                i += 1                              # (and reused by malloc) after its use
                yield item
                item = None  # not held while waiting for the next part
            elif req.done:
                return
            else:
                self._wait(req, deadline, timeout, lambda: len(frames) > i)

    def _wait(self, req: Recv, deadline: float, timeout: Optional[float],
              ready: Optional[Callable[[], bool]]) -> None:
        """Make progress until ``req`` is done (or ``ready()``), failed, or ``deadline``
        passed (CollectiveTimeout naming op, seq and the rank waited for). One waiter at
        a time holds the progress token and blocks in zmq_poll on the ROUTER; the others
        sleep on the condition variable until it hands over."""
        cond = self._cond
        while True:
            with cond:
                while True:
                    if req.done:
                        return
                    if req.error is not None:
                        raise req.error
                    if ready is not None and ready():
                        return
                    if self.closed:
                        raise CollectiveError(f"{req.call.where}: the group was "
                                              f"{self.closed} while waiting")
                    now = time.monotonic()
                    if now >= deadline:
                        c = req.call
                        wait = timeout if timeout is not None else c.timeout
                        why = "slower, hung, or in another collective" if c.collective \
                            else f"no send with tag {req.tag}"
                        raise CollectiveTimeout(
                            f"{c.where}: no message from {c.peer(req.src)} within {wait:g} s "
                            f"({why})", op=c.op, seq=c.seq if c.collective else -1,
                            missing=[c.group_rank(req.src)])
                    if not self._token:
                        self._token = True
                        break
                    cond.wait(min(deadline - now, SLICE_S))
            try:
                self._progress(min(deadline - time.monotonic(), SLICE_S))
            finally:
                with cond:
                    self._token = False
                    cond.notify_all()

    def wait_send(self, tracker: Any, call: Call, dst: int, timeout: Optional[float]) -> None:
        deadline = self._deadline(call, timeout)
        liveness, conns = self._liveness, self._conns
        while not tracker.done:
            if self.closed:
                raise CollectiveError(f"{call.where}: the group was {self.closed} while "
                                      f"sending")
            self._matcher.raise_if_failed(call)
            # Nobody else may be reading the sockets: learn of a death here too, or a
            # send to a dead rank would wait for the whole timeout.
            self.drain_if_free(lambda: liveness.lost or conns.monitor_pending())
            if liveness.down:
                with self._cond:
                    if call.collective and liveness.dead:
                        liveness.raise_if_member_dead(call)
                    said_bye = dst in liveness.down and dst not in liveness.dead
                    gone = liveness.down.get(dst)
                if said_bye and self._released_after_bye(tracker, deadline):
                    return
                if gone is not None:
                    raise call.peer_error(dst, f"{gone} before taking the message")
            now = time.monotonic()
            if now >= deadline:
                wait = timeout if timeout is not None else call.timeout
                raise CollectiveTimeout(f"{call.where}: {call.peer(dst)} did not take the "
                                        f"message within {wait:g} s", op=call.op,
                                        seq=call.seq if call.collective else -1,
                                        missing=[call.group_rank(dst)])
            try:
                tracker.wait(min(deadline - now, SLICE_S))
            except zmq.NotDone:
                pass

    @staticmethod
    def _released_after_bye(tracker: Any, deadline: float) -> bool:
        """``dst`` closed its group cleanly while this send waited: it finished every call
        it made, so it took the message if any call wanted it. libzmq has then written
        the frame, but pyzmq reports the release through its own garbage-collector thread,
        which lags under load (a closing peer's last sends were reported lost with a CPU
        hog beside). Give that report a moment before calling the message lost."""
        try:
            tracker.wait(max(0.0, min(BYE_RELEASE_GRACE_S, deadline - time.monotonic())))
        except zmq.NotDone:
            pass
        return tracker.done

    # ======================================================================== closing
    def shut(self, how: str, wait_s: float) -> Optional[bool]:
        """Mark the engine closed (``how``: "closed", "aborted"), fail every posted and
        partly received request, and take the progress token once its holder hands it
        back (at most ``wait_s``), for good. Returns whether this thread now owns the
        sockets (None: the engine was closed already)."""
        cond = self._cond
        with cond:
            if self.closed:
                return None
            self.closed = how
            until = time.monotonic() + wait_s  # a waiter hands the token back within a slice
            cond.notify_all()
            while self._token and time.monotonic() < until:
                cond.wait(SLICE_S)
            mine = not self._token  # else a waiter is stuck in the sockets: leave them
            self._token = True
            self._matcher.fail_all(how)
            cond.notify_all()
        return mine
