"""The large all_reduce of the shm backend in one copy: cross-memory attach (CMA).

The pipelined path (``reduce.py``) stages every byte through the shared segment: a copy
in, the reduction, a copy out, about 4 times the message in memory traffic per rank (two
ranks). Linux lets a process read and write another's memory directly
(``process_vm_readv`` / ``process_vm_writev``: the kernel copies between the peer's pages
and ours, as MPICH's and Open MPI's CMA transports do), so where the ranks may (same
user, ptrace rules, one PID namespace) the all_reduce of ``a`` works on the peers'
arrays where they lie:

1. phase 1 (needed every call anyway: the addresses change, and a peer must have entered
   the call before its array may be touched): every rank publishes the address of ``a``
   and its *line*, the smallest message it reads in place (0: it cannot: the compiled
   core not loaded, a peer's pid not visible, ``COLLECTIVES_SHM_CMA=0``, a kernel's copy
   too slow at every size; else the size from which :func:`cma_from_bytes` found the
   kernel's copy paying for two ranks, times ``n // 2``, or ``cma_min_bytes(n)`` with
   ``COLLECTIVES_SHM_CMA=1``); all ranks read the same words, so they all decide alike.
   A 0 turns the path off for the group, on every rank; else the group's line is the
   largest published, and a message below it takes the pipelined path (and later ones
   below it do not ask again: every rank raised its ``_cma_bytes`` alike). The first
   time all can, each also reads a byte of every peer's array and writes a byte of its
   own through the kernel, and publishes whether that worked (phase 2): a kernel that
   forbids it turns the path off for the group, on every rank, and that call and every
   later one take the pipelined path.
2. reduce and push: rank k owns piece k of ``a`` (n aligned pieces). Block by block (a
   quarter MiB, so it stays in cache) it reads piece k of every peer's array, reduces
   them with its own in rank order into its own array, and writes the reduced block into
   piece k of every peer's array (the core's ``Group.cma_reduce``, GIL released). Piece
   k of any array is touched by rank k alone during the call (its owner reads a block
   there before it writes that block), so nothing races.
3. phase: every owner is done, so every array holds the whole result; each rank may
   return and reuse its array.

A rank that leaves with an error instead (a timeout, a failed peer, a failed copy) may
have peers still writing into its array: before each block it writes, a peer stores
whom it writes into (``W_PUSHING``) and then checks that this rank has not failed, and
this rank marks itself failed and then waits for any block in flight into it before it
raises (``pushing.py``, at most the group's timeout). So nothing is written into an
array once its call has returned, error or not, unless a peer stops in the middle of a
block for longer than the timeout (``tests/test_shm_cma.py`` has a rank write 2.5 s late).

Each element is reduced once, by its owner, in rank order, by the same kernels as the
other paths: the ranks get bitwise-identical results, bitwise those of the pipelined
path. Traffic per rank: the peers' pieces read once, the reduction, the reduced piece
written to each peer from the cache, about 3 times the message, and two phases. Reading
the reduced pieces back after a third phase instead (as this path did at first) took
20-25% longer from 2 MiB: those reads came from memory. Messages of
``cma_min_bytes(n)`` and more take this path (1.5 MiB at 2 ranks; more with more ranks,
whose pieces are smaller and whose reads are more) where every rank votes for it at that
size; ``reduce`` (one root) and the other collectives keep theirs.
"""

from __future__ import annotations

import errno
import os
import sys
import time

import numpy as np

from collectives import settings
from collectives.errors import CollectiveError, PeerError
from collectives.reduce_op import ReduceOp

from .ops import _DTYPE_CODE, _REDOP_BY_ID, OP_ALL_REDUCE, piece_bounds

#: all_reduce messages of at least this many bytes, times ``size // 2``, read the peers'
#: memory directly where the group votes for it (cma_from_bytes). Measured on 2 cores,
#: the paths timed in turn: on the machine the path was built on (reading the reduced
#: pieces back, before they were pushed) staging was 13% faster at 1 MiB (336 vs 384 us,
#: 320 vs 366 us), even at 1.5 MiB, 10-25% slower from 2 MiB; on a later VM, pushing,
#: the two tied at 1 MiB (131-133 vs 125-142 us) and the single copy won from 1.5 MiB. At
#: 4 ranks (oversubscribed) on that VM, staging kept 1 and 2 MiB (483-494 vs 502-517 us,
#: 957-999 vs 991-996) and the single copy won from 4 MiB (1.49-1.51 vs 1.76-1.78 ms; 8
#: MiB 2.63-2.69 vs 3.49-3.55): the line times ``size // 2``.
CMA_ALL_REDUCE_BYTES = 3 << 19
#: ``0``: this rank votes against the single-copy path (and so turns it off for its
#: groups); ``1``: for it from ``cma_min_bytes(n)``, whatever the kernel's speed; unset:
#: for it where the kernel copies fast enough (:func:`cma_from_bytes`).
CMA_ENV = settings.SHM_CMA.name
#: The kernel's copy between processes may cost at most this many times a user-space copy
#: of the same bytes, timed at 1 MiB, for the single copy to pay from
#: :data:`CMA_ALL_REDUCE_BYTES`. Per rank and message M (2 ranks), staging moves about 4 M
#: in user space (copy in M/2, reduce: read M, write M, copy out M/2); the single copy
#: about 1.5 M in user space (reduce M/2 + M/2 into M/2) and 2 M through the kernel (a
#: read of M/2, a write of M/2): 1.5 + 2k < 4 where k is the kernel's cost per byte
#: against memcpy's.
CMA_MAX_COST = 1.25
#: The rungs :func:`cma_from_bytes` climbs: (bytes timed, the most the kernel's copy may
#: cost against memcpy there, the smallest all_reduce it then votes to read in place).
#: The kernel's copy has a cost per page that memcpy of a message in cache does not;
#: against memcpy of a larger one, which goes to memory, it catches up, and staging
#: costs more than its bytes say there (a phase per chunk, chunks that leave the cache).
#: Measured on 2-vCPU VMs (two ranks, float32 sum, the paths in turn in one session):
#:
#: - the kernel's copy 1.5-1.8 times memcpy at 1 MiB, 1.2-1.37 at 2 MiB, 1.2-1.3 at 4
#:   MiB (each rank of a fresh job timing it): the single copy took 1.5 MiB in 189 us
#:   against 198-223 staged, 2 MiB in 230-251 against 269-299, 4 MiB in 375-385 against
#:   527-602 (MPI's 508-627), 16 MiB in 1.19 ms against 2.1-2.3;
#: - on the VM before it, 1.6-1.8 times at 1 MiB, 1.3 at 4 MiB and 1.0-1.1 at 8 MiB: the
#:   single copy then (reading the reduced pieces back rather than pushing them, 20-25%
#:   slower than now) tied staging at 4 MiB and won by 1.3-1.7 times at 16 MiB;
#: - on the VM of the README's first figures, 3.5-5 times at 1 MiB: staging won at every
#:   size.
#:
#: Only the read is timed: a write through the kernel cost the same or less (on the VM
#: of the first point, 1.6 against 1.7 times memcpy at 2 MiB, 1.06 against 1.32 at 4).
SPEED_LADDER = (
    (1 << 20, CMA_MAX_COST, CMA_ALL_REDUCE_BYTES),
    (2 << 20, 1.4, 2 << 20),
    (4 << 20, 1.5, 4 << 20),
    (8 << 20, 1.5, 8 << 20),
)
#: The bytes of the first rung (the default of :func:`cma_cost_ratio`).
_PROBE_BYTES = SPEED_LADDER[0][0]

#: Timings of each size in :func:`cma_from_bytes` (the least of so many of each copy).
PROBE_ROUNDS = 5
#: This process's line (:func:`cma_from_bytes`), once measured.
_from_bytes: "int | None" = None
#: What :func:`cma_from_bytes` measured: probe bytes -> the kernel's cost against memcpy.
measured: dict[int, float] = {}
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


def cma_from_bytes(mod) -> int:
    """The smallest all_reduce this process votes to read in place on speed, for two
    ranks (0: none), measured once per process when its first group on the core is made
    (outside any collective, so that peers waiting in a phase do not share the cores
    with it).

    It climbs :data:`SPEED_LADDER` and stops at the first rung where the kernel's copy
    costs at most the rung's bound against memcpy (:data:`PROBE_ROUNDS` timings of each
    copy per rung: a few milliseconds at 1 MiB, about 25 ms for all four); what it
    measured stays in :data:`measured`."""
    global _from_bytes
    if _from_bytes is None:
        _from_bytes = 0
        for probe, bound, line in SPEED_LADDER:
            ratio = measured[probe] = cma_cost_ratio(mod, probe, PROBE_ROUNDS)
            if ratio <= bound:
                _from_bytes = line
                break
    return _from_bytes


def cma_min_bytes(size: int) -> int:
    """The smallest all_reduce a group of ``size`` ranks reads in place (where the
    kernel's copy pays from 1 MiB, :func:`cma_from_bytes`, or it is told to).

    >>> cma_min_bytes(2) == cma_min_bytes(3) == CMA_ALL_REDUCE_BYTES == 1536 * 1024
    True
    """
    return CMA_ALL_REDUCE_BYTES * max(1, size // 2)


class CmaReduce:
    """Mixed into ShmGroup: ``_cma_all_reduce``. ``_cma`` is None until the group's first
    large all_reduce decided, then True or False alike on every rank."""

    _cma = None

    def _cma_line(self) -> int:
        """This rank's vote in phase 1: the smallest message it reads its peers' memory
        for (0: none, it cannot or must not)."""
        if not (self._native is not None and sys.platform.startswith("linux")
                and all(self._pid_checkable[r] for r in self._peers)):
            return 0
        setting = settings.SHM_CMA.get()
        if setting == "0":
            return 0
        if setting == "1":
            return cma_min_bytes(self.size)
        # The process's line is for two ranks; more ranks move it up as they do the
        # lowest one (cma_min_bytes; measured at CMA_ALL_REDUCE_BYTES).
        return cma_from_bytes(self._native_module) * max(1, self.size // 2)

    def _cma_all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """all_reduce of the flat ``a`` through the peers' memory; False (having agreed
        on it with every rank) where the pipelined path must run instead.

        From the moment this rank publishes the address of ``a``, peers may write into
        it (the reduced pieces they own), so this rank leaves only when none does any
        more: by the last phase (every rank finished), or, on an error, through the
        caller's ``_fail`` (every caller has one), which marks it failed (a peer checks
        that before every block it writes) and waits for a block in flight
        (``pushing.py``)."""
        n, me = self.size, self.rank
        self._start(OP_ALL_REDUCE, seq, a.dtype, a.nbytes, -1, op)
        q = self._enter()
        words = self._sv(q & 1, me, np.uint64)
        words[0] = a.ctypes.data
        words[1] = self._cma_line()
        self._exchange(q)
        published = [self._sv(q & 1, r, np.uint64) for r in range(n)]
        addrs = [int(w[0]) for w in published]
        lines = [int(w[1]) for w in published]
        if not all(lines):
            self._cma = False
            return False
        line = max(lines)   # (the same words on every rank: the same line everywhere)
        self._cma_bytes = max(self._cma_bytes, line)
        if a.nbytes < line:
            return False
        if self._cma is None:
            self._cma = self._cma_probe(self._native_module, addrs)
            if not self._cma:
                return False
        itemsize = a.itemsize
        k0, k1 = piece_bounds(a.size, n, itemsize)[me]
        if k1 > k0:
            rc = self._native.cma_reduce(a[k0:k1], self._pids,
                                         [x + k0 * itemsize for x in addrs],
                                         _DTYPE_CODE.get(a.dtype, 0), _REDOP_BY_ID[id(op)])
            self._cma_check(rc, "reading the peers' pieces or writing them the result")
        self._exchange(self._enter())
        return True

    def _cma_probe(self, mod, addrs: list) -> bool:
        """Phase 2 of a group's first single-copy all_reduce: can every rank read a byte
        of every peer's array, and write through the kernel at all? Decided alike on
        every rank. The write goes to this rank's own memory: the kernel checks a write
        into a peer exactly as a read of it (ptrace access mode ATTACH for both), while a
        seccomp filter may allow one call and not the other; and nothing may be written
        into a peer that could have left the call."""
        probe, target = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
        ok = all(mod.cma_read(probe, self._pids[r], addrs[r]) == 0 for r in self._peers) \
            and mod.cma_write(probe, os.getpid(), target.ctypes.data) == 0
        q = self._enter()
        self._sv(q & 1, self.rank, np.uint64)[0] = int(ok)
        self._exchange(q)
        return all(int(self._sv(q & 1, r, np.uint64)[0]) for r in range(self.size))

    def _cma_check(self, rc: int, what: str) -> None:
        """Raise for a failed copy: PeerError for a peer that failed or closed (the core's
        ECANCELED: it stopped writing into it) or that is gone (the kernel's ESRCH),
        else CollectiveError with the kernel's reason."""
        if not rc:
            return
        if rc == -errno.ECANCELED:
            self._raise_failed_peer()
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
                raise PeerError(f"{self.where(self._op_name)} (seq {self._op_seq}): rank "
                                f"{gone[0]} (pid {self._pids[gone[0]]}) is exiting",
                                peer=gone[0])
        raise CollectiveError(
            f"{self.where(self._op_name)} (seq {self._op_seq}): {what} failed: "
            f"{os.strerror(-rc)} (with {CMA_ENV}=0 on any rank its groups stage through "
            f"shared memory instead)")
