"""Sleeping on a 32-bit word of shared memory without burning a core.

Linux: the ``futex`` system call through ctypes (``FUTEX_WAIT``/``FUTEX_WAKE``, the
*shared* variants: the PRIVATE ones only work inside one process). Elsewhere, or with
``COLLECTIVES_SHM_WAIT=sleep``, short sleeps that grow to about a millisecond.

ctypes releases the GIL around the call, so a thread asleep in the kernel does not stop
the other threads of its process.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from typing import Optional

from collectives import settings

FUTEX_WAIT = 0
FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF

#: syscall numbers of futex(2); both architectures Linux supports here.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}

#: ``COLLECTIVES_SHM_WAIT``: ``futex`` (default where available) or ``sleep``.
WAIT_ENV = settings.SHM_WAIT.name


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on addresses inside a shared mapping."""

    def __init__(self) -> None:
        nr = _SYS_FUTEX.get(platform.machine().lower())
        if nr is None or not os.uname().sysname == "Linux":
            raise OSError("futex is only wired up for Linux on x86_64 and aarch64")
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._nr = nr
        self._fn = fn
        # Probe: a wake on a private word must succeed (returns 0 woken).
        probe = ctypes.c_uint32(0)
        if fn(nr, ctypes.addressof(probe), FUTEX_WAKE, 1, None, None, 0) < 0:
            raise OSError(ctypes.get_errno(), "futex(FUTEX_WAKE) failed")

    def wait(self, addr: int, expected: int, seconds: float) -> None:
        """Sleep while the word at ``addr`` equals ``expected``, at most ``seconds``.
        Returns on a wake, a changed value, a signal or the timeout alike: callers
        re-check their condition."""
        seconds = max(0.0, seconds)
        ts = _Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
        self._fn(self._nr, addr, FUTEX_WAIT, expected, ctypes.byref(ts), None, 0)

    def wake(self, addr: int) -> None:
        """Wake every thread of every process asleep on the word at ``addr``."""
        self._fn(self._nr, addr, FUTEX_WAKE, _WAKE_ALL, None, None, 0)


_futex: Optional[Futex] = None
_futex_error: Optional[str] = None
_futex_lock = threading.Lock()


def get_futex() -> Optional[Futex]:
    """The process's futex, or None where it is unavailable."""
    global _futex, _futex_error
    with _futex_lock:
        if _futex is None and _futex_error is None:
            try:
                _futex = Futex()
            except (OSError, AttributeError) as exc:
                _futex_error = str(exc)
        return _futex


def wait_mode() -> str:
    """``futex`` or ``sleep``: what ``COLLECTIVES_SHM_WAIT`` asks for, falling back to
    ``sleep`` where futex is unavailable."""
    mode = settings.SHM_WAIT.get()
    if mode == "futex" and get_futex() is None:
        return "sleep"
    return mode


class Doorbells:
    """One futex word ("doorbell") per rank, plus a count of its sleeping threads.

    Anyone who publishes something rank r may wait for rings r: it writes a fresh value
    into r's doorbell and, if r has a thread asleep, FUTEX_WAKEs it. A waiter reads its
    own doorbell *before* re-checking its condition and then sleeps on that value, so a
    ring in between makes the FUTEX_WAIT return at once: no lost wake-ups, no atomics.

    The value written is ``writer_rank << 20 | counter`` (counter mod 2**20, rank mod
    4096): every ring changes the word, so the waiter's old value never comes back (no
    ABA short of 2**20 rings by one writer between a waiter's read and its sleep).

    Memory ordering (x86-64, TSO): stores are seen in program order and loads are not
    reordered with older loads, so "data, then `arrived`, then doorbell" on the writer and
    "doorbell, then `arrived`, then data" on the reader need no fences. The one exception
    is store-then-load: the ringer stores the doorbell and then loads the sleeper count;
    the sleeper stores the count and then (in the kernel, after a full barrier) loads the
    doorbell. The ringer's side needs a full fence there; an uncontended
    ``threading.Lock`` acquire/release is one (a LOCK-prefixed compare-and-swap in glibc's
    semaphores, or in CPython's own mutex). aarch64 would need release/acquire fences
    around every publication as well; this backend is tested on x86-64 only.
    """

    def __init__(self, u32: memoryview, u64: memoryview, base_addr: int,
                 bell_byte_offsets: list[int], sleeper_word_index: list[int], rank: int,
                 mode: str) -> None:
        self._u32 = u32
        self._u64 = u64
        self._bell_idx = [off // 4 for off in bell_byte_offsets]
        self._bell_addr = [base_addr + off for off in bell_byte_offsets]
        self._sleep_idx = sleeper_word_index
        self._rank = rank
        self._me_bell = self._bell_idx[rank]
        self._me_addr = self._bell_addr[rank]
        self._me_sleep = sleeper_word_index[rank]
        self._counter = 0
        self._fence_lock = threading.Lock()
        self._sleepers_lock = threading.Lock()
        self._sleepers = 0
        self.mode = mode
        self._futex = get_futex() if mode == "futex" else None
        if mode == "futex" and self._futex is None:
            self.mode = "sleep"

    def current(self) -> int:
        """This rank's doorbell value, read before re-checking a condition."""
        return self._u32[self._me_bell]

    def fence(self) -> None:
        """A full memory barrier (an uncontended lock's LOCK-prefixed CAS)."""
        lock = self._fence_lock
        lock.acquire()
        lock.release()

    def ring(self, ranks) -> None:
        """Tell ``ranks`` that something they may wait for was published."""
        self._counter = (self._counter + 1) & 0xFFFFF
        value = ((self._rank & 0xFFF) << 20) | self._counter  # fits the 32-bit word
        u32, bell_idx = self._u32, self._bell_idx
        for r in ranks:
            u32[bell_idx[r]] = value
        if self._futex is None:
            return
        lock = self._fence_lock  # full fence: doorbell stores before the sleeper loads
        lock.acquire()
        lock.release()
        u64, sleep_idx = self._u64, self._sleep_idx
        for r in ranks:
            if u64[sleep_idx[r]]:
                self._futex.wake(self._bell_addr[r])

    def local_sleepers(self) -> int:
        return self._sleepers

    def sleep(self, expected: int, seconds: float) -> None:
        """Sleep until the doorbell changes from ``expected`` (or ``seconds`` pass)."""
        if self._futex is None:
            time.sleep(seconds)
            return
        with self._sleepers_lock:
            self._sleepers += 1
            self._u64[self._me_sleep] = self._sleepers
        try:
            self._futex.wait(self._me_addr, expected, seconds)
        finally:
            with self._sleepers_lock:
                self._sleepers -= 1
                self._u64[self._me_sleep] = self._sleepers
