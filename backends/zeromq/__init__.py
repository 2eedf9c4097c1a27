"""The ``zmq`` backend: collectives over ZeroMQ sockets, within a host or across hosts.

Usage: ``collectives.init_process_group("zmq")`` (or ``COLLECTIVES_BACKEND=zmq``) under
``collectives.spawn``, torchrun, mpirun or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``.

Design
------
Start-up. Rank 0 listens at ``MASTER_ADDR:MASTER_PORT`` (only during start-up; under
torchrun, whose agent serves its store there, at a free port rank 0 publishes in that store:
see :mod:`backends.zeromq.torchrun`). Every rank
binds one ROUTER socket on the address of the interface that routes to ``MASTER_ADDR``
(found by ``connect()``-ing a UDP socket there; never ``0.0.0.0`` unless
``COLLECTIVES_ZMQ_BIND_ADDR`` says so) on an ephemeral port, plus an ``ipc://`` endpoint in
a private temporary directory (removed as soon as every peer connected). Each rank announces its endpoints and a
host key (hostname, boot id, network namespace, user) to rank 0 and receives the table of
all ranks; ranks with equal host keys that see each other's ipc socket file (same
filesystem) talk over ``ipc://``, the others over ``tcp://``
(``COLLECTIVES_ZMQ_TRANSPORT=tcp`` forces TCP).

Sockets and threads. Each rank receives everything on its ROUTER and sends to each peer
through one DEALER connected to that peer's ROUTER. No thread of ours: libzmq's I/O thread
moves the bytes, and whichever thread waits makes progress (polls the ROUTER and its
monitor, matches messages to posted receives, copies payloads in with ``recv_into``),
holding a progress token; other waiters sleep on a condition variable. See
:mod:`backends.zeromq.engine`.

Wire format. A fixed 132-byte binary header (magic, protocol version, kind, op, dtype,
reduce op, ndim, src, dst, group id, sequence number, tag, element count, byte count, byte
offset, the call's element count and root, shape) followed by the tensor's raw bytes as a
separate frame, sent zero-copy (with a tracker, so the buffer is not reused early) from 64
KiB up; tensors of at most 8 KiB travel as one INLINE frame (header and bytes together:
one send and one receive call fewer). Tensors above 4 MiB travel as several such
messages, which the receiver copies into place one by one while the next is on the wire
(or, in a large all_reduce's reduce-scatter, reduces straight out of the received frames:
no copy). Tensor traffic is never pickled. libzmq mallocs a buffer for every frame it
receives; so that these come from a heap that stays mapped instead of fresh pages, the
backend sets glibc's mmap and trim thresholds once per process (``COLLECTIVES_ZMQ_MALLOC``,
``pg.malloc``; see :mod:`backends.zeromq.heap`).
A receiver compares each header with what it expects (op, sequence number, dtype, element
and byte counts, root, reduce op) and raises ``CollectiveMismatch`` naming both sides; it
also notices a peer that is already in a later collective, or that sent a message for a
collective this rank finished without it, and tells the other members (they fail too
instead of waiting). See :mod:`backends.zeromq.wire`.

Collectives. Direct one-round algorithms for small messages up to 8 ranks (and a two-rank
all_reduce up to 8 MiB, folded straight from the received frames); reduce-scatter
+ all-gather (and scatter + all-gather, reduce-scatter + gather) for large ones; the
logarithmic and ring algorithms of ``collectives.algorithms`` beyond 8 ranks. All are
async-capable (``async_op=True`` runs them on the group's thread). Sub-groups share the
world's sockets; their messages carry their own group id. See
:mod:`backends.zeromq.native`.

Faults. ZMTP heartbeats (every ``COLLECTIVES_ZMQ_HEARTBEAT_S``/5 s, timeout
``COLLECTIVES_ZMQ_HEARTBEAT_S``, default 5) close silent connections; a socket monitor
reports each closed connection, mapped to the rank that authenticated on it (each rank is
connected to every other, so every survivor sees a death itself). Then every collective of
a group of the dead rank raises ``PeerError`` naming it: waits for it, waits for another
survivor of that group, sends it never took, and the calls that follow (a dead process:
within ~0.1 s; a vanished host: within the heartbeat timeout). As with torch's backends, a
rank whose part of the call in flight is done (a sender in ``gather``) may return from it;
its next call raises. Every wait honours the group timeout and raises ``CollectiveTimeout``
naming the op, its sequence number and the rank waited for. ``close()`` says goodbye to the
peers, closes every socket (queued sends to live peers get at most
``COLLECTIVES_ZMQ_LINGER_S``, default 2 s; to peers that closed or died, none) and the
context, and removes the ipc directory; no thread or port stays behind.

Threat model
------------
Assets: the integrity of the job's tensors and control flow, and the processes
themselves (no remote code execution). Confidentiality is *not* provided: tensors travel
unencrypted.

Authentication. Every connection, the rendezvous included, must complete a handshake
before any message on it is accepted: the connecting rank sends a fresh 32-byte nonce, the
listening rank answers with its own nonce and ``HMAC-SHA256(K, "server" || transcript)``,
and the connecting rank proves itself with ``HMAC-SHA256(K, "client" || transcript)``,
where the transcript holds both nonces, both ranks, the world size, the rendezvous port and
the purpose (rendezvous or data), and ``K`` is derived from the job secret. Both sides
verify (mutual authentication; replays fail on the fresh nonces; the labels stop
reflection). Messages from a connection that has not proven ``K`` are dropped unread
(counted in ``group.stats``). The job secret comes from ``COLLECTIVES_SECRET`` (or the file
named by ``COLLECTIVES_SECRET_FILE``); ``collectives.spawn`` generates a fresh one per job.
For torchrun or mpirun on one host without a secret, rank 0 writes a fresh key to a file
that only this user can read (``$TMPDIR/collectives-zmq-<uid>/``, removed once all joined).

An attacker on the network who does not know the secret:

- cannot join the job, impersonate a rank, inject, replay or alter messages through
  connections of their own (the handshake fails; their messages are dropped unread).
  Once every rank is connected, a rank refuses any further handshake before issuing a
  challenge, and its ipc socket file is already removed (existing connections stay);
- cannot make a rank run code: tensor traffic is never unpickled, and
  ``broadcast_object``/``all_gather_object`` unpickle only bytes that arrived on
  authenticated connections;
- can read tensors off the wire (no encryption), and can connect to a rank's data port and
  send garbage (dropped; libzmq refuses frames above 4 MiB) or open many connections,
  costing memory and CPU (denial of service); an on-path attacker who can hijack or
  inject into an established TCP connection can alter the payload (messages are not
  individually MACed): use a private network, a VPN or IPsec/WireGuard against that;
- can make a rank's collectives fail or time out (e.g. by resetting connections, or by
  occupying MASTER_PORT before rank 0 binds it): denial of service, always reported as
  ``PeerError``/``CollectiveTimeout``, never a hang beyond the group timeout.

Without a secret, on several hosts (mode ``open``, with a warning): rank 0 generates the key
and hands it to whoever completes the rendezvous first as each rank (trust on first use).
Connections made after the rendezvous still prove the key, so an attacker who arrives
later and did not see the rendezvous traffic is kept out; but anyone who can reach
``MASTER_PORT`` during start-up can claim a rank, and anyone who can read the rendezvous
traffic learns the key. No code execution even then: object collectives decode plain data
only (None, bool, int, float, str, bytes, containers) in this mode.
``COLLECTIVES_ZMQ_REQUIRE_SECRET=1`` makes a missing secret an error instead. A local
user with the same uid (or root) is trusted: they can read the secret from the process
environment or the key file anyway.
"""

from __future__ import annotations

import os
from typing import Any

from .engine import Engine
from .group import ZmqBackend

__all__ = ["create", "ZmqBackend"]


def create(rendezvous: Any, timeout: float) -> ZmqBackend:
    """Connect this rank (``rendezvous``: rank, world size, MASTER_ADDR/PORT, job id) to
    its world and return the world group; ``timeout`` (seconds) bounds every wait."""
    engine = Engine(rendezvous, timeout, os.environ)
    try:
        return ZmqBackend(engine, tuple(range(rendezvous.world_size)), 0, timeout)
    except BaseException:
        engine.close()
        raise
