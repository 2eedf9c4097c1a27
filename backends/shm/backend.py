"""``ShmBackend``: the Backend whose ranks are processes of one host sharing a segment.

It is made of parts, each an object it holds:

- ``phases`` (:class:`~backends.shm.phases.Phases`): the phase protocol over the segment,
  its waits and every error they end in;
- ``core``: the path, chosen when the group is made: the compiled core
  (:class:`~backends.shm.native_core.NativeCore`) or numpy
  (:class:`~backends.shm.core.PythonCore`), one interface (:mod:`backends.shm.core`);
- ``engine`` (:class:`~backends.shm.channels.Engine`): point to point, one ring per
  ordered pair of ranks;
- ``single_copy`` (:class:`~backends.shm.cma.SingleCopy`) and ``heap``
  (:class:`~backends.shm.symmetric.SymmetricHeap`): the large all_reduce's in-place
  paths.

Which path each op takes, by message size, is the table :meth:`ShmBackend.paths`
(``pg.describe()`` prints it; the conformance suite crosses every line of it).

Two ranks (``pg.transport.native`` says whether the compiled core runs them):

>>> import numpy as np, collectives
>>> def shm_pair():
...     pg = collectives.init_process_group("shm")
...     a = np.full(4, pg.rank + 1.0, np.float32)
...     pg.all_reduce(a)
...     text = pg.describe()       # the path table, the wait policy, the core in use
...     pg.close()
...     return a.tolist(), text.splitlines()[0]
>>> collectives.spawn(shm_pair, 2)[1]
([3.0, 3.0, 3.0, 3.0], "ProcessGroup 'world' on shm, rank 1 of 2, timeout ... s")
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives import settings
from collectives.backend import Backend, Capabilities
from collectives.paths import Path, PathTable
from collectives.reduce_op import ReduceOp, finish
from collectives.shm_names import segment_name
from collectives.thresholds import SizeThreshold
from collectives.work import Work

from . import moves
from . import segment as sg
from .channels import HEADER_BYTES, Engine
from .cma import SingleCopy, cma_from_bytes
from .cma_all_to_all import CMA_ALL_TO_ALL_BYTES
from .codes import (OP_ALL_GATHER, OP_ALL_REDUCE, OP_BROADCAST, OP_GATHER, OP_REDUCE,
                    OP_REDUCE_SCATTER, OP_SCATTER, dtype_code, dtype_name)
from .core import PythonCore
from .futex import Doorbells, wait_mode
from .native import native_module, wait_policy
from .native_core import NativeCore
from .phases import Phases
from .reduce import PIECE_MAX_BYTES, SMALL_REDUCE_BYTES, piece_layout, small_limit
from .symmetric import SymmetricHeap

#: Bytes per data slot (the staging chunk) when COLLECTIVES_SHM_CHUNK_BYTES is unset.
DEFAULT_CHUNK = settings.SHM_CHUNK_BYTES.default


def _layout_from_env(size: int) -> sg.Layout:
    chunk = settings.SHM_CHUNK_BYTES.get()
    chunk = max(chunk, 1024, 64 * size)
    chunk = (chunk + 4095) // 4096 * 4096 if chunk >= 4096 else (chunk + 63) // 64 * 64
    # Each of the n x (n-1) rings is R bytes of sparse memory: shrink R with the size.
    default_ring = 1 << 20
    if size > 1:
        budget = (16 << 20) // (size * (size - 1))
        default_ring = max(64 << 10, min(1 << 20, 1 << (budget.bit_length() - 1)))
    ring = settings.SHM_RING_BYTES.get() or default_ring
    ring = max(4096, (ring + 4095) // 4096 * 4096)
    return sg.Layout(size, chunk, ring)


class _P2PWork(Work):
    def __init__(self, backend: "ShmBackend", op: Any, what: str, peer: int) -> None:
        self._backend, self._op, self._what, self._peer = backend, op, what, peer

    def wait(self, timeout: Optional[float] = None) -> None:
        op = self._op
        if op.done and op.error is None:  # (the core often completes it when posted)
            return
        self._backend.core.p2p_wait(op, timeout, self._what, self._peer)

    def is_completed(self) -> bool:
        op = self._op
        if not op.done:
            engine = self._backend.engine
            if engine.lock.acquire(blocking=False):
                try:
                    if not engine.closed:
                        engine.progress_locked(drain=False)
                finally:
                    engine.lock.release()
        return op.done


class ShmBackend(Backend):
    """Ranks of one host communicating through one POSIX shared-memory segment."""

    name = "shm"
    capabilities = Capabilities(persistent=True, symmetric_memory=True, regroups=True)

    # ----------------------------------------------------------------- set-up
    @classmethod
    def open(cls, job_id: Optional[str], key: str, rank: int, size: int, timeout: float,
             world_ranks: tuple[int, ...], placement: Any = None) -> "ShmBackend":
        """Map (or, for a world of one, make) the segment of group ``key`` of job
        ``job_id`` and connect this rank to it."""
        where = f"[rank {rank}/{size}] shm init ({key})"
        layout = _layout_from_env(size)
        if size == 1:
            seg = sg.anonymous_segment(layout)
            seg.u64[layout.ctrl_word(0, sg.W_PID)] = os.getpid()
            seg.u64[layout.ctrl_word(0, sg.W_STATE)] = sg.STATE_ATTACHED
        else:
            if job_id is None:
                raise ValueError(
                    f"the shm backend needs a job id shared by the ranks of one job to name "
                    f"its shared memory: set {settings.JOB_ID.name} (any string unique on "
                    f"this host), or start the ranks with collectives.spawn, torchrun or "
                    f"mpirun")
            seg = sg.open_group_segment(segment_name(job_id, key), rank, size, layout,
                                        timeout, where)
        return cls(seg, rank, size, timeout, job_id, key, world_ranks, placement)

    def __init__(self, seg: sg.Segment, rank: int, size: int, timeout: float,
                 job_id: Optional[str], key: str, world_ranks: tuple[int, ...],
                 placement: Any = None) -> None:
        super().__init__(rank, size, timeout)
        #: The job's id and this group's key name its files; its ranks in the world.
        self.job_id, self.key, self.world_ranks = job_id, key, world_ranks
        #: The world group's ``placement.Placement`` (None in a sub-group).
        self.placement = placement
        lay = seg.layout
        spin, yld = wait_policy(size)
        bells = Doorbells(seg.u32, seg.u64, seg.base_addr,
                          [lay.bell_byte(r) for r in range(size)],
                          [lay.ctrl_word(r, sg.W_SLEEPERS) for r in range(size)],
                          rank, wait_mode())
        self.phases = ph = Phases(self, seg, bells, spin, yld)
        mod = native_module() if size > 1 else None
        if mod is not None:
            if settings.SHM_CMA.get() == "auto":
                cma_from_bytes(mod)   # measured now, outside any collective (once)
            self.core: Any = NativeCore(ph, mod)
        else:
            self.core = PythonCore(ph)
        self.engine = Engine(seg, rank, size, ph.bells.ring, self.where, dtype_name,
                             core=self.core.group if mod is not None else None)
        ph.engine = self.engine
        if mod is not None:
            self.core.bind_engine(self.engine)
        # Blocking send and recv in one call of the core where it can (None: posted).
        self._blocking = self.core.blocking_calls()
        self.single_copy = SingleCopy(self, ph, self.core, mod)
        self.heap = SymmetricHeap(self, ph, self.core)
        self._small_bytes = small_limit(ph)
        self._seg: Optional[sg.Segment] = seg
        self._close_lock = threading.Lock()

    # ----------------------------------------------------------- what it is
    @property
    def native(self) -> bool:
        """Whether this group runs on the compiled core (False: the Python path, because
        the core is missing or ``COLLECTIVES_SHM_NATIVE=0``)."""
        return self.core.native

    @property
    def bound_core(self) -> Optional[int]:
        """The core this rank was bound to when the world group opened (ranks
        outnumbering cores, see ``backends.shm.placement``), or None."""
        return self.placement.core if self.placement is not None else None

    @property
    def wait_mode(self) -> str:
        """``futex`` or ``sleep``: how this group's waits block."""
        return self.phases.bells.mode

    @property
    def footprint_bytes(self) -> int:
        """Size of the shared mapping (sparse: pages count once they are written)."""
        return self.phases.layout.total

    @property
    def chunk_bytes(self) -> int:
        return self.phases.S

    def paths(self) -> PathTable:
        """shm's choices by message size: the one-phase reduce, the single-copy and
        symmetric all_reduce, a message's split into slots of S bytes (S/n per rank where
        every rank's part of one input shares a slot) and a reduce's into chunks of n
        pieces; and a point-to-point message that wraps around its ring."""
        S, n = self.phases.S, self.size
        chunk = f"{settings.SHM_CHUNK_BYTES.name} (a slot)"
        one_phase = "one phase: copy in, barrier, rank-order reduce" + \
            (" (one call of the core)" if self.native else "")
        pieces = piece_layout(self.phases, 1)[1]
        large = [Path("pipelined reduce-scatter + all-gather, a chunk of n pieces a phase",
                      pieces, f"shm.reduce.PIECE_MAX_BYTES x size ({PIECE_MAX_BYTES >> 10} "
                              f"KiB pieces: a chunk)"),
                 Path("pipelined, several chunks")]
        moved = "one phase" + (" (one call of the core)" if self.native else "")
        return PathTable({
            "all_reduce": [Path(one_phase, self._small_bytes, "shm.reduce.SMALL_REDUCE_BYTES",
                                inclusive=True),
                           Path("pipelined reduce-scatter + all-gather through the slots",
                                self.single_copy.min_bytes, "shm.cma.CMA_ALL_REDUCE_BYTES"),
                           Path("single copy: each rank reduces its piece of the peers' "
                                "arrays and pushes it into theirs (where every rank votes "
                                "for it; else pipelined)")],
            "reduce": [Path(one_phase, self._small_bytes, "shm.reduce.SMALL_REDUCE_BYTES",
                            inclusive=True)] + large,
            "broadcast": [Path(moved, S, chunk, inclusive=True), Path("a slot a phase")],
            "all_gather": [Path(moved, S, chunk, inclusive=True), Path("a slot a phase")],
            "gather": [Path(moved, S, chunk, inclusive=True), Path("a slot a phase")],
            "scatter": [Path(moved, S // n, "shm.slot / size", inclusive=True),
                        Path("a piece of S/n a phase")],
            "reduce_scatter": [Path(moved + ", rank-order reduce", S // n, "shm.slot / size",
                                    inclusive=True),
                               Path("a piece of S/n a phase, rank-order reduce")],
            "all_to_all": [Path("one phase: the counts, every input behind them",
                                S // n, "shm.slot / size", inclusive=True),
                           Path("the counts, then one more phase (every input fits a "
                                "slot) or rounds of S/n pieces", CMA_ALL_TO_ALL_BYTES,
                                "shm.cma_all_to_all.CMA_ALL_TO_ALL_BYTES"),
                           Path("the counts, then each rank reads its parts from the "
                                "peers' inputs (single copy, where every rank votes for it; "
                                "else staged as above)")],
            "barrier": [Path("one empty phase")],
        }, lines=(
            SizeThreshold(f"shm.slot ({settings.SHM_CHUNK_BYTES.name})", S,
                          ("all_reduce", "reduce")),
            SizeThreshold(f"shm.ring ({settings.SHM_RING_BYTES.name})",
                          self.phases.layout.ring - HEADER_BYTES, ("send",)),
        ), notes=(
            "an all_reduce past the one-phase size of an array in symmetric memory "
            "(alloc_symmetric) reads the peers' buffers in place",))

    def describe(self) -> list[str]:
        ph = self.phases
        path = "the compiled core (backends.shm._native)" if self.native else "the Python path"
        return [f"{path}; waits: {ph.bells.mode}, spin {ph.spin_s * 1e6:g} us, yield "
                f"{ph.yield_s * 1e6:g} us" + (f"; bound to core {self.bound_core}"
                                              if self.bound_core is not None else ""),
                f"segment: {ph.layout.total} bytes mapped (sparse), slots of "
                f"{ph.S} bytes, rings of {ph.layout.ring} bytes"]

    # --------------------------------------------------------- point to point
    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        op = self.engine.post_send(array, dst, tag, dtype_code(array.dtype))
        return _P2PWork(self, op, f"send to rank {dst} (tag {tag})", dst)

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        op = self.engine.post_recv(array, src, tag, dtype_code(array.dtype))
        return _P2PWork(self, op, f"recv from rank {src} (tag {tag})", src)

    def send_now(self, array: np.ndarray, dst: int, tag: int) -> None:
        blocking = self._blocking
        if blocking is not None:
            blocking[0](array, dst, tag)
        else:
            self.isend(array, dst, tag).wait()

    def recv_now(self, array: np.ndarray, src: int, tag: int) -> None:
        blocking = self._blocking
        if blocking is not None:
            blocking[1](array, src, tag)
        else:
            self.irecv(array, src, tag).wait()

    # ------------------------------------------------------------ collectives
    def barrier(self, seq: int) -> None:
        if self.size > 1:
            self.core.barrier(seq)

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        if self.size == 1:
            finish(op, a, 1)
        elif not self.core.all_reduce(a, op, seq):   # (the one-phase path where it fits)
            try:
                self.large_all_reduce(a, op, seq)
            except BaseException as exc:
                self.phases.fail(exc)
                raise

    def large_all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        """A message past the one-phase path: an all_reduce of an array in symmetric
        memory reads the peers' buffers in place (in a group that has such buffers, any
        other large all_reduce pays one phase to find that out), one from
        ``single_copy.min_bytes`` reads the peers' memory directly where the group can,
        everything else is pipelined through the segment."""
        if self.heap.table and self.heap.all_reduce(a, op, seq):
            return   # read in place from every rank's symmetric buffer
        self.unplaced_all_reduce(a, op, seq)

    def unplaced_all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        """:meth:`large_all_reduce` once symmetric memory is ruled out."""
        copy = self.single_copy
        if a.nbytes >= copy.min_bytes and copy.decided is not False and \
                copy.all_reduce(a, op, seq):
            return
        self.core.pipelined_reduce(a, op, seq, -1, OP_ALL_REDUCE)

    def reduce(self, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> None:
        if self.size == 1:
            finish(op, a, 1)
            return
        try:
            if a.nbytes <= self._small_bytes:
                self.core.small_reduce(a, op, seq, root, OP_REDUCE)
            else:
                self.core.pipelined_reduce(a, op, seq, root, OP_REDUCE)
        except BaseException as exc:
            self.phases.fail(exc)
            raise

    def broadcast(self, a: np.ndarray, root: int, seq: int) -> None:
        if self.size > 1 and not self.core.move(OP_BROADCAST, a if self.rank == root else None,
                                                None if self.rank == root else a, root, None,
                                                a.nbytes, seq):
            self.phases.guard(moves.broadcast, self.phases, self.core, a, root, seq)

    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> None:
        if self.size == 1:
            out[...] = inp
        elif not self.core.move(OP_ALL_GATHER, inp, out, -1, None, inp.nbytes, seq):
            self.phases.guard(moves.gather, self.phases, self.core, inp, out, None, seq)

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], root: int,
               seq: int) -> None:
        if self.size == 1:
            out[...] = inp
        elif not self.core.move(OP_GATHER, inp, out if self.rank == root else None, root,
                                None, inp.nbytes, seq):
            self.phases.guard(moves.gather, self.phases, self.core, inp, out, root, seq)

    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], root: int,
                seq: int) -> None:
        if self.size == 1:
            out[...] = inp
        elif not self.core.move(OP_SCATTER, inp if self.rank == root else None, out, root,
                                None, out.nbytes, seq):
            self.phases.guard(moves.scatter, self.phases, self.core, out, inp, root, None, seq)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp,
                       seq: int) -> None:
        if self.size == 1:
            out[...] = inp
            finish(op, out, 1)
        elif not self.core.move(OP_REDUCE_SCATTER, inp, out, -1, op, out.nbytes, seq):
            self.phases.guard(moves.scatter, self.phases, self.core, out, inp, -1, op, seq)

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                   in_counts: Sequence[int], seq: int) -> None:
        if self.size == 1:
            if out_counts[0] != in_counts[0]:
                from collectives.errors import CollectiveMismatch
                raise CollectiveMismatch(
                    f"{self.where('all_to_all')} (seq {seq}): this rank sends "
                    f"{in_counts[0]} elements to itself but expects {out_counts[0]}")
            out[...] = inp
            return
        self.core.all_to_all(out, inp, list(out_counts), list(in_counts), seq)

    # ------------------------------------------------------- persistent rounds
    def persistent(self, op: str, arrays: Sequence[np.ndarray],
                   reduce_op: Optional[ReduceOp]) -> Optional[Callable[[int], None]]:
        """Each round bound once (see :mod:`backends.shm.persistent`)."""
        from .persistent import persistent_call
        return persistent_call(self, op, arrays, reduce_op)

    # ------------------------------------------------------- symmetric memory
    def alloc_symmetric(self, nbytes: int, where: str,
                        all_ranks: Callable[[list], np.ndarray]) -> np.ndarray:
        return self.heap.alloc(nbytes, where, all_ranks)

    # -------------------------------------------------------------- sub-groups
    def new_group(self, ranks: tuple[int, ...], instance: int) -> "ShmBackend":
        world = tuple(self.world_ranks[r] for r in ranks)
        key = f"{self.key}.g{'-'.join(map(str, world))}i{instance}"
        if len(key) > 120:
            key = "h" + hashlib.sha256(key.encode()).hexdigest()[:32]
        return ShmBackend.open(self.job_id, key, ranks.index(self.rank), len(ranks),
                               self.timeout, world)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        with self._close_lock:
            seg, self._seg = self._seg, None
            if seg is None:
                return
            try:
                self.phases.mark(sg.STATE_CLOSED)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
            self._release(seg)

    def abort(self) -> None:
        """Mark this rank failed in the segment (its peers' waits for it, and a phase it
        published but did not finish, raise PeerError at once), wake this rank's own
        sleepers, and let go of the segment without waiting for anybody. This rank's
        waits end at their next look (each looks at least every ``phases.SLICE``); the
        mapping stays while a thread is still inside a call of the core (it holds the
        core, which holds the mapping) and goes with the last reference. Unlike an
        error's exit (``Phases.fail``), an abort does not wait for a peer in the middle
        of writing into this rank's memory: a peer stopped in the middle of a piece of a
        single-copy or symmetric all_reduce may still finish that piece."""
        ph = self.phases
        with self._close_lock:
            seg, self._seg = self._seg, None
            if seg is None:
                return
            ph.aborted = True
            ph.mark_failed()
            try:
                ph.bells.ring([self.rank])   # (this rank's own sleepers look now)
            except Exception:  # noqa: BLE001 - aborting must not fail
                pass
            self._release(seg)

    def _release(self, seg: sg.Segment) -> None:
        self.engine.close()
        self._blocking = None
        self.heap.release()
        self.phases.release()
        seg.close()
        if self.placement is not None:
            self.placement.release()

    def __del__(self) -> None:
        # Collected without close(): tell the peers (best effort), never raise. Not in a
        # forked child, whose copy of the group must not close its parent's rank.
        try:
            ph = self.phases
            if getattr(self, "_seg", None) is not None and ph.u64 is not None and \
                    os.getpid() == ph.owner_pid:
                ph.u64[ph.state_idx[self.rank]] = sg.STATE_CLOSED
        except Exception:  # noqa: BLE001
            pass


__all__ = ["ShmBackend", "SMALL_REDUCE_BYTES", "time"]
