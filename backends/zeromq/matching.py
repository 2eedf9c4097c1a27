"""Message matching of the zmq engine: a receive that a call posts meets the message a peer
sent for it, whichever comes first. A receive posted before its message waits in
``_posted``; a message that arrives before its receive waits in ``_unexpected``; a tensor
that travels as several parts is followed in ``_partial`` until its last part is in. Every
match compares the header with what the receive expects, and a mismatch fails the receive
(and a collective's whole group, on every member).

This is the part of :class:`~backends.zeromq.engine.Engine` that decides where each byte
goes; when and by which thread the sockets are read is :mod:`backends.zeromq.progress`.
The tables it works on, and the lock that guards them, are the engine's.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import zmq

from collectives.errors import CollectiveMismatch, PeerError
from collectives.work import Work

from . import wire
from .calls import (Call, Message, Partial, PartsWork, Recv, RecvWork, ahead_problem,
                    describe_header, receive_problem, sequence_problem)
from .connect import _NOBLOCK, _RCVMORE


_HAS_RECV_INTO = hasattr(zmq.Socket, "recv_into")


class Matcher:
    """The matching part of :class:`~backends.zeromq.engine.Engine`."""

    # ================================================================ posted receives
    def irecv_parts(self, call: Call, src: int, tag: int, like: np.ndarray) -> "PartsWork":
        """Receive a message shaped like ``like`` without copying it anywhere: its parts
        stay in the buffers they arrived in, read in order through ``parts()`` (a
        reduction reads them straight from there, saving a copy of every byte). Same
        checks, errors and timeouts as :meth:`irecv`; ``like`` is not written."""
        return self.irecv(call, src, tag, like, frames=True)

    def irecv(self, call: Call, src: int, tag: int, array: np.ndarray,
              frames: bool = False) -> Work:
        req = Recv(call, src, tag, array, [] if frames else None)
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
                problem = receive_problem(req, msg.header)
                if problem:
                    self._mismatch(req, problem)
                    raise req.error
                self._fill(req, msg.buf)
                req.done = True
                return PartsWork(self, req) if frames else RecvWork(self, req)
            if collective and gs is not None:
                seen = gs.seen.get(src)
                if seen is not None and seen.seq > call.seq:
                    self._mismatch(req, ahead_problem(req, describe_header(seen)))
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
        return PartsWork(self, req) if frames else RecvWork(self, req)

    @staticmethod
    def _fill(req: Recv, buf: np.ndarray) -> None:
        """A whole message that arrived before ``req`` was posted goes to ``req``."""
        if req.frames is not None:
            if buf.size:
                req.frames.append((0, buf))
        elif buf.size:
            req.view[...] = buf

    def _unindex(self, req: Recv) -> None:
        if req.call.collective:
            gs = self._groups.get(req.call.gid)
            if gs is not None:
                s = gs.posted_from.get(req.src)
                if s is not None:
                    s.discard(req)

    def _mismatch(self, req: Recv, problem: str) -> None:
        """Fail ``req`` (lock held); a collective's group is failed everywhere."""
        c = req.call
        req.error = CollectiveMismatch(f"{c.where}: {problem}")
        if c.collective:
            gs = self._groups.get(c.gid)
            if gs is not None:
                self._fail_group(gs, problem, forward=True)

    # ======================================================================= arrivals
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
                problem = None if gs.error else sequence_problem(gs, src, h)
                seen = gs.seen.get(src)
                if seen is None or h.seq > seen.seq:
                    gs.seen[src] = h
                for req in list(gs.posted_from.get(src, ())):
                    if req.call.seq < h.seq and not req.done and req.error is None:
                        problem = problem or ahead_problem(req, describe_header(h))
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
                problem = receive_problem(req, h)
                if problem:
                    self._discard(self._router)
                    self._mismatch(req, problem)
                elif not self._recv_part(h, req.view, data, req.frames):
                    self._malformed(req, src)
                elif wire.part_size(h.nbytes, 0) < h.nbytes:
                    self._partial[key] = Partial(req, None, h)
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
            msg = Message(h, buf)
            if wire.part_size(h.nbytes, 0) < h.nbytes:
                self._partial[key] = Partial(None, msg, h)
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
            problem = receive_problem(req, part.msg.header)
            if problem:
                self._mismatch(req, problem)
            else:
                self._fill(req, part.msg.buf)
                req.done = True
            self._cond.notify_all()
        else:
            self._unexpected.setdefault(key, collections.deque()).append(part.msg)

    def _malformed(self, req: Recv, src: int) -> None:
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
