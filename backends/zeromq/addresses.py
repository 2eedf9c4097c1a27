"""Where a rank listens and how it reaches the others.

- The rendezvous address is ``MASTER_ADDR:MASTER_PORT`` (resolved once; IPv4 or IPv6).
- A rank binds its data socket on the address of the interface that routes to
  ``MASTER_ADDR``, found by ``connect()``-ing a UDP socket there (no packet is sent) and
  reading its local address. ``COLLECTIVES_ZMQ_BIND_ADDR`` overrides it (``0.0.0.0`` or
  ``*`` binds every interface; the advertised address is then still the routed one).
- Every rank also binds an ``ipc://`` endpoint in a private temporary directory; two ranks
  use it when they have the same *host key* (hostname, boot id, network namespace, user)
  and see the same socket file at its path (same filesystem); ``COLLECTIVES_ZMQ_TRANSPORT=tcp``
  turns that off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional

from collectives import settings
from collectives.hosts import machine_identity

_UNIX_PATH_MAX = 100


@dataclass(frozen=True)
class Master:
    host: str          # as given
    ip: str            # resolved
    port: int
    ipv6: bool

    def endpoint(self, ip: Optional[str] = None, port: Optional[int] = None) -> str:
        return tcp_endpoint(self.ip if ip is None else ip, self.port if port is None else port,
                            self.ipv6)


def tcp_endpoint(ip: str, port: "int | str", ipv6: bool) -> str:
    return f"tcp://[{ip}]:{port}" if ipv6 and ip != "*" else f"tcp://{ip}:{port}"


def resolve_master(addr: Optional[str], port: Optional[int], where: str) -> Master:
    if not addr or port is None:
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v and v != 0]
        raise ValueError(f"{where}: the zmq backend needs {' and '.join(missing)} (the "
                         f"address and port where rank 0 listens for the rendezvous); "
                         f"collectives.spawn and torchrun set them, otherwise export e.g. "
                         f"MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 on every rank")
    if not 0 < int(port) < 65536:
        raise ValueError(f"{where}: MASTER_PORT={port} is not a TCP port")
    try:
        infos = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{where}: cannot resolve MASTER_ADDR={addr!r}: {exc}") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # prefer IPv4 when both exist
    family, _, _, _, sockaddr = infos[0]
    return Master(addr, sockaddr[0], int(port), family == socket.AF_INET6)


def routed_local_ip(master: Master) -> str:
    """The local address of the interface that routes to the master (UDP connect trick)."""
    family = socket.AF_INET6 if master.ipv6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master.ip, master.port))
            return s.getsockname()[0]
        except OSError:
            return "::1" if master.ipv6 else "127.0.0.1"


def bind_ip(master: Master, env: Mapping[str, str]) -> tuple[str, str]:
    """``(address to bind, address to advertise)`` for this rank's data socket."""
    advertised = routed_local_ip(master)
    forced = settings.ZMQ_BIND_ADDR.get(env) or ""
    if not forced:
        return advertised, advertised
    if forced in ("*", "0.0.0.0", "::"):
        return "*", advertised
    return forced, forced


def host_key() -> str:
    """Equal for processes on one host as the network sees it: same machine (hostname and
    boot id), same network namespace (a container or a namespace is another host), same
    user. ipc:// is used between them when, in addition, the peer's socket file is the
    one this process sees at its path (:func:`ipc_identity`: same filesystem)."""
    return hashlib.sha256("|".join(machine_identity()).encode()).hexdigest()[:32]


def ipc_identity(endpoint: str) -> str:
    """``device:inode`` of an ipc endpoint's socket file ('' when it cannot be seen)."""
    try:
        st = os.stat(endpoint[len("ipc://"):])
    except (OSError, ValueError):
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def use_ipc(env: Mapping[str, str]) -> bool:
    return settings.ZMQ_TRANSPORT.get(env) != "tcp" and hasattr(socket, "AF_UNIX")


_IPC_PREFIX = "czmq-"


def sweep_stale_ipc_dirs(parent: Optional[str] = None) -> int:
    """Remove this user's ipc directories left by processes killed during start-up: those
    whose socket file exists and refuses connections (a live rank accepts). Returns how
    many were removed."""
    parent = parent or tempfile.gettempdir()
    removed = 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_IPC_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            entries = os.listdir(path) if stat.S_ISDIR(st.st_mode) else []
        except OSError:
            continue
        if st.st_uid != os.getuid() or len(entries) != 1 or not entries[0].startswith("r"):
            continue
        sock_path = os.path.join(path, entries[0])
        try:
            if not stat.S_ISSOCK(os.lstat(sock_path).st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                probe.connect(sock_path)
            continue  # someone listens: alive
        except ConnectionRefusedError:
            pass
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


class IpcDir:
    """A private (0700) temporary directory for this rank's ipc endpoint; removed once every
    peer connected (the connections stay), at the latest at close."""

    def __init__(self, rank: int) -> None:
        sweep_stale_ipc_dirs()
        self.path: Optional[str] = tempfile.mkdtemp(prefix=_IPC_PREFIX)
        self.endpoint_path = os.path.join(self.path, f"r{rank}")
        if len(self.endpoint_path) > _UNIX_PATH_MAX:
            self.remove()
            self.path = tempfile.mkdtemp(prefix=_IPC_PREFIX, dir="/tmp")
            self.endpoint_path = os.path.join(self.path, f"r{rank}")

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.endpoint_path}"

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
