"""The shm backend's symmetric memory (contract: :mod:`collectives.symmetric`): a buffer
of each rank in a shared file that every peer maps, and the all_reduce that reads the
peers' buffers where they lie.

Allocation (a collective; every rank calls it alike): each rank creates
``/dev/shm/collectives-<job>-<group>.sym<i>.r<rank>``, reserves its pages
(``posix_fallocate``: a full /dev/shm is a refusal now, not a SIGBUS at the first
write) and maps it; an all_gather of the sizes (equal, or ``ValueError`` on every rank)
and of whether that worked; each rank maps its peers' files (read and write: the
all_reduce below pushes results into them); an all_gather of
whether that worked (also the barrier after which the names may go); each rank unlinks
its own name. Where any rank failed, every rank returns plain memory instead (and a
warning says why): the buffer works, nothing is read in place. From then on nothing is
visible in /dev/shm, as with the group's segment; the launcher removes what a rank
killed in between left behind (the name carries the job's digest).

Lifetime: the heap keeps the peers' mappings of a buffer (in ``table``), never this
rank's own, so the own buffer is the caller's: once nothing refers to it any more (no
array, view or tensor over it; no plan, see :meth:`SymmetricHeap.plan`, and no entry of
the fast path's view cache: both are dropped at every ``alloc_symmetric``) its mapping
goes, and the group forgets its mappings of the peers' copies before it next places an
array (a large all_reduce, a persistent request) or allocates (or at close). The pages
come back once every rank has let its copy go. So a process that builds model after
model on one group (DDP makes a buffer per bucket) holds the buffers of the models
alive, not of every model ever built. The entry stays in the table as an empty
range, so every rank keeps voting in a large all_reduce (whether a rank votes depends on
the table being non-empty, which must be the same on every rank); a rank whose buffer is
gone just votes "not in a buffer" and the call takes the usual paths.

The all_reduce (past the one-phase size) of an array lying in buffer ``i`` at offset
``o`` on this rank:

1. phase: every rank publishes ``(i + 1, o)`` (0 where its array is not in a buffer);
   all read the same words, so all decide alike. Unless every rank published the same
   nonzero pair the call goes on by the usual paths (single-copy or pipelined), having
   cost one phase.
2. reduce and push: rank k owns piece k; it reduces piece k of every rank's buffer, in
   rank order, and writes the result into piece k of its own buffer and of every
   peer's (the core's ``combine`` with copies: the compiled one releases the GIL and
   copies piece by piece while the result is in cache; plain loads and stores through
   the peers' mappings). Only rank
   k reads or writes piece k of any buffer, so nobody needs to wait for anybody here.
3. phase: every piece has been written everywhere, and nobody reads any buffer any
   more, so each rank may return and reuse its array.

The same pieces and the same kernels as the other paths, each element reduced once by
its owner in rank order: bitwise the results of the single-copy path. Traffic per rank:
every rank's piece read once and the result written once per rank, twice the message
in all (two ranks), against about 3 times (single copy, through the kernel) and 4.5
(staged through the segment); and two phases. What a call needs to know of its array
(where it lies, its piece and the peers' views of it) is worked out once per array and
kept (:meth:`SymmetricHeap.plan`): DDP's bucket, a persistent request's array.

Two ranks, both::

    buf = heap.alloc(1 << 20, where, all_ranks)      # pg.alloc_symmetric(1 << 20)
    heap.all_reduce(buf.view(np.float32), ReduceOp.SUM, seq)   # True: read in place
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np

from collectives.reduce_op import ReduceOp
from collectives.shm_names import SHM_DIR, segment_name
from collectives.symmetric import plain_buffer

from .codes import OP_ALL_REDUCE, piece_bounds

#: Set in the root field of the vote phase's fingerprint (an all_reduce has no root),
#: so that ranks that disagree on whether to vote fail loudly instead of reading each
#: other's words of another phase.
VOTE_MARK = 0xFFFF << 16
#: Arrays whose plan a heap keeps (a persistent request or a loop over one buffer uses
#: one); past it the plans start over.
_PLANS_MAX = 16


class SymmetricHeap:
    """One group's symmetric buffers and the all_reduce that reads them in place.

    ``owner`` is the backend (its rank, size, where, job id and key name the files),
    ``phases`` and ``core`` its protocol and path."""

    def __init__(self, owner: Any, phases: Any, core: Any) -> None:
        self.owner, self.ph, self.core = owner, phases, core
        self.rank, self.size = owner.rank, owner.size
        #: One entry per non-empty buffer: (its first address here, nbytes, every peer's
        #: mapping of it as uint8 arrays, None at this rank's index); (0, 0, None) once
        #: this rank's own buffer is gone. Allocation is collective, so every rank holds
        #: as many, in the same order.
        self.table: tuple = ()
        self.count = 0
        #: Indexes into ``table`` whose own buffer has been freed (appended by a
        #: finalizer, from whichever thread dropped the last reference; forgotten by
        #: :meth:`forget_freed` on the group's own calls).
        self.freed: list = []
        #: id(array) -> (array, dtype, (i + 1, o), own piece or None, the pieces to reduce
        #: in rank order, the peers' copies of the piece), and the same by ((i + 1, o),
        #: nbytes, dtype): see :meth:`plan`.
        self.plans: dict = {}
        self.places: dict = {}
        # Held while the table is rebuilt (an entry added, freed ones forgotten): the
        # caller's thread and the group's async thread may both do it (an allocation
        # while a large all_reduce runs async), and neither may lose the other's.
        self._lock = threading.Lock()

    def alloc(self, nbytes: int, where: str,
              all_ranks: Callable[[list], np.ndarray]) -> np.ndarray:
        """``pg.alloc_symmetric(nbytes)`` (collective; ``all_ranks`` gathers the votes)."""
        # Drop what holds arrays (so a buffer referred to by nothing else goes now),
        # then the entries of the buffers gone.
        self.plans, self.places = {}, {}
        self.forget_freed()
        index = self.count
        self.count += 1
        if self.size == 1:
            return plain_buffer(nbytes)  # nothing to share
        own = self._path(index, self.rank)
        mine, why = self._create_own(own, nbytes) if nbytes else (None, "")
        views = None
        try:
            # Vote 1: every rank's size, and whether its file exists with its pages
            # reserved (sizes first: a rank asking for 0 bytes still takes part).
            sizes = all_ranks([nbytes, int(mine is not None or not nbytes)])
            if len({int(v) for v in sizes[:, 0]}) != 1:
                raise ValueError(f"{where}: every rank must ask for the same `nbytes`; "
                                 f"the ranks asked for {sizes[:, 0].tolist()}")
            if nbytes == 0:
                return plain_buffer(0)
            if sizes[:, 1].all():
                try:
                    views = [np.frombuffer(mine, np.uint8) if r == self.rank
                             else self._map_peer(r, index, nbytes) for r in range(self.size)]
                except OSError as exc:
                    views, why = None, f"mapping a peer's buffer failed: {exc}"
            # Vote 2 (also the barrier after which the names may go): did everyone map
            # everyone? Otherwise every rank falls back alike.
            mapped = all_ranks([int(views is not None)])
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
            return plain_buffer(nbytes)
        buf = views[self.rank]
        views[self.rank] = None   # this rank's own buffer is the caller's (see above)
        # When the mapping goes (every array over it gone), note its entry; a list's
        # append is atomic, and the finalizer holds the list, not the heap.
        with self._lock:
            weakref.finalize(mine, self.freed.append, len(self.table)).atexit = False
            self.table = self.table + ((buf.ctypes.data, nbytes, views),)
        return buf

    def forget_freed(self) -> None:
        """Let go of the peers' mappings of every buffer whose own copy is gone here:
        its entry becomes an empty range. Called before any array is placed
        (:meth:`place`), not only at the next allocation: the kernel hands a freed range
        out again at once, and an array there must not be taken for one in the old
        buffer (every rank would vote for the old place and reduce with the peers' old
        copies). No plan refers to a freed buffer: a plan holds its array."""
        freed = self.freed
        if freed:
            with self._lock:
                table = list(self.table)
                while freed:
                    index = freed.pop()
                    if index < len(table):   # (a table emptied by close: none to forget)
                        table[index] = (0, 0, None)
                self.table = tuple(table)

    def _create_own(self, path: str, nbytes: int) -> tuple:
        """(this rank's mapping of a new file of ``nbytes`` at ``path``, "") or (None, why).
        The pages are reserved now (``posix_fallocate``): a full /dev/shm is a refusal
        here, not a SIGBUS at the first write into the buffer (a training step)."""
        try:
            fd = _create_exclusive(path)
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

    def _path(self, index: int, rank: int) -> str:
        owner = self.owner
        return os.path.join(SHM_DIR, segment_name(owner.job_id or "",
                                                  f"{owner.key}.sym{index}.r{rank}"))

    def _map_peer(self, r: int, index: int, nbytes: int) -> np.ndarray:
        fd = os.open(self._path(index, r), os.O_RDWR)
        try:  # writable: the all_reduce's owner of a piece pushes the result into it
            return np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)
        finally:
            os.close(fd)

    def place(self, a: np.ndarray) -> tuple[int, int]:
        """(buffer index + 1, offset) of ``a`` in this rank's buffers; (0, 0) if outside."""
        if self.freed:
            self.forget_freed()
        lo = a.ctypes.data
        hi = lo + a.nbytes
        for i, (start, nbytes, _) in enumerate(self.table):
            if start <= lo and hi <= start + nbytes:
                return i + 1, lo - start
        return 0, 0

    def plan(self, a: np.ndarray) -> tuple:
        """What an all_reduce of ``a`` needs to know, worked out once per place: where it
        lies, this rank's piece of it (None where the piece is empty), that piece in every
        rank's buffer in rank order (the sources), and in every peer's (where the result
        is pushed). Kept by the array's identity (a persistent request's or DDP's array:
        the next call finds it at once) and by its place, address, size and dtype (a new
        view of the same memory each call, as ``reshape(-1)`` of a 2-D array makes, finds
        it there; the views in the plan are of the same memory, so they serve it
        alike)."""
        where = self.place(a)
        if not where[0]:
            return (a, a.dtype, where, None, [], [])
        place = (where, a.nbytes, a.dtype)
        plan = self.places.get(place)
        if plan is None:
            piece, srcs, copies = None, [], []
            lo, me = where[1], self.rank
            mapped = self.table[where[0] - 1][2]
            k0, k1 = piece_bounds(a.size, self.size, a.itemsize)[me]
            if k1 > k0:
                piece = a[k0:k1]
                for r in range(self.size):
                    if r == me:
                        srcs.append(piece)
                    else:
                        view = mapped[r][lo:lo + a.nbytes].view(a.dtype)[k0:k1]
                        srcs.append(view)
                        copies.append(view)
            plan = (a, a.dtype, where, piece, srcs, copies)
            if len(self.places) >= _PLANS_MAX:
                self.places = {}
            self.places[place] = plan
        if plan[0] is a:
            if len(self.plans) >= _PLANS_MAX:
                self.plans = {}
            self.plans[id(a)] = plan
        return plan

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """all_reduce of the flat ``a`` read in place from every rank's buffer; False
        (agreed with every rank) where ``a`` is not at one place in all of them."""
        self.ph.start(OP_ALL_REDUCE, seq, a.dtype, a.nbytes, -1, op)
        plan = self.plans.get(id(a))
        if plan is None or plan[0] is not a or plan[1] is not a.dtype:
            plan = self.plan(a)
        return self.core.symmetric_all_reduce(plan, op)

    def round(self, a: np.ndarray, op: ReduceOp, large: Callable,
              rest: Callable) -> Optional[Callable[[int], None]]:
        """A persistent all_reduce's round over ``a`` where it lies in this rank's
        buffers and the core binds one (``core.symmetric_round``), else None."""
        if not self.table or a.ndim != 1:
            return None
        plan = self.plan(a)
        if not plan[2][0]:
            return None
        return self.core.symmetric_round(plan, op, large, rest)

    def release(self) -> None:
        """At close: forget the peers' mappings (they unmap once unreferenced). This
        rank's own buffers stay valid: their arrays hold their mappings."""
        self.table = ()
        self.plans = {}
        self.places = {}


def _create_exclusive(path: str) -> int:
    """A new file at ``path`` (replacing one a killed run of the same job left)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
