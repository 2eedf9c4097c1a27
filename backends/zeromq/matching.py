"""Message matching of the zmq engine: a receive that a call posts meets the message a peer
sent for it, whichever comes first (what waits meanwhile is kept in a
:class:`~backends.zeromq.pending.Pending`). Every match compares the header with what the
receive expects, and each group's collectives are checked against the sequence numbers
its members' messages carry; a mismatch fails the receive and a collective's whole group,
on every member (an ABORT tells the others: their calls fail with a ``PeerError`` naming
the member that reported it). A peer that is gone fails what waits for it.

:class:`Matcher` decides where each byte goes and which request fails; when and by which
thread the sockets are read is :class:`~backends.zeromq.progress.Progress`'s. Its state
is guarded by the engine's one lock, given to it with the condition variable on which
waiters sleep (it wakes them when a request completes or fails).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import numpy as np
import zmq

from collectives.errors import CollectiveError, CollectiveMismatch, PeerError

from . import wire
from .calls import (BEFORE_SENDING, CANNOT_COMPLETE, Call, GroupState, Message, Partial,
                    Recv, ahead_problem, describe_header, rank_in_group, receive_problem,
                    sequence_problem)
from .connections import Connections
from .liveness import Liveness
from .pending import Pending
from .sockets import RCVMORE, discard_rest, recv_part
from .wire import Kind


class Matcher:
    """Posted receives, early messages and the groups' sequence checks of one rank."""

    def __init__(self, rank: int, lock: threading.Lock, cond: threading.Condition, stats: dict,
                 liveness: Liveness, connections: Connections) -> None:
        self._rank = rank
        self._lock, self._cond = lock, cond
        self._stats = stats
        self._liveness = liveness
        self._conns = connections  # to tell a failed group's other members
        self._pending = Pending()
        self._groups: dict[int, GroupState] = {}
        self._early_aborts: dict[int, tuple[int, str, bool]] = {}

    # ========================================================================= groups
    def register_group(self, gid: int, members: tuple) -> None:
        with self._lock:
            gs = self._groups.get(gid)
            if gs is not None:
                return
            gs = self._groups[gid] = GroupState(gid, members)
            early = self._early_aborts.pop(gid, None)
            if early is not None:  # a member failed in it before this rank created it
                self._reported(gs, *early)
            for src, msg in self._pending.unexpected_in(gid):  # what members sent before
                seen = gs.seen.get(src)
                if msg.header.seq != wire.NO_SEQ and (seen is None or msg.header.seq > seen.seq):
                    gs.seen[src] = msg.header

    def unregister_group(self, gid: int) -> None:
        with self._lock:
            self._groups.pop(gid, None)
            self._pending.drop_group(gid)

    def raise_if_failed(self, call: Call) -> None:
        """The group's error (:func:`group_error`) when ``call``'s group failed earlier
        (with or without the lock: it reads one attribute)."""
        gs = self._groups.get(call.gid)
        if gs is not None and gs.error:
            raise group_error(gs, f"{call.where}: the group is unusable after an earlier "
                                  f"error: {gs.error}")

    def begin(self, call: Call, sig: tuple) -> None:
        """Lock held: ``call`` (signature ``sig``) is the collective its group runs now;
        check what its peers already sent for it."""
        gs = self._groups[call.gid]
        gs.active_seq, gs.active_sig = call.seq, sig
        for src, msg in self._pending.unexpected_in(call.gid):
            if msg.header.seq == wire.NO_SEQ:  # point to point
                continue
            problem = sequence_problem(gs, src, msg.header)
            if problem:
                self._fail_group(gs, problem, forward=True)
                raise CollectiveMismatch(f"{call.where}: {problem}")

    def end(self, call: Call, ok: bool) -> None:
        """``call`` returned (``ok``) or raised: a failed call's receives are forgotten."""
        with self._lock:
            gs = self._groups.get(call.gid)
            if gs is None:
                return
            if call.seq >= gs.done_seq:
                gs.done_seq, gs.done_sig = call.seq, gs.active_sig
            gs.active_seq, gs.active_sig = -1, None
            if not ok:
                gs.failed_upto = max(gs.failed_upto, call.seq)
                self._drop(lambda k: True, lambda r: r.call is call)

    # ================================================================ posted receives
    def post(self, req: Recv) -> None:
        """Lock held: ``req`` meets the message that waits for it (done, or failed with
        the mismatch raised), or waits for it."""
        call, src = req.call, req.src
        collective = call.collective  # a collective of ours (sequence numbers are checked)
        gs = self._groups.get(call.gid)
        if gs is not None and gs.error:
            self.raise_if_failed(call)  # raises
        msg = self._pending.take_unexpected(req.key)
        if msg is not None:
            problem = receive_problem(req, msg.header)
            if problem:
                self._mismatch(req, problem)
                raise req.error
            self._fill(req, msg.buf)
            req.done = True
            return
        if collective and gs is not None:
            seen = gs.seen.get(src)
            if seen is not None and seen.seq > call.seq:
                self._mismatch(req, ahead_problem(req, describe_header(seen)))
                raise req.error
        liveness = self._liveness
        why = liveness.down.get(src)
        if why is not None:
            raise call.peer_error(src, f"{why} {BEFORE_SENDING}")
        if collective and liveness.dead:  # a member died after this collective began
            liveness.raise_if_member_dead(call)
        self._pending.post(req)
        if collective and gs is not None:
            gs.posted_from.setdefault(src, set()).add(req)

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
    def on_data(self, sock: zmq.Socket, src: int, h: wire.Header, data: Optional[bytes]) -> None:
        """A DATA message (one part of a tensor) from authenticated ``src``, its payload
        frame still unread on ``sock``; or an INLINE message, ``data`` (header and payload)."""
        key = (src, h.gid, h.tag)
        with self._lock:
            if h.offset:
                self._on_later_part(sock, src, key, h)
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
                    discard_rest(sock)
                    self._fail_group(gs, problem, forward=True)
                    return
            req = self._pending.take_posted(key)
            if req is not None:
                self._unindex(req)
                problem = receive_problem(req, h)
                if problem:
                    discard_rest(sock)
                    self._mismatch(req, problem)
                elif not recv_part(sock, h, req.view, data, req.frames):
                    self._malformed(req, src)
                elif wire.part_size(h.nbytes, 0) < h.nbytes:
                    self._pending.start_partial(key, Partial(req, None, h))
                    if req.frames is not None:
                        self._cond.notify_all()  # a reader of the parts may start
                    return
                else:
                    req.done = True
                self._cond.notify_all()
                return
            if data is not None:  # keep the INLINE frame: read-only, never written
                buf = np.frombuffer(data, np.uint8, h.nbytes, wire.HEADER.size)
                if sock.get(RCVMORE):
                    discard_rest(sock)
                    self._stats["rejected"] += 1
                    return
            else:
                buf = np.empty(h.nbytes, np.uint8)
                if not recv_part(sock, h, buf):
                    self._stats["rejected"] += 1
                    return
            self._stats["unexpected"] += 1
            msg = Message(h, buf)
            if wire.part_size(h.nbytes, 0) < h.nbytes:
                self._pending.start_partial(key, Partial(None, msg, h))
            else:
                self._pending.keep(key, msg)

    def _on_later_part(self, sock: zmq.Socket, src: int, key: tuple, h: wire.Header) -> None:
        """Lock held: part ``h.offset`` of a tensor whose first part arrived."""
        pending = self._pending
        part = pending.partial(key)
        if part is None or part.next != h.offset or part.header.nbytes != h.nbytes:
            discard_rest(sock)  # e.g. the rest of a message whose call failed
            if part is not None:
                pending.end_partial(key)
                if part.req is not None:
                    self._malformed(part.req, src)
            return
        req = part.req
        if req is not None:
            ok = recv_part(sock, h, req.view, None, req.frames)
        else:
            ok = recv_part(sock, h, part.msg.buf)
        if not ok:
            pending.end_partial(key)
            if part.req is not None:
                self._malformed(part.req, src)
            return
        part.next += wire.part_size(h.nbytes, h.offset)
        if part.next < h.nbytes:
            if req is not None and req.frames is not None:
                self._cond.notify_all()  # a reader of the parts may go on
            return
        pending.end_partial(key)
        if part.req is not None:
            part.req.done = True
            self._cond.notify_all()
            return
        req = pending.take_posted(key)  # a receive posted while the message was arriving
        if req is not None:
            self._unindex(req)
            problem = receive_problem(req, part.msg.header)
            if problem:
                self._mismatch(req, problem)
            else:
                self._fill(req, part.msg.buf)
                req.done = True
            self._cond.notify_all()
        else:
            pending.keep(key, part.msg)

    def _malformed(self, req: Recv, src: int) -> None:
        req.error = req.call.peer_error(src, "sent a malformed message")
        self._cond.notify_all()

    # ======================================================================= failures
    def abort_group(self, gid: int) -> None:
        """This rank aborted group ``gid``: its waits fail, and its other members are told."""
        with self._lock:
            gs = self._groups.get(gid)
            if gs is not None:
                self._fail_group(gs, "the group was aborted", forward=True, left=True)

    def on_abort(self, peer: int, gid: int, text: str, left: bool = False) -> None:
        """``peer`` failed group ``gid`` (``text``: why; ``left``: it left the group's call,
        rather than saw its calls disagree): so does this rank."""
        with self._lock:
            gs = self._groups.get(gid)
            if gs is not None:
                self._reported(gs, peer, text, left)
            elif len(self._early_aborts) < 1024:  # a group this rank has yet to create
                self._early_aborts[gid] = (peer, text, left)

    def _reported(self, gs: GroupState, peer: int, text: str, left: bool) -> None:
        """Lock held: member ``peer`` reported that it failed group ``gs`` (see
        :meth:`on_abort`)."""
        r = rank_in_group(gs, peer)
        self._fail_group(gs, f"rank {r} reported: {text}", forward=False,
                         peer=r if left else -1)

    def _fail_group(self, gs: GroupState, problem: str, forward: bool, peer: int = -1,
                    left: bool = False) -> None:
        """Lock held: the group's calls fail from now on (:func:`group_error`; ``peer``:
        the member that left the group's call, failing it, by its rank in the group); with ``forward``, tell the
        other members (they fail too instead of waiting; ``left``: this rank left it)."""
        if gs.error:
            return
        gs.error, gs.error_peer = problem, peer
        gid = gs.gid
        self._fail(self._drop(lambda k: k[1] == gid),
                   lambda r: group_error(gs, f"{r.call.where}: {problem}"))
        gs.posted_from.clear()
        self._cond.notify_all()
        if forward:
            rank = self._rank
            text = f"rank {rank_in_group(gs, rank)} detected: {problem}".encode()[:4000]
            meta = wire.Meta(0, max(gs.active_seq, 0))
            tag = wire.ABORT_LEFT if left else 0
            down = self._liveness.down
            for p in gs.members:
                if p != rank and p not in down:
                    self._conns.send_control(p, [wire.pack(Kind.ABORT, rank, p, gid=gid, meta=meta,
                                                           tag=tag), text])

    def peer_down(self, peer: int, why: str, died: bool = False) -> None:
        """Lock held: ``peer`` is gone; fail every receive waiting for it, and when it
        ``died`` (no BYE: it cannot have finished its part), every collective wait in a
        group it belongs to."""
        if not self._liveness.mark_down(peer, why, died):
            return
        pending = self._pending
        self._fail(pending.drop_partial(lambda k: k[0] == peer),
                   lambda r: r.call.peer_error(peer, f"{why} in the middle of a message"))
        self._fail(self._unindexed(pending.drop_posted(lambda k: k[0] == peer)),
                   lambda r: r.call.peer_error(peer, f"{why} {BEFORE_SENDING}"))
        if died:
            # A collective over the dead rank cannot complete even where this rank waits
            # for another member (which may wait for the dead one, or give up on it): fail
            # those waits too, naming the dead rank, rather than let them time out naming
            # a survivor. (A rank that said BYE had finished every call it made.)
            groups = {gid for gid, gs in self._groups.items() if peer in gs.members}
            self._fail(self._drop(lambda k: k[1] in groups, lambda r: r.call.collective),
                       lambda r: r.call.peer_error(peer, f"{why}; {CANNOT_COMPLETE}"))
        self._cond.notify_all()

    def fail_all(self, how: str) -> None:
        """Lock held: the engine was closed or aborted (``how``): every request fails, and
        everything kept is forgotten."""
        self._fail(self._pending.waiting(),
                   lambda r: CollectiveError(f"{r.call.where}: the group was {how}"))
        self._pending.clear()

    def clear(self) -> None:
        """Lock held: forget every request and every message kept (the engine is closing)."""
        self._pending.clear()

    def _drop(self, key_ok: Callable[[tuple], bool],
              req_ok: Optional[Callable[[Recv], bool]] = None) -> list[Recv]:
        """Lock held: forget the receives, posted or partly received, whose key is
        ``key_ok`` (and, given ``req_ok``, that are); return them."""
        pending = self._pending
        return pending.drop_partial(key_ok, req_ok) + \
            self._unindexed(pending.drop_posted(key_ok, req_ok))

    def _unindexed(self, reqs: list[Recv]) -> list[Recv]:
        for r in reqs:
            self._unindex(r)
        return reqs

    @staticmethod
    def _fail(reqs: list[Recv], error: Callable[[Recv], BaseException]) -> None:
        """Each of ``reqs`` fails with ``error(req)``, unless it is over already."""
        for r in reqs:
            if r.error is None and not r.done:
                r.error = error(r)


def group_error(gs: GroupState, message: str) -> CollectiveError:
    """The error of a call in failed group ``gs``: ``PeerError`` naming the member
    (``peer``, its rank in the group) that left the group's call (it aborted the
    group, because of a failure of its own), else ``CollectiveMismatch`` (the group's
    calls disagree, or this rank aborted it)."""
    if gs.error_peer >= 0:
        return PeerError(message, peer=gs.error_peer)
    return CollectiveMismatch(message)
