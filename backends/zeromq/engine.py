"""The transport under every zmq group of a process: message matching, progress,
liveness and shutdown (start-up and authentication: :mod:`backends.zeromq.connect`).

Sockets (per rank)
    one ROUTER, bound on ``tcp://<routed address>:<ephemeral>`` and
    ``ipc://<private dir>/r<rank>``: every message *to* this rank arrives here; one
    DEALER per peer, connected to that peer's ROUTER: every message *from* this rank leaves
    through it (each pair of ranks thus has two connections, one per direction). Rank 0
    also binds a ROUTER at ``MASTER_ADDR:MASTER_PORT`` for the start-up only.

Threads
    none of our own. libzmq's I/O thread moves bytes; progress (reading the ROUTER,
    matching, copying into the destination array) is made by whichever thread waits, under
    a *progress token*: one waiter polls the ROUTER and its monitor, the others sleep on a
    condition variable and are woken when the poller completes their request. Sends are
    made by the calling thread, through the peer's DEALER under a per-peer lock. An
    ``async_op`` collective runs on the group's executor thread (the base class), which
    is just one more waiter.

Liveness
    ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL``/``TIMEOUT``) on every connection close a
    connection whose peer went silent; a dead process closes its connections at once. A
    monitor on the ROUTER reports each closed inbound connection by file descriptor, mapped
    to the rank that authenticated on it (``ZMQ_SRCFD`` of its proof), so a rank waiting
    for a dead peer raises PeerError after draining what that peer had sent. Every rank
    is connected to every other, so each survivor sees the death itself: it then fails
    every collective wait in a group of the dead rank (also a wait for another survivor,
    which may have given up), every collective over it started later, and every send
    still waiting to be taken by it (a zero-copy frame queued to a dead connection is
    never released), each with PeerError naming the dead rank. A rank that only sends
    looks at the monitor when a collective starts (at most every MONITOR_LOOK_S), so its
    next call fails. A peer that said BYE (closed its group) had finished its calls:
    only waits for it fail.
"""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np
import zmq

from collectives.errors import (CollectiveError, CollectiveMismatch, CollectiveTimeout,
                                PeerError)
from collectives.work import Work

from . import wire
from .addresses import IpcDir
from .calls import (Call, _describe_header, _describe_meta, _describe_sig, _group_rank,
                    _GroupState, _Msg, _Partial, _PartsWork, _Recv, _RecvWork, _SendWork,
                    _sig_differs, _signature)
from .wire import Kind

from .connect import (LOST_GRACE_S, SLICE_S, ZERO_COPY_MIN, Connector, _Inbound, _live_engines,
                      _maybe_stop_gc, _EVENTS, _NOBLOCK, _POLLIN, _RCVMORE, _SNDMORE)


_HAS_RECV_INTO = hasattr(zmq.Socket, "recv_into")
#: How often a collective's start looks for a closed connection nobody waited on.
MONITOR_LOOK_S = 0.01
#: How long a send to a rank that closed its group cleanly waits for libzmq's release of
#: the frame (see ``Engine._released_after_bye``) before it calls the message lost.
BYE_RELEASE_GRACE_S = 2.0


class Engine(Connector):
    """All sockets of one world, shared by its sub-groups."""

    def __init__(self, rendezvous: Any, timeout: float, env: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if env is None else env
        self.rank, self.size = rendezvous.rank, rendezvous.world_size
        self.timeout = timeout
        self._where0 = f"[rank {self.rank}/{self.size}] zmq"
        self.stats = {"rejected": 0, "bad_proofs": 0, "refused": 0, "unexpected": 0}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._token = False
        self._closed = False
        self._posted: dict[tuple, collections.deque] = {}
        self._unexpected: dict[tuple, collections.deque] = {}
        self._partial: dict[tuple, _Partial] = {}
        self._groups: dict[int, _GroupState] = {}
        self._early_aborts: dict[int, tuple[int, str]] = {}
        self._down: dict[int, str] = {}
        self._dead: set[int] = set()  # the ranks in _down that went without saying BYE
        self._next_look = 0.0  # when begin() may next look at the monitor
        self._lost: dict[int, float] = {}
        self._fd_rank: dict[int, int] = {}
        self._dealers: list[Optional[zmq.Socket]] = [None] * self.size
        self._dealer_locks = [threading.Lock() for _ in range(self.size)]
        self._ctx: Optional[zmq.Context] = None
        self._router: Optional[zmq.Socket] = None
        self._monitor: Optional[zmq.Socket] = None
        self._inbound: Optional[_Inbound] = None
        self._ipc: Optional[IpcDir] = None
        self.endpoints: dict[str, str] = {}
        self.connections: dict[int, str] = {}
        self.mode = "local"
        self.malloc = "system"  # a world of one receives nothing (see heap.py)
        self._key: Optional[bytes] = None
        self.table: list[dict] = []
        if self.size > 1:
            try:
                self._start(rendezvous, env)
            except BaseException:
                self._teardown(linger_ms=0)
                raise
        _live_engines.add(self)

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
                    self._fail_group(gs, f"rank {_group_rank(gs, peer)} reported: {text}",
                                     forward=False)
                elif len(self._early_aborts) < 1024:  # a group this rank has yet to create
                    self._early_aborts[h.gid] = (peer, text)
        elif h.kind == Kind.BYE:
            self._discard(sock)
            with self._lock:
                self._mark_down(peer, "closed its process group")
        else:
            self._reject(sock)

    # ======================================================================== groups
    def register_group(self, gid: int, members: tuple) -> None:
        with self._lock:
            gs = self._groups.get(gid)
            if gs is None:
                gs = self._groups[gid] = _GroupState(gid, members)
                early = self._early_aborts.pop(gid, None)
                if early is not None:  # a member failed in it before this rank created it
                    gs.error = f"rank {_group_rank(gs, early[0])} reported: {early[1]}"
                for key, q in self._unexpected.items():  # what members sent before that
                    if key[1] == gid:
                        for msg in q:
                            seen = gs.seen.get(key[0])
                            if msg.header.seq != wire.NO_SEQ and (seen is None or
                                                                  msg.header.seq > seen.seq):
                                gs.seen[key[0]] = msg.header

    def unregister_group(self, gid: int) -> None:
        with self._lock:
            self._groups.pop(gid, None)
            for table in (self._unexpected, self._posted, self._partial):
                for key in [k for k in table if k[1] == gid]:
                    del table[key]

    def begin(self, call: Call, sig: tuple) -> None:
        """A collective starts on this rank: check what its peers already sent."""
        with self._lock:
            self._check_open(call)
            gs = self._groups[call.gid]
            if gs.error:
                raise CollectiveMismatch(f"{call.where}: the group is unusable after an "
                                         f"earlier error: {gs.error}")
            if not self._token and (self._lost or self._look_at_monitor()):
                # A peer's connection closed and nobody waits to notice (a rank that only
                # sends, e.g. gather to another root): look now, so that the calls after
                # a death fail instead of sending on into a broken group.
                self._token = True
                self._lock.release()
                try:
                    self._drain()
                finally:
                    self._lock.acquire()
                    self._token = False
                    self._cond.notify_all()
            if self._dead:
                self._raise_if_member_dead(call)
            gs.active_seq, gs.active_sig = call.seq, sig
            for key, q in self._unexpected.items():
                if key[1] != call.gid:
                    continue
                for msg in q:
                    if msg.header.seq == wire.NO_SEQ:  # point to point
                        continue
                    problem = self._check_sequence(gs, key[0], msg.header)
                    if problem:
                        self._fail_group(gs, problem, forward=True)
                        raise CollectiveMismatch(f"{call.where}: {problem}")

    def end(self, call: Call, ok: bool) -> None:
        with self._lock:
            gs = self._groups.get(call.gid)
            if gs is None:
                return
            if call.seq >= gs.done_seq:
                gs.done_seq, gs.done_sig = call.seq, gs.active_sig
            gs.active_seq, gs.active_sig = -1, None
            if not ok:
                gs.failed_upto = max(gs.failed_upto, call.seq)
                for key in [k for k, p in self._partial.items()
                            if p.req is not None and p.req.call is call]:
                    del self._partial[key]
                for key in list(self._posted):
                    q = self._posted[key]
                    kept = collections.deque(r for r in q if r.call is not call)
                    for r in q:
                        if r.call is call:
                            self._unindex(r)
                    if kept:
                        self._posted[key] = kept
                    else:
                        del self._posted[key]

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

    def _raise_if_member_dead(self, call: Call) -> None:
        """Lock held: PeerError naming the first member of ``call``'s group that died (a
        collective over it cannot complete)."""
        for m in call.members:
            if m in self._dead:
                why = self._down[m]
                raise PeerError(f"{call.where}: {call.peer(m)} {why}; a collective over it "
                                f"cannot complete", peer=m)

    def _check_sequence(self, gs: _GroupState, src: int, h: wire.Header) -> Optional[str]:
        """Why a collective message from ``src`` cannot belong to a call this rank makes
        (None when it can)."""
        if h.seq <= gs.done_seq and h.seq > gs.failed_upto:
            # Name this rank's own side too when it is the call just finished (a root or
            # size mismatch usually shows there): both calls, as for the other mismatches.
            mine = f" as {_describe_sig(h.seq, gs.done_sig)}" \
                if h.seq == gs.done_seq and gs.done_sig is not None else ""
            return (f"rank {_group_rank(gs, src)} sent {_describe_header(h)}, a collective this "
                    f"rank already finished{mine} without that message: the ranks called it "
                    f"with different sizes, roots or dtypes")
        if h.seq == gs.active_seq and gs.active_sig is not None and \
                _sig_differs(_signature(h), gs.active_sig):
            return (f"rank {_group_rank(gs, src)} called {_describe_header(h)} but this rank "
                    f"called {_describe_sig(gs.active_seq, gs.active_sig)}")
        return None

    # ================================================================== point to point
    def _check_open(self, call: Call) -> None:
        if self._closed:
            raise CollectiveError(f"{call.where}: the group is closed")

    def isend(self, call: Call, dst: int, tag: int, array: np.ndarray) -> Work:
        self._check_open(call)
        gs = self._groups.get(call.gid)
        if gs is not None and gs.error:
            raise CollectiveMismatch(f"{call.where}: the group is unusable after an earlier "
                                     f"error: {gs.error}")
        why = self._down.get(dst)
        if why is not None:
            raise PeerError(f"{call.where}: cannot send to {call.peer(dst)}: it {why}", peer=dst)
        if self._dead and call.collective:  # a member died after this collective began
            with self._lock:
                self._raise_if_member_dead(call)
        header = wire.pack(Kind.DATA, self.rank, dst, meta=call.meta, gid=call.gid, tag=tag,
                           array=array)
        flat = array.reshape(-1).view(np.uint8) if array.size else None
        frames = []
        with self._dealer_locks[dst]:  # the parts of one message never interleave with others
            sock = self._dealers[dst]
            if sock is None:
                raise CollectiveError(f"{call.where}: the group is closed")
            try:
                if flat is None:
                    sock.send(header, _NOBLOCK)
                elif flat.size <= wire.INLINE_MAX:
                    sock.send(wire.pack_inline(header, flat.data), _NOBLOCK)
                else:
                    for off in range(0, flat.size, wire.FRAME_MAX):
                        chunk = flat[off:off + wire.FRAME_MAX]
                        sock.send(wire.with_offset(header, off) if off else header,
                                  _NOBLOCK | _SNDMORE)
                        if chunk.size >= ZERO_COPY_MIN:
                            f = zmq.Frame(chunk, track=True, copy=False)
                            sock.send(f, 0, copy=False)
                            frames.append(f)
                        else:
                            sock.send(chunk, 0, copy=True)
            except zmq.Again:
                raise PeerError(f"{call.where}: {call.peer(dst)} is unreachable (its "
                                f"connection closed)", peer=dst) from None
        tracker = zmq.MessageTracker(*frames) if frames else None
        return _SendWork(self, call, dst, tracker)

    def irecv_parts(self, call: Call, src: int, tag: int, like: np.ndarray) -> "_PartsWork":
        """Receive a message shaped like ``like`` without copying it anywhere: its parts
        stay in the buffers they arrived in, read in order through ``parts()`` (a
        reduction reads them straight from there, saving a copy of every byte). Same
        checks, errors and timeouts as :meth:`irecv`; ``like`` is not written."""
        return self.irecv(call, src, tag, like, frames=True)

    def irecv(self, call: Call, src: int, tag: int, array: np.ndarray,
              frames: bool = False) -> Work:
        req = _Recv(call, src, tag, array, [] if frames else None)
        collective = call.collective  # a collective of ours (sequence numbers are checked)
        with self._lock:
            self._check_open(call)
            gs = self._groups.get(call.gid)
            if gs is not None and gs.error:
                raise CollectiveMismatch(f"{call.where}: the group is unusable after an "
                                         f"earlier error: {gs.error}")
            q = self._unexpected.get(req.key)
            if q:
                msg = q.popleft()
                if not q:
                    del self._unexpected[req.key]
                problem = self._compare(req, msg.header)
                if problem:
                    self._mismatch(req, problem)
                    raise req.error
                self._fill(req, msg.buf)
                req.done = True
                return _PartsWork(self, req) if frames else _RecvWork(self, req)
            if collective and gs is not None:
                seen = gs.seen.get(src)
                if seen is not None and seen.seq > call.seq:
                    self._mismatch(req, self._ahead_text(req, _describe_header(seen)))
                    raise req.error
            why = self._down.get(src)
            if why is not None:
                raise PeerError(f"{call.where}: {call.peer(src)} {why} before sending the "
                                f"message this rank waits for", peer=src)
            if collective and self._dead:  # a member died after this collective began
                self._raise_if_member_dead(call)
            self._posted.setdefault(req.key, collections.deque()).append(req)
            if collective and gs is not None:
                gs.posted_from.setdefault(src, set()).add(req)
        return _PartsWork(self, req) if frames else _RecvWork(self, req)

    @staticmethod
    def _fill(req: _Recv, buf: np.ndarray) -> None:
        """A whole message that arrived before ``req`` was posted goes to ``req``."""
        if req.frames is not None:
            if buf.size:
                req.frames.append((0, buf))
        elif buf.size:
            req.view[...] = buf

    def _unindex(self, req: _Recv) -> None:
        if req.call.collective:
            gs = self._groups.get(req.call.gid)
            if gs is not None:
                s = gs.posted_from.get(req.src)
                if s is not None:
                    s.discard(req)

    def _ahead_text(self, req: _Recv, theirs: str) -> str:
        c = req.call
        return (f"{c.peer(req.src)} is already in {theirs} while this rank still expects its "
                f"message of {_describe_meta(c.meta, c.dtype, c.op)}: the ranks called "
                f"different collectives, or with different sizes or roots")

    def _compare(self, req: _Recv, h: wire.Header) -> Optional[str]:
        c = req.call
        m = c.meta
        same = (h.op == m.op and h.seq == m.seq and h.dtype == req.dtype and
                h.nbytes == req.view.nbytes and h.count == req.count and
                not _sig_differs(_signature(h), (m.op, req.dtype, m.sig_count, m.root, m.redop)))
        if same:
            return None
        theirs = wire.describe(h.op, h.seq, h.dtype, h.count, h.shape, h.sig_count, h.root,
                               h.redop)
        mine = wire.describe(m.op, m.seq, req.dtype, req.count, req.shape, m.sig_count, m.root,
                             m.redop)
        what = "called" if c.collective else "sent"
        return (f"{c.peer(req.src)} {what} {theirs} but this rank "
                f"{'called' if c.collective else 'receives'} {mine}"
                + ("" if c.collective else f" (tag {req.tag})"))

    def _mismatch(self, req: _Recv, problem: str) -> None:
        """Fail ``req`` (lock held); a collective's group is failed everywhere."""
        c = req.call
        req.error = CollectiveMismatch(f"{c.where}: {problem}")
        if c.collective:
            gs = self._groups.get(c.gid)
            if gs is not None:
                self._fail_group(gs, problem, forward=True)

    def _fail_group(self, gs: _GroupState, problem: str, forward: bool) -> None:
        """Lock held: the group's calls fail with CollectiveMismatch from now on; with
        ``forward``, tell the other members (they fail too instead of waiting)."""
        if gs.error:
            return
        gs.error = problem
        for key in [k for k in self._partial if k[1] == gs.gid]:
            r = self._partial.pop(key).req
            if r is not None and r.error is None and not r.done:
                r.error = CollectiveMismatch(f"{r.call.where}: {problem}")
        for key in [k for k in self._posted if k[1] == gs.gid]:
            for r in self._posted.pop(key):
                if r.error is None and not r.done:
                    r.error = CollectiveMismatch(f"{r.call.where}: {problem}")
        gs.posted_from.clear()
        self._cond.notify_all()
        if forward:
            me = _group_rank(gs, self.rank)
            text = f"rank {me} detected: {problem}".encode()[:4000]
            for p in gs.members:
                if p == self.rank or p in self._down:
                    continue
                with self._dealer_locks[p]:
                    sock = self._dealers[p]
                    if sock is None:
                        continue
                    try:
                        sock.send_multipart([wire.pack(Kind.ABORT, self.rank, p, gid=gs.gid,
                                                       meta=wire.Meta(0, max(gs.active_seq, 0))),
                                             text], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass

    def _mark_down(self, peer: int, why: str, died: bool = False) -> None:
        """Lock held: ``peer`` is gone; fail every receive waiting for it, and when it
        ``died`` (no BYE: it cannot have finished its part), every collective wait in a
        group it belongs to."""
        if peer in self._down:
            return
        self._down[peer] = why
        if died:
            self._dead.add(peer)
        for key in [k for k in self._partial if k[0] == peer]:
            r = self._partial.pop(key).req
            if r is not None and r.error is None and not r.done:
                r.error = PeerError(f"{r.call.where}: {r.call.peer(peer)} {why} in the middle "
                                    f"of a message", peer=peer)
        for key in [k for k in self._posted if k[0] == peer]:
            for r in self._posted.pop(key):
                self._unindex(r)
                if r.error is None and not r.done:
                    r.error = PeerError(f"{r.call.where}: {r.call.peer(peer)} {why} before "
                                        f"sending the message this rank waits for", peer=peer)
        if not died:  # a rank that closed its group had finished every call it made
            self._cond.notify_all()
            return
        # A collective over the dead rank cannot complete even where this rank waits for
        # another member (which may wait for the dead one, or give up on it): fail those
        # waits too, naming the dead rank, rather than let them time out naming a survivor.
        groups = {gid for gid, gs in self._groups.items() if peer in gs.members}
        for key in [k for k in self._partial if k[1] in groups]:
            r = self._partial[key].req
            if r is not None and r.call.collective:
                del self._partial[key]
                if r.error is None and not r.done:
                    r.error = PeerError(f"{r.call.where}: {r.call.peer(peer)} {why}; a "
                                        f"collective over it cannot complete", peer=peer)
        for key in [k for k in self._posted if k[1] in groups]:
            q = self._posted[key]
            kept = collections.deque(r for r in q if not r.call.collective)
            for r in q:
                if r.call.collective:
                    self._unindex(r)
                    if r.error is None and not r.done:
                        r.error = PeerError(f"{r.call.where}: {r.call.peer(peer)} {why}; a "
                                            f"collective over it cannot complete", peer=peer)
            if kept:
                self._posted[key] = kept
            else:
                del self._posted[key]
        self._cond.notify_all()

    # ======================================================================= progress
    def _on_data(self, src: int, h: wire.Header, data: Optional[bytes]) -> None:
        """A DATA message (one part of a tensor) from authenticated ``src``, its payload
        frame still unread; or an INLINE message, ``data`` (header and payload)."""
        key = (src, h.gid, h.tag)
        with self._lock:
            if h.offset:
                self._on_later_part(src, key, h)
                return
            gs = self._groups.get(h.gid)
            if gs is not None and h.seq != wire.NO_SEQ:  # a collective of ours
                problem = None if gs.error else self._check_sequence(gs, src, h)
                seen = gs.seen.get(src)
                if seen is None or h.seq > seen.seq:
                    gs.seen[src] = h
                for req in list(gs.posted_from.get(src, ())):
                    if req.call.seq < h.seq and not req.done and req.error is None:
                        problem = problem or self._ahead_text(req, _describe_header(h))
                if problem:
                    self._discard(self._router)
                    self._fail_group(gs, problem, forward=True)
                    return
            q = self._posted.get(key)
            if q:
                req = q.popleft()
                if not q:
                    del self._posted[key]
                self._unindex(req)
                problem = self._compare(req, h)
                if problem:
                    self._discard(self._router)
                    self._mismatch(req, problem)
                elif not self._recv_part(h, req.view, data, req.frames):
                    self._malformed(req, src)
                elif wire.part_size(h.nbytes, 0) < h.nbytes:
                    self._partial[key] = _Partial(req, None, h)
                    if req.frames is not None:
                        self._cond.notify_all()  # a reader of the parts may start
                    return
                else:
                    req.done = True
                self._cond.notify_all()
                return
            if data is not None:  # keep the INLINE frame: read-only, never written
                buf = np.frombuffer(data, np.uint8, h.nbytes, wire.HEADER.size)
                if self._router.get(_RCVMORE):
                    self._discard(self._router)
                    self.stats["rejected"] += 1
                    return
            else:
                buf = np.empty(h.nbytes, np.uint8)
                if not self._recv_part(h, buf):
                    self.stats["rejected"] += 1
                    return
            self.stats["unexpected"] += 1
            msg = _Msg(h, buf)
            if wire.part_size(h.nbytes, 0) < h.nbytes:
                self._partial[key] = _Partial(None, msg, h)
            else:
                self._unexpected.setdefault(key, collections.deque()).append(msg)

    def _on_later_part(self, src: int, key: tuple, h: wire.Header) -> None:
        """Lock held: part ``h.offset`` of a tensor whose first part arrived."""
        part = self._partial.get(key)
        if part is None or part.next != h.offset or part.header.nbytes != h.nbytes:
            self._discard(self._router)  # e.g. the rest of a message whose call failed
            if part is not None:
                del self._partial[key]
                if part.req is not None:
                    self._malformed(part.req, src)
            return
        req = part.req
        if req is not None:
            ok = self._recv_part(h, req.view, None, req.frames)
        else:
            ok = self._recv_part(h, part.msg.buf)
        if not ok:
            del self._partial[key]
            if part.req is not None:
                self._malformed(part.req, src)
            return
        part.next += wire.part_size(h.nbytes, h.offset)
        if part.next < h.nbytes:
            if req is not None and req.frames is not None:
                self._cond.notify_all()  # a reader of the parts may go on
            return
        del self._partial[key]
        if part.req is not None:
            part.req.done = True
            self._cond.notify_all()
            return
        q = self._posted.get(key)  # a receive posted while the message was arriving
        if q:
            req = q.popleft()
            if not q:
                del self._posted[key]
            self._unindex(req)
            problem = self._compare(req, part.msg.header)
            if problem:
                self._mismatch(req, problem)
            else:
                self._fill(req, part.msg.buf)
                req.done = True
            self._cond.notify_all()
        else:
            self._unexpected.setdefault(key, collections.deque()).append(part.msg)

    def _malformed(self, req: _Recv, src: int) -> None:
        req.error = PeerError(f"{req.call.where}: malformed message from "
                              f"{req.call.peer(src)}", peer=src)
        self._cond.notify_all()

    def _recv_part(self, h: wire.Header, view: np.ndarray, data: Optional[bytes] = None,
                   frames: Optional[list] = None) -> bool:
        """Read the payload of part ``h.offset`` into ``view`` (bytes of the tensor): from
        ``data`` (an INLINE frame), or the next frame; with ``frames``, append that frame
        itself (zero-copy) as ``(offset, buffer)`` instead."""
        sock = self._router
        size = wire.part_size(h.nbytes, h.offset) if h.nbytes else 0
        try:
            if data is not None:  # parse() checked len(data) == header + nbytes
                if frames is not None:
                    frames.append((0, memoryview(data)[wire.HEADER.size:]))
                else:
                    view[:size] = np.frombuffer(data, np.uint8, size, wire.HEADER.size)
            elif size and frames is not None:
                if not sock.get(_RCVMORE):
                    return False
                frame = sock.recv(_NOBLOCK, copy=False)
                if len(frame) != size:
                    self._discard(sock)
                    return False
                frames.append((h.offset, frame.buffer))
            elif size:
                if not sock.get(_RCVMORE):
                    return False
                if _HAS_RECV_INTO:
                    got = sock.recv_into(view[h.offset:h.offset + size], flags=_NOBLOCK)
                else:  # pyzmq < 26.4: one more copy, out of libzmq's buffer
                    frame = sock.recv(_NOBLOCK, copy=False)
                    got = len(frame.buffer)
                    if got == size:
                        view[h.offset:h.offset + size] = np.frombuffer(frame.buffer, np.uint8)
                if got != size:
                    self._discard(sock)
                    return False
        except zmq.Again:
            return False
        if sock.get(_RCVMORE):
            self._discard(sock)
            return False
        return True

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

    def wait_recv(self, req: _Recv, timeout: Optional[float]) -> None:
        if req.done:
            return
        self._wait(req, self._deadline(req.call, timeout), timeout, None)

    def iter_parts(self, req: _Recv, timeout: Optional[float]) -> Iterator[tuple[int, Any]]:
        """The parts of a ``frames`` receive, in order, each as soon as it arrived."""
        deadline = self._deadline(req.call, timeout)
        frames, i = req.frames, 0
        while True:
            if i < len(frames):
                item, frames[i] = frames[i], None  # read once: libzmq's buffer is freed
                i += 1                              # (and reused by malloc) after its use
                yield item
            elif req.done:
                return
            else:
                self._wait(req, deadline, timeout, lambda: len(frames) > i)

    def _wait(self, req: _Recv, deadline: float, timeout: Optional[float],
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
                        raise CollectiveError(f"{req.call.where}: the group was closed while "
                                              f"waiting")
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

    def test_recv(self, req: _Recv) -> bool:
        if not (req.done or req.error is not None):
            self._drain_if_free()
        return req.done or req.error is not None

    def wait_send(self, tracker: Any, call: Call, dst: int, timeout: Optional[float]) -> None:
        deadline = self._deadline(call, timeout)
        while not tracker.done:
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

    # ========================================================================== close
    def close(self) -> None:
        """Say goodbye to the peers, close every socket and the context (sends still queued
        get at most COLLECTIVES_ZMQ_LINGER_S), remove the ipc directory."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            until = time.monotonic() + 2.0  # a waiter hands the token back within a slice
            while self._token and time.monotonic() < until:
                self._cond.wait(SLICE_S)
            mine = not self._token  # else a waiter is stuck in the sockets: leave them
            self._token = True
            for q in self._posted.values():
                for r in q:
                    if r.error is None and not r.done:
                        r.error = CollectiveError(f"{r.call.where}: the group was closed")
            for part in self._partial.values():
                r = part.req
                if r is not None and r.error is None and not r.done:
                    r.error = CollectiveError(f"{r.call.where}: the group was closed")
            self._posted.clear()
            self._unexpected.clear()
            self._partial.clear()
            self._cond.notify_all()
        if mine and self._router is not None:
            # Read the BYEs of peers that closed first: a BYE (or a queued send) to them
            # would wait out the whole linger in ctx.term (2 s, in 1 close in 15).
            try:
                self._drain()
            except zmq.ZMQError:
                pass
            with self._lock:  # what the drain queued for the closed group
                self._posted.clear()
                self._unexpected.clear()
                self._partial.clear()
        for p, sock in enumerate(self._dealers):
            if sock is None:
                continue
            with self._dealer_locks[p]:
                if p not in self._down:
                    try:
                        sock.send(wire.pack(Kind.BYE, self.rank, p), zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
        self._teardown(linger_ms=int(getattr(self, "_linger_s", 0) * 1000))

    def _teardown(self, linger_ms: int) -> None:
        for p, sock in enumerate(self._dealers):
            if sock is not None:
                with self._dealer_locks[p]:
                    # nothing queued for a rank that is gone can be delivered: no linger
                    sock.close(linger=0 if p in self._down else linger_ms)
                    self._dealers[p] = None
        for out in list(getattr(self, "_outbound", {}).values()):
            if not out.sock.closed:
                out.sock.close(0)
        if self._router is not None:
            try:
                self._router.disable_monitor()
            except zmq.ZMQError:
                pass
            self._router.close(0)
            self._router = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
        for attr in ("_rdv_in", "_rdv_out"):
            end = getattr(self, attr, None)
            if end is not None and not end.sock.closed:
                end.sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._ipc is not None:
            self._ipc.remove()
            self._ipc = None
        _live_engines.discard(self)
        _maybe_stop_gc()
