"""What the zmq engine keeps per operation and per group: a :class:`Call` (one operation:
group, name, sequence number, signature, deadline), a posted receive (``_Recv``), a
message that arrived before its receive (``_Msg``), a tensor whose first parts arrived
(``_Partial``), a group's matching state (``_GroupState``), the Works of sends and
receives, and how call signatures are compared and described in errors. The engine
itself is :mod:`backends.zeromq.engine`, its matching :mod:`backends.zeromq.matching` and
its progress :mod:`backends.zeromq.progress`.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import numpy as np

from collectives.work import Work

from . import wire



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


class _Recv:
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


class _Msg:
    __slots__ = ("header", "buf")

    def __init__(self, header: wire.Header, buf: np.ndarray) -> None:
        self.header, self.buf = header, buf


class _Partial:
    """A tensor whose first parts arrived: into a posted receive, or a buffer."""

    __slots__ = ("req", "msg", "header", "next")

    def __init__(self, req: Optional["_Recv"], msg: Optional["_Msg"], header: wire.Header) -> None:
        self.req, self.msg, self.header = req, msg, header
        self.next = wire.part_size(header.nbytes, 0)


class _GroupState:
    __slots__ = ("gid", "members", "active_seq", "active_sig", "done_seq", "done_sig",
                 "failed_upto", "error", "seen", "posted_from")

    def __init__(self, gid: int, members: tuple) -> None:
        self.gid, self.members = gid, members
        self.active_seq = -1
        self.active_sig: Optional[tuple] = None
        self.done_seq = -1
        self.done_sig: Optional[tuple] = None          # signature of call done_seq
        self.failed_upto = -1
        self.error: Optional[str] = None
        self.seen: dict[int, wire.Header] = {}         # src -> its message of highest seq
        self.posted_from: dict[int, set] = {}          # src -> posted collective _Recvs


class _RecvWork(Work):
    __slots__ = ("_engine", "_req")

    def __init__(self, engine: Any, req: _Recv) -> None:
        self._engine, self._req = engine, req

    def wait(self, timeout: Optional[float] = None) -> None:
        self._engine.wait_recv(self._req, timeout)

    def is_completed(self) -> bool:
        return self._engine.test_recv(self._req)


class _PartsWork(_RecvWork):
    """A receive whose parts are read where they arrived (see :meth:`Engine.irecv_parts`)."""

    __slots__ = ()

    def parts(self, timeout: Optional[float] = None) -> Iterator[tuple[int, memoryview]]:
        """Yield ``(byte offset, bytes)`` of each part in order, as soon as it arrived;
        raises like ``wait``."""
        return self._engine.iter_parts(self._req, timeout)


class _SendWork(Work):
    __slots__ = ("_engine", "_call", "_dst", "_tracker")

    def __init__(self, engine: Any, call: Call, dst: int, tracker: Any) -> None:
        self._engine, self._call, self._dst, self._tracker = engine, call, dst, tracker

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._tracker is not None:
            self._engine.wait_send(self._tracker, self._call, self._dst, timeout)
            self._tracker = None

    def is_completed(self) -> bool:
        return self._tracker is None or self._tracker.done


# ------------------------------------------------------------------------- helpers
def _group_rank(gs: _GroupState, world: int) -> int:
    try:
        return gs.members.index(world)
    except ValueError:
        return world


def _signature(h: wire.Header) -> tuple:
    return (h.op, h.dtype, h.sig_count, h.root, h.redop)


def _sig_differs(a: tuple, b: tuple) -> bool:
    """Two call signatures (op, dtype, count, root, redop) disagree (ANY_COUNT matches
    every count)."""
    if a[2] != b[2] and wire.ANY_COUNT not in (a[2], b[2]):
        return True
    return (a[0], a[1], a[3], a[4]) != (b[0], b[1], b[3], b[4])


def _describe_header(h: wire.Header) -> str:
    return wire.describe(h.op, h.seq, h.dtype, h.sig_count if h.sig_count != wire.ANY_COUNT
                         else h.count, (), wire.ANY_COUNT, h.root, h.redop)


def _describe_sig(seq: int, sig: tuple) -> str:
    op, dtype, count, root, redop = sig
    return wire.describe(op, seq, dtype, count if count != wire.ANY_COUNT else 0, (),
                         wire.ANY_COUNT, root, redop)


def _describe_meta(meta: wire.Meta, dtype: int, op: str) -> str:
    return _describe_sig(meta.seq, (meta.op, dtype, meta.sig_count, meta.root, meta.redop))
