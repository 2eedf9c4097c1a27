"""The sockets of one rank of a zmq world, and who is on them: the context, the ROUTER
every peer sends to (bound on tcp and, within a host, ipc) with its monitor, one DEALER
per peer (each behind its own lock, so that the frames of one message never interleave
with another's), the map from a connection's file descriptor to the rank that
authenticated on it, and the orderly or abrupt close of them all.

:class:`Connections` opens the sockets; :class:`~backends.zeromq.handshake.Handshake`
then authenticates every connection on them; the engine's
:class:`~backends.zeromq.progress.Progress` reads the ROUTER and the monitor. A closed
connection, read off the monitor, is reported to the world's
:class:`~backends.zeromq.liveness.Liveness`.
"""

from __future__ import annotations

import collections
import struct
import threading
import time
import weakref
from typing import Any, Mapping, Optional

import numpy as np
import zmq

from collectives import settings
from collectives.errors import CollectiveError

from . import auth, heap, wire
from .addresses import IpcDir, bind_ip, tcp_endpoint, use_ipc
from .calls import Call
from .liveness import Liveness
from .sockets import EVENTS, NOBLOCK, POLLIN, discard_rest, new_dealer, new_router, write_tensor
from .wire import Kind


class Inbound:
    """A bound ROUTER and who authenticated on it (and how far each handshake got)."""

    def __init__(self, sock: zmq.Socket, purpose: int) -> None:
        self.sock, self.purpose = sock, purpose
        self.rid_rank: dict[bytes, int] = {}
        self.rank_rid: dict[int, bytes] = {}
        self.pending: "collections.OrderedDict[bytes, tuple[int, bytes]]" = collections.OrderedDict()
        self.transcripts: dict[int, bytes] = {}


_live: "weakref.WeakSet" = weakref.WeakSet()  # started Connections, not yet closed
_gc_lock = threading.Lock()
_gc_was_running: Optional[bool] = None


class Connections:
    """The sockets of one rank. ``stats`` (the engine's counters) and ``liveness`` (the
    world's record of gone peers) are shared with the engine's other parts."""

    def __init__(self, rank: int, size: int, stats: dict, liveness: Liveness) -> None:
        self.rank, self.size = rank, size
        self._stats = stats
        self._liveness = liveness
        self.router: Optional[zmq.Socket] = None
        self.monitor: Optional[zmq.Socket] = None   # the ROUTER's closed connections
        self.inbound: Optional[Inbound] = None      # who authenticated on the ROUTER
        self.endpoints: dict[str, str] = {}         # where the ROUTER listens
        self.sends_to: dict[int, str] = {}          # peer -> the endpoint its DEALER uses
        self.malloc = "unused"  # a world of one receives nothing (see heap.py)
        self.ipv6 = False
        self.bind_address = ""  # the ROUTER's interface ("*": all of them)
        self._ctx: Optional[zmq.Context] = None
        self._dealers: list[Optional[zmq.Socket]] = [None] * size
        self._dealer_locks = [threading.Lock() for _ in range(size)]
        self._fd_rank: dict[int, int] = {}
        self._ipc: Optional[IpcDir] = None
        self._poller: Optional[zmq.Poller] = None
        self._heartbeat_s = 0.0
        self._linger_s = 0.0

    # ========================================================================= opening
    def open(self, master: Any, env: Mapping[str, str]) -> None:
        """The context and this rank's ROUTER (``master``: where rank 0 listens, which
        chooses the interface and the address family)."""
        self._heartbeat_s = settings.ZMQ_HEARTBEAT_S.get(env)
        self._linger_s = settings.ZMQ_LINGER_S.get(env)
        self.ipv6 = master.ipv6
        self.malloc = heap.keep_receive_buffers(env)  # before libzmq's first receive
        self._ctx = zmq.Context(io_threads=settings.ZMQ_IO_THREADS.get(env))
        self._ctx.setsockopt(zmq.LINGER, 0)
        _note_gc_state()
        self.bind_address, advertised = bind_ip(master, env)
        router = self.router = self.new_router()
        router.bind(tcp_endpoint(self.bind_address, "*", master.ipv6))
        port = router.last_endpoint.decode().rsplit(":", 1)[1]
        self.endpoints["tcp"] = tcp_endpoint(advertised, port, master.ipv6)
        if use_ipc(env):
            self._ipc = IpcDir(self.rank)
            router.bind(self._ipc.endpoint)
            self.endpoints["ipc"] = self._ipc.endpoint
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.inbound = Inbound(router, auth.PURPOSE_DATA)
        self._poller = zmq.Poller()
        self._poller.register(router, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def new_router(self) -> zmq.Socket:
        return new_router(self._ctx, self._heartbeat_s, self.ipv6)

    def new_dealer(self, reconnect: bool) -> zmq.Socket:
        return new_dealer(self._ctx, self._heartbeat_s, self.ipv6, reconnect)

    def add_dealer(self, peer: int, endpoint: str) -> zmq.Socket:
        """This rank's DEALER to ``peer``'s ROUTER at ``endpoint`` (yet to authenticate)."""
        sock = self._dealers[peer] = self.new_dealer(reconnect=False)
        sock.connect(endpoint)
        self.sends_to[peer] = endpoint
        return sock

    def authenticated(self, fd: int, peer: int) -> None:
        """``peer`` proved itself on the inbound connection of file descriptor ``fd``."""
        self.read_monitor()  # events of an earlier connection on a reused fd come first
        self._fd_rank[fd] = peer

    def started(self) -> None:
        """Every peer is connected both ways: the ipc file goes, and these sockets count
        among the open ones (pyzmq's collector thread stays while any is)."""
        if self._ipc is not None:
            # The socket file is no longer needed: removing it keeps the connections,
            # refuses any later one, and leaves nothing behind even if this process is
            # killed.
            self._ipc.remove()
        _live.add(self)

    # ========================================================================= sending
    def send_tensor(self, call: Call, dst: int, header: bytes, flat: Optional[np.ndarray]) -> list:
        """The message(s) of one tensor to ``dst`` (see
        :func:`~backends.zeromq.sockets.write_tensor`); returns the zero-copy frames."""
        with self._dealer_locks[dst]:  # the parts of one message never interleave with others
            sock = self._dealers[dst]
            if sock is None:
                raise CollectiveError(f"{call.where}: the group is closed")
            try:
                return write_tensor(sock, header, flat)
            except zmq.Again:
                raise call.peer_error(dst, "is unreachable (its connection closed)") from None

    def send_control(self, peer: int, frames: list) -> None:
        """A control message (ABORT, BYE) to ``peer``; dropped when it cannot be queued
        (the peer is gone, or this rank is closing)."""
        with self._dealer_locks[peer]:
            sock = self._dealers[peer]
            if sock is None:
                return
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def say_bye(self) -> None:
        """Tell every peer still up that this rank closed (it fails no call over it)."""
        down = self._liveness.down
        for p in range(self.size):
            if p != self.rank and p not in down:
                self.send_control(p, [wire.pack(Kind.BYE, self.rank, p)])

    # ======================================================================= receiving
    def poll(self, timeout_ms: int) -> None:
        """Sleep until the ROUTER or its monitor has something, or ``timeout_ms`` passed."""
        self._poller.poll(timeout_ms)

    def reject(self, sock: zmq.Socket) -> None:
        """Drop the message being received on ``sock``, counted."""
        self._stats["rejected"] += 1
        discard_rest(sock)

    def monitor_pending(self) -> bool:
        """The monitor holds an event (only the thread that reads the sockets asks)."""
        mon = self.monitor
        return mon is not None and bool(mon.get(EVENTS) & POLLIN)

    def read_monitor(self) -> None:
        """Report every closed inbound connection of an authenticated peer as lost."""
        mon = self.monitor
        while mon.get(EVENTS) & POLLIN:
            try:
                ev = mon.recv(NOBLOCK)
            except zmq.Again:
                return
            discard_rest(mon)
            if len(ev) >= 6:
                event, value = struct.unpack("=HI", ev[:6])
                if event == zmq.EVENT_DISCONNECTED:
                    peer = self._fd_rank.pop(value, None)
                    if peer is not None:
                        self._liveness.connection_closed(peer)

    # ========================================================================= closing
    def close(self, linger: bool) -> None:
        """Close every socket and the context: with ``linger``, sends still queued to a
        live peer get COLLECTIVES_ZMQ_LINGER_S; remove the ipc directory."""
        linger_ms = int(self._linger_s * 1000) if linger else 0
        down = self._liveness.down
        for p, sock in enumerate(self._dealers):
            if sock is not None:
                with self._dealer_locks[p]:
                    # nothing queued for a rank that is gone can be delivered: no linger
                    sock.close(linger=0 if p in down else linger_ms)
                    self._dealers[p] = None
        if self.router is not None:
            try:
                self.router.disable_monitor()
            except zmq.ZMQError:
                pass
            self.router.close(0)
            self.router = None
        if self.monitor is not None:
            self.monitor.close(0)
            self.monitor = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._ipc is not None:
            self._ipc.remove()
            self._ipc = None
        _live.discard(self)
        _maybe_stop_gc()


def _note_gc_state() -> None:
    """Remember whether pyzmq's zero-copy collector thread ran before our first sockets."""
    global _gc_was_running
    with _gc_lock:
        if _gc_was_running is None or not _live:
            try:
                from zmq.utils.garbage import gc
                _gc_was_running = gc.is_alive()
            except Exception:  # noqa: BLE001 - pyzmq internals may change
                _gc_was_running = True


def _maybe_stop_gc() -> None:
    """pyzmq tracks zero-copy sends in a process-wide thread, started on first use. When
    our sockets started it and none is left open, stop it (once it holds no buffer), so
    that a closed group leaves no thread behind; pyzmq restarts it on demand."""
    global _gc_was_running
    with _gc_lock:
        if _live or _gc_was_running is not False:
            return
        try:
            from zmq.utils.garbage import gc
        except Exception:  # noqa: BLE001
            return
        until = time.monotonic() + 1.0
        while gc.refs and time.monotonic() < until:
            time.sleep(0.005)
        if gc.is_alive() and not gc.refs:
            try:
                gc.stop()
            except Exception:  # noqa: BLE001 - never fail a close over this
                pass
        _gc_was_running = None
