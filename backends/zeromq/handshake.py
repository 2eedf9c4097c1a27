"""Start-up of the zmq backend: the rendezvous at rank 0 and the authentication handshake
of every connection (see the threat model in the package docstring).

Rendezvous. Rank 0 binds a ROUTER at ``MASTER_ADDR:MASTER_PORT``; every other rank
connects a DEALER to it, authenticates (below), sends its *announce* (rank, host key, tcp
and ipc endpoints) inside its proof, and receives the *table* of all announces (MACed
under the job key). Then every rank connects one DEALER to each peer's data ROUTER and
authenticates on it; start-up ends when this rank has an authenticated connection to and
from every peer. Rank 0 then closes the rendezvous socket.

Handshake (both purposes)::

    client -> server   HELLO      purpose, mode, nonce_c (32 random bytes)
    server -> client   CHALLENGE  nonce_s, HMAC(K, "server" || transcript)
    client -> server   PROOF      HMAC(K, "client" || transcript [|| sha256(announce)])

``transcript`` = purpose, mode, client rank, server rank, world size, rendezvous port,
nonce_c, nonce_s. The client checks the server's MAC before proving itself; the server
accepts nothing but HELLO and PROOF from a connection until the proof checks out. A
server answers a HELLO whose mode differs, or a second connection for an authenticated
rank, with REFUSED (in clear; it carries no secret).

:class:`Handshake` is the client side and the rendezvous; it holds the
:class:`~backends.zeromq.connections.Connections` whose connections it authenticates, and
the :class:`~backends.zeromq.handshake_server.HandshakeServer` that answers handshakes
(on the data ROUTER, whose unauthenticated messages the engine's progress hands over,
and on rank 0's rendezvous ROUTER). After start-up, every further handshake is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Callable, Mapping, Optional

import zmq

from collectives import logs, settings
from collectives.errors import CollectiveError, CollectiveTimeout, PeerError

from . import auth, wire
from .addresses import host_key, ipc_identity, tcp_endpoint
from .connections import Connections, Inbound
from .liveness import Liveness
from .handshake_server import HELLO, MODE_CODES, HandshakeServer
from .sockets import RCVMORE
from .wire import Kind

_log = logs.get_logger("backend.zmq")

#: The rendezvous may take at least this long (COLLECTIVES_ZMQ_INIT_TIMEOUT overrides).
MIN_INIT_TIMEOUT = 60.0


class _Outbound:
    """A DEALER to one server ROUTER, with its handshake state."""

    def __init__(self, sock: zmq.Socket, server: int, purpose: int, endpoint: str) -> None:
        self.sock, self.server, self.purpose, self.endpoint = sock, server, purpose, endpoint
        self.nonce = b""
        self.transcript = b""
        self.state = "new"          # new -> hello -> proved
        self.retry_at = 0.0


class Handshake:
    """The rendezvous and the authentication of every connection of ``connections``.
    ``mode`` is the authentication mode (``secret``, ``file``, ``open``; ``local`` in a
    world of one) and ``table`` every rank's announce once the rendezvous is done."""

    def __init__(self, connections: Connections, liveness: Liveness, rank: int, size: int,
                 stats: dict, where: str) -> None:
        self._conns = connections
        self._liveness = liveness
        self.rank, self.size = rank, size
        self._stats = stats
        self._where = f"{where} init"
        self.mode = "local"
        self.table: list[dict] = []
        self._key: Optional[bytes] = None
        self._mode_code = 0
        self._key_path: Optional[str] = None
        self._master: Any = None
        self._announce = b""  # this rank's, as it goes into the table
        self._server: Optional[HandshakeServer] = None
        self._rdv_in: Optional[Inbound] = None
        self._rdv_out: Optional[_Outbound] = None
        self._outbound: dict[int, _Outbound] = {}

    def choose_key(self, rdzv: Any, env: Mapping[str, str], master: Any) -> None:
        """The authentication mode and key, before any socket (rank 0 makes the key and,
        in mode ``file``, writes it for the others)."""
        self._master = master
        self.mode, self._key = auth.choose_mode(rdzv, env)
        self._mode_code = MODE_CODES[self.mode]
        self._key_path = auth.key_file_path(f"{rdzv.job_id}|{master.ip}:{master.port}|{self.size}") \
            if self.mode == "file" else None
        if self.rank == 0 and self._key is None:
            self._key = secrets.token_bytes(32)
            if self.mode == "file":
                auth.write_key_file(self._key_path, self._key)
        self._server = HandshakeServer(self._conns, self.rank, self.size, self._stats,
                                       self.mode, self._key, master.port)

    def run(self, init_timeout: float, drain: Callable[[], Any]) -> None:
        """Rendezvous, then authenticate every connection (``drain``: read the data
        ROUTER, whose handshakes come back here); returns when this rank has an
        authenticated connection to and from every peer."""
        conns, master = self._conns, self._master
        endpoints = conns.endpoints
        self._announce = json.dumps({
            "rank": self.rank, "host": host_key(), "tcp": endpoints["tcp"],
            "ipc": endpoints.get("ipc", ""),
            "ipc_id": ipc_identity(endpoints["ipc"]) if "ipc" in endpoints else "",
            "pid": os.getpid()}).encode()
        try:
            if self.rank == 0:
                sock = conns.new_router()
                bind_addr = "*" if conns.bind_address == "*" else master.ip
                try:
                    sock.bind(tcp_endpoint(bind_addr, master.port, master.ipv6))
                except zmq.ZMQError as exc:
                    sock.close(0)
                    raise ValueError(f"{self._where}: rank 0 cannot listen at {master.endpoint()} "
                                     f"(MASTER_ADDR={master.host}, MASTER_PORT={master.port}): "
                                     f"{exc}") from None
                self._rdv_in = Inbound(sock, auth.PURPOSE_RENDEZVOUS)
            else:
                self._rdv_out = _Outbound(conns.new_dealer(reconnect=True), 0,
                                          auth.PURPOSE_RENDEZVOUS, master.endpoint())
                self._rdv_out.sock.connect(master.endpoint())
                self._send_hello(self._rdv_out)
            self._loop(time.monotonic() + init_timeout, init_timeout, drain)
        finally:
            if self._rdv_in is not None:
                self._rdv_in.sock.close(0)
                self._rdv_in = None
            if self._rdv_out is not None:
                self._rdv_out.sock.close(0)
                self._rdv_out = None
            if self.rank == 0 and self._key_path:
                auth.remove_key_file(self._key_path)

    def _loop(self, deadline: float, init_timeout: float, drain: Callable[[], Any]) -> None:
        conns = self._conns
        waiting = logs.Awaiting(_log, f"the rendezvous of {self.size} ranks at "
                                      f"{self._master.endpoint()} (this is rank {self.rank}, "
                                      f"auth mode {self.mode})")
        while True:
            socks = [conns.router, conns.monitor]
            if self._rdv_in is not None:
                socks.append(self._rdv_in.sock)
            if self._rdv_out is not None:
                socks.append(self._rdv_out.sock)
            socks += [o.sock for o in self._outbound.values()]
            poller = zmq.Poller()
            for s in socks:
                poller.register(s, zmq.POLLIN)
            poller.poll(20)
            drain()
            if self._rdv_in is not None:
                self._serve_rendezvous()
            if self._rdv_out is not None:
                self._read_outbound(self._rdv_out)
            for out in list(self._outbound.values()):
                self._read_outbound(out)
            now = time.monotonic()
            for out in [self._rdv_out, *self._outbound.values()]:
                if out is not None and out.state == "retry" and now >= out.retry_at:
                    self._send_hello(out)
            ready_out = sum(o.state == "proved" for o in self._outbound.values())
            ready_in = len(conns.inbound.rank_rid)
            if self.table and ready_out == self.size - 1 and ready_in == self.size - 1:
                waiting.done()
                return
            if waiting.due(now):   # (who is awaited costs a scan: only when it is told)
                waiting.still(self._awaited()[1])
            down = self._liveness.down
            if down:
                p, why = next(iter(down.items()))
                raise PeerError(f"{self._where}: rank {p} {why}", peer=p)
            if now >= deadline:
                raise self._timed_out(init_timeout)

    def _timed_out(self, init_timeout: float) -> CollectiveTimeout:
        missing, what = self._awaited()
        return CollectiveTimeout(f"{self._where}: {what} within {init_timeout:g} s "
                                 f"(auth mode {self.mode})", op="init", missing=missing)

    def _awaited(self) -> tuple[list[int], str]:
        """The ranks this rank still waits for, and what for."""
        master = self._master
        if not self.table:
            if self.rank == 0:
                missing = [r for r in range(1, self.size) if r not in self._server.announces]
                what = f"ranks {missing} did not join the rendezvous at {master.endpoint()}"
            else:
                missing = [0]
                what = f"no rendezvous with rank 0 at {master.endpoint()}"
        else:
            rank_rid = self._conns.inbound.rank_rid
            missing = sorted({r for r in range(self.size) if r != self.rank and (
                r not in rank_rid or
                self._outbound.get(r) is None or self._outbound[r].state != "proved")})
            what = f"no authenticated connection with ranks {missing}"
        return missing, what

    # ---------------------------------------------------------------- client side
    def _send_hello(self, out: _Outbound) -> None:
        out.nonce = secrets.token_bytes(auth.NONCE_BYTES)
        out.state = "hello"
        header = wire.pack(Kind.HELLO, self.rank, out.server)
        out.sock.send_multipart([header, HELLO.pack(out.purpose, self._mode_code, out.nonce)])

    def _client_key(self, out: _Outbound) -> Optional[bytes]:
        if self.mode == "file" and self.rank != 0 and out.purpose == auth.PURPOSE_RENDEZVOUS:
            self._key = auth.read_key_file(self._key_path)
            self._server.learn_key(self._key)
        return self._key

    def _read_outbound(self, out: _Outbound) -> None:
        while True:
            try:
                frames = out.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            h = wire.parse(frames[0]) if frames else None
            if h is None or h.src != out.server or h.dst != self.rank:
                continue
            if h.kind == Kind.REFUSED:
                text = frames[1].decode("utf-8", "replace")[:500] if len(frames) > 1 else ""
                if self.mode == "file" and out.purpose == auth.PURPOSE_RENDEZVOUS:
                    _log.debug("the rendezvous at %s refused this rank (%s): retrying",
                               out.endpoint, text)
                    out.state, out.retry_at = "retry", time.monotonic() + 0.1
                    continue
                raise auth.AuthenticationError(
                    f"{self._where}: rank {out.server} at {out.endpoint} refused this "
                    f"rank: {text}")
            if h.kind == Kind.CHALLENGE and out.state == "hello" and len(frames) == 2 \
                    and len(frames[1]) == auth.NONCE_BYTES + auth.MAC_BYTES:
                self._answer_challenge(out, frames[1])
            elif h.kind == Kind.TABLE and out.purpose == auth.PURPOSE_RENDEZVOUS \
                    and out.state == "proved" and len(frames) == 3:
                body = frames[2]
                if self.mode != "open" and not auth.verify(self._key, b"table", out.transcript,
                                                           frames[1], body):
                    continue
                self._accept_table(json.loads(body))

    def _answer_challenge(self, out: _Outbound, body: bytes) -> None:
        """Check the server's MAC, then prove this rank (with its announce, to rank 0)."""
        nonce_s, mac_s = body[:auth.NONCE_BYTES], body[auth.NONCE_BYTES:]
        t = auth.transcript(out.purpose, self._mode_code, self.rank, out.server,
                            self.size, self._master.port, out.nonce, nonce_s)
        trust_on_first_use = self.mode == "open" and out.purpose == auth.PURPOSE_RENDEZVOUS
        key = self._client_key(out)
        if not trust_on_first_use and not auth.verify(key, b"server", t, mac_s):
            if self.mode == "file" and out.purpose == auth.PURPOSE_RENDEZVOUS:
                out.state, out.retry_at = "retry", time.monotonic() + 0.1  # stale key file
                _log.debug("the rendezvous at %s did not prove the key file's key (a stale "
                           "file?): retrying", out.endpoint)
                return
            who = "the rank 0 rendezvous" if out.purpose == auth.PURPOSE_RENDEZVOUS \
                else f"rank {out.server}"
            raise auth.AuthenticationError(
                f"{self._where}: {who} at {out.endpoint} could not prove the job "
                f"key (auth mode {self.mode}): a different {settings.SECRET.name}, or not a "
                f"rank of this job")
        out.transcript = t
        extra = self._announce if out.purpose == auth.PURPOSE_RENDEZVOUS else b""
        proof = bytes(auth.MAC_BYTES) if trust_on_first_use else \
            auth.mac(key, b"client", t, extra)
        frames_out = [wire.pack(Kind.PROOF, self.rank, out.server), proof]
        if extra:
            frames_out.append(extra)
        out.sock.send_multipart(frames_out)
        out.state = "proved"

    def _accept_table(self, table: dict) -> None:
        if self.mode == "open":
            self._key = bytes.fromhex(table["key"])
            self._server.learn_key(self._key)
        entries = table["ranks"]
        if len(entries) != self.size or [e["rank"] for e in entries] != list(range(self.size)):
            raise CollectiveError(f"{self._where}: malformed rendezvous table")
        self.table = entries
        _log.debug("rank %d: the rendezvous table arrived; connecting to %d peers", self.rank,
                   self.size - 1)
        self._open_dealers()

    def _open_dealers(self) -> None:
        mine = self.table[self.rank]
        for p, entry in enumerate(self.table):
            if p == self.rank:
                continue
            local = entry["host"] == mine["host"] and entry["ipc"] and mine["ipc"] and \
                entry["ipc_id"] and ipc_identity(entry["ipc"]) == entry["ipc_id"]
            endpoint = entry["ipc"] if local else entry["tcp"]
            out = _Outbound(self._conns.add_dealer(p, endpoint), p, auth.PURPOSE_DATA, endpoint)
            self._outbound[p] = out
            self._send_hello(out)

    # ---------------------------------------------------------------- server side
    def on_message(self, inb: Inbound, rid: bytes) -> None:
        """A message from a connection of ``inb`` that has not authenticated yet."""
        self._server.on_message(inb, rid)

    def _serve_rendezvous(self) -> None:
        """Rank 0: admit every rank; once all proved their announce, send them the table."""
        inb = self._rdv_in
        sock = inb.sock
        while True:
            try:
                rid = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not sock.get(RCVMORE):
                self._stats["rejected"] += 1
            elif rid in inb.rid_rank:  # an admitted client has nothing more to say
                self._conns.reject(sock)
            else:
                self._server.on_message(inb, rid)
        announces = self._server.announces
        if len(announces) == self.size - 1 and not self.table:
            table = {"ranks": [json.loads(self._announce)] +
                     [announces[r] for r in range(1, self.size)]}
            if self.mode == "open":
                table["key"] = self._key.hex()
            body = json.dumps(table).encode()
            for p, rid in inb.rank_rid.items():
                tag = bytes(auth.MAC_BYTES) if self.mode == "open" else \
                    auth.mac(self._key, b"table", inb.transcripts[p], body)
                try:
                    sock.send_multipart([rid, wire.pack(Kind.TABLE, 0, p), tag, body],
                                        zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self.table = table["ranks"]
            self._open_dealers()
