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

Lifetime: the group keeps the peers' mappings of a buffer (in ``_symmetric``), never this
rank's own, so the own buffer is the caller's: once nothing refers to it any more (no
array, view or tensor over it; no plan, see ``_symmetric_plan``, and no entry of the
fast path's view cache: both are dropped at every ``alloc_symmetric``) its mapping
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
   peer's (``ReduceOps._rank_order_reduce`` with copies: the core's ``combine``, GIL
   released, piece by piece while the result is in cache; plain loads and stores
   through the peers' mappings). Only rank
   k reads or writes piece k of any buffer, so nobody needs to wait for anybody here.
3. phase: every piece has been written everywhere, and nobody reads any buffer any
   more, so each rank may return and reuse its array.

The same pieces and the same kernels as the other paths, each element reduced once by
its owner in rank order: bitwise the results of the single-copy path. Traffic per rank:
every rank's piece read once and the result written once per rank, twice the message
in all (two ranks), against about 3 times (single copy, through the kernel) and 4.5
(staged through the segment); and two phases. What a call needs to know of its array
(where it lies, its piece and the peers' views of it) is worked out once per array and
kept (``_symmetric_plan``): DDP's bucket, a persistent request's array.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from typing import Callable

import numpy as np

from collectives.reduce_op import ReduceOp
from collectives.symmetric import plain_buffer
from collectives.shm_names import SHM_DIR, segment_name

from .ops import _DTYPE_CODE, _REDOP_BY_ID, OP_ALL_REDUCE, fingerprint, piece_bounds


#: Set in the root field of the vote phase's fingerprint (an all_reduce has no root),
#: so that ranks that disagree on whether to vote fail loudly instead of reading each
#: other's words of another phase.
_VOTE_MARK = 0xFFFF << 16
#: Arrays whose plan a group keeps (a persistent request or a loop over one buffer uses
#: one); past it the plans start over.
_PLANS_MAX = 16
#: Held while a group's table of buffers is rebuilt (an entry added, freed ones
#: forgotten): the caller's thread and the group's async thread may both do it (an
#: allocation while a large all_reduce runs async), and neither may lose the other's.
_TABLE_LOCK = threading.Lock()


class SymmetricHeap:
    """Mixed into ShmBackend: ``alloc_symmetric`` and ``_symmetric_all_reduce``."""

    #: One entry per non-empty buffer: (its first address here, nbytes, every peer's
    #: mapping of it as uint8 arrays, None at this rank's index); (0, 0, None) once this
    #: rank's own buffer is gone. Allocation is collective, so every rank holds as many,
    #: in the same order.
    _symmetric: tuple = ()
    _symmetric_count = 0
    #: Indexes into ``_symmetric`` whose own buffer has been freed (appended by a
    #: finalizer, from whichever thread dropped the last reference; forgotten by
    #: ``_forget_freed_symmetric`` on the group's own calls). Each group makes its own.
    _symmetric_freed: "list | tuple" = ()
    #: id(array) -> (array, dtype, (i + 1, o), own piece or None, the pieces to reduce in
    #: rank order, the peers' copies of the piece), and the same by ((i + 1, o), nbytes,
    #: dtype): see _symmetric_plan. (Empty here; a group writes only into its own.)
    _symmetric_plans: dict = {}
    _symmetric_places: dict = {}

    def alloc_symmetric(self, nbytes: int, where: str,
                        all_ranks: Callable[[list], np.ndarray]) -> np.ndarray:
        # Drop what holds arrays (so a buffer referred to by nothing else goes now),
        # then the entries of the buffers gone.
        self._symmetric_plans, self._symmetric_places = {}, {}
        self._forget_freed_symmetric()
        index = self._symmetric_count
        self._symmetric_count += 1
        if self.size == 1:
            return plain_buffer(nbytes)  # nothing to share
        own = self._symmetric_path(index, self.rank)
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
        if "_symmetric_freed" not in self.__dict__:
            self._symmetric_freed = []
        # When the mapping goes (every array over it gone), note its entry; a list's
        # append is atomic, and the finalizer holds the list, not the group.
        with _TABLE_LOCK:
            weakref.finalize(mine, self._symmetric_freed.append,
                             len(self._symmetric)).atexit = False
            self._symmetric = self._symmetric + ((buf.ctypes.data, nbytes, views),)
        return buf

    def _forget_freed_symmetric(self) -> None:
        """Let go of the peers' mappings of every buffer whose own copy is gone here:
        its entry becomes an empty range. Called before any array is placed
        (``_symmetric_place``), not only at the next allocation: the kernel hands a
        freed range out again at once, and an array there must not be taken for one in
        the old buffer (every rank would vote for the old place and reduce with the
        peers' old copies). No plan refers to a freed buffer: a plan holds its array."""
        freed = self._symmetric_freed
        if freed:
            with _TABLE_LOCK:
                table = list(self._symmetric)
                while freed:
                    index = freed.pop()
                    if index < len(table):   # (a table emptied by close: none to forget)
                        table[index] = (0, 0, None)
                self._symmetric = tuple(table)

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
        fd = os.open(self._symmetric_path(index, r), os.O_RDWR)
        try:  # writable: the all_reduce's owner of a piece pushes the result into it
            return np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)
        finally:
            os.close(fd)

    def _symmetric_place(self, a: np.ndarray) -> tuple[int, int]:
        """(buffer index + 1, offset) of ``a`` in this rank's buffers; (0, 0) if outside."""
        if self._symmetric_freed:
            self._forget_freed_symmetric()
        lo = a.ctypes.data
        hi = lo + a.nbytes
        for i, (start, nbytes, _) in enumerate(self._symmetric):
            if start <= lo and hi <= start + nbytes:
                return i + 1, lo - start
        return 0, 0

    def _symmetric_plan(self, a: np.ndarray) -> tuple:
        """What an all_reduce of ``a`` needs to know, worked out once per place (see
        ``_symmetric_plans``): where it lies, this rank's piece of it (None where the
        piece is empty), that piece in every rank's buffer in rank order (the sources),
        and in every peer's (where the result is pushed). Kept by the array's identity
        (a persistent request's or DDP's array: the next call finds it at once) and by
        its place, address, size and dtype (a new view of the same memory each call, as
        ``reshape(-1)`` of a 2-D array makes, finds it there; the views in the plan are
        of the same memory, so they serve it alike)."""
        where = self._symmetric_place(a)
        if not where[0]:
            return (a, a.dtype, where, None, [], [])
        if "_symmetric_places" not in self.__dict__:   # this group's own tables
            self._symmetric_plans, self._symmetric_places = {}, {}
        place = (where, a.nbytes, a.dtype)
        plan = self._symmetric_places.get(place)
        if plan is None:
            piece, srcs, copies = None, [], []
            lo, me = where[1], self.rank
            mapped = self._symmetric[where[0] - 1][2]
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
            if len(self._symmetric_places) >= _PLANS_MAX:
                self._symmetric_places = {}
            self._symmetric_places[place] = plan
        if plan[0] is a:
            if len(self._symmetric_plans) >= _PLANS_MAX:
                self._symmetric_plans = {}
            self._symmetric_plans[id(a)] = plan
        return plan

    def _symmetric_all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """all_reduce of the flat ``a`` read in place from every rank's buffer; False
        (agreed with every rank) where ``a`` is not at one place in all of them."""
        self._start(OP_ALL_REDUCE, seq, a.dtype, a.nbytes, -1, op)
        plan = self._symmetric_plans.get(id(a))
        if plan is None or plan[0] is not a or plan[1] is not a.dtype:
            plan = self._symmetric_plan(a)
        _, _, where, piece, srcs, copies = plan
        if self._native is not None:
            return self._symmetric_all_reduce_native(op, plan[1], where, piece, srcs, copies)
        fp0 = self._fp0
        self._fp0 = fp0 | _VOTE_MARK  # a rank in another path's first phase: a mismatch
        q = self._enter()
        bank = q & 1
        words = self._sv(bank, self.rank, np.uint64)
        words[0], words[1] = where
        self._exchange(q)
        self._fp0 = fp0
        if where[0] == 0 or any((int(w[0]), int(w[1])) != where for w in
                                (self._sv(bank, r, np.uint64) for r in self._peers)):
            return False
        if piece is not None:
            self._rank_order_reduce(piece, srcs, op)
            for r, view in zip(self._peers, copies):   # (fenced: pushing.py)
                self._push_into(r, view, piece)
        self._exchange(self._enter())
        return True

    def _symmetric_all_reduce_native(self, op: ReduceOp, dtype: np.dtype, where: tuple,
                                     piece, srcs: list, copies: list) -> bool:
        """The two phases, the vote and the reduce-and-push in one call of the core
        (``sym_all_reduce``); Python only where a wait outlasts the core's budget (and
        then raises what the Python path raises)."""
        core = self._native
        fp0, fp1 = self._fp0, self._fp1
        q = self._phase = self._phase + 1
        call = (piece, srcs, copies, q, fp0 | _VOTE_MARK, fp0, fp1, where[0], where[1],
                _DTYPE_CODE.get(dtype, 0), _REDOP_BY_ID[id(op)])
        budget = 0.0 if self._engine.pending else self._wait_budget
        status, phase = core.sym_all_reduce(*call, budget, False)
        return self._symmetric_settled(call, status, phase)

    def _symmetric_settled(self, call: tuple, status: int, phase: int) -> bool:
        """After the core's ``sym_all_reduce(*call, budget, resume)`` came back with
        ``status`` in ``phase`` (0: the vote, 1: the push): wait out what is left (the
        core resumes where it stopped), leave the group in phase q + 1, and say whether
        the reduce was done in place (False: every rank declined alike)."""
        core = self._native
        q, vfp0, fp0, fp1 = call[3:7]
        if phase == 0 and status != self._DONE and status != self._DECLINED:
            self._fp0 = vfp0   # (what a mismatch in the vote reports)
            if status != self._MISMATCH:
                status = self._settle(q, lambda b: core.exchange(q, vfp0, fp1, b, True),
                                      status)
            if status == self._MISMATCH:
                self._mismatch(q)
            status, phase = core.sym_all_reduce(*call, self._wait_budget, True)
        self._fp0 = fp0
        if status == self._DECLINED:
            return False
        if status == self._CANCELED:   # (a peer failed before this rank's push into it)
            self._raise_failed_peer()
        self._phase = q + 1
        if status != self._DONE and status != self._MISMATCH:
            status = self._settle(q + 1, lambda b: core.exchange(q + 1, fp0, fp1, b, True),
                                  status)
        if status == self._MISMATCH:
            self._mismatch(q + 1)
        return True

    def _symmetric_round(self, a: np.ndarray, op: ReduceOp):
        """A persistent all_reduce's round over ``a`` in symmetric memory on the core,
        bound once (DDP's bucket): ``round_(seq)`` is ``_large_reduce`` with ``_start``
        and ``_symmetric_all_reduce`` in the same Python frame as the core's call: the
        same phases and fingerprints, so it meets the plain path on the other ranks.
        Where the group has failed, is closed or has point to point in flight, the
        round takes the plain path (which raises or waits as usual); where the vote
        declines, it goes on by the other paths as the plain one does. None instead of
        a round where ``a`` is not in this rank's buffers or the group is not on the
        core.

        In a training step every Python frame between the bucket and the core costs one
        to two microseconds with the caches cold; the plain path has four more."""
        if self._native is None or not self._symmetric or a.ndim != 1:
            return None
        _, dtype, where, piece, srcs, copies = self._symmetric_plan(a)
        if not where[0]:
            return None
        core, engine = self._native, self._engine
        sym, settled, done = core.sym_all_reduce, self._symmetric_settled, self._DONE
        large, rest, fail = self._large_reduce, self._large_reduce_unplaced, self._fail
        code, redop = _DTYPE_CODE.get(dtype, 0), _REDOP_BY_ID[id(op)]
        base = fingerprint(OP_ALL_REDUCE, redop, code, -1, 0)   # (the seq field per round)
        nbytes, (w0, w1) = a.nbytes, where

        def round_(seq: int) -> None:
            try:
                if self._broken is not None or self._seg is None or engine.pending:
                    large(a, op, seq, -1, OP_ALL_REDUCE)
                    return
                fp0 = base | ((seq & 0xFFFFFFFF) << 32)
                self._op_name, self._op_seq, self._fp0, self._fp1 = ("all_reduce", seq, fp0,
                                                                     nbytes)
                q = core.phase + 1
                core.phase = q
                call = (piece, srcs, copies, q, fp0 | _VOTE_MARK, fp0, nbytes, w0, w1,
                        code, redop)
                status, phase = sym(*call, self._wait_budget, False)
                if status == done:
                    core.phase = q + 1
                elif not settled(call, status, phase):
                    rest(a, op, seq, -1, OP_ALL_REDUCE)
            except BaseException as exc:
                fail(exc)
                raise
        return round_

    def _release_symmetric(self) -> None:
        """At close: forget the peers' mappings (they unmap once unreferenced). This
        rank's own buffers stay valid: their arrays hold their mappings."""
        self._symmetric = ()
        self._symmetric_plans = {}
        self._symmetric_places = {}

