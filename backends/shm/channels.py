"""Point to point over shared memory: one byte ring per ordered pair of ranks.

The ring src -> dst has a ``head`` (bytes ever written; stored by the sender only) and a
``tail`` (bytes ever consumed; stored by the receiver only), so no atomics are needed.
A message is a 32-byte header (tag, payload bytes, dtype code) and its payload, streamed
through the ring in pieces when it is larger than the ring.

Matching is MPI's: a receive for (src, tag) takes the first message from src with that
tag; messages with other tags that come first are copied out into a private
"unexpected" queue keyed by (src, tag) (only when the waiter has nothing better to do,
so a matching receive that is posted in time gets the bytes without a second copy).
Messages of one (src, tag) stay in order.

Progress happens inside waits: whoever waits advances every pending send and receive of
this process (under one lock, never held while asleep), so exchanges of large messages on
a ring, or two ranks blocked sending to each other, always complete. One exception:
a blocking receive with nothing of this rank in flight (``blocking_calls``) holds the
lock through a short C wait (the wait policy's spin and yield window) for its message.
"""

from __future__ import annotations

import collections
import struct
import threading
from typing import Callable, Optional

import numpy as np

from collectives.errors import CollectiveError, CollectiveMismatch

from .segment import Layout, Segment

HEADER = struct.Struct("<QQII8x")
HEADER_BYTES = HEADER.size  # 32
_MSG_MAGIC = 0x4D534731


class SendOp:
    __slots__ = ("dst", "tag", "payload", "header", "pos", "total", "done", "error")

    def __init__(self, dst: int, tag: int, payload: np.ndarray, dtype_code: int) -> None:
        self.dst = dst
        self.tag = tag
        self.payload = payload
        self.header = np.frombuffer(HEADER.pack(tag, payload.size, dtype_code, _MSG_MAGIC),
                                    np.uint8)
        self.pos = 0                      # bytes of header + payload written
        self.total = HEADER_BYTES + payload.size
        self.done = False
        self.error: Optional[BaseException] = None


class RecvOp:
    __slots__ = ("src", "tag", "array", "done", "error", "dtype_code")

    def __init__(self, src: int, tag: int, array: np.ndarray, dtype_code: int) -> None:
        self.src = src
        self.tag = tag
        self.array = array                # uint8 view of the destination
        self.done = False
        self.error: Optional[BaseException] = None
        self.dtype_code = dtype_code


class _Done:
    """What a send or receive that the core completed at once returns."""

    __slots__ = ()
    done = True
    error = None


_DONE = _Done()


class _Unexpected:
    """A message that arrived before its receive was posted."""

    __slots__ = ("data", "complete", "recv", "dtype_code")

    def __init__(self, nbytes: int, dtype_code: int) -> None:
        self.data = np.empty(nbytes, np.uint8)
        self.complete = False
        self.recv: Optional[RecvOp] = None   # a receive matched while still arriving
        self.dtype_code = dtype_code


class _Incoming:
    """The message now streaming in from one source."""

    __slots__ = ("tag", "nbytes", "dtype_code", "pos", "target", "recv", "unexpected",
                 "discard")

    def __init__(self, tag: int, nbytes: int, dtype_code: int) -> None:
        self.tag = tag
        self.nbytes = nbytes
        self.dtype_code = dtype_code
        self.pos = 0
        self.target: Optional[np.ndarray] = None
        self.recv: Optional[RecvOp] = None
        self.unexpected: Optional[_Unexpected] = None
        self.discard = False


class Engine:
    """The point-to-point state of one rank of one group."""

    def __init__(self, seg: Segment, rank: int, size: int, ring: Callable[[list], None],
                 where: Callable[[str], str], dtype_name: Callable[[int], str],
                 core=None) -> None:
        lay: Layout = seg.layout
        # The compiled core (native.py's module), or None: it moves a whole message in one call
        # when nothing else is queued on that ring (same bytes, same counters).
        self._core = core if size > 1 else None
        self.rank, self.size = rank, size
        self.lock = threading.Lock()
        self._u64 = seg.u64
        self._ring_doorbells = ring
        self.where = where
        self._dtype_name = dtype_name
        self._R = lay.ring
        self._out_rings = [None if d == rank or size == 1 else
                           seg.bytes[lay.ring_byte(rank, d):lay.ring_byte(rank, d) + lay.ring]
                           for d in range(size)]
        self._in_rings = [None if s == rank or size == 1 else
                          seg.bytes[lay.ring_byte(s, rank):lay.ring_byte(s, rank) + lay.ring]
                          for s in range(size)]
        self._out_head = [lay.head_word(rank, d) for d in range(size)]
        self._out_tail = [lay.tail_word(rank, d) for d in range(size)]
        self.in_head = [lay.head_word(s, rank) for s in range(size)]
        self._in_tail = [lay.tail_word(s, rank) for s in range(size)]
        # Our own counters, cached (we are their only writer).
        self._heads = [0] * size
        self._tails = [0] * size
        self._sendq: list[collections.deque] = [collections.deque() for _ in range(size)]
        self._posted: list[collections.deque] = [collections.deque() for _ in range(size)]
        self._incoming: list[Optional[_Incoming]] = [None] * size
        self._unexpected: dict[tuple[int, int], collections.deque] = {}
        self._peers = [r for r in range(size) if r != rank]
        self.pending = 0          # sends and receives not yet done
        self.closed = False
        # Stream in pieces of a quarter ring, so the receiver copies while we write.
        self._piece = max(4096, self._R // 4)
        if self._core is not None:   # the rings of every peer, for send_now / recv_now
            offsets = []
            for r in range(size):
                offsets += [lay.ring_byte(rank, r), lay.ring_byte(r, rank),
                            8 * lay.head_word(rank, r), 8 * lay.tail_word(rank, r),
                            8 * lay.head_word(r, rank), 8 * lay.tail_word(r, rank)]
            self._core.bind_p2p(self._R, _MSG_MAGIC, offsets)

    # ------------------------------------------------------- blocking, in one call
    def blocking_calls(self, post_send: Callable, post_recv: Callable,
                       budget: float, codes: dict) -> tuple[Callable, Callable]:
        """``(send_now, recv_now)`` for the fast path's blocking send and receive with
        the core: closures over this engine's state, so that a call costs one Python
        frame and one C call when the ring allows. What the ring does not allow goes to
        ``post_send``/``post_recv`` (the backend's ``isend``/``irecv``) and their wait.

        ``send_now(array, dst, tag)`` puts the whole message into the ring to ``dst``
        if nothing of ours waits on that ring and it fits now.

        ``recv_now(array, src, tag)`` waits in C for at most ``budget`` seconds (the
        wait policy's spin and yield, GIL released) until the next message from ``src``
        is all in the ring, and takes it if it is this one (one larger than the ring
        goes to the engine at once, which streams it); only when nothing of ours is
        in flight (``pending`` 0: no send or receive of this rank needs progress
        meanwhile) and nothing could match first (no receive posted from ``src``, none
        half read, no ``(src, tag)`` message set aside). The lock is held through the
        wait: another thread of ours that posts meanwhile waits at most ``budget``.
        ``dst``/``src`` are peers (not this rank), ``tag`` a user tag."""
        lock, heads, tails = self.lock, self._heads, self._tails
        sendq, posted, incoming = self._sendq, self._posted, self._incoming
        unexpected = self._unexpected

        def send_now(array: np.ndarray, dst: int, tag: int) -> None:
            dtype = array.dtype
            # (bfloat16 has no buffer export with a format: the core gets its bits)
            bits = array.view(np.uint16) if dtype.itemsize == 2 else array
            with lock:
                if not self.closed and not sendq[dst]:   # (close() drops the core)
                    head = self._core.send(dst, heads[dst], tag, codes.get(dtype, 0), bits)
                    if head >= 0:
                        heads[dst] = head
                        return
            post_send(array, dst, tag).wait()

        def recv_now(array: np.ndarray, src: int, tag: int) -> None:
            bits = array.view(np.uint16) if array.dtype.itemsize == 2 else array
            with lock:
                if not (self.pending or self.closed or posted[src] or incoming[src]
                        is not None or (unexpected and (src, tag) in unexpected)):
                    tail = self._core.recv(src, tails[src], tag, bits, budget)
                    if tail >= 0:
                        tails[src] = tail
                        return
            post_recv(array, src, tag).wait()

        return send_now, recv_now

    # ------------------------------------------------------------------ posting
    def post_send(self, array: np.ndarray, dst: int, tag: int, dtype_code: int) -> SendOp:
        payload = array.reshape(-1).view(np.uint8)
        core = self._core
        if core is not None and dst != self.rank:
            with self.lock:
                self._check_open("send")
                if not self._sendq[dst]:       # in order behind nothing: one C call
                    head = core.send(dst, self._heads[dst], tag, dtype_code, payload)
                    if head >= 0:              # (the core rang dst's doorbell)
                        self._heads[dst] = head
                        return _DONE
        op = SendOp(dst, tag, payload, dtype_code)
        with self.lock:
            self._check_open("send")
            if dst == self.rank:
                self._deliver_local(op)
                return op
            self._sendq[dst].append(op)
            self.pending += 1
            self.progress_locked(drain=False)
        return op

    def post_recv(self, array: np.ndarray, src: int, tag: int, dtype_code: int) -> RecvOp:
        target = array.reshape(-1).view(np.uint8)
        core = self._core
        if core is not None and src != self.rank:
            with self.lock:
                self._check_open("recv")
                # Only when this message could not match anything else first: nothing
                # posted from src, nothing of src half read, no (src, tag) set aside.
                if not self._posted[src] and self._incoming[src] is None \
                        and (src, tag) not in self._unexpected:
                    tail = core.recv(src, self._tails[src], tag, target, 0.0)
                    if tail >= 0:   # (the core rang src, which may wait for room)
                        self._tails[src] = tail
                        return _DONE
        op = RecvOp(src, tag, target, dtype_code)
        with self.lock:
            self._check_open("recv")
            self.pending += 1
            key = (src, tag)
            queue = self._unexpected.get(key)
            inc = self._incoming[src]
            if queue:
                u = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                if self._size_ok(op, u.data.size, u.dtype_code):
                    if u.complete:
                        op.array[...] = u.data
                        self._complete(op)
                    else:
                        u.recv = op
                else:
                    self._complete(op)  # failed; the message is dropped
            elif inc is not None and inc.target is None and not inc.discard \
                    and inc.tag == tag:
                self._match(inc, op)
            else:
                self._posted[src].append(op)
            if not op.done and src != self.rank:
                self.progress_locked(drain=False)
        return op

    def take_posted_locked(self, op: RecvOp) -> bool:
        """With the core: complete ``op``, the first receive posted from its source,
        straight from the ring if its whole message is next there (one C call); False
        leaves it to ``progress_locked``."""
        src = op.src
        posted = self._posted[src]
        if self._core is None or op.done or not posted or posted[0] is not op \
                or self._incoming[src] is not None:
            return False
        tail = self._core.recv(src, self._tails[src], op.tag, op.array, 0.0)
        if tail < 0:
            return False
        posted.popleft()
        self._tails[src] = tail
        self._complete(op)
        return True

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise CollectiveError(f"{self.where(what)}: the group is closed")

    def _complete(self, op) -> None:
        if not op.done:
            op.done = True
            self.pending -= 1

    def _size_ok(self, op: RecvOp, nbytes: int, dtype_code: int) -> bool:
        if op.array.size == nbytes:
            return True
        op.error = CollectiveMismatch(
            f"{self.where('recv')} from rank {op.src} (tag {op.tag}): rank {op.src} sent "
            f"{nbytes} bytes of {self._dtype_name(dtype_code)}, this rank receives into "
            f"{op.array.size} bytes of {self._dtype_name(op.dtype_code)}")
        return False

    def _match(self, inc: _Incoming, op: RecvOp) -> None:
        if self._size_ok(op, inc.nbytes, inc.dtype_code):
            inc.target = op.array
            inc.recv = op
        else:
            inc.discard = True
            self._complete(op)

    def _deliver_local(self, op: SendOp) -> None:
        posted = self._posted[self.rank]
        for i, recv in enumerate(posted):
            if recv.tag == op.tag:
                del posted[i]
                if self._size_ok(recv, op.payload.size, 0):
                    recv.array[...] = op.payload
                self._complete(recv)
                op.done = True
                return
        u = _Unexpected(op.payload.size, 0)
        u.data[...] = op.payload
        u.complete = True
        self._unexpected.setdefault((self.rank, op.tag), collections.deque()).append(u)
        op.done = True

    # ----------------------------------------------------------------- progress
    def progress_locked(self, drain: bool) -> bool:
        """Move what can be moved now; with ``drain``, also copy unmatched incoming
        messages into the unexpected queue. Returns whether anything moved."""
        moved_to: list[int] = []
        moved = False
        for dst in self._peers:
            if self._sendq[dst] and self._push(dst):
                moved_to.append(dst)
        for src in self._peers:
            if self._pull(src, drain):
                moved_to.append(src)
        if moved_to:
            moved = True
            self._ring_doorbells(moved_to)
        return moved

    def _push(self, dst: int) -> bool:
        queue = self._sendq[dst]
        R = self._R
        ring = self._out_rings[dst]
        head = self._heads[dst]
        free = R - (head - self._u64[self._out_tail[dst]])
        start = head
        while queue and free > 0:
            op = queue[0]
            if op.pos == 0:
                if free < HEADER_BYTES:
                    break
                head = self._write(ring, head, op.header)
                free -= HEADER_BYTES
                op.pos = HEADER_BYTES
            k = min(op.total - op.pos, free, self._piece)
            if k:
                off = op.pos - HEADER_BYTES
                head = self._write(ring, head, op.payload[off:off + k])
                free -= k
                op.pos += k
                # Publish each piece, so the receiver starts copying.
                self._u64[self._out_head[dst]] = head
            if op.pos == op.total:
                queue.popleft()
                op.payload = None
                self._complete(op)
        if head != start:
            self._u64[self._out_head[dst]] = head
            self._heads[dst] = head
            return True
        return False

    def _write(self, ring: np.ndarray, head: int, data: np.ndarray) -> int:
        R = self._R
        pos = head % R
        k = data.size
        first = min(k, R - pos)
        ring[pos:pos + first] = data[:first]
        if first < k:
            ring[:k - first] = data[first:]
        return head + k

    def _read(self, ring: np.ndarray, tail: int, out: Optional[np.ndarray], k: int) -> None:
        if out is None:
            return
        R = self._R
        pos = tail % R
        first = min(k, R - pos)
        out[:first] = ring[pos:pos + first]
        if first < k:
            out[first:k] = ring[:k - first]

    def _pull(self, src: int, drain: bool) -> bool:
        tail = self._tails[src]
        avail = self._u64[self.in_head[src]] - tail
        if avail == 0 and self._incoming[src] is None:
            return False
        ring = self._in_rings[src]
        start = tail
        finished = False  # a message completed (an empty one moves no bytes)
        while True:
            inc = self._incoming[src]
            if inc is None:
                if avail < HEADER_BYTES:
                    break
                raw = np.empty(HEADER_BYTES, np.uint8)
                self._read(ring, tail, raw, HEADER_BYTES)
                tag, nbytes, dtype_code, magic = HEADER.unpack(raw.tobytes())
                if magic != _MSG_MAGIC:
                    raise CollectiveError(f"{self.where('recv')}: corrupt message header "
                                          f"from rank {src} (shared memory overwritten?)")
                tail += HEADER_BYTES
                avail -= HEADER_BYTES
                inc = _Incoming(tag, nbytes, dtype_code)
                self._incoming[src] = inc
                posted = self._posted[src]
                for i, op in enumerate(posted):
                    if op.tag == tag:
                        del posted[i]
                        self._match(inc, op)
                        break
            if inc.target is None and not inc.discard:
                if not drain:
                    break
                u = _Unexpected(inc.nbytes, inc.dtype_code)
                self._unexpected.setdefault((src, inc.tag), collections.deque()).append(u)
                inc.unexpected = u
                inc.target = u.data
            k = min(avail, inc.nbytes - inc.pos)
            if k:
                self._read(ring, tail, None if inc.discard else inc.target[inc.pos:], k)
                tail += k
                avail -= k
                inc.pos += k
            if inc.pos < inc.nbytes:
                break
            self._incoming[src] = None
            finished = True
            if inc.recv is not None:
                self._complete(inc.recv)
            elif inc.unexpected is not None:
                u = inc.unexpected
                u.complete = True
                if u.recv is not None:
                    u.recv.array[...] = u.data
                    self._complete(u.recv)
        if tail != start:
            self._u64[self._in_tail[src]] = tail
            self._tails[src] = tail
            return True
        return finished

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._core = None   # its hold on the mapping
            self._out_rings = self._in_rings = []  # drop views of the mapping
            error = CollectiveError(f"{self.where('p2p')}: the group was closed")
            for queue in self._sendq + self._posted:
                for op in queue:
                    if not op.done:
                        op.error = error
                        self._complete(op)
                queue.clear()
            for inc in self._incoming:
                if inc is not None and inc.recv is not None and not inc.recv.done:
                    inc.recv.error = error
                    self._complete(inc.recv)
            for queue in self._unexpected.values():
                for u in queue:
                    if u.recv is not None and not u.recv.done:
                        u.recv.error = error
                        self._complete(u.recv)
            self._incoming = [None] * self.size
            self._unexpected.clear()
