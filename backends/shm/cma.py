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
raises (``Phases.await_pushers``, at most the group's timeout). So nothing is written into an
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
size; the large all_to_all reads its parts the same way, with this group's vote and
probe (:mod:`backends.shm.cma_all_to_all`); ``reduce`` (one root) and the other
collectives keep theirs.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any, Optional

import numpy as np

from collectives import settings
from collectives.errors import CollectiveError, PeerError
from collectives.reduce_op import ReduceOp

from .codes import OP_ALL_REDUCE, piece_bounds

#: all_reduce messages of at least this many bytes, times ``size // 2``, read the peers'
#: memory directly where the group votes for it (cma_from_bytes): below it staging's
#: copies stay in cache and win; the line grows with the ranks because each rank's share
#: of the kernel's copies does (measured in docs/performance.md).
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
#: Only the read is timed: a write through the kernel costs the same or less. The
#: measurements behind the rungs are in docs/performance.md.
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


class SingleCopy:
    """One group's single-copy all_reduce (see the module docstring): whether the group
    decided for it (``decided``: None until its first large all_reduce, then True or
    False alike on every rank) and from which size (``min_bytes``, raised alike on every
    rank by the votes). ``owner`` is the backend, ``phases`` and ``core`` its protocol
    and path, ``mod`` the compiled core's module (None: this rank cannot read its
    peers' memory and votes against)."""

    def __init__(self, owner: Any, phases: Any, core: Any, mod: Any) -> None:
        self.owner, self.ph, self.core, self.mod = owner, phases, core, mod
        self.decided: Optional[bool] = None
        self.min_bytes = cma_min_bytes(owner.size)
        #: A byte the peers' probe reads where this rank publishes no array of its own
        #: (an all_to_all's empty input): the probe must try every pair of ranks.
        self.anchor = np.zeros(1, np.uint8)

    def line(self) -> int:
        """This rank's vote in phase 1: the smallest message it reads its peers' memory
        for (0: none, it cannot or must not)."""
        ph = self.ph
        if not (self.mod is not None and sys.platform.startswith("linux")
                and all(ph.pid_checkable[r] for r in ph.peers)):
            return 0
        setting = settings.SHM_CMA.get()
        if setting == "0":
            return 0
        if setting == "1":
            return cma_min_bytes(ph.size)
        # The process's line is for two ranks; more ranks move it up as they do the
        # lowest one (cma_min_bytes; measured at CMA_ALL_REDUCE_BYTES).
        return cma_from_bytes(self.mod) * max(1, ph.size // 2)

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """all_reduce of the flat ``a`` through the peers' memory; False (having agreed
        on it with every rank) where the pipelined path must run instead.

        From the moment this rank publishes the address of ``a``, peers may write into
        it (the reduced pieces they own), so this rank leaves only when none does any
        more: by the last phase (every rank finished), or, on an error, through the
        caller's ``Phases.fail`` (every caller has one), which marks it failed (a peer
        checks that before every block it writes) and waits for a block in flight."""
        ph, core = self.ph, self.core
        n, me = ph.size, ph.rank
        ph.start(OP_ALL_REDUCE, seq, a.dtype, a.nbytes, -1, op)
        q = ph.enter()
        words = ph.sv(q & 1, me, np.uint64)
        words[0] = a.ctypes.data
        words[1] = self.line()
        core.exchange(q)
        published = [ph.sv(q & 1, r, np.uint64) for r in range(n)]
        addrs = [int(w[0]) for w in published]
        lines = [int(w[1]) for w in published]
        if not all(lines):
            self.decided = False
            return False
        line = max(lines)   # (the same words on every rank: the same line everywhere)
        self.min_bytes = max(self.min_bytes, line)
        if a.nbytes < line:
            return False
        if self.decided is None:
            self.decided = self.probe(addrs)
            if not self.decided:
                return False
        itemsize = a.itemsize
        k0, k1 = piece_bounds(a.size, n, itemsize)[me]
        if k1 > k0:
            rc = core.cma_reduce(a[k0:k1], ph.pids, [x + k0 * itemsize for x in addrs], op)
            self.check(rc, "reading the peers' pieces or writing them the result")
        core.exchange(ph.enter())
        return True

    def probe(self, addrs: list) -> bool:
        """Phase 2 of a group's first single-copy all_reduce (or phase 3 of its first
        single-copy all_to_all, :mod:`backends.shm.cma_all_to_all`): can every rank read
        a byte of every peer's array at ``addrs``, and write through the kernel at all? Decided alike on every rank. The write goes to
        this rank's own memory: the kernel checks a write into a peer exactly as a read
        of it (ptrace access mode ATTACH for both), while a seccomp filter may allow one
        call and not the other; and nothing may be written into a peer that could have
        left the call."""
        ph, mod = self.ph, self.mod
        probe, target = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
        ok = all(mod.cma_read(probe, ph.pids[r], addrs[r]) == 0 for r in ph.peers) \
            and mod.cma_write(probe, os.getpid(), target.ctypes.data) == 0
        q = ph.enter()
        ph.sv(q & 1, ph.rank, np.uint64)[0] = int(ok)
        self.core.exchange(q)
        return all(int(ph.sv(q & 1, r, np.uint64)[0]) for r in range(ph.size))

    def check(self, rc: int, what: str) -> None:
        """Raise for a failed copy: PeerError for a peer that failed or closed (the core's
        ECANCELED: it stopped writing into it) or that is gone (the kernel's ESRCH),
        else CollectiveError with the kernel's reason."""
        if not rc:
            return
        ph = self.ph
        if rc == -errno.ECANCELED:
            ph.raise_failed_peer()
        if rc == -errno.ESRCH:
            # The peer's memory is gone: it is exiting. Name it once it is a zombie, as
            # the other ranks' own liveness checks will, so that every rank names the
            # dead one (this rank's failure, published now, would name this rank).
            deadline = time.monotonic() + _EXIT_GRACE
            while time.monotonic() < deadline:
                ph.raise_if_a_peer_died(ph.op_name, ph.op_seq)
                time.sleep(0.002)
            probe = np.zeros(1, np.uint8)
            gone = [r for r in ph.peers
                    if self.mod.cma_read(probe, ph.pids[r], 0) == -errno.ESRCH]
            if gone:
                raise PeerError(f"{ph.owner.where(ph.op_name)} (seq {ph.op_seq}): rank "
                                f"{gone[0]} (pid {ph.pids[gone[0]]}) is exiting",
                                peer=gone[0])
        raise CollectiveError(
            f"{ph.owner.where(ph.op_name)} (seq {ph.op_seq}): {what} failed: "
            f"{os.strerror(-rc)} (with {CMA_ENV}=0 on any rank its groups stage through "
            f"shared memory instead)")
