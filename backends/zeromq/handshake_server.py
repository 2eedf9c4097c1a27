"""The server side of the zmq handshake (the protocol is described in
:mod:`backends.zeromq.handshake`): what a ROUTER answers to a connection that has not
authenticated yet. A HELLO gets a challenge (or REFUSED: another authentication mode, or
a rank that is already connected); a PROOF that checks out admits its connection, and at
the rendezvous its announce; anything else is dropped unread.

Its only state is the job key (which the client side may learn late), the handshakes
under way (kept on each :class:`~backends.zeromq.connections.Inbound`) and the announces
proved at the rendezvous.
"""

from __future__ import annotations

import json
import secrets
import struct
from typing import Optional

import zmq

from collectives import settings

from . import auth, wire
from .connections import Connections, Inbound
from .sockets import discard_rest
from .wire import Kind

#: Unauthenticated handshakes remembered at once (oldest forgotten first).
MAX_PENDING_HANDSHAKES = 256
#: The body of a HELLO: purpose, mode, the client's nonce.
HELLO = struct.Struct("<BB32s")
MODE_CODES = {"secret": 1, "file": 2, "open": 3}


class HandshakeServer:
    """Admits the connections of this rank's ROUTERs (``connections``' data ROUTER, and
    rank 0's rendezvous ROUTER) that prove the job key."""

    def __init__(self, connections: Connections, rank: int, size: int, stats: dict,
                 mode: str, key: Optional[bytes], port: int) -> None:
        self._conns = connections
        self.rank, self.size = rank, size
        self._stats = stats
        self._mode, self._mode_code = mode, MODE_CODES[mode]
        self._key = key
        self._port = port  # the rendezvous port, part of every transcript
        self._early_hellos: list = []  # HELLOs that came before the key (mode open)
        self.announces: dict[int, dict] = {}  # client -> its announce, proved at the rendezvous

    def learn_key(self, key: Optional[bytes]) -> None:
        """The job key became known (mode ``open``: with the rendezvous table; ``file``:
        from the key file, None while rank 0 has yet to write it): answer the HELLOs
        that waited for it."""
        self._key = key
        if key is None:
            return
        early, self._early_hellos = self._early_hellos, []
        for inb, rid, h, body in early:
            self._answer_hello(inb, rid, h, body)

    def on_message(self, inb: Inbound, rid: bytes) -> None:
        """A message from a connection of ``inb`` that has not authenticated (its first
        frame is next): only a HELLO or a PROOF is read (the proof needs the frame's file
        descriptor), anything else dropped."""
        sock = inb.sock
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        h = wire.parse(frame.bytes)
        if h is None:
            self._conns.reject(sock)
        elif h.kind == Kind.HELLO:
            self._on_hello(inb, rid, h)
        elif h.kind == Kind.PROOF:
            self._on_proof(inb, rid, h, frame)
        else:
            self._conns.reject(sock)

    def _refuse(self, inb: Inbound, rid: bytes, client: int, text: str) -> None:
        self._stats["refused"] += 1
        try:
            inb.sock.send_multipart([rid, wire.pack(Kind.REFUSED, self.rank, client),
                                     text.encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _on_hello(self, inb: Inbound, rid: bytes, h: wire.Header) -> None:
        sock = inb.sock
        body = sock.recv(zmq.NOBLOCK) if sock.getsockopt(zmq.RCVMORE) else b""
        discard_rest(sock)
        if len(body) != HELLO.size:
            self._stats["rejected"] += 1
            return
        if self._key is None:
            # Without a secret (mode open) the key comes with the rendezvous table, and a
            # faster peer may connect to this rank's data socket before that arrived:
            # answer once the key is known (see learn_key); a few at most are kept.
            if len(self._early_hellos) < MAX_PENDING_HANDSHAKES:
                self._early_hellos.append((inb, rid, h, body))
            return
        self._answer_hello(inb, rid, h, body)

    def _answer_hello(self, inb: Inbound, rid: bytes, h: wire.Header, body: bytes) -> None:
        purpose, mode, nonce_c = HELLO.unpack(body)
        client = h.src
        lowest = 1 if inb.purpose == auth.PURPOSE_RENDEZVOUS else 0
        if purpose != inb.purpose or h.dst != self.rank or not lowest <= client < self.size \
                or client == self.rank:
            self._stats["rejected"] += 1
            return
        if mode != self._mode_code:
            names = {v: k for k, v in MODE_CODES.items()}
            self._refuse(inb, rid, client, f"authentication mode mismatch: rank {self.rank} "
                                           f"uses {self._mode!r}, you {names.get(mode, mode)!r} "
                                           f"(set the same {settings.SECRET.name} on every rank)")
            return
        if client in inb.rank_rid:
            self._refuse(inb, rid, client, f"rank {client} is already connected")
            return
        nonce_s = secrets.token_bytes(auth.NONCE_BYTES)
        t = auth.transcript(purpose, mode, client, self.rank, self.size, self._port,
                            nonce_c, nonce_s)
        inb.pending[rid] = (client, t)
        inb.pending.move_to_end(rid)
        while len(inb.pending) > MAX_PENDING_HANDSHAKES:
            inb.pending.popitem(last=False)
        try:
            inb.sock.send_multipart([rid, wire.pack(Kind.CHALLENGE, self.rank, client),
                                     nonce_s + auth.mac(self._key, b"server", t)], zmq.NOBLOCK)
        except zmq.ZMQError:
            inb.pending.pop(rid, None)

    def _on_proof(self, inb: Inbound, rid: bytes, h: wire.Header, frame: zmq.Frame) -> None:
        sock = inb.sock
        parts = []
        try:
            while sock.getsockopt(zmq.RCVMORE) and len(parts) < 2:
                parts.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass
        discard_rest(sock)
        entry = inb.pending.pop(rid, None)
        if entry is None or h.src != entry[0] or not parts:
            self._stats["rejected"] += 1
            return
        client, t = entry
        rendezvous = inb.purpose == auth.PURPOSE_RENDEZVOUS
        extra = parts[1] if rendezvous and len(parts) > 1 else b""
        if not (self._mode == "open" and rendezvous) and \
                not auth.verify(self._key, b"client", t, parts[0], extra):
            self._stats["bad_proofs"] += 1
            self._refuse(inb, rid, client, "authentication failed")
            return
        if client in inb.rank_rid:
            self._refuse(inb, rid, client, f"rank {client} is already connected")
            return
        if rendezvous:
            announce = _valid_announce(client, extra)
            if announce is None:
                self._stats["rejected"] += 1
                return
            self.announces[client] = announce
        else:
            self._conns.authenticated(frame.get(zmq.SRCFD), client)
        inb.rid_rank[rid] = client
        inb.rank_rid[client] = rid
        inb.transcripts[client] = t


def _valid_announce(client: int, extra: bytes) -> Optional[dict]:
    """The announce rank ``client`` proved, if it is well formed (else None)."""
    try:
        announce = json.loads(extra)
        ok = (announce["rank"] == client and isinstance(announce["host"], str)
              and str(announce["tcp"]).startswith("tcp://")
              and (announce["ipc"] == "" or str(announce["ipc"]).startswith("ipc://"))
              and len(extra) < 4096)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return None
    return {k: announce.get(k, "") for k in ("rank", "host", "tcp", "ipc", "ipc_id", "pid")}
