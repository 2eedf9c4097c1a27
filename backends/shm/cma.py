"""The large all_reduce of the shm backend in one copy: cross-memory attach (CMA).

The pipelined path (``reduce.py``) stages every byte through the shared segment: a copy
in, the reduction, a copy out, about 4.5 times the message in memory traffic per rank
(two ranks). Linux lets a process read another's memory directly
(``process_vm_readv``, the kernel copying from the peer's pages into ours, as MPICH's
and Open MPI's CMA transports do), so where the ranks may (same user, ptrace rules,
one PID namespace) the all_reduce of ``a`` reads the peers' arrays where they lie:

1. phase 1 (needed every call anyway: the addresses change, and a peer must have entered
   the call before its array may be read): every rank publishes the address of ``a`` and
   whether it can take this path
   (the compiled core loaded, every peer's pid visible, and the kernel's copy fast
   enough here: :func:`cma_pays_off`, or ``COLLECTIVES_SHM_CMA`` ``1``, not ``0``);
   all ranks read the same words, so they all decide alike. The first time
   all can, each also reads a word of every peer's array and publishes whether that
   worked (phase 2): a kernel that forbids it turns the path off for the group, on
   every rank, and that call and every later one take the pipelined path.
2. reduce-scatter: rank k owns piece k of ``a`` (n aligned pieces); it reads piece k of
   every peer's array block by block (a quarter MiB, so the copies stay in cache) and
   reduces them with its own in rank order, in place (``_native.cma_reduce``, GIL
   released). Nobody writes a piece another rank reads: rank r writes only piece r.
3. phase: every owner is done. all-gather: rank k reads each peer's reduced piece
   straight into ``a`` (``_native.cma_read``).
4. phase: every rank finished reading, so each may return and reuse its array.

Each element is reduced once, by its owner, in rank order, by the same kernels as the
other paths: the ranks get bitwise-identical results, bitwise those of the pipelined
path. Traffic per rank: the peers' pieces read once, the reduction, the gather read once,
about 3 times the message. Messages of ``cma_min_bytes(n)`` and more take this path (1.5
MiB at 2 ranks; more with more ranks, whose pieces are smaller and whose reads are more)
where every rank votes for it; ``reduce`` (one root) and the other collectives keep theirs.
"""

from __future__ import annotations

import errno
import os
import sys
import time

import numpy as np

from collectives.errors import CollectiveError, PeerError
from collectives.reduce_op import ReduceOp

from .ops import _DTYPE_CODE, _REDOP_BY_ID, OP_ALL_REDUCE, piece_bounds

#: all_reduce messages of at least this many bytes, times ``size // 2``, read the peers'
#: memory directly where the group votes for it (cma_pays_off). Measured on 2 cores of
#: the machine it was built on (where it pays), the paths timed in turn in one job: at 2 ranks
#: staging is 13% faster at 1 MiB (twice: 336 vs 384 us, 320 vs 366 us), even at 1.5
#: MiB, 10-25% slower from 2 MiB. At 4 ranks (oversubscribed) staging was faster at 3
#: MiB (2.60 vs 3.52 ms) and 4 MiB (3.40 vs 3.66 ms) and the two within 6% of each other
#: from 6 to 16 MiB: the 3 MiB line there (this one times size // 2) is not tuned for
#: 4 ranks on 2 cores, only moved with the 2-rank one.
CMA_ALL_REDUCE_BYTES = 3 << 19
#: ``0``: this rank votes against the single-copy path (and so turns it off for its
#: groups); ``1``: for it, whatever the kernel's speed; unset: for it where the kernel
#: copies fast enough (:func:`cma_pays_off`).
CMA_ENV = "COLLECTIVES_SHM_CMA"
#: The kernel's copy between processes may cost at most this many times a user-space copy
#: of the same bytes for the single copy to pay. Per rank and message M (2 ranks), staging
#: moves about 4 M in user space (copy in M/2, reduce: read M, write M, copy out M/2); the
#: single copy about 1.5 M in user space (reduce M/2 + M/2 into M/2) and 2 M through the
#: kernel (two reads of M/2): 1.5 + 2k < 4 where k is the kernel's cost per byte against
#: memcpy's.
CMA_MAX_COST = 1.25
#: Bytes copied by each of the measurements of :func:`cma_pays_off`.
_PROBE_BYTES = 1 << 20

_pays_off: "bool | None" = None
#: Seconds a rank that found a peer's memory gone waits to see it die before it says so.
_EXIT_GRACE = 2.0


def cma_cost_ratio(mod, nbytes: int = _PROBE_BYTES, rounds: int = 3) -> float:
    """What a ``process_vm_readv`` of ``nbytes`` (this process's own memory, the path a
    peer's takes through the kernel) costs against ``np.copyto`` of as many bytes: the
    least of ``rounds`` timings each, after one of each to fault the pages in."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    pid, addr = os.getpid(), src.ctypes.data
    if mod.cma_read(dst, pid, addr) != 0:
        return float("inf")
    np.copyto(dst, src)
    kernel = user = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        mod.cma_read(dst, pid, addr)
        t1 = time.perf_counter()
        np.copyto(dst, src)
        t2 = time.perf_counter()
        kernel, user = min(kernel, t1 - t0), min(user, t2 - t1)
    return kernel / max(user, 1e-9)


def cma_pays_off(mod) -> bool:
    """Whether this process votes for the single-copy path on speed: measured once per
    process (about a millisecond), when its first group on the core is made (outside any
    collective, so that peers waiting in a phase do not share the cores with it). On the
    2-core VM of the README's figures (Linux 6.18, 4 KiB pages) the kernel's copy costs
    3.5 to 5 times memcpy's and staging won at every size and world size; on the
    machine the path was built on it won by 10-25% from 2 MiB."""
    global _pays_off
    if _pays_off is None:
        _pays_off = cma_cost_ratio(mod) <= CMA_MAX_COST
    return _pays_off


def cma_min_bytes(size: int) -> int:
    """The smallest all_reduce a group of ``size`` ranks reads in place.

    >>> cma_min_bytes(2) == cma_min_bytes(3) == CMA_ALL_REDUCE_BYTES == 1536 * 1024
    True
    """
    return CMA_ALL_REDUCE_BYTES * max(1, size // 2)


class CmaReduce:
    """Mixed into ShmGroup: ``_cma_all_reduce``. ``_cma`` is None until the group's first
    large all_reduce decided, then True or False alike on every rank."""

    _cma = None

    def _cma_able(self) -> bool:
        """Whether this rank can read its peers' memory (its vote in phase 1)."""
        if not (self._native is not None and sys.platform.startswith("linux")
                and all(self._pid_checkable[r] for r in self._peers)):
            return False
        setting = os.environ.get(CMA_ENV, "").strip()
        return setting != "0" and (setting == "1" or cma_pays_off(self._native_module))

    def _cma_all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """all_reduce of the flat ``a`` through the peers' memory; False (having agreed
        on it with every rank) where the pipelined path must run instead."""
        n, me = self.size, self.rank
        self._start(OP_ALL_REDUCE, seq, a.dtype, a.nbytes, -1, op)
        q = self._enter()
        words = self._sv(q & 1, me, np.uint64)
        words[0] = a.ctypes.data
        words[1] = int(self._cma_able())
        self._exchange(q)
        published = [self._sv(q & 1, r, np.uint64) for r in range(n)]
        addrs = [int(w[0]) for w in published]
        if not all(int(w[1]) for w in published):
            self._cma = False
            return False
        mod = self._native_module
        if self._cma is None:
            self._cma = self._cma_probe(mod, addrs)
            if not self._cma:
                return False
        itemsize = a.itemsize
        bounds = piece_bounds(a.size, n, itemsize)
        pids = self._pids
        k0, k1 = bounds[me]
        if k1 > k0:
            rc = mod.cma_reduce(a[k0:k1], pids, [x + k0 * itemsize for x in addrs], me,
                                _DTYPE_CODE.get(a.dtype, 0), _REDOP_BY_ID[id(op)])
            self._cma_check(rc, "reading the peers' pieces")
        self._exchange(self._enter())
        for r in self._peers:
            r0, r1 = bounds[r]
            if r1 > r0:
                self._cma_check(mod.cma_read(a[r0:r1], pids[r], addrs[r] + r0 * itemsize),
                                f"reading rank {r}'s reduced piece")
        self._exchange(self._enter())
        return True

    def _cma_probe(self, mod, addrs: list) -> bool:
        """Phase 2 of a group's first single-copy all_reduce: can every rank read a word
        of every peer's array? Decided alike on every rank."""
        probe = np.zeros(1, np.uint8)
        ok = all(mod.cma_read(probe, self._pids[r], addrs[r]) == 0 for r in self._peers)
        q = self._enter()
        self._sv(q & 1, self.rank, np.uint64)[0] = int(ok)
        self._exchange(q)
        return all(int(self._sv(q & 1, r, np.uint64)[0]) for r in range(self.size))

    def _cma_check(self, rc: int, what: str) -> None:
        """Raise for a failed read: PeerError for a peer that is gone (the kernel's
        ESRCH), else CollectiveError with the kernel's reason."""
        if not rc:
            return
        if rc == -errno.ESRCH:
            # The peer's memory is gone: it is exiting. Name it once it is a zombie, as
            # the other ranks' own liveness checks will, so that every rank names the
            # dead one (this rank's failure, published now, would name this rank).
            deadline = time.monotonic() + _EXIT_GRACE
            while time.monotonic() < deadline:
                self._raise_if_a_peer_died(self._op_name, self._op_seq)
                time.sleep(0.002)
            probe = np.zeros(1, np.uint8)
            gone = [r for r in self._peers
                    if self._native_module.cma_read(probe, self._pids[r], 0) == -errno.ESRCH]
            if gone:
                raise PeerError(f"{self._where(self._op_name)} (seq {self._op_seq}): rank "
                                f"{gone[0]} (pid {self._pids[gone[0]]}) is exiting",
                                peer=gone[0])
        raise CollectiveError(
            f"{self._where(self._op_name)} (seq {self._op_seq}): {what} failed: "
            f"{os.strerror(-rc)} (with {CMA_ENV}=0 on any rank its groups stage through "
            f"shared memory instead)")
