"""The shared-memory segment of one group: its layout, and how the ranks meet in it.

Layout (byte offsets, every region 4 KiB aligned)::

    header        4 KiB   magic, version, group size, layout, creator pid, nonce
    control       n x 128 B, one block per rank (two cache lines, written by its owner
                  except the doorbell)
    channel ctl   n x n x 128 B: head (written by the sender) and tail (written by the
                  receiver) of the ring src -> dst, 64 B apart
    data          2 banks x n slots x S bytes (S = staging chunk, phase parity = bank)
    rings         n x n rings of R bytes (src -> dst; the diagonal is never touched)

The file is sparse (tmpfs allocates a page when it is first written), so the footprint is
what is used: 2 x n x S for collectives plus what point to point touches.

Rendezvous through /dev/shm alone: the leader (lowest rank) creates the file under a
temporary name, sizes it, writes the header and publishes it atomically with
``os.link``; the others poll for the name, map it and check the header; each rank writes
its pid and marks itself attached; the first rank to see everybody attached unlinks the
name. From then on nothing is visible in /dev/shm, and a SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from collectives import logs, settings
from collectives.errors import CollectiveError, CollectiveTimeout, PeerError
from collectives.lifetime import process_alive
from collectives.shm_names import SHM_DIR

MAGIC = b"COLLSHM\x01"
VERSION = 1
PAGE = 4096
HEADER_BYTES = PAGE
CTRL_STRIDE = 128
CHAN_STRIDE = 128

# Control block of a rank: uint64 word indices inside its 128 bytes.
W_ARRIVED = 0      # the last phase this rank published
W_FP = 1           # fingerprints: (FP0, FP1) for phase parity 0 at 1, 2; parity 1 at 3, 4
W_PID = 5
W_STATE = 6        # see STATE_*
W_PIDNS = 7        # inode of /proc/self/ns/pid (0 if unknown)
BELL_BYTE = 64     # uint32 doorbell (futex word), second cache line
W_SLEEPERS = 9     # threads of this rank asleep on its doorbell
W_PUSHING = 10     # 1 + the rank this rank is writing into (Phases.push_into), else 0

_log = logs.get_logger("backend.shm")

#: ``0`` turns off the pid liveness checks (e.g. peers in another PID namespace).
PID_CHECK_ENV = settings.SHM_PID_CHECK.name

STATE_DETACHED = 0
STATE_ATTACHED = 1
STATE_FAILED = 2
STATE_CLOSED = 3

#    magic, version, size, total, chunk, ring, creator pid, nonce
_HEADER = struct.Struct("<8sIIQQQQQ")


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    size: int
    chunk: int      # S: bytes per data slot
    ring: int       # R: bytes per p2p ring

    @property
    def ctrl_off(self) -> int:
        return HEADER_BYTES

    @property
    def chan_off(self) -> int:
        return self.ctrl_off + _round_up(self.size * CTRL_STRIDE, PAGE)

    @property
    def data_off(self) -> int:
        return self.chan_off + _round_up(self.size * self.size * CHAN_STRIDE, PAGE)

    @property
    def ring_off(self) -> int:
        return self.data_off + 2 * self.size * self.chunk

    @property
    def total(self) -> int:
        n_rings = self.size * self.size if self.size > 1 else 0
        return self.ring_off + n_rings * self.ring

    def ctrl_word(self, rank: int, word: int) -> int:
        """uint64 index of ``word`` in ``rank``'s control block."""
        return (self.ctrl_off + rank * CTRL_STRIDE) // 8 + word

    def bell_byte(self, rank: int) -> int:
        return self.ctrl_off + rank * CTRL_STRIDE + BELL_BYTE

    def head_word(self, src: int, dst: int) -> int:
        return (self.chan_off + (src * self.size + dst) * CHAN_STRIDE) // 8

    def tail_word(self, src: int, dst: int) -> int:
        return self.head_word(src, dst) + 8

    def slot_off(self, bank: int, rank: int) -> int:
        return self.data_off + (bank * self.size + rank) * self.chunk

    def ring_byte(self, src: int, dst: int) -> int:
        return self.ring_off + (src * self.size + dst) * self.ring


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def same_pid_namespace(peer_ns: int) -> bool:
    """Whether a peer's pid means something here (liveness checks are possible);
    ``COLLECTIVES_SHM_PID_CHECK=0`` turns them off altogether."""
    if not settings.SHM_PID_CHECK.get():
        return False
    mine = pid_namespace()
    return mine == 0 or peer_ns in (0, mine)


class Segment:
    """A mapped segment: the mmap plus typed views over it."""

    def __init__(self, mm: mmap.mmap, layout: Layout, name: Optional[str],
                 inode: Optional[int]) -> None:
        self.mm = mm
        self.layout = layout
        self.name = name          # the file name under /dev/shm, while it may be linked
        self.inode = inode
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.base_addr = ctypes.addressof(self._anchor)
        self._mv = memoryview(mm)
        self.u64 = self._mv.cast("Q")
        self.u32 = self._mv.cast("I")
        self.bytes = np.frombuffer(mm, dtype=np.uint8)

    def close(self) -> None:
        """Unmap (once nothing else views the mapping; otherwise leave it to the GC)."""
        mm = self.mm
        if mm is None:
            return
        self.mm = None
        for view in (self.u64, self.u32, self._mv):
            try:
                view.release()
            except Exception:  # noqa: BLE001 - a view still exported elsewhere
                pass
        self.u64 = self.u32 = self._mv = None  # type: ignore[assignment]
        self.bytes = None  # type: ignore[assignment]
        self._anchor = None  # type: ignore[assignment]
        try:
            mm.close()
        except BufferError:
            pass  # a numpy view is still alive somewhere; the GC unmaps it later

    # ------------------------------------------------------------------ header
    def write_header(self, creator_pid: int, nonce: int) -> None:
        lay = self.layout
        packed = _HEADER.pack(b"\0" * 8, VERSION, lay.size, lay.total, lay.chunk, lay.ring,
                              creator_pid, nonce)
        self.mm[8:_HEADER.size] = packed[8:]
        self.mm[0:8] = MAGIC  # last: a reader that sees the magic sees the rest


def read_header(mm: mmap.mmap) -> Optional[tuple]:
    if len(mm) < HEADER_BYTES:
        return None
    fields = _HEADER.unpack_from(mm, 0)
    if fields[0] != MAGIC:
        return None
    return fields


def anonymous_segment(layout: Layout) -> Segment:
    """A private mapping for a group of one: no file, no rendezvous."""
    mm = mmap.mmap(-1, layout.total)
    return Segment(mm, layout, None, None)


def _shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _map_fd(fd: int, length: int) -> mmap.mmap:
    return mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink_if_ours(path: str, inode: Optional[int]) -> None:
    try:
        if inode is None or os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _create_and_publish(name: str, layout: Layout, deadline: float, where: str) -> Segment:
    """The leader: create, initialise, publish atomically with os.link."""
    path = _shm_path(name)
    tmp = _shm_path(f"{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, layout.total)
        mm = _map_fd(fd, layout.total)
        inode = os.fstat(fd).st_ino
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    seg = Segment(mm, layout, name, inode)
    try:
        seg.write_header(os.getpid(), secrets.randbits(63))
        delay = 0.001
        while True:
            try:
                os.link(tmp, path)
                break
            except FileExistsError:
                pass
            owner = _existing_owner(path)
            if owner is None or not process_alive(owner):
                # A stale segment of a crashed job with the same id: replace it.
                _log.warning("replacing the stale shared-memory segment %s (creator pid "
                             "%s is gone)", path, owner)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                continue
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{where}: shared-memory segment {path} already exists and belongs "
                    f"to the live process {owner}: is another job running with the same "
                    f"job id ({settings.JOB_ID.name})?")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    except BaseException:
        seg.close()
        os.unlink(tmp)
        raise
    os.unlink(tmp)
    return seg


def _existing_owner(path: str) -> Optional[int]:
    """Creator pid of the segment at ``path``: 0 if there is none any more, None if
    it is not a valid segment (either way the caller may replace it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        if os.fstat(fd).st_size < HEADER_BYTES:
            return None
        mm = mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        fields = read_header(mm)
    finally:
        mm.close()
    return None if fields is None else fields[6]


def _try_attach(name: str, size: int, where: str) -> Optional[Segment]:
    """A non-leader: map the published segment if it is there and valid."""
    path = _shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size < HEADER_BYTES:
            return None
        mm = _map_fd(fd, st.st_size)
    finally:
        os.close(fd)
    fields = read_header(mm)
    if fields is None:
        mm.close()
        return None
    _, version, n, total, chunk, ring, creator, _nonce = fields
    if not process_alive(creator):
        mm.close()
        return None  # stale, from a crashed job: the leader will replace it
    if version != VERSION or n != size or total != st.st_size:
        mm.close()
        raise CollectiveError(
            f"{where}: shared-memory segment {path} (created by pid {creator}) is for "
            f"{n} ranks, version {version}; this group has {size} ranks, version "
            f"{VERSION}: another job with the same job id?")
    return Segment(mm, Layout(size, chunk, ring), name, st.st_ino)


def open_group_segment(name: str, rank: int, size: int, layout: Layout, timeout: float,
                       where: str) -> Segment:
    """Create (rank 0 of the group) or attach to segment ``name``; return once every
    rank attached, with the name already unlinked."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        seg = _create_and_publish(name, layout, deadline, where)
        _log.debug("rank 0 of %d: created the segment %s (%d bytes)", size, _shm_path(name),
                   layout.total)
    else:
        seg = None
        delay = 0.0005
        created = logs.Awaiting(_log, f"rank 0 to create the segment {_shm_path(name)}")
        while seg is None:
            seg = _try_attach(name, size, where)
            if seg is None:
                created.still([0])
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        f"{where}: timed out after {timeout:g} s waiting for rank 0 to "
                        f"create the shared-memory segment {_shm_path(name)}",
                        op="init", missing=[0])
                time.sleep(delay)
                delay = min(delay * 1.5, 0.02)
        created.done()
    try:
        _attach_and_wait(seg, rank, size, deadline, timeout, where)
    except BaseException:
        if rank == 0:
            _unlink_if_ours(_shm_path(name), seg.inode)
        seg.close()
        raise
    return seg


def _attach_and_wait(seg: Segment, rank: int, size: int, deadline: float, timeout: float,
                     where: str) -> None:
    lay, u64 = seg.layout, seg.u64
    pid = os.getpid()
    other = u64[lay.ctrl_word(rank, W_PID)]
    if u64[lay.ctrl_word(rank, W_STATE)] != STATE_DETACHED and other != pid \
            and process_alive(other):
        raise CollectiveError(
            f"{where}: rank {rank} of this group is already attached by process {other}: "
            f"two processes with the same rank, or a job id reused by a running job")
    u64[lay.ctrl_word(rank, W_PID)] = pid
    u64[lay.ctrl_word(rank, W_PIDNS)] = pid_namespace()
    u64[lay.ctrl_word(rank, W_STATE)] = STATE_ATTACHED
    delay = 0.0002
    attached = logs.Awaiting(_log, f"the {size} ranks to attach to {_shm_path(seg.name or '')}"
                             f" (this is rank {rank})")
    while True:
        missing = [r for r in range(size)
                   if u64[lay.ctrl_word(r, W_STATE)] == STATE_DETACHED]
        if not missing:
            break
        attached.still(missing)
        for r in range(size):
            if r != rank and u64[lay.ctrl_word(r, W_STATE)] != STATE_DETACHED \
                    and same_pid_namespace(u64[lay.ctrl_word(r, W_PIDNS)]):
                peer_pid = u64[lay.ctrl_word(r, W_PID)]
                if not process_alive(peer_pid):
                    raise PeerError(f"{where}: rank {r} (pid {peer_pid}) died while the "
                                    f"group was being set up", peer=r)
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{where}: timed out after {timeout:g} s waiting for ranks {missing} to "
                f"attach to the shared-memory segment {_shm_path(seg.name or '')}",
                op="init", missing=missing)
        time.sleep(delay)
        delay = min(delay * 1.5, 0.01)
    attached.done()
    # Everybody mapped it: the name is no longer needed.
    if seg.name is not None:
        _unlink_if_ours(_shm_path(seg.name), seg.inode)
    # A peer that attached and already closed cleanly (it had nothing to say to us) is
    # fine; one that failed is not.
    for r in range(size):
        if u64[lay.ctrl_word(r, W_STATE)] == STATE_FAILED:
            raise PeerError(f"{where}: rank {r} failed while the group was being set up",
                            peer=r)
