"""The transport under every zmq group of a process: one :class:`Engine` per world, made of
four parts. Start-up and authentication are :mod:`backends.zeromq.connect`; message
matching (a posted receive meets its message) is :mod:`backends.zeromq.matching`; reading
the sockets and waiting is :mod:`backends.zeromq.progress`. This module holds the state they
share and what is left: groups and their sequence checks, sends, failing calls after a
mismatch or a peer's death, and shutdown.

Sockets (per rank)
    one ROUTER, bound on ``tcp://<routed address>:<ephemeral>`` and
    ``ipc://<private dir>/r<rank>``: every message *to* this rank arrives here; one
    DEALER per peer, connected to that peer's ROUTER: every message *from* this rank leaves
    through it (each pair of ranks thus has two connections, one per direction). Rank 0
    also binds a ROUTER at ``MASTER_ADDR:MASTER_PORT`` for the start-up only.

Threads
    none of our own. libzmq's I/O thread moves bytes; progress (reading the ROUTER,
    matching, copying into the destination array) is made by whichever thread waits, under
    a *progress token* (:mod:`backends.zeromq.progress`): one waiter polls the ROUTER and
    its monitor, the others sleep on a condition variable and are woken when the poller
    completes their request. Sends are made by the calling thread, through the peer's
    DEALER under a per-peer lock. An ``async_op`` collective runs on the group's executor
    thread (the base class), which is just one more waiter.

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
    looks at the monitor when a collective starts (at most every
    ``progress.MONITOR_LOOK_S``), so its next call fails. A peer that said BYE (closed its
    group) had finished its calls: only waits for it fail.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Mapping, Optional

import numpy as np
import zmq

from collectives.errors import CollectiveError, CollectiveMismatch, PeerError
from collectives.work import Work

from . import wire
from .addresses import IpcDir
from .calls import Call, GroupState, Partial, SendWork, rank_in_group, sequence_problem
from .wire import Kind

from .connect import (SLICE_S, ZERO_COPY_MIN, Connector, _Inbound, _live_engines,
                      _maybe_stop_gc, _NOBLOCK, _SNDMORE)
from .matching import Matcher
from .progress import Progress


class Engine(Matcher, Progress, Connector):
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
        self._closed: Optional[str] = None   # "closed" or "aborted" once it is
        self._posted: dict[tuple, collections.deque] = {}
        self._unexpected: dict[tuple, collections.deque] = {}
        self._partial: dict[tuple, Partial] = {}
        self._groups: dict[int, GroupState] = {}
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
        self.malloc = "unused"  # a world of one receives nothing (see heap.py)
        self._key: Optional[bytes] = None
        self.table: list[dict] = []
        if self.size > 1:
            try:
                self._start(rendezvous, env)
            except BaseException:
                self._teardown(linger_ms=0)
                raise
        _live_engines.add(self)

    # ======================================================================== groups
    def register_group(self, gid: int, members: tuple) -> None:
        with self._lock:
            gs = self._groups.get(gid)
            if gs is None:
                gs = self._groups[gid] = GroupState(gid, members)
                early = self._early_aborts.pop(gid, None)
                if early is not None:  # a member failed in it before this rank created it
                    gs.error = f"rank {rank_in_group(gs, early[0])} reported: {early[1]}"
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
                    problem = sequence_problem(gs, key[0], msg.header)
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

    def _raise_if_member_dead(self, call: Call) -> None:
        """Lock held: PeerError naming the first member of ``call``'s group that died (a
        collective over it cannot complete)."""
        for m in call.members:
            if m in self._dead:
                why = self._down[m]
                raise PeerError(f"{call.where}: {call.peer(m)} {why}; a collective over it "
                                f"cannot complete", peer=m)

    # ========================================================================== sends
    def _check_open(self, call: Call) -> None:
        if self._closed:
            raise CollectiveError(f"{call.where}: the group is {self._closed}")

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
        return SendWork(self, call, dst, tracker)

    # ======================================================================= failures
    def _fail_group(self, gs: GroupState, problem: str, forward: bool) -> None:
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
            me = rank_in_group(gs, self.rank)
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

    # ========================================================================== close
    def close(self) -> None:
        """Say goodbye to the peers, close every socket and the context (sends still queued
        get at most COLLECTIVES_ZMQ_LINGER_S), remove the ipc directory."""
        mine = self._shut("closed", wait_s=2.0)
        if mine is None:
            return
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

    def abort(self) -> None:
        """End every wait now and close every socket without a goodbye and without
        lingering: the peers see this rank's connections drop, as if it died, and fail
        their calls over it. A waiter in the sockets hands the progress token back within
        a slice (``SLICE_S``: its poll is bounded by it) and raises; only a waiter that
        did not within a second would leave the sockets open (to the process's exit)."""
        mine = self._shut("aborted", wait_s=1.0)
        if mine:
            self._teardown(linger_ms=0)

    def abort_group(self, gid: int) -> None:
        """A sub-group was aborted: its waits fail now, its later calls fail, and its
        other members are told (they fail instead of waiting); the world goes on."""
        with self._lock:
            gs = self._groups.get(gid)
            if gs is not None:
                self._fail_group(gs, "the group was aborted", forward=True)

    def _shut(self, how: str, wait_s: float) -> Optional[bool]:
        """Mark the engine closed (``how``: "closed", "aborted"), fail every posted and
        partly received request, and take the progress token once its holder hands it
        back (at most ``wait_s``). Returns whether this thread now owns the sockets (None:
        the engine was closed already)."""
        with self._cond:
            if self._closed:
                return None
            self._closed = how
            until = time.monotonic() + wait_s  # a waiter hands the token back within a slice
            self._cond.notify_all()
            while self._token and time.monotonic() < until:
                self._cond.wait(SLICE_S)
            mine = not self._token  # else a waiter is stuck in the sockets: leave them
            self._token = True
            for q in self._posted.values():
                for r in q:
                    if r.error is None and not r.done:
                        r.error = CollectiveError(f"{r.call.where}: the group was {how}")
            for part in self._partial.values():
                r = part.req
                if r is not None and r.error is None and not r.done:
                    r.error = CollectiveError(f"{r.call.where}: the group was {how}")
            self._posted.clear()
            self._unexpected.clear()
            self._partial.clear()
            self._cond.notify_all()
        return mine

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
