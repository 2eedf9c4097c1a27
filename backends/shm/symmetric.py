"""The shm backend's symmetric memory (contract: :mod:`collectives.symmetric`): a buffer
of each rank in a shared file that every peer maps, and the all_reduce that reads the
peers' buffers where they lie.

Allocation (a collective; every rank calls it alike): each rank creates
``/dev/shm/collectives-<job>-<group>.sym<i>.r<rank>``, reserves its pages
(``posix_fallocate``: a full /dev/shm is a refusal now, not a SIGBUS at the first
write) and maps it; an all_gather of the sizes (equal, or ``ValueError`` on every rank)
and of whether that worked; each rank maps its peers' files read-only; an all_gather of
whether that worked (also the barrier after which the names may go); each rank unlinks
its own name. Where any rank failed, every rank returns plain memory instead (and a
warning says why): the buffer works, nothing is read in place. From then on nothing is
visible in /dev/shm, as with the group's segment; the launcher removes what a rank
killed in between left behind (the name carries the job's digest). A buffer and the
peers' mappings of it live until the group closes (there is no free); the rank's own
array stays valid after that.

The all_reduce (past the one-phase size) of an array lying in buffer ``i`` at offset
``o`` on this rank:

1. phase: every rank publishes ``(i + 1, o)`` (0 where its array is not in a buffer);
   all read the same words, so all decide alike. Unless every rank published the same
   nonzero pair the call goes on by the usual paths (single-copy or pipelined), having
   cost one phase.
2. reduce-scatter: rank k owns piece k; it reduces piece k of every rank's buffer, in
   rank order, into its own (``ReduceOps._rank_order_reduce``: the core's ``combine``,
   GIL released; plain loads from the peers' mappings). Nobody writes a piece another rank reads in this phase.
3. phase; all-gather: rank k copies each peer's reduced piece into its own buffer.
4. phase: every rank finished reading, so each may return and reuse its array.

The same pieces and the same kernels as the other paths, each element reduced once by
its owner in rank order: bitwise the results of the single-copy path. Traffic per rank,
two ranks: the reduction of half the message (two reads, one write) and a copy of the
other half: about 2.5 times the message, against 3 (single copy, through the kernel)
and 4.5 (staged through the segment).
"""

from __future__ import annotations

import mmap
import os
import warnings
import numpy as np

from collectives.reduce_op import ReduceOp
from collectives.shm_names import SHM_DIR, segment_name

from .ops import OP_ALL_REDUCE, piece_bounds


#: Set in the root field of the vote phase's fingerprint (an all_reduce has no root),
#: so that ranks that disagree on whether to vote fail loudly instead of reading each
#: other's words of another phase.
_VOTE_MARK = 0xFFFF << 16


class SymmetricHeap:
    """Mixed into ShmGroup: ``_alloc_symmetric`` and ``_symmetric_all_reduce``."""

    #: One entry per non-empty buffer: (its first address here, nbytes, every rank's
    #: mapping of it as uint8 arrays, this rank's own at its index). Allocation is
    #: collective, so every rank holds as many, in the same order.
    _symmetric: tuple = ()
    _symmetric_count = 0

    def _alloc_symmetric(self, nbytes: int, where: str) -> np.ndarray:
        index = self._symmetric_count
        self._symmetric_count += 1
        if self.size == 1:
            return super()._alloc_symmetric(nbytes, where)  # nothing to share
        own = self._symmetric_path(index, self.rank)
        mine, why = self._create_own(own, nbytes) if nbytes else (None, "")
        views = None
        try:
            # Vote 1: every rank's size, and whether its file exists with its pages
            # reserved (sizes first: a rank asking for 0 bytes still takes part).
            sizes = self._all_ranks([nbytes, int(mine is not None or not nbytes)])
            if len({int(v) for v in sizes[:, 0]}) != 1:
                raise ValueError(f"{where}: every rank must ask for the same `nbytes`; "
                                 f"the ranks asked for {sizes[:, 0].tolist()}")
            if nbytes == 0:
                return super()._alloc_symmetric(0, where)
            if sizes[:, 1].all():
                try:
                    views = [np.frombuffer(mine, np.uint8) if r == self.rank
                             else self._map_peer(r, index, nbytes) for r in range(self.size)]
                except OSError as exc:
                    views, why = None, f"mapping a peer's buffer failed: {exc}"
            # Vote 2 (also the barrier after which the names may go): did everyone map
            # everyone? Otherwise every rank falls back alike.
            mapped = self._all_ranks([int(views is not None)])
        finally:
            try:
                os.unlink(own)
            except FileNotFoundError:
                pass
        if not mapped.all():
            # The ranks to blame: those that could not create their file, else those
            # that could not map a peer's (the others did not try to map).
            bad = ([r for r in range(self.size) if not sizes[r, 1]]
                   or [r for r in range(self.size) if not mapped[r, 0]])
            if why:
                warnings.warn(f"{where}: {why}; every rank uses plain memory for this "
                              f"buffer (nothing read in place)", RuntimeWarning, stacklevel=3)
            elif self.rank == min(r for r in range(self.size) if r not in bad):
                warnings.warn(f"{where}: rank(s) {bad} could not share {nbytes} bytes "
                              f"(see their warnings); every rank uses plain memory for "
                              f"this buffer", RuntimeWarning, stacklevel=3)
            return super()._alloc_symmetric(nbytes, where)
        buf = views[self.rank]
        self._symmetric = self._symmetric + ((buf.ctypes.data, nbytes, views),)
        return buf

    def _all_ranks(self, values: list) -> np.ndarray:
        """``values`` (ints) of every rank, one row per rank (an all_gather)."""
        mine = np.array(values, np.int64)
        every = np.zeros(self.size * mine.size, np.int64)
        self.all_gather(every, mine)
        return every.reshape(self.size, mine.size)

    def _create_own(self, path: str, nbytes: int) -> tuple:
        """(this rank's mapping of a new file of ``nbytes`` at ``path``, "") or (None, why).
        The pages are reserved now (``posix_fallocate``): a full /dev/shm is a refusal
        here, not a SIGBUS at the first write into the buffer (a training step)."""
        try:
            fd = self._create_exclusive(path)
        except OSError as exc:
            return None, f"creating {path} failed: {exc}"
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE), ""
        except OSError as exc:
            return None, (f"reserving {nbytes} bytes in {SHM_DIR} failed: {exc} (a "
                          f"container's /dev/shm is often 64 MiB: raise --shm-size)")
        finally:
            os.close(fd)

    def _symmetric_path(self, index: int, rank: int) -> str:
        return os.path.join(SHM_DIR, segment_name(self._job_id or "",
                                                  f"{self._key}.sym{index}.r{rank}"))

    @staticmethod
    def _create_exclusive(path: str) -> int:
        """A new file at ``path`` (replacing one a killed run of the same job left)."""
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            os.unlink(path)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def _map_peer(self, r: int, index: int, nbytes: int) -> np.ndarray:
        fd = os.open(self._symmetric_path(index, r), os.O_RDONLY)
        try:
            return np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ),
                                 np.uint8)
        finally:
            os.close(fd)

    def _symmetric_place(self, a: np.ndarray) -> tuple[int, int]:
        """(buffer index + 1, offset) of ``a`` in this rank's buffers; (0, 0) if outside."""
        lo = a.ctypes.data
        hi = lo + a.nbytes
        for i, (start, nbytes, _) in enumerate(self._symmetric):
            if start <= lo and hi <= start + nbytes:
                return i + 1, lo - start
        return 0, 0

    def _symmetric_all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """all_reduce of the flat ``a`` read in place from every rank's buffer; False
        (agreed with every rank) where ``a`` is not at one place in all of them."""
        n, me = self.size, self.rank
        self._start(OP_ALL_REDUCE, seq, a.dtype, a.nbytes, -1, op)
        where = self._symmetric_place(a)
        fp0 = self._fp0
        self._fp0 = fp0 | _VOTE_MARK  # a rank in another path's first phase: a mismatch
        q = self._enter()
        words = self._sv(q & 1, me, np.uint64)
        words[0], words[1] = where
        self._exchange(q)
        self._fp0 = fp0
        if where[0] == 0 or any((int(w[0]), int(w[1])) != where for w in
                                (self._sv(q & 1, r, np.uint64) for r in self._peers)):
            return False
        lo = where[1]
        views = [a if r == me else
                 self._symmetric[where[0] - 1][2][r][lo:lo + a.nbytes].view(a.dtype)
                 for r in range(n)]
        bounds = piece_bounds(a.size, n, a.itemsize)
        k0, k1 = bounds[me]
        if k1 > k0:
            piece = a[k0:k1]
            self._rank_order_reduce(piece, [piece if r == me else v[k0:k1]
                                            for r, v in enumerate(views)], op)
        self._exchange(self._enter())
        for r in self._peers:
            r0, r1 = bounds[r]
            if r1 > r0:
                np.copyto(a[r0:r1], views[r][r0:r1])
        self._exchange(self._enter())
        return True

    def _release_symmetric(self) -> None:
        """At close: forget the peers' mappings (they unmap once unreferenced). This
        rank's own buffers stay valid: their arrays hold their mappings."""
        self._symmetric = ()

