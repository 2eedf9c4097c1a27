"""Who may talk to a rank: the job key, the handshake MACs, and safe object decoding.

Three modes, chosen identically by every rank from its environment (see the threat model
in the package docstring):

``secret``
    ``COLLECTIVES_SECRET`` (at least 16 characters; ``collectives.spawn`` generates one per
    job) or the file named by ``COLLECTIVES_SECRET_FILE``. Every connection, the rendezvous
    included, proves knowledge of it.
``file``
    No secret given, but the launcher says every rank runs on this host (torchrun or mpirun
    on one node, or a world whose ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``): rank 0
    generates a key and writes it to a file only its user can read
    (``$TMPDIR/collectives-zmq-<uid>/<job>.key``, directory 0700, file 0600, removed once
    every rank joined); the others read it. As strong as ``secret`` against anyone who is
    not this user (or root).
``open``
    Neither: rank 0 generates the key and hands it to whoever completes the rendezvous
    first as each rank (trust on first use). Connections made after the rendezvous still
    prove the key, but an attacker who can reach MASTER_PORT during start-up, or read the
    rendezvous traffic, can join. Objects are then decoded by a restricted unpickler
    (plain data only). ``COLLECTIVES_ZMQ_REQUIRE_SECRET=1`` turns this mode into an error.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import secrets
import stat
import struct
import tempfile
import time
import warnings
from typing import Any, Mapping, Optional

from collectives import settings

SECRET_ENV = settings.SECRET.name
SECRET_FILE_ENV = settings.SECRET_FILE.name
REQUIRE_ENV = settings.ZMQ_REQUIRE_SECRET.name
MIN_SECRET_CHARS = 16
NONCE_BYTES = 32
MAC_BYTES = 32

PURPOSE_RENDEZVOUS = 0
PURPOSE_DATA = 1

MODES = ("secret", "file", "open")


class AuthenticationError(PermissionError):
    """A peer could not prove the job's key (or this rank could not find the key)."""


def derive_key(secret: bytes) -> bytes:
    """The job key: HMAC-SHA256 of a fixed label under the secret (domain separation)."""
    return hmac.new(secret, b"collectives/zmq/v1/job-key", hashlib.sha256).digest()


def transcript(purpose: int, mode: int, client: int, server: int, world_size: int,
               port: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    """The bytes both sides of a handshake MAC (each side under its own label)."""
    return struct.pack("<BBIIIH", purpose, mode, client, server, world_size, port) + \
        nonce_c + nonce_s


def mac(key: bytes, label: bytes, data: bytes, extra: bytes = b"") -> bytes:
    """HMAC-SHA256 of ``label || data || sha256(extra)``."""
    h = hmac.new(key, label, hashlib.sha256)
    h.update(data)
    h.update(hashlib.sha256(extra).digest())
    return h.digest()


def verify(key: Optional[bytes], label: bytes, data: bytes, tag: bytes, extra: bytes = b"") -> bool:
    return key is not None and hmac.compare_digest(mac(key, label, data, extra), tag)


# --------------------------------------------------------------------------- the mode
def choose_mode(rendezvous: Any, env: Mapping[str, str]) -> tuple[str, Optional[bytes]]:
    """``(mode, key or None)`` from the environment; rank 0 of ``file``/``open`` mode
    generates the key later, the others learn it at the rendezvous."""
    secret = settings.SECRET.get(env)     # (blank: not set)
    path = settings.SECRET_FILE.get(env)
    if secret is None and path:
        try:
            with open(path, "rb") as f:
                secret_bytes = f.read().strip()
        except OSError as exc:
            raise ValueError(f"zmq backend: cannot read {SECRET_FILE_ENV}={path!r}: {exc}") from None
        secret = secret_bytes.decode("utf-8", "replace")
    if secret is not None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"zmq backend: {SECRET_ENV} must have at least "
                             f"{MIN_SECRET_CHARS} characters (use e.g. `python -c 'import "
                             f"secrets; print(secrets.token_hex(32))'`)")
        return "secret", derive_key(secret.encode("utf-8"))
    single_host = (rendezvous.launcher in ("spawn", "torchrun", "mpi", "slurm")
                   and rendezvous.local_world_size == rendezvous.world_size)
    if single_host:
        return "file", None
    if settings.ZMQ_REQUIRE_SECRET.get(env):
        raise ValueError(f"zmq backend: {REQUIRE_ENV} is set but no {SECRET_ENV} (or "
                         f"{SECRET_FILE_ENV}) was given; export the same secret to every rank")
    if rendezvous.rank == 0:
        warnings.warn(
            f"zmq backend: no {SECRET_ENV} for a job whose ranks may span hosts: rank 0 hands "
            f"out a fresh key to whoever joins first (trust on first use). Anyone who can "
            f"reach MASTER_PORT during start-up or read the rendezvous traffic can join the "
            f"job; object collectives only accept plain data. Export {SECRET_ENV} to every "
            f"rank to authenticate every connection.", RuntimeWarning, stacklevel=3)
    return "open", None


# ---------------------------------------------------------------- file mode (one host)
def key_file_path(job: str) -> str:
    uid = os.getuid()
    directory = os.path.join(tempfile.gettempdir(), f"collectives-zmq-{uid}")
    name = hashlib.sha256(job.encode()).hexdigest()[:32] + ".key"
    return os.path.join(directory, name)


def _private_dir(directory: str) -> None:
    """Create ``directory`` 0700, or check that an existing one is ours, private and not a
    link (another user must not be able to plant or read key files)."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise AuthenticationError(f"zmq backend: {directory} is not a private directory of "
                                  f"this user (mode {oct(st.st_mode)}, uid {st.st_uid}); "
                                  f"remove it or set {SECRET_ENV}")


def write_key_file(path: str, key: bytes) -> None:
    """Write ``key`` atomically, readable by this user only."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    for attempt in range(3):  # another job's remove_key_file may take the empty directory
        _private_dir(os.path.dirname(path))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    try:
        os.write(fd, key.hex().encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_key_file(path: str) -> Optional[bytes]:
    """The key in ``path``; None while it does not exist (rank 0 has not written it)."""
    try:
        st = os.lstat(os.path.dirname(path))
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise AuthenticationError(f"zmq backend: {os.path.dirname(path)} is not private")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        fst = os.fstat(fd)
        if fst.st_uid != os.getuid() or fst.st_mode & 0o077:
            raise AuthenticationError(f"zmq backend: key file {path} is not private")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(data.decode())
    except ValueError:
        return None  # being replaced
    return key if len(key) == 32 else None


def remove_key_file(path: str) -> None:
    """Remove the key file, and its directory once no job of this user has one there."""
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        os.rmdir(os.path.dirname(path))  # fails while another job's key is in it
    except OSError:
        pass


# ------------------------------------------------------------------- object decoding
#: What the restricted unpickler may construct (besides the opcodes for None, bool, int,
#: float, str, bytes, tuple, list, dict, set, frozenset, which need no lookup).
_SAFE_GLOBALS = {
    ("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "bytearray"), ("builtins", "range"), ("builtins", "slice"),
    ("collections", "OrderedDict"),
}


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def plain_loads(data: bytes) -> Any:
    """Unpickle plain data only (no classes, no callables): nothing here can run code."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()


def wait_for_key_file(path: str, deadline: float) -> Optional[bytes]:
    """Poll for rank 0's key file until ``deadline``."""
    while True:
        key = read_key_file(path)
        if key is not None or time.monotonic() >= deadline:
            return key
        time.sleep(0.02)
