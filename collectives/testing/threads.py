"""An in-process world of threads: check a collective algorithm with no processes at all.

Each rank is a :class:`~collectives.ProcessGroup` over a :class:`ThreadBackend`
(backend name ``"threads"``) running on its own thread; messages travel through
in-memory mailboxes, one FIFO per (source, destination, tag). Sends are eager (the array is copied at once, so ``isend`` never blocks); a receive
blocks on a condition variable with the group's timeout. Nothing is registered globally:
build worlds with :func:`run_threads` (or :class:`ThreadWorld`).

::

    from collectives.testing.threads import run_threads
    from collectives.algorithms import Links
    from collectives.algorithms import ring

    def rank_fn(pg):
        a = np.full(5, pg.rank + 1.0)
        ring.all_reduce(Links(pg, seq=0), a, ReduceOp.SUM)   # one algorithm, directly
        pg.all_reduce(b := np.ones(3))                        # or the public API
        return a

    results = run_threads(rank_fn, 4)    # [array([10., ...]), ...] in rank order

A rank that raises aborts the world: the other ranks' pending waits fail at once with
:class:`~collectives.errors.PeerError` instead of running into their timeouts, and
``run_threads`` re-raises the first failure with a note naming its rank.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np

from ..algorithms.links import COLLECTIVE_TAG_BIT
from ..backend import Backend
from ..errors import (CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerError,
                      add_note, where)
from ..group import ProcessGroup
from ..validation import timeout_seconds
from ..work import CompletedWork, Work

BACKEND = "threads"


def describe_tag(tag: int) -> str:
    """A readable tag: ``collective seq 3 step 1``, ``tag 7``, with its sub-group id."""
    group = tag >> 40
    suffix = f" in sub-group {group:#x}" if group else ""
    if tag & COLLECTIVE_TAG_BIT:
        return f"collective seq {(tag >> 12) & 0xFFFFFF} step {tag & 0xFFF}{suffix}"
    return f"tag {tag & (COLLECTIVE_TAG_BIT - 1)}{suffix}"


class _Mailbox:
    """Messages on one (src, dst, tag): the n-th receive posted gets the n-th send."""

    __slots__ = ("sent", "posted", "messages")

    def __init__(self) -> None:
        self.sent = 0
        self.posted = 0
        self.messages: dict[int, np.ndarray] = {}


class ThreadWorld:
    """The shared state of ``size`` thread ranks: mailboxes, a barrier, the first failure.

    ``world.groups[r]`` is rank ``r``'s :class:`~collectives.ProcessGroup` (over a
    :class:`ThreadBackend`); hand each to its own thread.
    """

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"ThreadWorld: size must be a positive int, got {size!r}")
        self.size = size
        self.timeout = timeout_seconds(timeout, 30.0)
        self._conds = [threading.Condition() for _ in range(size)]   # one per destination
        self._boxes: list[dict[tuple[int, int], _Mailbox]] = [{} for _ in range(size)]
        self._sent_to = [0] * size
        self._barrier = threading.Barrier(size)
        self._arrived: dict[int, set[int]] = {}
        self._arrived_lock = threading.Lock()
        self.failure: Optional[tuple[int, BaseException]] = None
        self._failure_lock = threading.Lock()
        #: Ranks that aborted their group: they left, every wait over them fails.
        self.aborted: set[int] = set()
        self.groups = [ProcessGroup(ThreadBackend(self, r)) for r in range(size)]

    # ------------------------------------------------------------------ mailboxes
    def _box(self, src: int, dst: int, tag: int) -> _Mailbox:
        boxes = self._boxes[dst]
        box = boxes.get((src, tag))
        if box is None:
            box = boxes[(src, tag)] = _Mailbox()
        return box

    def post(self, src: int, dst: int, tag: int, array: np.ndarray) -> None:
        with self._conds[dst]:
            box = self._box(src, dst, tag)
            box.messages[box.sent] = array
            box.sent += 1
            self._sent_to[dst] += 1
            self._conds[dst].notify_all()

    @property
    def messages_sent(self) -> int:
        """How many messages all ranks have sent so far (to count an algorithm's alphas)."""
        return sum(self._sent_to)

    def undelivered(self) -> list[str]:
        """Messages sent but never received, described (empty when all were received)."""
        left = []
        for dst, boxes in enumerate(self._boxes):
            with self._conds[dst]:
                for (src, tag), box in boxes.items():
                    if box.messages:
                        left.append(f"{len(box.messages)} message(s) from rank {src} to "
                                    f"rank {dst}, {describe_tag(tag)}")
        return left

    # ------------------------------------------------------------------- failures
    def fail(self, rank: int, exc: BaseException) -> None:
        """Record that ``rank`` raised ``exc`` (the first one wins) and wake every wait."""
        with self._failure_lock:
            if self.failure is None:
                self.failure = (rank, exc)
        for cond in self._conds:
            with cond:
                cond.notify_all()
        self._barrier.abort()

    def abort(self, rank: int) -> None:
        """Rank ``rank`` aborted its group: it left, and every wait over it ends."""
        with self._failure_lock:
            self.aborted.add(rank)
        for cond in self._conds:
            with cond:
                cond.notify_all()
        self._barrier.abort()

    def _stopped(self, rank: int, src: int) -> bool:
        """Whether a wait of ``rank`` for ``src`` must end (a failure, an abort)."""
        return self.failure is not None or rank in self.aborted or src in self.aborted

    def _peer_error(self, rank: int, what: str, src: int = -1) -> CollectiveError:
        if rank in self.aborted:
            return CollectiveError(f"{where(rank, self.size, what)}: this rank aborted its "
                                   f"group")
        if self.failure is None:
            gone = src if src in self.aborted else min(self.aborted)
            return PeerError(f"{where(rank, self.size, what)}: rank {gone} aborted its "
                             f"group", peer=gone)
        bad, exc = self.failure
        return PeerError(f"{where(rank, self.size, what)}: rank {bad} failed "
                         f"({type(exc).__name__}: {exc})", peer=bad)


class _RecvWork(Work):
    """A posted receive; matched to the send of the same ordinal on its mailbox."""

    def __init__(self, world: ThreadWorld, rank: int, src: int, tag: int, ticket: int,
                 array: np.ndarray) -> None:
        self._world, self._rank, self._src, self._tag = world, rank, src, tag
        self._ticket = ticket
        self._array: Optional[np.ndarray] = array
        self._error: Optional[BaseException] = None

    def _what(self) -> str:
        return f"recv from rank {self._src} ({describe_tag(self._tag)})"

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._array is None:
            if self._error is not None:
                raise self._error
            return
        world, limit = self._world, timeout_seconds(timeout, self._world.timeout)
        cond = world._conds[self._rank]
        with cond:
            box = world._box(self._src, self._rank, self._tag)
            cond.wait_for(lambda: self._ticket in box.messages
                          or world._stopped(self._rank, self._src), limit)
            message = box.messages.pop(self._ticket, None)
            if not box.messages and box.posted == box.sent:   # every send was received
                del world._boxes[self._rank][(self._src, self._tag)]
        if message is None:
            if world._stopped(self._rank, self._src):
                raise world._peer_error(self._rank, self._what(), self._src)
            tag = self._tag
            raise CollectiveTimeout(
                f"{where(self._rank, world.size, self._what())}: nothing arrived within "
                f"{limit:g} s; rank {self._src} did not send",
                op="recv", seq=(tag >> 12) & 0xFFFFFF if tag & COLLECTIVE_TAG_BIT else -1,
                missing=(self._src,))
        array, self._array = self._array, None
        if message.dtype != array.dtype or message.size != array.size:
            self._error = CollectiveMismatch(
                f"{where(self._rank, world.size, self._what())}: rank {self._src} sent "
                f"{message.size} x {message.dtype}, this rank expects {array.size} x "
                f"{array.dtype}")
            raise self._error
        np.copyto(array.reshape(-1), message.reshape(-1))

    def is_completed(self) -> bool:
        if self._array is None:
            return True
        with self._world._conds[self._rank]:
            box = self._world._box(self._src, self._rank, self._tag)
            return self._ticket in box.messages or self._world._stopped(self._rank, self._src)


class ThreadBackend(Backend):
    """One rank of a :class:`ThreadWorld`: point to point through in-memory mailboxes,
    every collective through the send/recv algorithms (the Backend defaults) but the
    barrier. ``backend.world`` is the shared :class:`ThreadWorld`."""

    name = BACKEND

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__(rank, world.size, world.timeout)
        self.world = world
        self._world = world

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        if self._world._stopped(self.rank, dst):
            raise self._world._peer_error(self.rank, f"send to rank {dst}", dst)
        self._world.post(self.rank, dst, tag, np.array(array, copy=True))
        return CompletedWork()

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        world = self._world
        with world._conds[self.rank]:
            box = world._box(src, self.rank, tag)
            ticket = box.posted
            box.posted += 1
        return _RecvWork(world, self.rank, src, tag, ticket, array)

    def close(self) -> None:
        """Nothing to release: the mailboxes belong to the world."""

    def abort(self) -> None:
        self._world.abort(self.rank)

    def barrier(self, seq: int) -> None:
        world = self._world
        with world._arrived_lock:
            world._arrived.setdefault(seq, set()).add(self.rank)
        try:
            world._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            if world.failure is not None or world.aborted:
                raise world._peer_error(self.rank, f"barrier (seq {seq})") from None
            with world._arrived_lock:
                missing = sorted(set(range(self.size)) - world._arrived.get(seq, set()))
            raise CollectiveTimeout(
                f"{self.where('barrier')} (seq {seq}): not every rank arrived within "
                f"{self.timeout:g} s; missing ranks {missing}",
                op="barrier", seq=seq, missing=missing) from None
        with world._arrived_lock:   # every rank reached this one: forget earlier ones
            for old in [s for s in world._arrived if s < seq]:
                del world._arrived[old]


def run_threads(fn: Callable[[ProcessGroup], Any], nproc: int, *,
                timeout: float = 30.0) -> list:
    """Run ``fn(group)`` for each rank of a fresh world of ``nproc`` thread ranks and
    return the results in rank order.

    ``timeout`` (seconds) bounds every blocking wait. Each rank's group is closed when
    its ``fn`` returns. If a rank raises, the others are woken with ``PeerError`` and the
    first failure is re-raised here, with a note naming its rank. A message that was sent
    but never received is a bug in a collective program: it raises ``CollectiveError``.
    """
    world = ThreadWorld(nproc, timeout)
    results: list = [None] * nproc

    def body(rank: int) -> None:
        group = world.groups[rank]
        try:
            results[rank] = fn(group)
            group.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            world.fail(rank, exc)
            try:
                group.close()
            except BaseException:  # noqa: BLE001 - the first failure is what matters
                pass

    threads = [threading.Thread(target=body, args=(r,), name=f"run_threads-rank{r}",
                                daemon=True) for r in range(nproc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if world.failure is not None:
        rank, exc = world.failure
        add_note(exc, f"raised on rank {rank} of {nproc} (collectives.testing.threads)")
        raise exc
    left = world.undelivered()
    if left:
        raise CollectiveError("run_threads: every rank returned but messages were never "
                              "received: " + "; ".join(left))
    return results
