"""The shm backend's symmetric memory (contract: :mod:`collectives.symmetric`): a buffer
of each rank in a shared file that every peer maps, and the all_reduce that reads the
peers' buffers where they lie.

Allocation (a collective; every rank calls it alike): each rank creates
``/dev/shm/collectives-<job>-<group>.sym<i>.r<rank>``, sizes it and maps it; an
all_gather of the sizes (equal, or ``ValueError`` on every rank); each rank maps its
peers' files read-only; a barrier; each rank unlinks its own name. From then on nothing
is visible in /dev/shm, as with the group's segment; the launcher removes what a rank
killed in between left behind (the name carries the job's digest).

The all_reduce (past the one-phase size) of an array lying in buffer ``i`` at offset
``o`` on this rank:

1. phase: every rank publishes ``(i + 1, o)`` (0 where its array is not in a buffer);
   all read the same words, so all decide alike. Unless every rank published the same
   nonzero pair the call goes on by the usual paths (single-copy or pipelined), having
   cost one phase.
2. reduce-scatter: rank k owns piece k; it reduces piece k of every rank's buffer, in
   rank order, into its own (``combine``, GIL released; plain loads from the peers'
   mappings). Nobody writes a piece another rank reads in this phase.
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
import numpy as np

from collectives.reduce_op import ReduceOp, finish
from collectives.shm_names import SHM_DIR, segment_name

from .ops import _ALIGN, _DTYPE_CODE, _REDOP_BY_ID, OP_ALL_REDUCE


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
        if self.size == 1 or nbytes == 0:
            return np.zeros(nbytes, np.uint8)  # nothing to share (same on every rank)
        own = self._symmetric_path(index, self.rank)
        fd = self._create_exclusive(own)
        try:
            try:
                os.ftruncate(fd, nbytes)
                mine = mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            sizes = np.zeros(self.size, np.int64)
            self.all_gather(sizes, np.array([nbytes], np.int64))
            if len(set(sizes.tolist())) != 1:
                raise ValueError(f"{where}: every rank must ask for the same `nbytes`; "
                                 f"the ranks asked for {sizes.tolist()}")
            views = [np.frombuffer(mine, np.uint8) if r == self.rank
                     else self._map_peer(r, index, nbytes) for r in range(self.size)]
            self.barrier()  # every peer mapped this rank's file: its name may go
        finally:
            try:
                os.unlink(own)
            except FileNotFoundError:
                pass
        buf = views[self.rank]
        self._symmetric = self._symmetric + ((buf.ctypes.data, nbytes, views),)
        return buf

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
        q = self._enter()
        words = self._sv(q & 1, me, np.uint64)
        words[0], words[1] = where
        self._exchange(q)
        if where[0] == 0 or any((int(w[0]), int(w[1])) != where for w in
                                (self._sv(q & 1, r, np.uint64) for r in self._peers)):
            return False
        lo = where[1]
        views = [a if r == me else
                 self._symmetric[where[0] - 1][2][r][lo:lo + a.nbytes].view(a.dtype)
                 for r in range(n)]
        align = max(1, _ALIGN // a.itemsize)
        part = ((a.size + n - 1) // n + align - 1) // align * align
        bounds = [(min(a.size, k * part), min(a.size, (k + 1) * part)) for k in range(n)]
        k0, k1 = bounds[me]
        if k1 > k0:
            piece = a[k0:k1]
            self._reduce_piece(piece, [piece if r == me else v[k0:k1]
                                       for r, v in enumerate(views)], op)
        self._exchange(self._enter())
        for r in self._peers:
            r0, r1 = bounds[r]
            if r1 > r0:
                np.copyto(a[r0:r1], views[r][r0:r1])
        self._exchange(self._enter())
        return True

    def _reduce_piece(self, out: np.ndarray, srcs: list, op: ReduceOp) -> None:
        """``out`` (one of ``srcs``) = the rank-order reduction of ``srcs``."""
        combine = self._native_combine
        if combine is not None:  # the compiled core: any source may be `out`
            combine(out, srcs, _DTYPE_CODE.get(out.dtype, 0), _REDOP_BY_ID[id(op)], len(srcs))
            return
        from .reduce import _KERNEL_BY_ID
        kernel = _KERNEL_BY_ID[id(op)]
        srcs = [s.copy() if s is out else s for s in srcs]  # numpy: `out` is overwritten
        kernel(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            kernel(out, s, out=out)
        finish(op, out, len(srcs))

    def _release_symmetric(self) -> None:
        """At close: forget the peers' mappings (they unmap once unreferenced). This
        rank's own buffers stay valid: their arrays hold their mappings."""
        self._symmetric = ()

