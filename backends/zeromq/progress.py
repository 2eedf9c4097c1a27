"""Progress of the zmq engine: who reads the sockets, when, and how a call waits. There is
no thread of ours: a thread that waits takes the *progress token*, reads the ROUTER's
monitor (closed connections, mapped to ranks) and then the ROUTER, and hands each message
on by kind (a handshake to :mod:`backends.zeromq.connect`, a tensor to
:mod:`backends.zeromq.matching`, an ABORT or a BYE to the engine's failure handling); the
other waiters sleep on the engine's condition variable until it hands the token over. A
send waits here too, until libzmq released its zero-copy frames or its peer is gone.

This is the part of :class:`~backends.zeromq.engine.Engine` that owns the sockets' reading
and the deadlines; what a message means, and where its bytes go, is decided elsewhere. It
is one module because the token's rules (who may touch the sockets, who must be woken, and
when) can only be checked when read together.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any, Callable, Iterator, Optional

import zmq

from collectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerError

from . import wire
from .calls import Call, Recv, rank_in_group
from .connect import LOST_GRACE_S, SLICE_S, _Inbound, _EVENTS, _NOBLOCK, _POLLIN, _RCVMORE
from .wire import Kind


#: How often a collective's start looks for a closed connection nobody waited on.
MONITOR_LOOK_S = 0.01
#: How long a send to a rank that closed its group cleanly waits for libzmq's release of
#: the frame (see ``Progress._released_after_bye``) before it calls the message lost.
BYE_RELEASE_GRACE_S = 2.0


class Progress:
    """The progress part of :class:`~backends.zeromq.engine.Engine`."""

    # ======================================================================= dispatch
    def _on_router_message(self, inb: _Inbound, rid: bytes) -> None:
        sock = inb.sock
        if not sock.get(_RCVMORE):
            self.stats["rejected"] += 1
            return
        peer = inb.rid_rank.get(rid)
        if peer is None:  # a handshake: its proof needs the frame's file descriptor
            frame = sock.recv(_NOBLOCK, copy=False)
            h = wire.parse(frame.bytes)
            if h is None:
                self._reject(sock)
            elif h.kind == Kind.HELLO:
                self._on_hello(inb, rid, h)
            elif h.kind == Kind.PROOF:
                self._on_proof(inb, rid, h, frame)
            else:
                self._reject(sock)
            return
        data = sock.recv(_NOBLOCK)  # a header (or an INLINE frame): small, copied
        h = wire.parse(data)
        if h is None or h.src != peer or h.dst != self.rank or inb is not self._inbound:
            self._reject(sock)
            return
        if h.kind == Kind.DATA:
            self._on_data(peer, h, None)
        elif h.kind == Kind.INLINE:
            self._on_data(peer, h, data)
        elif h.kind == Kind.ABORT:
            text = sock.recv(zmq.NOBLOCK).decode("utf-8", "replace") if sock.getsockopt(zmq.RCVMORE) else ""
            self._discard(sock)
            with self._lock:
                gs = self._groups.get(h.gid)
                if gs is not None:
                    self._fail_group(gs, f"rank {rank_in_group(gs, peer)} reported: {text}",
                                     forward=False)
                elif len(self._early_aborts) < 1024:  # a group this rank has yet to create
                    self._early_aborts[h.gid] = (peer, text)
        elif h.kind == Kind.BYE:
            self._discard(sock)
            with self._lock:
                self._mark_down(peer, "closed its process group")
        else:
            self._reject(sock)

    # ======================================================================== monitor
    def _look_at_monitor(self) -> bool:
        """Lock held, token free: :meth:`_monitor_pending`, asked at most once per
        MONITOR_LOOK_S (a look costs ~1.5 us; the clock ~0.1 us; waiters look anyway)."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + MONITOR_LOOK_S
        return self._monitor_pending()

    def _monitor_pending(self) -> bool:
        """Lock held, token free (so no thread uses the monitor): an event is queued."""
        mon = self._monitor
        return mon is not None and bool(mon.get(_EVENTS) & _POLLIN)

    def _drain_monitor(self) -> None:
        mon = self._monitor
        while mon.get(_EVENTS) & _POLLIN:
            try:
                ev = mon.recv(_NOBLOCK)
            except zmq.Again:
                return
            self._discard(mon)
            if len(ev) >= 6:
                event, value = struct.unpack("=HI", ev[:6])
                if event == zmq.EVENT_DISCONNECTED:
                    peer = self._fd_rank.pop(value, None)
                    if peer is not None:
                        self._lost.setdefault(peer, time.monotonic())

    # ======================================================================= progress
    def _drain(self, limit: int = 4096) -> int:
        """Process what arrived (token held, or start-up): monitor events, then messages."""
        self._drain_monitor()
        router, inb, n = self._router, self._inbound, 0
        while n < limit and router.get(_EVENTS) & _POLLIN:
            try:
                rid = router.recv(_NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                self._on_router_message(inb, rid)
            except zmq.Again:
                self.stats["rejected"] += 1
        if self._lost and n < limit:
            # Fail waits on a lost peer only once everything that arrived before has
            # been read (a long backlog can take longer than the grace to drain, and the
            # lost peer's last messages are at its end).
            now = time.monotonic()
            for peer, since in list(self._lost.items()):
                if now - since >= LOST_GRACE_S:
                    del self._lost[peer]
                    with self._lock:
                        self._mark_down(peer, "died or lost its connection", died=True)
        return n

    def _progress(self, timeout: float) -> None:
        if self._drain():
            return
        if self._spin_s > 0:
            # A message usually follows within microseconds: yield the core (libzmq's I/O
            # threads need it) and look again, before paying for a sleep and a wake-up.
            router, until = self._router, time.perf_counter() + min(self._spin_s, timeout)
            while time.perf_counter() < until:
                os.sched_yield()
                if router.get(_EVENTS) & _POLLIN:
                    self._drain()
                    return
        if timeout > 0:
            if self._lost:
                timeout = min(timeout, LOST_GRACE_S)
            self._poller.poll(max(1, int(timeout * 1000)))
            self._drain()

    def _deadline(self, call: Call, timeout: Optional[float]) -> float:
        if timeout is not None:
            return time.monotonic() + timeout
        if call.deadline is not None:
            return call.deadline
        return time.monotonic() + call.timeout

    def wait_recv(self, req: Recv, timeout: Optional[float]) -> None:
        if req.done:
            return
        self._wait(req, self._deadline(req.call, timeout), timeout, None)

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
                    if self._closed:
                        raise CollectiveError(f"{req.call.where}: the group was "
                                              f"{self._closed} while waiting")
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

    def _drain_if_free(self, also: Optional[Callable[[], bool]] = None) -> None:
        """Read what the sockets hold, unless another thread holds the progress token
        (or ``also()``, checked under the lock, says there is no reason to)."""
        with self._cond:
            mine = not self._token and not self._closed and (also is None or also())
            if mine:
                self._token = True
        if mine:
            try:
                self._drain()
            finally:
                with self._cond:
                    self._token = False
                    self._cond.notify_all()

    def test_recv(self, req: Recv) -> bool:
        if not (req.done or req.error is not None):
            self._drain_if_free()
        return req.done or req.error is not None

    def wait_send(self, tracker: Any, call: Call, dst: int, timeout: Optional[float]) -> None:
        deadline = self._deadline(call, timeout)
        while not tracker.done:
            if self._closed:
                raise CollectiveError(f"{call.where}: the group was {self._closed} while "
                                      f"sending")
            gs = self._groups.get(call.gid)
            if gs is not None and gs.error:
                raise CollectiveMismatch(f"{call.where}: the group is unusable after an "
                                         f"earlier error: {gs.error}")
            # Nobody else may be reading the sockets: learn of a death here too, or a
            # send to a dead rank would wait for the whole timeout.
            self._drain_if_free(lambda: self._lost or self._monitor_pending())
            if self._down:
                with self._lock:
                    if call.collective and self._dead:
                        self._raise_if_member_dead(call)
                    said_bye = dst in self._down and dst not in self._dead
                    gone = self._down.get(dst)
                if said_bye and self._released_after_bye(tracker, deadline):
                    return
                if gone is not None:
                    raise PeerError(f"{call.where}: {call.peer(dst)} {gone} "
                                    f"before taking the message", peer=dst)
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
        which lags under load (a 2-rank all_gather then close failed 3 worlds in 40 with
        a CPU hog beside). Give that report a moment before calling the message lost."""
        try:
            tracker.wait(max(0.0, min(BYE_RELEASE_GRACE_S, deadline - time.monotonic())))
        except zmq.NotDone:
            pass
        return tracker.done
