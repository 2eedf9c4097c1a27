"""``ShmBackend``: the Backend whose ranks are processes of one host sharing a segment.

Waiting never burns a core for long: up to 50 microseconds of spinning (none when the
ranks outnumber the cores), ``sched_yield`` for up to a millisecond
(``native.wait_policy``: longer with a core per rank, shorter when oversubscribed), then
sleep in the kernel on this rank's doorbell (``futex.Doorbells``), in slices of at most
200 ms so that the deadline and the peers' liveness (pid alive and not a
zombie; their state word: failed or closed) are checked. The yield phase pays for itself
because a futex wake-up costs tens of microseconds on virtual machines: two ranks that
both went to sleep would hand each phase over through the kernel. Spinning stays short so
that 4 ranks on 2 cores still give the CPU to the ranks that have work (and there the
world group binds each rank to one core: ``placement``).

Errors: a wait past ``timeout`` raises CollectiveTimeout (op, sequence number, missing
ranks); a dead or departed peer raises PeerError naming it within about 0.3 s; after an
error in a collective this rank marks itself failed in shared memory, so its peers raise
PeerError at once instead of waiting for their own timeout.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Callable, Optional

import numpy as np

from collectives import settings
from collectives.lifetime import process_alive
from collectives.errors import CollectiveError, CollectiveTimeout, PeerError
from collectives.backend import Backend, Capabilities
from collectives.paths import PathTable
from collectives.shm_names import segment_name
from collectives.thresholds import SizeThreshold
from collectives.work import Work

from . import segment as sg
from .channels import HEADER_BYTES, Engine, SendOp
from .cma import CmaReduce, cma_min_bytes
from .pushing import PushGuard
from .futex import Doorbells, wait_mode
from .native_ops import NativePaths
from .ops import _DTYPE_CODE, CollectiveOps, dtype_code, dtype_name
from .reduce import ReduceOps
from .symmetric import SymmetricHeap

#: Bytes per data slot (the staging chunk); a message larger than this is chunked.
CHUNK_ENV = settings.SHM_CHUNK_BYTES.name
DEFAULT_CHUNK = 1 << 20
#: Bytes per point-to-point ring (default scales down with the group size).
RING_ENV = settings.SHM_RING_BYTES.name
#: ``0`` turns off the pid liveness checks (peers in another PID namespace).
PID_CHECK_ENV = sg.PID_CHECK_ENV
#: Microseconds of pure spinning, then of sched_yield, before sleeping in the kernel.
SPIN_ENV = settings.SHM_SPIN_US.name
YIELD_ENV = settings.SHM_YIELD_US.name

_SLICE = 0.2            # longest single sleep: the deadline and liveness are checked after
_LIVENESS_EVERY = 0.1   # seconds between pid checks of the ranks being waited for


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
    def __init__(self, group: "ShmGroup", op, what: str, peer: int) -> None:
        self._group, self._op, self._what, self._peer = group, op, what, peer

    def wait(self, timeout: Optional[float] = None) -> None:
        op = self._op
        if op.done and op.error is None:  # (the core often completes it when posted)
            return
        self._group._p2p_wait(op, timeout, self._what, self._peer)

    def is_completed(self) -> bool:
        op = self._op
        if not op.done:
            engine = self._group._engine
            if engine.lock.acquire(blocking=False):
                try:
                    if not engine.closed:
                        engine.progress_locked(drain=False)
                finally:
                    engine.lock.release()
        return op.done


class ShmBackend(NativePaths, SymmetricHeap, CmaReduce, PushGuard, ReduceOps,
                 CollectiveOps, Backend):
    """Ranks of one host communicating through one POSIX shared-memory segment."""

    name = "shm"
    capabilities = Capabilities(persistent=True, symmetric_memory=True)
    #: The world group's ``placement.Placement`` (None in a sub-group).
    _placement = None

    # ----------------------------------------------------------------- set-up
    @classmethod
    def open(cls, job_id: Optional[str], key: str, rank: int, size: int, timeout: float,
             world_ranks: tuple[int, ...]) -> "ShmBackend":
        where = f"[rank {rank}/{size}] shm init ({key})"
        layout = _layout_from_env(size)
        if size == 1:
            seg = sg.anonymous_segment(layout)
            seg.u64[layout.ctrl_word(0, sg.W_PID)] = os.getpid()
            seg.u64[layout.ctrl_word(0, sg.W_STATE)] = sg.STATE_ATTACHED
        else:
            if job_id is None:
                raise ValueError(
                    "the shm backend needs a job id shared by the ranks of one job to name "
                    f"its shared memory: set {settings.JOB_ID.name} (any string unique on this "
                    "host), or start the ranks with collectives.spawn, torchrun or mpirun")
            name = segment_name(job_id, key)
            seg = sg.open_group_segment(name, rank, size, layout, timeout, where)
        return cls(seg, rank, size, timeout, job_id, key, world_ranks)

    def __init__(self, seg: sg.Segment, rank: int, size: int, timeout: float,
                 job_id: Optional[str], key: str, world_ranks: tuple[int, ...]) -> None:
        super().__init__(rank, size, timeout)
        self._seg = seg
        self._job_id = job_id
        self._key = key
        self._world_ranks = world_ranks
        lay = seg.layout
        self._layout = lay
        self._u64 = seg.u64
        self._all = list(range(size))
        self._peers = [r for r in range(size) if r != rank]
        self._arrived_idx = [lay.ctrl_word(r, sg.W_ARRIVED) for r in range(size)]
        self._me_arrived = self._arrived_idx[rank]
        self._fp_idx = [[lay.ctrl_word(r, sg.W_FP + 2 * p) for r in range(size)]
                        for p in (0, 1)]
        self._state_idx = [lay.ctrl_word(r, sg.W_STATE) for r in range(size)]
        self._pids = [seg.u64[lay.ctrl_word(r, sg.W_PID)] for r in range(size)]
        self._pid_checkable = [
            r != rank and sg.same_pid_namespace(seg.u64[lay.ctrl_word(r, sg.W_PIDNS)])
            for r in range(size)]
        self._bells = Doorbells(seg.u32, seg.u64, seg.base_addr,
                                [lay.bell_byte(r) for r in range(size)],
                                [lay.ctrl_word(r, sg.W_SLEEPERS) for r in range(size)],
                                rank, wait_mode())
        self._S = lay.chunk
        self._cma_bytes = cma_min_bytes(size)
        self._use_native()  # the compiled core, its doorbells and the wait policy
        self._engine = Engine(seg, rank, size, self._bells.ring, self.where, dtype_name,
                              core=self._native)
        if self._native is not None and type(self).send_now is Backend.send_now \
                and type(self).recv_now is Backend.recv_now:
            # Blocking send and recv in one C call where they can (unless a subclass
            # has hooks of its own); the C wait is bounded like every C wait here.
            self.send_now, self.recv_now = self._engine.blocking_calls(
                self.isend, self.irecv, min(self._spin_s + self._yield_s,
                                              self._wait_budget), _DTYPE_CODE)
        if self._native is not None and type(self).all_reduce is ReduceOps.all_reduce:
            self.all_reduce = self._all_reduce_hook()   # (not over a subclass's hook)
        if self._native is not None and type(self).barrier is CollectiveOps.barrier:
            self.barrier = self._barrier_hook()
        self._phase = int(seg.u64[self._me_arrived])
        self._slots = [[seg.bytes[lay.slot_off(b, r):lay.slot_off(b, r) + lay.chunk]
                        for r in range(size)] for b in (0, 1)]
        self._typed: dict = {}
        self._small_cache: dict = {}
        self._broken: Optional[BaseException] = None
        self._op_name = ""
        self._op_seq = -1
        self._fp0 = self._fp1 = 0
        self._close_lock = threading.Lock()
        self._owner_pid = os.getpid()   # a forked child must not speak for this rank

    @property
    def bound_core(self) -> Optional[int]:
        """The core this rank was bound to when the world group opened (ranks
        outnumbering cores, see ``backends.shm.placement``), or None."""
        place = self._placement
        return place.core if place is not None else None

    @property
    def wait_mode(self) -> str:
        """``futex`` or ``sleep``: how this group's waits block."""
        return self._bells.mode

    @property
    def footprint_bytes(self) -> int:
        """Size of the shared mapping (sparse: pages count once they are written)."""
        return self._layout.total

    @property
    def chunk_bytes(self) -> int:
        return self._S

    def size_thresholds(self) -> tuple[SizeThreshold, ...]:
        """shm's own lines: the one-phase reduce, the single-copy all_reduce (cma.py), a
        message's split into slots of S bytes
        (S/n per rank where every rank's part of one input shares a slot) and a reduce's
        into chunks of n pieces (``reduce.PIECE_MAX_BYTES``), and a point to point message
        that wraps around its ring."""
        S, n = self._S, self.size
        return (
            SizeThreshold("shm.reduce.SMALL_REDUCE_BYTES", self._small_limit,
                          ("all_reduce", "reduce")),
            SizeThreshold("shm.cma.CMA_ALL_REDUCE_BYTES", self._cma_bytes,
                          ("all_reduce",)),
            SizeThreshold(f"shm.slot ({settings.SHM_CHUNK_BYTES.name})", S,
                          ("broadcast", "all_reduce", "reduce", "all_gather", "gather")),
            SizeThreshold("shm.reduce.PIECE_MAX_BYTES x size (a pipelined chunk)",
                          self._piece_layout(1)[1],
                          ("all_reduce", "reduce")),
            SizeThreshold("shm.slot / size", S // n, ("scatter", "reduce_scatter",
                                                      "all_to_all")),
            SizeThreshold(f"shm.ring ({settings.SHM_RING_BYTES.name})",
                          self._layout.ring - HEADER_BYTES, ("send",)),
        )

    def paths(self) -> PathTable:
        """The lines above as the path table (a table of paths replaces them below)."""
        return PathTable({}, self.size_thresholds())

    # ------------------------------------------------------------------ waits
    def _check_peer(self, r: int, what: str, seq: int, *, fatal_states=(sg.STATE_FAILED,
                                                                           sg.STATE_CLOSED),
                    check_pid: bool, done: Optional[Callable[[], bool]] = None) -> None:
        """Raise PeerError if rank ``r`` closed, failed or died, unless ``done()`` says
        that what this rank waits for from ``r`` arrived after all. Where ``r`` failed,
        a peer that died is named instead: ``r`` most likely failed because of it.

        ``done`` is asked *after* the state (and the pid) was read, and that order is
        what makes it right: a peer publishes its arrival (or its message) before it
        closes or exits, so a state read as CLOSED guarantees that a later read sees the
        arrival if there was one (x86-64: stores become visible in order, loads are not
        reordered). The caller's own check came before, so between its "not arrived"
        and our "closed" the peer may have arrived, finished and closed: on two cores
        and four ranks a rank is preempted there now and then (a 4-rank soak failed
        with "rank 0 closed the group" every ~100 s until ``done`` was asked here)."""
        state = self._u64[self._state_idx[r]] if self._u64 is not None else sg.STATE_CLOSED
        if state in fatal_states:
            if done is not None and self._u64 is not None and done():
                return
            if state == sg.STATE_FAILED:
                self._raise_if_a_peer_died(what, seq)   # the cause, not its consequence
            how = "closed the group" if state == sg.STATE_CLOSED else \
                "failed in a collective (see its own error)"
            raise PeerError(f"{self._where_seq(what, seq)}: rank {r} {how}", peer=r)
        if check_pid and self._dead(r):
            if done is not None and self._u64 is not None and done():
                return
            raise self._died(r, what, seq)

    def _dead(self, r: int) -> bool:
        """Rank ``r``'s process is gone (as far as this rank can see its pid)."""
        return self._pid_checkable[r] and not process_alive(self._pids[r])

    def _died(self, r: int, what: str, seq: int) -> PeerError:
        return PeerError(f"{self._where_seq(what, seq)}: rank {r} (pid {self._pids[r]}) "
                         f"died", peer=r)

    def _raise_if_a_peer_died(self, what: str, seq: int) -> None:
        """PeerError naming a peer whose process is gone, if one is: where a peer
        failed because another died (it noticed first), the dead one is what to name."""
        u64 = self._u64
        for p in self._peers:
            if u64 is not None and u64[self._state_idx[p]] == sg.STATE_CLOSED:
                continue   # it left the group in order (and may have exited since)
            if self._dead(p):
                raise self._died(p, what, seq)

    def _where_seq(self, what: str, seq: int) -> str:
        # Built only when raising: _check_peer runs on every slow wait.
        return self.where(what) + (f" (seq {seq})" if seq >= 0 else "")

    def _backoff(self, stage: list, deadline: float, expected_bell: int) -> None:
        """One step of waiting: spin, then yield, then sleep in the kernel.

        ``stage`` is the caller's [start, last_liveness_check, sleep_s] state."""
        now = time.perf_counter()
        elapsed = now - stage[0]
        if elapsed < self._spin_s:
            return
        if elapsed < self._spin_s + self._yield_s:
            os.sched_yield()
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if self._bells.mode == "futex":
            self._bells.sleep(expected_bell, min(_SLICE, remaining))
        else:
            time.sleep(min(stage[2], remaining))
            stage[2] = min(stage[2] * 2, 1e-3)

    def _await_all(self, q: int) -> None:
        """Return once every rank published phase ``q``."""
        u64 = self._u64
        for i in self._arrived_idx:
            if u64[i] < q:
                break
        else:
            return
        self._await_slow(q)

    def _await_slow(self, q: int) -> None:
        u64, idx, bells, engine = self._u64, self._arrived_idx, self._bells, self._engine
        deadline = time.monotonic() + self.timeout
        start = time.perf_counter()
        stage = [start, start, 5e-5]
        while True:
            bell = bells.current()
            missing = [r for r in self._all if u64[idx[r]] < q]
            if not missing:
                return
            if engine.pending and engine.lock.acquire(blocking=False):
                moved = False
                try:  # keep this rank's own sends and receives moving meanwhile
                    if not engine.closed:
                        moved = engine.progress_locked(drain=False)
                finally:
                    engine.lock.release()
                if moved and bells.local_sleepers():
                    bells.ring([self.rank])  # a thread of ours may wait for that
            now = time.perf_counter()
            if now - start > self._spin_s:
                check_pid = now - stage[1] > _LIVENESS_EVERY
                if check_pid:
                    stage[1] = now
                for r in missing:
                    i = idx[r]
                    if u64[i] < q:
                        self._check_peer(r, self._op_name, self._op_seq, check_pid=check_pid,
                                         done=lambda i=i: u64[i] >= q)
                if time.monotonic() >= deadline:
                    missing = [r for r in self._all if u64[idx[r]] < q]
                    if missing:
                        raise CollectiveTimeout(
                            f"{self.where(self._op_name)} (seq {self._op_seq}): timed out "
                            f"after {self.timeout:g} s waiting for ranks {missing} "
                            f"(phase {q}); they did not arrive",
                            op=self._op_name, seq=self._op_seq, missing=missing)
            self._backoff(stage, deadline, bell)

    def _p2p_wait(self, op, timeout: Optional[float], what: str, peer: int) -> None:
        engine, bells = self._engine, self._bells
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        start = time.perf_counter()
        stage = [start, start, 5e-5]
        while not op.done:
            bell = bells.current()
            moved = False
            with engine.lock:
                if not op.done and not engine.closed:
                    moved = engine.progress_locked(drain=False)
                    if not op.done and not moved:
                        moved = engine.progress_locked(drain=True)
            if moved and bells.local_sleepers():
                bells.ring([self.rank])  # another thread of ours may wait for this
            if op.done:
                break
            if engine.closed:
                raise CollectiveError(f"{self.where(what)}: the group was closed")
            if moved:
                stage[0] = time.perf_counter()
                continue
            now = time.perf_counter()
            if now - start > self._spin_s and peer != self.rank:
                check_pid = now - stage[1] > _LIVENESS_EVERY
                if check_pid:
                    stage[1] = now
                self._check_peer(peer, what, -1, fatal_states=(sg.STATE_CLOSED,),
                                 check_pid=check_pid,
                                 done=lambda: self._progress_once(op))
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(
                        f"{self.where(what)}: timed out after {limit:g} s; rank {peer} "
                        f"did not {'receive' if isinstance(op, SendOp) else 'send'} it",
                        op=what, missing=[peer])
            self._backoff(stage, deadline, bell)
        if op.error is not None:
            raise op.error

    def _progress_once(self, op) -> bool:
        """Move this rank's messages once (draining what arrived); whether ``op`` is done.
        For a peer found closed or dead: what it sent before is still in the rings."""
        engine = self._engine
        with engine.lock:
            if not op.done and not engine.closed:
                engine.progress_locked(drain=True)
        return op.done

    # --------------------------------------------------------- point to point
    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        op = self._engine.post_send(array, dst, tag, dtype_code(array.dtype))
        return _P2PWork(self, op, f"send to rank {dst} (tag {tag})", dst)

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        op = self._engine.post_recv(array, src, tag, dtype_code(array.dtype))
        return _P2PWork(self, op, f"recv from rank {src} (tag {tag})", src)

    # ------------------------------------------------------------ persistent
    def persistent(self, op, arrays, reduce_op):
        """Each round straight to the phase functions (see backends.shm.persistent)."""
        from .persistent import persistent_call
        return persistent_call(self, op, arrays, reduce_op)

    # -------------------------------------------------------------- sub-groups
    def new_group(self, ranks: tuple[int, ...], instance: int) -> "ShmBackend":
        world = tuple(self._world_ranks[r] for r in ranks)
        key = f"{self._key}.g{'-'.join(map(str, world))}i{instance}"
        if len(key) > 120:
            key = "h" + hashlib.sha256(key.encode()).hexdigest()[:32]
        return ShmBackend.open(self._job_id, key, ranks.index(self.rank), len(ranks),
                               self.timeout, world)

    # ---------------------------------------------------------------- lifetime
    def _mark(self, state: int) -> None:
        u64 = self._u64
        if u64 is None or os.getpid() != self._owner_pid:
            return
        idx = self._state_idx[self.rank]
        if u64[idx] == sg.STATE_ATTACHED or state == sg.STATE_FAILED:
            u64[idx] = state
        self._bells.ring(self._peers)

    def abort(self) -> None:
        """Mark this rank failed in the segment (its peers' waits for it raise PeerError
        at once), end this rank's own waits (every wait looks at the group's state at
        least every ``_LIVENESS_EVERY``) and release the segment once no thread is in a
        call (at most a second); nothing waits for a peer."""
        self._aborted = True
        try:
            self._mark(sg.STATE_FAILED)
        except Exception:  # noqa: BLE001 - the segment may be gone already
            pass
        self.close()

    def close(self) -> None:
        with self._close_lock:
            seg = self._seg
            if seg is None:
                return
            self._seg = None
            try:
                self._mark(sg.STATE_CLOSED)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
            if self._native is not None:
                self._py_phase = self._native.phase   # (the counter moves back here)
            self._native = None  # releases its hold on the mapping
            self._engine.close()
            for name in ("send_now", "recv_now", "all_reduce", "barrier"):
                self.__dict__.pop(name, None)   # the bound fast paths (and their cycles)
            self._typed.clear()
            self._small_cache.clear()
            self._release_symmetric()
            self._slots = []
            self._u64 = None
            seg.close()
            if self._placement is not None:
                self._placement.release()

    def __del__(self) -> None:
        # Collected without close(): tell the peers (best effort), never raise. Not in a
        # forked child, whose copy of the group must not close its parent's rank.
        try:
            if getattr(self, "_seg", None) is not None and getattr(self, "_u64", None) \
                    is not None and os.getpid() == self._owner_pid:
                self._u64[self._state_idx[self.rank]] = sg.STATE_CLOSED
        except Exception:  # noqa: BLE001
            pass
