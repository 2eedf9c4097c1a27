"""What the zmq engine keeps per operation and per group: a :class:`Call` (one operation:
group, name, sequence number, signature, deadline), a posted receive (:class:`Recv`), a
message that arrived before its receive (:class:`Message`), a tensor whose first parts
arrived (:class:`Partial`), a group's matching state (:class:`GroupState`), the Works of
sends and receives, and how calls are compared (what is wrong when a message does not fit
the call it meets) and described in errors. Plain data and pure functions (the Works
wait through the engine's :class:`~backends.zeromq.progress.Progress`, which they are
given): the objects that act on them are the engine's parts (:mod:`backends.zeromq.engine`).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import numpy as np

from collectives.errors import PeerError
from collectives.work import Work

from . import wire


#: How a lost peer's errors end: where a collective's member died (it cannot complete),
#: and where a receive waited for a message that will not come.
CANNOT_COMPLETE = "a collective over it cannot complete"
BEFORE_SENDING = "before sending the message this rank waits for"


class Call:
    """One operation as the engine sees it: group, name, sequence number, signature,
    deadline, and how to name ranks in its errors."""

    __slots__ = ("gid", "members", "rank", "size", "op", "seq", "meta", "dtype", "deadline",
                 "timeout", "_where", "collective")

    def __init__(self, gid: int, members: tuple, rank: int, op: str, seq: int,
                 meta: wire.Meta, dtype: int, timeout: float, where: str,
                 collective: bool) -> None:
        self.gid, self.members, self.rank, self.size = gid, members, rank, len(members)
        self.op, self.seq, self.meta, self.dtype = op, seq, meta, dtype
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if collective else None
        self._where, self.collective = where, collective

    @property
    def where(self) -> str:
        """``[rank r/n] op`` (with ``(seq s)`` for a collective), for error messages:
        formatted only when one is raised, not on every call."""
        if self.collective:
            return f"{self._where} (seq {self.seq})"
        return self._where

    def group_rank(self, world: int) -> int:
        try:
            return self.members.index(world)
        except ValueError:
            return -1

    def peer(self, world: int) -> str:
        r = self.group_rank(world)
        if self.gid == 0 or r == world:
            return f"rank {r}"
        return f"rank {r} (world rank {world})"

    def peer_error(self, world: int, what: str) -> PeerError:
        """``PeerError("<where>: <the peer> <what>")`` for a failure of world rank
        ``world`` (gone, or sending garbage), naming it by its rank in this call's group,
        in the message and on the error."""
        return PeerError(f"{self.where}: {self.peer(world)} {what}",
                         peer=self.group_rank(world))


class Recv:
    """A posted receive. Normally the payload is copied into ``view``; with ``frames``
    (a list) the parts are kept as received, ``(byte offset, buffer)`` in order, for the
    caller to read (e.g. reduce) without a copy into ``view`` first."""

    __slots__ = ("call", "src", "tag", "view", "done", "error", "key", "count", "dtype",
                 "shape", "frames")

    def __init__(self, call: Call, src: int, tag: int, array: np.ndarray,
                 frames: Optional[list] = None) -> None:
        self.call, self.src, self.tag = call, src, tag
        self.count, self.dtype, self.shape = array.size, wire.dtype_code(array.dtype), array.shape
        self.view = array.reshape(-1).view(np.uint8)
        self.done = False
        self.error: Optional[BaseException] = None
        self.key = (src, call.gid, tag)
        self.frames = frames


class Message:
    __slots__ = ("header", "buf")

    def __init__(self, header: wire.Header, buf: np.ndarray) -> None:
        self.header, self.buf = header, buf


class Partial:
    """A tensor whose first parts arrived: into a posted receive, or a buffer."""

    __slots__ = ("req", "msg", "header", "next")

    def __init__(self, req: Optional["Recv"], msg: Optional["Message"], header: wire.Header) -> None:
        self.req, self.msg, self.header = req, msg, header
        self.next = wire.part_size(header.nbytes, 0)


class GroupState:
    __slots__ = ("gid", "members", "active_seq", "active_sig", "done_seq", "done_sig",
                 "failed_upto", "error", "error_peer", "seen", "posted_from")

    def __init__(self, gid: int, members: tuple) -> None:
        self.gid, self.members = gid, members
        self.active_seq = -1
        self.active_sig: Optional[tuple] = None
        self.done_seq = -1
        self.done_sig: Optional[tuple] = None          # signature of call done_seq
        self.failed_upto = -1
        self.error: Optional[str] = None
        #: The member (its rank in the group) whose report failed the group, or -1.
        self.error_peer = -1
        self.seen: dict[int, wire.Header] = {}         # src -> its message of highest seq
        self.posted_from: dict[int, set] = {}          # src -> posted collective Recvs


class RecvWork(Work):
    """A posted receive, waited for through the engine's
    :class:`~backends.zeromq.progress.Progress`."""

    __slots__ = ("_progress", "_req")

    def __init__(self, progress: Any, req: Recv) -> None:
        self._progress, self._req = progress, req

    def wait(self, timeout: Optional[float] = None) -> None:
        self._progress.wait_recv(self._req, timeout)

    def is_completed(self) -> bool:
        return self._progress.test_recv(self._req)


class PartsWork(RecvWork):
    """A receive whose parts are read where they arrived (see :meth:`Engine.irecv_parts`)."""

    __slots__ = ()

    def parts(self, timeout: Optional[float] = None) -> Iterator[tuple[int, memoryview]]:
        """Yield ``(byte offset, bytes)`` of each part in order, as soon as it arrived;
        raises like ``wait``."""
        return self._progress.iter_parts(self._req, timeout)


class SendWork(Work):
    """A send, done once libzmq released its zero-copy frames (``tracker``; None: none)."""

    __slots__ = ("_progress", "_call", "_dst", "_tracker")

    def __init__(self, progress: Any, call: Call, dst: int, tracker: Any) -> None:
        self._progress, self._call, self._dst, self._tracker = progress, call, dst, tracker

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._tracker is not None:
            self._progress.wait_send(self._tracker, self._call, self._dst, timeout)
            self._tracker = None

    def is_completed(self) -> bool:
        return self._tracker is None or self._tracker.done


# ------------------------------------------------------------------------- helpers
def rank_in_group(gs: GroupState, world: int) -> int:
    try:
        return gs.members.index(world)
    except ValueError:
        return world


def signature(h: wire.Header) -> tuple:
    return (h.op, h.dtype, h.sig_count, h.root, h.redop)


def sig_differs(a: tuple, b: tuple) -> bool:
    """Two call signatures (op, dtype, count, root, redop) disagree (ANY_COUNT matches
    every count)."""
    if a[2] != b[2] and wire.ANY_COUNT not in (a[2], b[2]):
        return True
    return (a[0], a[1], a[3], a[4]) != (b[0], b[1], b[3], b[4])


def describe_header(h: wire.Header) -> str:
    return wire.describe(h.op, h.seq, h.dtype, h.sig_count if h.sig_count != wire.ANY_COUNT
                         else h.count, (), wire.ANY_COUNT, h.root, h.redop)


def describe_sig(seq: int, sig: tuple) -> str:
    op, dtype, count, root, redop = sig
    return wire.describe(op, seq, dtype, count if count != wire.ANY_COUNT else 0, (),
                         wire.ANY_COUNT, root, redop)


def describe_meta(meta: wire.Meta, dtype: int, op: str) -> str:
    return describe_sig(meta.seq, (meta.op, dtype, meta.sig_count, meta.root, meta.redop))


# ---------------------------------------------------------------------- mismatches
def receive_problem(req: Recv, h: wire.Header) -> Optional[str]:
    """Why the message of header ``h`` cannot fill ``req`` (None when it can): both calls
    described, as each rank made it."""
    c = req.call
    m = c.meta
    same = (h.op == m.op and h.seq == m.seq and h.dtype == req.dtype and
            h.nbytes == req.view.nbytes and h.count == req.count and
            not sig_differs(signature(h), (m.op, req.dtype, m.sig_count, m.root, m.redop)))
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


def ahead_problem(req: Recv, theirs: str) -> str:
    """``req``'s sender is already in a later collective, ``theirs`` (described)."""
    c = req.call
    return (f"{c.peer(req.src)} is already in {theirs} while this rank still expects its "
            f"message of {describe_meta(c.meta, c.dtype, c.op)}: the ranks called "
            f"different collectives, or with different sizes or roots")


def sequence_problem(gs: GroupState, src: int, h: wire.Header) -> Optional[str]:
    """Why a collective message from ``src`` cannot belong to a call this rank makes
    (None when it can)."""
    if h.seq <= gs.done_seq and h.seq > gs.failed_upto:
        # Name this rank's own side too when it is the call just finished (a root or
        # size mismatch usually shows there): both calls, as for the other mismatches.
        mine = f" as {describe_sig(h.seq, gs.done_sig)}" \
            if h.seq == gs.done_seq and gs.done_sig is not None else ""
        return (f"rank {rank_in_group(gs, src)} sent {describe_header(h)}, a collective this "
                f"rank already finished{mine} without that message: the ranks called it "
                f"with different sizes, roots or dtypes")
    if h.seq == gs.active_seq and gs.active_sig is not None and \
            sig_differs(signature(h), gs.active_sig):
        return (f"rank {rank_in_group(gs, src)} called {describe_header(h)} but this rank "
                f"called {describe_sig(gs.active_seq, gs.active_sig)}")
    return None
