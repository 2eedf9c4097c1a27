"""The transport under every zmq group of a process: one :class:`Engine` per world, made
of parts that are objects, each with its own state, which the engine holds:

- :class:`~backends.zeromq.connections.Connections`: the context and the sockets (below),
  the map from an inbound connection to the rank that authenticated on it, and closing;
- :class:`~backends.zeromq.handshake.Handshake`: the rendezvous at rank 0 and the
  authentication of every connection (its server side,
  :class:`~backends.zeromq.handshake_server.HandshakeServer`, also turns away any later
  one);
- :class:`~backends.zeromq.matching.Matcher`: posted receives meet messages, each group's
  sequence checks, and which request fails when a call mismatches or a peer is gone;
- :class:`~backends.zeromq.progress.Progress`: the progress token, reading the sockets,
  and every wait;
- :class:`~backends.zeromq.liveness.Liveness`: which peers are gone, and why.

The engine creates the one lock (with its condition variable) that guards the matcher's
state and the progress token, and gives it to both; it also shares its ``stats``
counters. What is left here: the calls of the groups (``begin``/``end``, ``isend``,
``irecv``) and closing the whole in order.

Sockets (per rank)
    one ROUTER, bound on ``tcp://<routed address>:<ephemeral>`` and
    ``ipc://<private dir>/r<rank>``: every message *to* this rank arrives here; one
    DEALER per peer, connected to that peer's ROUTER: every message *from* this rank leaves
    through it (each pair of ranks thus has two connections, one per direction). Rank 0
    also binds a ROUTER at ``MASTER_ADDR:MASTER_PORT`` for the start-up only (under
    torchrun, whose agent holds that port, at a port it publishes in the agent's store:
    :mod:`backends.zeromq.torchrun`).

Threads
    none of our own. libzmq's I/O thread moves bytes; progress (reading the ROUTER,
    matching, copying into the destination array) is made by whichever thread waits, under
    the *progress token*: one waiter polls the ROUTER and its monitor, the others sleep on
    the condition variable and are woken when the poller completes their request. Sends
    are made by the calling thread, through the peer's DEALER under a per-peer lock. An
    ``async_op`` collective runs on the group's executor thread (:mod:`collectives.running`),
    which is just one more waiter.

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

import os
import threading
from typing import Any, Mapping, Optional

import numpy as np
import zmq

from collectives import settings
from collectives.work import Work

from . import torchrun, wire
from .addresses import resolve_master
from .calls import Call, PartsWork, Recv, RecvWork, SendWork
from .connections import Connections
from .handshake import MIN_INIT_TIMEOUT, Handshake
from .liveness import Liveness
from .matching import Matcher
from .progress import Progress
from .wire import Kind


class Engine:
    """All sockets of one world, shared by its sub-groups."""

    def __init__(self, rendezvous: Any, timeout: float, env: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if env is None else env
        self.rank, self.size = rendezvous.rank, rendezvous.world_size
        self.timeout = timeout
        self._where0 = f"[rank {self.rank}/{self.size}] zmq"
        self.stats = {"rejected": 0, "bad_proofs": 0, "refused": 0, "unexpected": 0}
        self._lock = threading.Lock()
        cond = threading.Condition(self._lock)
        liveness = self._liveness = Liveness()
        self._connections = Connections(self.rank, self.size, self.stats, liveness)
        self._handshake = Handshake(self._connections, liveness, self.rank, self.size,
                                    self.stats, self._where0)
        self._matcher = Matcher(self.rank, self._lock, cond, self.stats, liveness,
                                self._connections)
        spin_s = settings.ZMQ_SPIN_US.get(env) * 1e-6 if self.size > 1 else 0.0
        self._progress = Progress(cond, self.rank, self.stats, self._connections,
                                  self._handshake, self._matcher, liveness, spin_s)
        self._matcher.register_group(0, tuple(range(self.size)))
        if self.size > 1:
            try:
                self._start(rendezvous, env)
            except BaseException:
                self._connections.close(linger=False)
                raise

    def _start(self, rdzv: Any, env: Mapping[str, str]) -> None:
        """Open the sockets and authenticate a connection to and from every peer."""
        init_timeout = settings.ZMQ_INIT_TIMEOUT.get(env) or max(self.timeout,
                                                                 MIN_INIT_TIMEOUT)
        rdzv = torchrun.own_port(rdzv, env, init_timeout)  # the agent holds MASTER_PORT
        master = resolve_master(rdzv.master_addr, rdzv.master_port, f"{self._where0} init")
        self._handshake.choose_key(rdzv, env, master)
        self._connections.open(master, env)
        self._handshake.run(init_timeout, drain=self._progress.drain)
        self._connections.started()

    # ================================================================== introspection
    @property
    def mode(self) -> str:
        """The authentication mode (``secret``, ``file``, ``open``; ``local``: one rank)."""
        return self._handshake.mode

    @property
    def endpoints(self) -> dict:
        """Where this rank's ROUTER listens (``tcp``, and ``ipc`` when bound)."""
        return self._connections.endpoints

    @property
    def sends_to(self) -> dict:
        """Peer -> the endpoint this rank's DEALER to it is connected to."""
        return self._connections.sends_to

    @property
    def malloc(self) -> str:
        """What was done to malloc so that libzmq's buffers are reused (see heap.py)."""
        return self._connections.malloc

    # ========================================================================= groups
    def register_group(self, gid: int, members: tuple) -> None:
        self._matcher.register_group(gid, members)

    def unregister_group(self, gid: int) -> None:
        self._matcher.unregister_group(gid)

    def begin(self, call: Call, sig: tuple) -> None:
        """A collective starts on this rank: check what its peers already sent."""
        with self._lock:
            self._progress.raise_if_closed(call)
            self._matcher.raise_if_failed(call)
            self._progress.look_for_closed_connections()
            if self._liveness.dead:
                self._liveness.raise_if_member_dead(call)
            self._matcher.begin(call, sig)

    def end(self, call: Call, ok: bool) -> None:
        self._matcher.end(call, ok)

    # ========================================================================== calls
    def isend(self, call: Call, dst: int, tag: int, array: np.ndarray) -> Work:
        self._progress.raise_if_closed(call)
        self._matcher.raise_if_failed(call)
        liveness = self._liveness
        why = liveness.down.get(dst)
        if why is not None:
            raise call.peer_error(dst, f"{why}; this rank cannot send to it")
        if liveness.dead and call.collective:  # a member died after this collective began
            with self._lock:
                liveness.raise_if_member_dead(call)
        header = wire.pack(Kind.DATA, self.rank, dst, meta=call.meta, gid=call.gid, tag=tag,
                           array=array)
        flat = array.reshape(-1).view(np.uint8) if array.size else None
        frames = self._connections.send_tensor(call, dst, header, flat)
        tracker = zmq.MessageTracker(*frames) if frames else None
        return SendWork(self._progress, call, dst, tracker)

    def irecv(self, call: Call, src: int, tag: int, array: np.ndarray,
              frames: bool = False) -> Work:
        req = Recv(call, src, tag, array, [] if frames else None)
        with self._lock:
            self._progress.raise_if_closed(call)
            self._matcher.post(req)
        return PartsWork(self._progress, req) if frames else RecvWork(self._progress, req)

    def irecv_parts(self, call: Call, src: int, tag: int, like: np.ndarray) -> PartsWork:
        """Receive a message shaped like ``like`` without copying it anywhere: its parts
        stay in the buffers they arrived in, read in order through ``parts()`` (a
        reduction reads them straight from there, saving a copy of every byte). Same
        checks, errors and timeouts as :meth:`irecv`; ``like`` is not written."""
        return self.irecv(call, src, tag, like, frames=True)

    # ========================================================================= closing
    def close(self) -> None:
        """Say goodbye to the peers, close every socket and the context (sends still queued
        get at most COLLECTIVES_ZMQ_LINGER_S), remove the ipc directory."""
        mine = self._progress.shut("closed", wait_s=2.0)
        if mine is None:
            return
        if mine and self._connections.router is not None:
            # Read the BYEs of peers that closed first: a BYE (or a queued send) to them
            # would wait out the whole linger in ctx.term.
            try:
                self._progress.drain()
            except zmq.ZMQError:
                pass
            with self._lock:  # what the drain queued for the closed group
                self._matcher.clear()
        self._connections.say_bye()
        self._connections.close(linger=True)

    def abort(self) -> None:
        """End every wait now and close every socket without a goodbye and without
        lingering: the peers see this rank's connections drop, as if it died, and fail
        their calls over it. A waiter in the sockets hands the progress token back within
        a slice (``progress.SLICE_S``: its poll is bounded by it) and raises; only a waiter
        that did not within a second would leave the sockets open (to the process's exit)."""
        if self._progress.shut("aborted", wait_s=1.0):
            self._connections.close(linger=False)

    def abort_group(self, gid: int) -> None:
        """A sub-group was aborted: its waits fail now, its later calls fail, and its
        other members are told (they fail instead of waiting); the world goes on."""
        self._matcher.abort_group(gid)
