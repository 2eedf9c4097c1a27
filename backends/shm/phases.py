"""The phase protocol of one shm group, in Python: entering a phase, waiting for every
rank to publish it, comparing their fingerprints, and every error a wait can end in.

Every rank counts phases identically. In phase q a rank writes only its own slot of bank
``q % 2`` (every rank has published phase q-1, so nobody still reads that bank from
phase q-2), stores its op fingerprint (:mod:`backends.shm.codes`) and ``arrived = q``,
rings the others, waits until every rank arrived at q, compares their fingerprints with
its own (a few integer compares: different ops, sizes, dtypes, roots or reduce ops raise
CollectiveMismatch on every rank) and then reads bank ``q % 2``. Each phase is thus a
full barrier; large messages go through in chunks of S bytes (one slot) with the two
banks pipelining consecutive chunks, so any size works with a fixed footprint of
2 x n x S bytes.

Waiting never burns a core for long: up to 50 microseconds of spinning (none when the
ranks outnumber the cores), ``sched_yield`` for up to a millisecond
(``native.wait_policy``: longer with a core per rank, shorter when oversubscribed), then
sleep in the kernel on this rank's doorbell (``futex.Doorbells``), in slices of at most
200 ms so that the deadline, the group's state (an abort) and the peers' liveness (pid
alive and not a zombie; their state word: failed or closed) are checked. The yield phase
pays for itself because a futex wake-up costs tens of microseconds on virtual machines:
two ranks that both went to sleep would hand each phase over through the kernel.

Errors: a wait past ``timeout`` raises CollectiveTimeout (op, sequence number, missing
ranks); a dead or departed peer raises PeerError naming it within about 0.3 s; after an
error in a collective this rank marks itself failed in shared memory (:meth:`Phases.fail`),
so its peers raise PeerError at once instead of waiting for their own timeout.

Writes into a peer's memory (the single copy's and symmetric memory's pushes) are fenced
against that peer's exit with an error (:meth:`Phases.push_into`,
:meth:`Phases.await_pushers`), as a Dekker lock: the writer stores "writing into r" in
its ``W_PUSHING`` word, then loads r's state and writes only if r has neither failed nor
closed; a rank leaving with an error stores its failed state, then waits while a live
peer names it. With a full fence between each side's store and load, at least one of
the two sees the other's store: nothing is written into an array once its call returned,
unless a peer stops in the middle of a piece for longer than the timeout (a debugger,
SIGSTOP), which the error's note then names.

The compiled core (:mod:`backends.shm.native_core`) runs the same protocol over the same
words; it keeps the phase counter then (``Phases.counter`` is its group object).

Two ranks, a barrier by hand::

    phases.start(OP_BARRIER, seq)
    phases.exchange(phases.enter())     # (the core's exchange where it is loaded)
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import numpy as np

from collectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, \
    PeerError, add_note
from collectives.lifetime import process_alive

from . import segment as sg
from .channels import SendOp
from .codes import ALIGN, DTYPE_CODE, OP_FAILED, OP_NAMES, REDOP_BY_ID, describe, fingerprint

#: Longest single sleep: the deadline, the group's state and liveness are checked after.
SLICE = 0.2
#: Seconds between pid checks of the ranks being waited for (and the longest single
#: wait of the compiled core).
LIVENESS_EVERY = 0.1
_SMALL_CACHE_MAX = 32   # (dtype, length) entries of cached small-message views


class PhaseCounter:
    """The phase counter where no compiled core keeps it (the core's group object has
    the same ``phase`` attribute)."""

    __slots__ = ("phase",)

    def __init__(self, phase: int) -> None:
        self.phase = phase


class Phases:
    """One rank's side of a group's phase protocol over its segment.

    ``owner`` is the backend (its ``rank``, ``size``, ``timeout`` and ``where`` name the
    calls); ``engine`` (point to point) is set once it exists: a wait keeps this rank's
    sends and receives moving. ``counter.phase`` is the last phase this rank entered.
    """

    def __init__(self, owner: Any, seg: sg.Segment, bells: Any, spin_s: float,
                 yield_s: float) -> None:
        self.owner = owner
        rank, size = owner.rank, owner.size
        self.rank, self.size = rank, size
        self.seg = seg
        lay = self.layout = seg.layout
        self.u64 = seg.u64
        self.S = lay.chunk
        self.all = list(range(size))
        self.peers = [r for r in range(size) if r != rank]
        self.arrived_idx = [lay.ctrl_word(r, sg.W_ARRIVED) for r in range(size)]
        self.me_arrived = self.arrived_idx[rank]
        self.fp_idx = [[lay.ctrl_word(r, sg.W_FP + 2 * p) for r in range(size)]
                       for p in (0, 1)]
        self.state_idx = [lay.ctrl_word(r, sg.W_STATE) for r in range(size)]
        self.pids = [seg.u64[lay.ctrl_word(r, sg.W_PID)] for r in range(size)]
        self.pid_checkable = [
            r != rank and sg.same_pid_namespace(seg.u64[lay.ctrl_word(r, sg.W_PIDNS)])
            for r in range(size)]
        self.bells = bells
        self.spin_s, self.yield_s = spin_s, yield_s
        self.engine: Any = None
        self.counter: Any = PhaseCounter(int(seg.u64[self.me_arrived]))
        self.slots = [[seg.bytes[lay.slot_off(b, r):lay.slot_off(b, r) + lay.chunk]
                       for r in range(size)] for b in (0, 1)]
        self._typed: dict = {}
        self._small: dict = {}
        #: The call in progress, for errors: its name, sequence number and fingerprint.
        self.op_name, self.op_seq = "", -1
        self.fp0 = self.fp1 = 0
        #: The error that broke the group (every later call raises it), or None.
        self.broken: Optional[BaseException] = None
        #: Set by abort(): every wait ends at its next look.
        self.aborted = False
        #: A forked child's copy of the group must not speak for this rank.
        self.owner_pid = os.getpid()

    # ------------------------------------------------------------------- naming
    @property
    def timeout(self) -> float:
        return self.owner.timeout

    def where_seq(self, what: str, seq: int) -> str:
        # Built only when raising: check_peer runs on every slow wait.
        return self.owner.where(what) + (f" (seq {seq})" if seq >= 0 else "")

    # -------------------------------------------------------------- a phase
    @property
    def phase(self) -> int:
        """The last phase this rank entered (the compiled core keeps it where loaded)."""
        return self.counter.phase

    @phase.setter
    def phase(self, q: int) -> None:
        self.counter.phase = q

    def start(self, opcode: int, seq: int, dtype: Optional[np.dtype] = None,
              nbytes: int = 0, root: int = -1, redop: Any = None) -> None:
        """Begin a call: raise if the group is broken, closed or aborted; note what the
        call is (its errors name it) and its fingerprint."""
        name = OP_NAMES[opcode]
        self.check_usable(name, seq)
        self.op_name, self.op_seq = name, seq
        self.fp0 = fingerprint(opcode, REDOP_BY_ID.get(id(redop), 0), DTYPE_CODE.get(dtype, 0),
                               root, seq)
        self.fp1 = nbytes

    def check_usable(self, name: str, seq: int) -> None:
        """Raise for a group that failed, was aborted or closed."""
        if self.aborted:
            raise CollectiveError(f"{self.where_seq(name, seq)}: the group was aborted")
        if self.broken is not None:
            raise CollectiveError(
                f"{self.owner.where(name)} (seq {seq}): this group failed in an earlier "
                f"collective ({type(self.broken).__name__}: {self.broken}); close it")
        if self.u64 is None:
            raise CollectiveError(f"{self.owner.where(name)}: the group is closed")

    def enter(self) -> int:
        """Begin the next phase: publish the fingerprint for it; return its number."""
        q = self.counter.phase + 1
        self.counter.phase = q
        u64, i = self.u64, self.fp_idx[q & 1][self.rank]
        u64[i] = self.fp0
        u64[i + 1] = self.fp1
        return q

    def exchange(self, q: int) -> None:
        """Publish phase ``q``, wait for everybody's, check their fingerprints.

        Only the last rank to arrive rings the others (each waiter is woken once per
        phase, not once per arrival). Two ranks arriving at once both store ``arrived``,
        fence, then load the others' (Dekker): at least one of them sees everybody."""
        u64 = self.u64
        u64[self.me_arrived] = q
        self.bells.fence()
        for i in self.arrived_idx:
            if u64[i] < q:
                break
        else:
            self.bells.ring(self.peers)
        self.await_all(q)
        fp0, fp1 = self.fp0, self.fp1
        for i in self.fp_idx[q & 1]:
            if u64[i] != fp0 or u64[i + 1] != fp1:
                self.mismatch(q)

    def mismatch(self, q: int) -> None:
        """Raise for phase ``q`` whose fingerprints differ: PeerError where a peer failed
        in it, else CollectiveMismatch naming both calls."""
        u64 = self.u64
        mine = describe(self.fp0, self.fp1)
        fps = [(r, u64[i], u64[i + 1]) for r, i in enumerate(self.fp_idx[q & 1])]
        where = f"{self.owner.where(self.op_name)} (seq {self.op_seq})"
        for r, fp0, fp1 in fps:
            if fp0 & 0xF == OP_FAILED:
                raise PeerError(f"{where}: rank {r} failed in this collective (see its "
                                f"error)", peer=r)
        for r, fp0, fp1 in fps:
            if fp0 != self.fp0 or fp1 != self.fp1:
                raise CollectiveMismatch(f"{where}: rank {r} called {describe(fp0, fp1)}; "
                                         f"this rank {mine}")

    # -------------------------------------------------------------- the slots
    def sv(self, bank: int, r: int, dt: np.dtype) -> np.ndarray:
        """Slot ``r`` of ``bank`` as a flat array of ``dt``."""
        return self.views(dt)[bank][r]

    def views(self, dt: np.dtype) -> list:
        """``[bank][rank]`` -> that slot as a flat array of ``dt`` (cached)."""
        views = self._typed.get(dt)
        if views is None:
            views = self._typed[dt] = [[slot.view(dt) for slot in bank]
                                       for bank in self.slots]
        return views

    def small_views(self, dt: np.dtype, count: int) -> tuple:
        """``[bank][rank]`` -> the first ``count`` elements of that slot as ``dt``
        (cached per (dtype, length): the one-phase reduce then does no slicing)."""
        key = (dt, count)
        views = self._small.get(key)
        if views is None:
            if len(self._small) >= _SMALL_CACHE_MAX:
                self._small.clear()
            views = self._small[key] = tuple([slot[:count] for slot in bank]
                                             for bank in self.views(dt))
        return views

    def piece_elems(self, itemsize: int) -> int:
        """Elements of one of the n pieces of a slot (64-byte aligned)."""
        return (self.S // self.size) // ALIGN * ALIGN // itemsize

    def a2a_head_bytes(self) -> int:
        """Where the input starts in the all_to_all's first slot: after the 2n counts."""
        return (16 * self.size + ALIGN - 1) // ALIGN * ALIGN

    # ------------------------------------------------------------------ waits
    def await_all(self, q: int) -> None:
        """Return once every rank published phase ``q``."""
        u64 = self.u64
        for i in self.arrived_idx:
            if u64[i] < q:
                break
        else:
            return
        self.await_slow(q)

    def await_slow(self, q: int) -> None:
        """:meth:`await_all`'s wait: spin, yield, sleep; move this rank's point to point
        meanwhile; raise for a dead, failed or departed peer, an abort or the timeout."""
        u64, idx, bells, engine = self.u64, self.arrived_idx, self.bells, self.engine
        timeout = self.timeout
        deadline = time.monotonic() + timeout
        start = time.perf_counter()
        stage = [start, start, 5e-5]
        while True:
            bell = bells.current()
            missing = [r for r in self.all if u64[idx[r]] < q]
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
            if now - start > self.spin_s:
                if self.aborted:
                    raise CollectiveError(f"{self.where_seq(self.op_name, self.op_seq)}: "
                                          f"the group was aborted")
                check_pid = now - stage[1] > LIVENESS_EVERY
                if check_pid:
                    stage[1] = now
                for r in missing:
                    i = idx[r]
                    if u64[i] < q:
                        self.check_peer(r, self.op_name, self.op_seq, check_pid=check_pid,
                                        done=lambda i=i: u64[i] >= q)
                if time.monotonic() >= deadline:
                    self.raise_timeout(q, [r for r in self.all if u64[idx[r]] < q])
            self.backoff(stage, deadline, bell)

    def raise_timeout(self, q: int, missing: list) -> None:
        if missing:
            raise CollectiveTimeout(
                f"{self.owner.where(self.op_name)} (seq {self.op_seq}): timed out after "
                f"{self.timeout:g} s waiting for ranks {missing} (phase {q}); they did not "
                f"arrive", op=self.op_name, seq=self.op_seq, missing=missing)

    def backoff(self, stage: list, deadline: float, expected_bell: int) -> None:
        """One step of waiting: spin, then yield, then sleep in the kernel.

        ``stage`` is the caller's [start, last_liveness_check, sleep_s] state."""
        now = time.perf_counter()
        elapsed = now - stage[0]
        if elapsed < self.spin_s:
            return
        if elapsed < self.spin_s + self.yield_s:
            os.sched_yield()
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if self.bells.mode == "futex":
            self.bells.sleep(expected_bell, min(SLICE, remaining))
        else:
            time.sleep(min(stage[2], remaining))
            stage[2] = min(stage[2] * 2, 1e-3)

    def p2p_wait(self, op: Any, timeout: Optional[float], what: str, peer: int) -> None:
        """Wait for a posted send or receive (``op`` of the channels' engine) to complete,
        moving every pending operation of this rank meanwhile; raise for a peer that
        closed or died (once what it sent before is read), an abort, or the timeout."""
        engine, bells = self.engine, self.bells
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
            if engine.closed or self.aborted:
                how = "aborted" if self.aborted else "closed"
                raise CollectiveError(f"{self.owner.where(what)}: the group was {how}")
            if moved:
                stage[0] = time.perf_counter()
                continue
            now = time.perf_counter()
            if now - start > self.spin_s and peer != self.rank:
                check_pid = now - stage[1] > LIVENESS_EVERY
                if check_pid:
                    stage[1] = now
                self.check_peer(peer, what, -1, fatal_states=(sg.STATE_CLOSED,),
                                check_pid=check_pid, done=lambda: self.progress_once(op))
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(
                        f"{self.owner.where(what)}: timed out after {limit:g} s; rank {peer} "
                        f"did not {'receive' if isinstance(op, SendOp) else 'send'} it",
                        op=what, missing=[peer])
            self.backoff(stage, deadline, bell)
        if op.error is not None:
            raise op.error

    def progress_once(self, op: Any) -> bool:
        """Move this rank's messages once (draining what arrived); whether ``op`` is done.
        For a peer found closed or dead: what it sent before is still in the rings."""
        engine = self.engine
        with engine.lock:
            if not op.done and not engine.closed:
                engine.progress_locked(drain=True)
        return op.done

    # --------------------------------------------------------------- the peers
    def check_peer(self, r: int, what: str, seq: int, *,
                   fatal_states=(sg.STATE_FAILED, sg.STATE_CLOSED), check_pid: bool,
                   done: Optional[Callable[[], bool]] = None) -> None:
        """Raise PeerError if rank ``r`` closed, failed or died, unless ``done()`` says
        that what this rank waits for from ``r`` arrived after all. Where ``r`` failed,
        a peer that died is named instead: ``r`` most likely failed because of it.

        ``done`` is asked *after* the state (and the pid) was read, and that order is
        what makes it right: a peer publishes its arrival (or its message) before it
        closes or exits, so a state read as CLOSED guarantees that a later read sees the
        arrival if there was one (x86-64: stores become visible in order, loads are not
        reordered). The caller's own check came before, so between its "not arrived"
        and our "closed" the peer may have arrived, finished and closed: on two cores
        and four ranks a rank is preempted there now and then."""
        u64 = self.u64
        state = u64[self.state_idx[r]] if u64 is not None else sg.STATE_CLOSED
        if state in fatal_states:
            if done is not None and self.u64 is not None and done():
                return
            if state == sg.STATE_FAILED:
                self.raise_if_a_peer_died(what, seq)   # the cause, not its consequence
            how = "closed the group" if state == sg.STATE_CLOSED else \
                "failed in a collective (see its own error)"
            raise PeerError(f"{self.where_seq(what, seq)}: rank {r} {how}", peer=r)
        if check_pid and self.dead(r):
            if done is not None and self.u64 is not None and done():
                return
            raise self.died(r, what, seq)

    def dead(self, r: int) -> bool:
        """Rank ``r``'s process is gone (as far as this rank can see its pid)."""
        return self.pid_checkable[r] and not process_alive(self.pids[r])

    def died(self, r: int, what: str, seq: int) -> PeerError:
        return PeerError(f"{self.where_seq(what, seq)}: rank {r} (pid {self.pids[r]}) died",
                         peer=r)

    def raise_if_a_peer_died(self, what: str, seq: int) -> None:
        """PeerError naming a peer whose process is gone, if one is: where a peer
        failed because another died (it noticed first), the dead one is what to name."""
        u64 = self.u64
        for p in self.peers:
            if u64 is not None and u64[self.state_idx[p]] == sg.STATE_CLOSED:
                continue   # it left the group in order (and may have exited since)
            if self.dead(p):
                raise self.died(p, what, seq)

    # ------------------------------------------------------------- failures
    def guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one collective; any failure leaves the group broken and tells the peers."""
        try:
            fn(*args)
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` as the group's failure and tell the peers (best effort): over a
        phase this rank already published, its fingerprint becomes OP_FAILED, so a peer
        arriving later raises PeerError instead of completing with it. Then wait for a
        peer in the middle of writing into this rank's memory: once this returns, none
        writes there any more."""
        if self.u64 is not None and self.broken is None:
            self.broken = exc
            self.mark_failed()
            writing = self.await_pushers()
            if writing:
                add_note(exc, f"[rank {self.rank}] ranks {writing} were still writing into "
                              f"this call's memory {self.timeout:g} s after this error "
                              f"(stopped in the middle of a piece?)")

    def mark_failed(self) -> None:
        """Tell the peers this rank failed (best effort, never raises): its state word,
        and over a phase it already published, its fingerprint (OP_FAILED), so that a
        peer arriving there later raises PeerError instead of completing with it."""
        try:
            q = self.counter.phase
            if self.u64[self.me_arrived] == q:
                i = self.fp_idx[q & 1][self.rank]
                self.u64[i] = OP_FAILED | (self.fp0 & ~0xF)
            self.mark(sg.STATE_FAILED)
        except Exception:  # noqa: BLE001 - the caller's error is what matters
            pass

    def mark(self, state: int) -> None:
        """Publish this rank's state (CLOSED only over ATTACHED; FAILED always) and ring
        the peers, so that their waits for it look at once."""
        u64 = self.u64
        if u64 is None or os.getpid() != self.owner_pid:
            return
        idx = self.state_idx[self.rank]
        if u64[idx] == sg.STATE_ATTACHED or state == sg.STATE_FAILED:
            u64[idx] = state
        self.bells.ring(self.peers)

    # ----------------------------------------------------- writes into peers
    def await_pushers(self) -> list:
        """After this rank marked itself failed: wait until no live peer is in the middle
        of a write into this rank's memory, at most the group's timeout; the ranks still
        writing then (empty unless one is stopped)."""
        u64 = self.u64
        if u64 is None or self.size == 1:
            return []
        self.bells.fence()
        lay, mine = self.layout, self.rank + 1
        deadline = time.monotonic() + self.timeout
        while True:
            writing = [r for r in self.peers
                       if u64[lay.ctrl_word(r, sg.W_PUSHING)] == mine and not self.dead(r)]
            if not writing or time.monotonic() >= deadline:
                return writing
            time.sleep(0.0002)

    def raise_failed_peer(self) -> None:
        """A write into a peer was refused (the core's CANCELED / -ECANCELED): raise the
        PeerError naming the peer that failed or closed (or died, its cause)."""
        for r in self.peers:
            self.check_peer(r, self.op_name, self.op_seq, check_pid=True)
        raise CollectiveError(f"{self.owner.where(self.op_name)} (seq {self.op_seq}): a "
                              f"write into a peer was refused, but no peer failed")

    def push_into(self, r: int, view: np.ndarray, values: np.ndarray) -> None:
        """``view[...] = values`` where ``view`` is memory of rank ``r``, fenced against
        r's exit (the Python path's side of the core's ``push_begin``/``push_end``):
        PeerError naming r, and nothing written, where r has failed or closed."""
        u64, word = self.u64, self.layout.ctrl_word(self.rank, sg.W_PUSHING)
        try:
            u64[word] = r + 1
            self.bells.fence()
            self.check_peer(r, self.op_name, self.op_seq, check_pid=False)
            np.copyto(view, values)
        finally:
            u64[word] = 0

    # -------------------------------------------------------------- lifetime
    def release(self) -> None:
        """Forget the mapping's views (the segment is closed by its owner next)."""
        self._typed.clear()
        self._small.clear()
        self.slots = []
        self.u64 = None
