"""Start-up of the zmq backend: sockets, the rendezvous at rank 0, and the authentication
handshake of every connection (see the threat model in the package docstring).

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
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import struct
import threading
import time
import weakref
from typing import Any, Mapping, Optional

import zmq

from collectives import settings
from collectives.errors import CollectiveError, CollectiveTimeout, PeerError

from . import auth, heap, wire
from .addresses import (IpcDir, bind_ip, host_key, ipc_identity, resolve_master, tcp_endpoint,
                        use_ipc)
from .wire import Kind

#: Frames of at least this many bytes are sent zero-copy (pyzmq copies smaller ones anyway).
ZERO_COPY_MIN = 64 * 1024
#: The rendezvous may take at least this long (COLLECTIVES_ZMQ_INIT_TIMEOUT overrides).
MIN_INIT_TIMEOUT = 60.0
#: Unauthenticated handshakes remembered at once (oldest forgotten first).
MAX_PENDING_HANDSHAKES = 256
#: After a peer's connection closed: how long to keep reading what it had sent before
#: failing the waits on it.
LOST_GRACE_S = 0.05
#: First retry of a refused connection (the rendezvous, before rank 0 listens), doubled
#: up to the second value while rank 0 is late (a late rank 0 costs at most that much
#: more). libzmq's 100 ms default would make a rank that came before rank 0 wait up to
#: 100 ms more for nothing (docs/performance.md).
RECONNECT_IVL_MS = 2
RECONNECT_IVL_MAX_MS = 50
#: Longest single sleep of a waiter (deadlines and closing are checked between).
SLICE_S = 0.1
_HELLO = struct.Struct("<BB32s")
# pyzmq's constants are enum members; plain ints keep the hot paths cheap.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_MODE_CODES = {"secret": 1, "file": 2, "open": 3}


class _Inbound:
    """A bound ROUTER and who authenticated on it."""

    def __init__(self, sock: zmq.Socket, purpose: int) -> None:
        self.sock, self.purpose = sock, purpose
        self.rid_rank: dict[bytes, int] = {}
        self.rank_rid: dict[int, bytes] = {}
        self.pending: "collections.OrderedDict[bytes, tuple[int, bytes]]" = collections.OrderedDict()
        self.transcripts: dict[int, bytes] = {}


class _Outbound:
    """A DEALER to one server ROUTER, with its handshake state."""

    def __init__(self, sock: zmq.Socket, server: int, purpose: int, endpoint: str) -> None:
        self.sock, self.server, self.purpose, self.endpoint = sock, server, purpose, endpoint
        self.nonce = b""
        self.transcript = b""
        self.state = "new"          # new -> hello -> proved
        self.retry_at = 0.0


_live_engines: "weakref.WeakSet" = weakref.WeakSet()  # open Engines
_gc_lock = threading.Lock()
_gc_was_running: Optional[bool] = None


class Connector:
    """The start-up part of :class:`~backends.zeromq.engine.Engine`."""

    def _socket_options(self, sock: zmq.Socket, ipv6: bool) -> None:
        hb = self._heartbeat_s
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, int(hb * 200)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(500, int(hb * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TTL, max(500, int(hb * 1000)))
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)

    def _new_router(self, ipv6: bool) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        self._socket_options(sock, ipv6)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.FRAME_MAX + 4096)
        return sock

    def _new_dealer(self, ipv6: bool, reconnect: bool) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        self._socket_options(sock, ipv6)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.ROUTING_ID, bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(15))
        if not reconnect:
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
        else:
            # A rank often connects to the rendezvous before rank 0 listens there: retry
            # soon (see RECONNECT_IVL_MS), backing off while rank 0 is late.
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        return sock

    def _start(self, rdzv: Any, env: Mapping[str, str]) -> None:
        where = f"{self._where0} init"
        self._master = master = resolve_master(rdzv.master_addr, rdzv.master_port, where)
        self._heartbeat_s = settings.ZMQ_HEARTBEAT_S.get(env)
        self._spin_s = settings.ZMQ_SPIN_US.get(env) * 1e-6
        self._linger_s = settings.ZMQ_LINGER_S.get(env)
        init_timeout = settings.ZMQ_INIT_TIMEOUT.get(env) or max(self.timeout,
                                                                 MIN_INIT_TIMEOUT)
        self.mode, self._key = auth.choose_mode(rdzv, env)
        self._mode_code = _MODE_CODES[self.mode]
        self._key_path = auth.key_file_path(f"{rdzv.job_id}|{master.ip}:{master.port}|{self.size}") \
            if self.mode == "file" else None
        if self.rank == 0 and self._key is None:
            self._key = secrets.token_bytes(32)
            if self.mode == "file":
                auth.write_key_file(self._key_path, self._key)

        self.malloc = heap.keep_receive_buffers(env)  # before libzmq's first receive
        self._ctx = zmq.Context(io_threads=settings.ZMQ_IO_THREADS.get(env))
        self._ctx.setsockopt(zmq.LINGER, 0)
        _note_gc_state()
        # This rank's inbound socket.
        bind, advertised = bind_ip(master, env)
        self._router = self._new_router(master.ipv6)
        self._router.bind(tcp_endpoint(bind, "*", master.ipv6))
        port = self._router.last_endpoint.decode().rsplit(":", 1)[1]
        self.endpoints["tcp"] = tcp_endpoint(advertised, port, master.ipv6)
        if use_ipc(env):
            self._ipc = IpcDir(self.rank)
            self._router.bind(self._ipc.endpoint)
            self.endpoints["ipc"] = self._ipc.endpoint
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._inbound = _Inbound(self._router, auth.PURPOSE_DATA)
        self.register_group(0, tuple(range(self.size)))
        self._announce = json.dumps({
            "rank": self.rank, "host": host_key(), "tcp": self.endpoints["tcp"],
            "ipc": self.endpoints.get("ipc", ""),
            "ipc_id": ipc_identity(self.endpoints["ipc"]) if "ipc" in self.endpoints else "",
            "pid": os.getpid()}).encode()
        self._early_hellos: list = []  # HELLOs that came before the key (mode open)
        self._rdv_in: Optional[_Inbound] = None
        self._rdv_out: Optional[_Outbound] = None
        self._outbound: dict[int, _Outbound] = {}
        self._announces: dict[int, dict] = {}
        try:
            if self.rank == 0:
                sock = self._new_router(master.ipv6)
                bind_addr = "*" if bind == "*" else master.ip
                try:
                    sock.bind(tcp_endpoint(bind_addr, master.port, master.ipv6))
                except zmq.ZMQError as exc:
                    sock.close(0)
                    raise ValueError(f"{where}: rank 0 cannot listen at {master.endpoint()} "
                                     f"(MASTER_ADDR={master.host}, MASTER_PORT={master.port}): "
                                     f"{exc}") from None
                self._rdv_in = _Inbound(sock, auth.PURPOSE_RENDEZVOUS)
                self._announces[0] = json.loads(self._announce)
            else:
                sock = self._new_dealer(master.ipv6, reconnect=True)
                sock.connect(master.endpoint())
                self._rdv_out = _Outbound(sock, 0, auth.PURPOSE_RENDEZVOUS, master.endpoint())
                self._send_hello(self._rdv_out)
            self._handshake_loop(time.monotonic() + init_timeout, init_timeout)
            if self._ipc is not None:
                # Every peer is connected: the socket file is no longer needed. Removing
                # it keeps those connections, refuses any later one, and leaves nothing
                # behind even if this process is killed.
                self._ipc.remove()
        finally:
            if self._rdv_in is not None:
                self._rdv_in.sock.close(0)
                self._rdv_in = None
            if self._rdv_out is not None:
                self._rdv_out.sock.close(0)
                self._rdv_out = None
            if self.rank == 0 and self._key_path:
                auth.remove_key_file(self._key_path)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _handshake_loop(self, deadline: float, init_timeout: float) -> None:
        """Rendezvous, then authenticate every connection; returns when this rank has an
        authenticated connection to and from every peer."""
        while True:
            socks = [self._router, self._monitor]
            if self._rdv_in is not None:
                socks.append(self._rdv_in.sock)
            if self._rdv_out is not None:
                socks.append(self._rdv_out.sock)
            socks += [o.sock for o in self._outbound.values()]
            poller = zmq.Poller()
            for s in socks:
                poller.register(s, zmq.POLLIN)
            poller.poll(20)
            self._drain()
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
            ready_in = len(self._inbound.rank_rid)
            if self.table and ready_out == self.size - 1 and ready_in == self.size - 1:
                return
            if self._down:
                p, why = next(iter(self._down.items()))
                raise PeerError(f"{self._where0} init: rank {p} {why}", peer=p)
            if now >= deadline:
                if not self.table:
                    if self.rank == 0:
                        missing = [r for r in range(self.size) if r not in self._announces]
                        what = f"ranks {missing} did not join the rendezvous at " \
                               f"{self._master.endpoint()}"
                    else:
                        missing = [0]
                        what = f"no rendezvous with rank 0 at {self._master.endpoint()}"
                else:
                    missing = sorted({r for r in range(self.size) if r != self.rank and (
                        r not in self._inbound.rank_rid or
                        self._outbound.get(r) is None or self._outbound[r].state != "proved")})
                    what = f"no authenticated connection with ranks {missing}"
                raise CollectiveTimeout(f"{self._where0} init: {what} within {init_timeout:g} s "
                                        f"(auth mode {self.mode})", op="init", missing=missing)

    # ---------------------------------------------------------------- client side
    def _send_hello(self, out: _Outbound) -> None:
        out.nonce = secrets.token_bytes(auth.NONCE_BYTES)
        out.state = "hello"
        header = wire.pack(Kind.HELLO, self.rank, out.server)
        out.sock.send_multipart([header, _HELLO.pack(out.purpose, self._mode_code, out.nonce)])

    def _client_key(self, out: _Outbound) -> Optional[bytes]:
        if self.mode == "file" and self.rank != 0 and out.purpose == auth.PURPOSE_RENDEZVOUS:
            self._key = auth.read_key_file(self._key_path)
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
                    out.state, out.retry_at = "retry", time.monotonic() + 0.1
                    continue
                raise auth.AuthenticationError(
                    f"{self._where0} init: rank {out.server} at {out.endpoint} refused this "
                    f"rank: {text}")
            if h.kind == Kind.CHALLENGE and out.state == "hello" and len(frames) == 2 \
                    and len(frames[1]) == auth.NONCE_BYTES + auth.MAC_BYTES:
                nonce_s, mac_s = frames[1][:auth.NONCE_BYTES], frames[1][auth.NONCE_BYTES:]
                t = auth.transcript(out.purpose, self._mode_code, self.rank, out.server,
                                    self.size, self._master.port, out.nonce, nonce_s)
                trust_on_first_use = self.mode == "open" and out.purpose == auth.PURPOSE_RENDEZVOUS
                key = self._client_key(out)
                if not trust_on_first_use and not auth.verify(key, b"server", t, mac_s):
                    if self.mode == "file" and out.purpose == auth.PURPOSE_RENDEZVOUS:
                        out.state, out.retry_at = "retry", time.monotonic() + 0.1  # stale key file
                        continue
                    who = "the rank 0 rendezvous" if out.purpose == auth.PURPOSE_RENDEZVOUS \
                        else f"rank {out.server}"
                    raise auth.AuthenticationError(
                        f"{self._where0} init: {who} at {out.endpoint} could not prove the job "
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
            elif h.kind == Kind.TABLE and out.purpose == auth.PURPOSE_RENDEZVOUS \
                    and out.state == "proved" and len(frames) == 3:
                body = frames[2]
                if self.mode != "open" and not auth.verify(self._key, b"table", out.transcript,
                                                           frames[1], body):
                    continue
                self._accept_table(json.loads(body))

    def _accept_table(self, table: dict) -> None:
        if self.mode == "open":
            self._key = bytes.fromhex(table["key"])
            early, self._early_hellos = self._early_hellos, []
            for inb, rid, h, body in early:
                self._answer_hello(inb, rid, h, body)
        entries = table["ranks"]
        if len(entries) != self.size or [e["rank"] for e in entries] != list(range(self.size)):
            raise CollectiveError(f"{self._where0} init: malformed rendezvous table")
        self.table = entries
        self._open_dealers()

    def _open_dealers(self) -> None:
        mine = self.table[self.rank]
        for p, entry in enumerate(self.table):
            if p == self.rank:
                continue
            local = entry["host"] == mine["host"] and entry["ipc"] and mine["ipc"] and \
                entry["ipc_id"] and ipc_identity(entry["ipc"]) == entry["ipc_id"]
            endpoint = entry["ipc"] if local else entry["tcp"]
            sock = self._new_dealer(self._master.ipv6, reconnect=False)
            sock.connect(endpoint)
            self._dealers[p] = sock
            self.connections[p] = endpoint
            out = _Outbound(sock, p, auth.PURPOSE_DATA, endpoint)
            self._outbound[p] = out
            self._send_hello(out)

    # ---------------------------------------------------------------- server side
    def _serve_rendezvous(self) -> None:
        inb = self._rdv_in
        while True:
            try:
                rid = inb.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_router_message(inb, rid)
        if len(self._announces) == self.size and not self.table:
            table = {"ranks": [self._announces[r] for r in range(self.size)]}
            if self.mode == "open":
                table["key"] = self._key.hex()
            body = json.dumps(table).encode()
            for p, rid in inb.rank_rid.items():
                tag = bytes(auth.MAC_BYTES) if self.mode == "open" else \
                    auth.mac(self._key, b"table", inb.transcripts[p], body)
                try:
                    inb.sock.send_multipart([rid, wire.pack(Kind.TABLE, 0, p), tag, body],
                                            zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self.table = table["ranks"]
            self._open_dealers()

    def _reject(self, sock: zmq.Socket) -> None:
        self.stats["rejected"] += 1
        self._discard(sock)

    @staticmethod
    def _discard(sock: zmq.Socket) -> None:
        try:
            while sock.get(_RCVMORE):
                sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            pass

    def _refuse(self, inb: _Inbound, rid: bytes, client: int, text: str) -> None:
        self.stats["refused"] += 1
        try:
            inb.sock.send_multipart([rid, wire.pack(Kind.REFUSED, self.rank, client),
                                     text.encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _on_hello(self, inb: _Inbound, rid: bytes, h: wire.Header) -> None:
        sock = inb.sock
        body = sock.recv(zmq.NOBLOCK) if sock.getsockopt(zmq.RCVMORE) else b""
        self._discard(sock)
        if len(body) != _HELLO.size:
            self.stats["rejected"] += 1
            return
        if self._key is None:
            # Without a secret (mode open) the key comes with the rendezvous table, and a
            # faster peer may connect to this rank's data socket before that arrived:
            # answer once the key is known (see _accept_table); a few at most are kept.
            if len(self._early_hellos) < MAX_PENDING_HANDSHAKES:
                self._early_hellos.append((inb, rid, h, body))
            return
        self._answer_hello(inb, rid, h, body)

    def _answer_hello(self, inb: _Inbound, rid: bytes, h: wire.Header, body: bytes) -> None:
        sock = inb.sock
        purpose, mode, nonce_c = _HELLO.unpack(body)
        client = h.src
        lowest = 1 if inb.purpose == auth.PURPOSE_RENDEZVOUS else 0
        if purpose != inb.purpose or h.dst != self.rank or not lowest <= client < self.size \
                or client == self.rank:
            self.stats["rejected"] += 1
            return
        if mode != self._mode_code:
            names = {v: k for k, v in _MODE_CODES.items()}
            self._refuse(inb, rid, client, f"authentication mode mismatch: rank {self.rank} "
                                           f"uses {self.mode!r}, you {names.get(mode, mode)!r} "
                                           f"(set the same {settings.SECRET.name} on every rank)")
            return
        if client in inb.rank_rid:
            self._refuse(inb, rid, client, f"rank {client} is already connected")
            return
        nonce_s = secrets.token_bytes(auth.NONCE_BYTES)
        t = auth.transcript(purpose, mode, client, self.rank, self.size, self._master.port,
                            nonce_c, nonce_s)
        inb.pending[rid] = (client, t)
        inb.pending.move_to_end(rid)
        while len(inb.pending) > MAX_PENDING_HANDSHAKES:
            inb.pending.popitem(last=False)
        try:
            sock.send_multipart([rid, wire.pack(Kind.CHALLENGE, self.rank, client),
                                 nonce_s + auth.mac(self._key, b"server", t)], zmq.NOBLOCK)
        except zmq.ZMQError:
            inb.pending.pop(rid, None)

    def _on_proof(self, inb: _Inbound, rid: bytes, h: wire.Header, frame: zmq.Frame) -> None:
        sock = inb.sock
        parts = []
        try:
            while sock.getsockopt(zmq.RCVMORE) and len(parts) < 2:
                parts.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass
        self._discard(sock)
        entry = inb.pending.pop(rid, None)
        if entry is None or h.src != entry[0] or not parts:
            self.stats["rejected"] += 1
            return
        client, t = entry
        rendezvous = inb.purpose == auth.PURPOSE_RENDEZVOUS
        extra = parts[1] if rendezvous and len(parts) > 1 else b""
        if not (self.mode == "open" and rendezvous) and \
                not auth.verify(self._key, b"client", t, parts[0], extra):
            self.stats["bad_proofs"] += 1
            self._refuse(inb, rid, client, "authentication failed")
            return
        if client in inb.rank_rid:
            self._refuse(inb, rid, client, f"rank {client} is already connected")
            return
        if rendezvous:
            try:
                announce = json.loads(extra)
                ok = (announce["rank"] == client and isinstance(announce["host"], str)
                      and str(announce["tcp"]).startswith("tcp://")
                      and (announce["ipc"] == "" or str(announce["ipc"]).startswith("ipc://"))
                      and len(extra) < 4096)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                self.stats["rejected"] += 1
                return
            self._announces[client] = {k: announce.get(k, "") for k in
                                       ("rank", "host", "tcp", "ipc", "ipc_id", "pid")}
        else:
            self._drain_monitor()  # events of an earlier connection on a reused fd come first
            self._fd_rank[frame.get(zmq.SRCFD)] = client
        inb.rid_rank[rid] = client
        inb.rank_rid[client] = rid
        inb.transcripts[client] = t


def _note_gc_state() -> None:
    """Remember whether pyzmq's zero-copy collector thread ran before our first engine."""
    global _gc_was_running
    with _gc_lock:
        if _gc_was_running is None or not _live_engines:
            try:
                from zmq.utils.garbage import gc
                _gc_was_running = gc.is_alive()
            except Exception:  # noqa: BLE001 - pyzmq internals may change
                _gc_was_running = True


def _maybe_stop_gc() -> None:
    """pyzmq tracks zero-copy sends in a process-wide thread, started on first use. When
    our engines started it and none is left, stop it (once it holds no buffer), so that a
    closed group leaves no thread behind; pyzmq restarts it on demand."""
    global _gc_was_running
    with _gc_lock:
        if _live_engines or _gc_was_running is not False:
            return
        try:
            from zmq.utils.garbage import gc
        except Exception:  # noqa: BLE001
            return
        until = time.monotonic() + 1.0
        while gc.refs and time.monotonic() < until:
            time.sleep(0.005)
        if gc.is_alive() and not gc.refs:
            try:
                gc.stop()
            except Exception:  # noqa: BLE001 - never fail a close over this
                pass
        _gc_was_running = None
