"""The compiled path of the shm backend: :class:`NativeCore`, the interface of
:mod:`backends.shm.core` over the compiled core (``_native.c``).

It runs exactly the protocol of the Python path (same slots, fingerprints, phases,
doorbells, rings): one C call publishes a phase (release order), waits for it (spin,
yield, futex; the GIL released) and checks the fingerprints; the one-phase reduce, a
one-phase move of the gather and scatter families and all_to_all's first phase copy,
publish, wait and finish in one call each, as do the pipelined and the symmetric
all_reduce over their phases. The core keeps the phase counter (``counter`` is its group
object), because its one-phase all_reduce enters phases without Python.

The C waits never raise: each returns after at most ``phases.LIVENESS_EVERY`` seconds
(less with point to point in flight, which Python's wait moves), or at once when a
missing peer failed or closed, and Python then waits the phase out (:meth:`NativeCore.settle`)
and raises what the Python path raises (``CollectiveTimeout``, ``PeerError``,
``CollectiveMismatch``).

Two ranks, both: ``core.all_reduce(a, ReduceOp.SUM, seq)`` on 16 bytes is one call of
``Group.small_all_reduce``: copy in, publish, wait, reduce in rank order.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives.errors import CollectiveError, CollectiveTimeout
from collectives.reduce_op import ReduceOp

from . import moves
from . import segment as sg
from .channels import RecvOp
from .codes import (DTYPE_CODE, OP_ALL_GATHER, OP_ALL_REDUCE, OP_ALL_TO_ALL,
                    OP_BARRIER, OP_BROADCAST, OP_GATHER, OP_REDUCE_SCATTER, OP_SCATTER,
                    REDOP_BY_ID, fingerprint)
from .native import NativeDoorbells
from .phases import LIVENESS_EVERY, SLICE, Phases
from .reduce import small_limit

#: Which of the core's one-phase moves a collective is.
_MOVES = {OP_BROADCAST: "MOVE_BROADCAST", OP_ALL_GATHER: "MOVE_GATHER",
          OP_GATHER: "MOVE_GATHER", OP_SCATTER: "MOVE_SCATTER",
          OP_REDUCE_SCATTER: "MOVE_REDUCE_SCATTER"}


class NativeCore:
    """The shm protocol on the compiled core ``mod`` (see the module docstring)."""

    native = True

    def __init__(self, phases: Phases, mod: ModuleType) -> None:
        ph = self.ph = phases
        lay, seg = phases.layout, phases.seg
        mode = phases.bells.mode
        group = mod.Group(seg.mm, lay.ctrl_off, lay.data_off, lay.chunk, ph.rank, ph.size,
                          ph.spin_s, ph.yield_s, SLICE, mode == "futex")
        group.small_limit = small_limit(ph)
        group.phase = phases.counter.phase
        self.group = self.counter = group
        phases.counter = group   # (from now on the core keeps the phase counter)
        phases.bells = NativeDoorbells(group, mode)
        self.mod = mod
        self.DONE, self.MISMATCH, self.DECLINED = mod.DONE, mod.MISMATCH, mod.DECLINED
        self.CANCELED, self.NOT_TAKEN = mod.CANCELED, mod.NOT_TAKEN
        self._moves = {op: getattr(mod, name) for op, name in _MOVES.items()}
        #: The longest single C wait (the deadline and the peers' pids are looked at in
        #: between); 0 with point to point in flight (Python's wait moves it).
        self.wait_budget = min(LIVENESS_EVERY, phases.timeout)
        self.engine: Any = None   # the channels' engine, once it exists (bind_engine)
        self._small_all_reduce = group.small_all_reduce

    def bind_engine(self, engine: Any) -> None:
        self.engine = engine

    @property
    def budget(self) -> float:
        return 0.0 if self.engine.pending else self.wait_budget

    # ---------------------------------------------------------------- waiting
    def exchange(self, q: int) -> None:
        """``Phases.exchange`` in one C call: publish q, wait, compare fingerprints."""
        ph = self.ph
        fp0, fp1 = ph.fp0, ph.fp1
        status = self.group.exchange(q, fp0, fp1, self.budget, False)
        if status != self.DONE:   # (the hot path returns here, past no other frame)
            self.wait_out(q, fp0, fp1, status)

    def wait_out(self, q: int, fp0: int, fp1: int, status: int) -> None:
        """Phase q, published with ``(fp0, fp1)``, after the core came back with
        ``status`` other than DONE: wait it out (:meth:`settle`) and raise on a mismatch."""
        group = self.group
        status = self.settle(q, lambda budget: group.exchange(q, fp0, fp1, budget, True),
                             status)
        if status == self.MISMATCH:
            self.ph.mismatch(q)

    def settle(self, q: int, again: Callable[[float], int], status: int) -> int:
        """Keep waiting for phase q (``again(budget)`` waits at most ``budget`` seconds
        and returns the core's status) until it is done or mismatched, and raise, as
        the Python path does, for a missing peer that failed, closed or died, an abort,
        or when the group's timeout passes."""
        ph, group = self.ph, self.group
        timeout = ph.timeout
        deadline = time.monotonic() + timeout - min(LIVENESS_EVERY, timeout)
        last_pid_check = time.monotonic()
        while status != self.DONE and status != self.MISMATCH:
            if self.engine.pending:
                ph.await_slow(q)   # the Python wait, which also moves p2p traffic
                return again(0.0)
            if ph.aborted:
                raise CollectiveError(f"{ph.where_seq(ph.op_name, ph.op_seq)}: the group "
                                      f"was aborted")
            now = time.monotonic()
            check_pid = now - last_pid_check >= LIVENESS_EVERY
            if check_pid:
                last_pid_check = now
            for r in range(ph.size):
                if group.arrived(r) < q:
                    # done() after the state was read: fence, then an acquire load.
                    ph.check_peer(r, ph.op_name, ph.op_seq, check_pid=check_pid,
                                  done=lambda r=r: (group.fence(), group.arrived(r) >= q)[1])
            now = time.monotonic()
            if now >= deadline:
                ph.raise_timeout(q, [r for r in range(ph.size) if group.arrived(r) < q])
            status = again(max(0.0, min(LIVENESS_EVERY, deadline - now)))
        return status

    def p2p_wait(self, op: Any, timeout: Optional[float], what: str, peer: int) -> None:
        """``Phases.p2p_wait`` for the common case of one receive in flight: sleep in C
        until the ring from ``peer`` moves, instead of polling from Python. Anything else
        (a send waiting for room, several operations in flight) takes the Python wait,
        which moves every pending operation of this rank."""
        ph = self.ph
        engine = self.engine
        if op.done or peer == ph.rank or not isinstance(op, RecvOp) or engine.pending != 1:
            return ph.p2p_wait(op, timeout, what, peer)
        group, u64 = self.group, ph.u64
        head_idx = engine.in_head[peer]
        limit = ph.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        last_pid_check = time.monotonic()
        while True:
            head = u64[head_idx]
            with engine.lock:
                if not op.done and not engine.closed and not engine.take_posted_locked(op):
                    if not engine.progress_locked(drain=False) and not op.done:
                        engine.progress_locked(drain=True)
            if op.done:
                break
            if engine.closed or ph.aborted:
                how = "aborted" if ph.aborted else "closed"
                raise CollectiveError(f"{ph.owner.where(what)}: the group was {how}")
            if engine.pending != 1:      # another thread posted meanwhile
                return ph.p2p_wait(op, timeout, what, peer)
            now = time.monotonic()
            if group.wait_change(8 * head_idx, head,
                                 max(0.0, min(LIVENESS_EVERY, deadline - now))) == self.DONE:
                continue
            now = time.monotonic()
            check_pid = now - last_pid_check >= LIVENESS_EVERY
            if check_pid:
                last_pid_check = now
            ph.check_peer(peer, what, -1, fatal_states=(sg.STATE_CLOSED,),
                          check_pid=check_pid, done=lambda: ph.progress_once(op))
            if op.done:
                break
            if now >= deadline:
                raise CollectiveTimeout(
                    f"{ph.owner.where(what)}: timed out after {limit:g} s; rank {peer} did "
                    f"not send it", op=what, missing=[peer])
        if op.error is not None:
            raise op.error

    def blocking_calls(self) -> Optional[tuple[Callable, Callable]]:
        """Blocking send and recv in one C call where they can (the engine's); what the
        ring does not allow goes to the backend's ``isend``/``irecv`` and their wait. The
        C wait is bounded like every C wait here."""
        ph = self.ph
        return self.engine.blocking_calls(ph.owner.isend, ph.owner.irecv,
                                          min(ph.spin_s + ph.yield_s, self.wait_budget),
                                          DTYPE_CODE)

    # ------------------------------------------------------------- reductions
    def combine(self, out: np.ndarray, srcs: list, op: ReduceOp,
                copies: Sequence[np.ndarray] = ()) -> None:
        """The core's rank-order reduction, the GIL released, accumulating block by block
        (any source may be ``out``); the copies made piece by piece while in cache."""
        self.mod.combine(out, srcs, DTYPE_CODE.get(out.dtype, 0), REDOP_BY_ID[id(op)],
                         len(srcs), copies)

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """A message of the one-phase path is one call of the core
        (``small_all_reduce``: the fast path's call reaches C through this frame and the
        backend's); anything else (a larger message: False; point to point in flight, a
        failed group: the one-phase path in Python's hands), and a wait that outlasts
        the core's budget, goes on in Python. A failure breaks the group."""
        ph = self.ph
        if self.engine.pending or ph.broken is not None or ph.aborted:
            return self._small_all_reduce_in_python(a, op, seq)
        try:
            status = self._small_all_reduce(a, op, seq, self.wait_budget)
        except BaseException as exc:
            self._small_all_reduce_state(a, op, seq)
            ph.fail(exc)
            raise
        if status == self.DONE:
            return True
        if status == self.NOT_TAKEN:   # (a dtype or operator the call does not take)
            return self._small_all_reduce_in_python(a, op, seq)
        try:
            fp0, nbytes, code, redop = self._small_all_reduce_state(a, op, seq)
            self._small_waits(a, self.group.phase, fp0, nbytes, code, redop, True, status)
        except BaseException as exc:
            ph.fail(exc)
            raise
        return True

    def _small_all_reduce_in_python(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """The one-phase all_reduce with Python's codes (False: too large for it)."""
        if a.nbytes > self.group.small_limit:
            return False
        try:
            self.small_reduce(a, op, seq, -1, OP_ALL_REDUCE)
        except BaseException as exc:
            self.ph.fail(exc)
            raise
        return True

    def _small_all_reduce_state(self, a: np.ndarray, op: ReduceOp, seq: int) -> tuple:
        """What ``small_all_reduce`` entered its phase with, into the group's state for
        errors; returns (fp0, nbytes, dtype code, operator code)."""
        ph = self.ph
        ph.op_name, ph.op_seq = "all_reduce", seq
        code, redop = DTYPE_CODE.get(a.dtype, 0), REDOP_BY_ID.get(id(op), 0)
        fp0 = ph.fp0 = fingerprint(OP_ALL_REDUCE, redop, code, -1, seq)
        nbytes = ph.fp1 = a.nbytes
        return fp0, nbytes, code, redop

    def small_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                     opcode: int) -> None:
        """The one-phase reduce in one C call: copy in, publish, wait, check, and reduce
        the n slots in rank order into ``a`` (where the result is wanted)."""
        ph = self.ph
        if ph.broken is not None or ph.u64 is None or ph.aborted:
            ph.start(opcode, seq)  # raises the group's error
        ph.op_name = "all_reduce" if dst < 0 else "reduce"
        ph.op_seq = seq
        code = DTYPE_CODE.get(a.dtype, 0)
        redop = REDOP_BY_ID.get(id(op), 0)
        fp0 = ph.fp0 = fingerprint(opcode, redop, code, dst, seq)
        nbytes = ph.fp1 = a.nbytes
        group = self.group
        q = group.phase = group.phase + 1
        want = dst < 0 or dst == ph.rank
        status = group.small_reduce(a, q, fp0, nbytes, code, redop, want, self.budget, False)
        if status != self.DONE:
            self._small_waits(a, q, fp0, nbytes, code, redop, want, status)

    def _small_waits(self, a: np.ndarray, q: int, fp0: int, nbytes: int, code: int,
                     redop: int, want: bool, status: int) -> None:
        """Wait out the one-phase reduce's phase q after the core came back with
        ``status``, and reduce once it is done; raise as the Python path does."""
        group = self.group
        if status != self.MISMATCH:
            status = self.settle(
                q, lambda b: group.small_reduce(a, q, fp0, nbytes, code, redop, want, b,
                                                True), status)
        if status == self.MISMATCH:
            self.ph.mismatch(q)

    def pipelined_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                         opcode: int) -> None:
        """Reduce-scatter + all-gather (:mod:`backends.shm.reduce`) in calls of the core
        (``pipelined``): the same slots, pieces and phases, every step's copies and
        reduction with the GIL released; Python only where a phase's wait outlasts the
        core's budget (it waits that phase out as ``exchange`` does, and the core goes
        on from the next step)."""
        ph, group = self.ph, self.group
        ph.start(opcode, seq, a.dtype, a.nbytes, dst, op)
        fp0, fp1 = ph.fp0, ph.fp1
        q0 = group.phase + 1
        code, redop = DTYPE_CODE.get(a.dtype, 0), REDOP_BY_ID[id(op)]
        result = dst < 0 or dst == ph.rank
        budget = self.budget
        j = 0
        while True:
            status, j = group.pipelined(a, q0, fp0, fp1, code, redop, result, j, budget)
            if status == self.DONE:
                group.phase = q0 + j - 1   # the last step's phase
                return
            group.phase = q0 + j
            self.wait_out(q0 + j, fp0, fp1, status)
            j += 1

    # ------------------------------------------- the gather and scatter families
    def move(self, opcode: int, inp: Optional[np.ndarray], out: Optional[np.ndarray],
             root: int, op: Optional[ReduceOp], nbytes: int, seq: int) -> bool:
        """A broadcast, gather family or scatter family call whose message fits one slot
        (``nbytes`` of one rank's part; the scatter family's whole input): one phase of
        the core's ``move`` (codes, fingerprint and phase found in C, as
        ``small_all_reduce`` does); a wait that outlasts the core's budget, or a call it
        does not take, goes on in Python. False where the message does not fit."""
        ph = self.ph
        whole = nbytes * ph.size if opcode in (OP_SCATTER, OP_REDUCE_SCATTER) else nbytes
        if whole > ph.S:
            return False
        if ph.broken is not None or ph.u64 is None or ph.aborted:
            ph.start(opcode, seq)   # raises the group's error
        kind = self._moves[opcode]
        try:
            status = self.group.move(kind, opcode, inp, out, seq, root, op, self.budget)
        except BaseException as exc:
            self._move_state(opcode, inp, out, root, op, nbytes, seq)
            ph.fail(exc)
            raise
        if status != self.DONE:
            self._move_waits(kind, opcode, inp, out, root, op, nbytes, seq, status)
        return True

    def _move_state(self, opcode: int, inp: Optional[np.ndarray], out: Optional[np.ndarray],
                    root: int, op: Optional[ReduceOp], nbytes: int,
                    seq: int) -> tuple[int, int, int]:
        """``Phases.start`` for this move (what the errors read); returns (fp0, dtype
        code, operator code)."""
        dtype = (out if inp is None else inp).dtype
        ph = self.ph
        ph.start(opcode, seq, dtype, nbytes, root, op)
        return ph.fp0, DTYPE_CODE.get(dtype, 0), 0 if op is None else REDOP_BY_ID[id(op)]

    def _move_waits(self, kind: int, opcode: int, inp: Optional[np.ndarray],
                    out: Optional[np.ndarray], root: int, op: Optional[ReduceOp],
                    nbytes: int, seq: int, status: int) -> None:
        """After ``move`` came back without its phase done: wait it out (:meth:`settle`,
        then the core finishes the move), or raise; a call ``move`` did not take
        (NOT_TAKEN) runs through ``small_move`` with the codes found here."""
        group = self.group
        try:
            fp0, code, redop = self._move_state(opcode, inp, out, root, op, nbytes, seq)
            if status == self.NOT_TAKEN:
                q = group.phase = group.phase + 1
                status = group.small_move(kind, inp, out, q, fp0, nbytes, root, code, redop,
                                          self.budget, False)
            else:
                q = group.phase
            if status != self.DONE:
                if status != self.MISMATCH:
                    status = self.settle(q, lambda b: group.small_move(
                        kind, inp, out, q, fp0, nbytes, root, code, redop, b, True), status)
                if status == self.MISMATCH:
                    self.ph.mismatch(q)
        except BaseException as exc:
            self.ph.fail(exc)
            raise

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: list,
                   in_counts: list, seq: int) -> None:
        """``moves.all_to_all`` with its first phase in one call of the core (the counts,
        the input where it fits behind them, the wait, the check, the copies): the whole
        call where every rank's input fits; else Python goes on from the counts
        (``moves.all_to_all_rest``: the mismatch error, or the further phases)."""
        ph, group = self.ph, self.group
        head, itemsize = ph.a2a_head_bytes(), out.itemsize
        try:
            ph.start(OP_ALL_TO_ALL, seq, out.dtype, 0)   # (raises on a broken group)
            fp0 = ph.fp0
            q = group.phase = group.phase + 1
            status = group.all_to_all(inp, out, in_counts + out_counts, q, fp0, 0, head,
                                      itemsize, self.budget)
            if status == self.DONE:
                return
            if status != self.MISMATCH and status != self.DECLINED:
                status = self.settle(q, lambda b: group.exchange(q, fp0, 0, b, True), status)
                if status == self.DONE:
                    status = group.all_to_all_take(out, q, head, itemsize)
            if status == self.MISMATCH:
                ph.mismatch(q)
            if status != self.DONE:   # DECLINED: the counts disagree, or more phases
                moves.all_to_all_rest(ph, self, out, inp, out_counts, in_counts, seq, q & 1)
        except BaseException as exc:
            ph.fail(exc)
            raise

    def barrier(self, seq: int) -> None:
        """One call of the core (``barrier``) enters, publishes and waits for the empty
        phase; Python only where point to point is in flight or the group failed, or for
        a wait that outlasts the core's budget."""
        ph = self.ph
        try:
            if self.engine.pending or ph.broken is not None or ph.aborted:
                ph.start(OP_BARRIER, seq)
                self.exchange(ph.enter())
                return
            status = self.group.barrier(OP_BARRIER, seq, self.wait_budget)
            if status != self.DONE:
                ph.start(OP_BARRIER, seq)
                self.wait_out(self.group.phase, ph.fp0, ph.fp1, status)
        except BaseException as exc:
            ph.fail(exc)
            raise

    # ---------------------------------------------------------- symmetric memory
    def symmetric_all_reduce(self, plan: tuple, op: ReduceOp) -> bool:
        """The two phases, the vote and the reduce-and-push in one call of the core
        (``sym_all_reduce``); Python only where a wait outlasts the core's budget."""
        from .symmetric import VOTE_MARK
        ph = self.ph
        _, dtype, where, piece, srcs, copies = plan
        fp0, fp1 = ph.fp0, ph.fp1
        q = self.group.phase = self.group.phase + 1
        call = (piece, srcs, copies, q, fp0 | VOTE_MARK, fp0, fp1, where[0], where[1],
                DTYPE_CODE.get(dtype, 0), REDOP_BY_ID[id(op)])
        status, phase = self.group.sym_all_reduce(*call, self.budget, False)
        return self.symmetric_settled(call, status, phase)

    def symmetric_settled(self, call: tuple, status: int, phase: int) -> bool:
        """After the core's ``sym_all_reduce(*call, budget, resume)`` came back with
        ``status`` in ``phase`` (0: the vote, 1: the push): wait out what is left (the
        core resumes where it stopped), leave the group in phase q + 1, and say whether
        the reduce was done in place (False: every rank declined alike)."""
        ph, group = self.ph, self.group
        q, vfp0, fp0, fp1 = call[3:7]
        if phase == 0 and status != self.DONE and status != self.DECLINED:
            ph.fp0 = vfp0   # (what a mismatch in the vote reports)
            if status != self.MISMATCH:
                status = self.settle(q, lambda b: group.exchange(q, vfp0, fp1, b, True),
                                     status)
            if status == self.MISMATCH:
                ph.mismatch(q)
            status, phase = group.sym_all_reduce(*call, self.wait_budget, True)
        ph.fp0 = fp0
        if status == self.DECLINED:
            return False
        if status == self.CANCELED:   # (a peer failed before this rank's push into it)
            ph.raise_failed_peer()
        group.phase = q + 1
        if status != self.DONE and status != self.MISMATCH:
            status = self.settle(q + 1, lambda b: group.exchange(q + 1, fp0, fp1, b, True),
                                 status)
        if status == self.MISMATCH:
            ph.mismatch(q + 1)
        return True

    def symmetric_round(self, plan: tuple, op: ReduceOp, large: Callable,
                        rest: Callable) -> Optional[Callable[[int], None]]:
        """A persistent all_reduce's round over an array in symmetric memory (DDP's
        bucket), bound once: ``round_(seq)`` does what ``symmetric_all_reduce`` does
        with the start of the call in the same Python frame as the core's call (the
        same phases and fingerprints, so it meets the plain path on the other ranks).
        Where the group has failed, is closed or has point to point in flight, the round
        takes ``large`` (the plain path, which raises or waits as usual); where the vote
        declines, ``rest`` (the other large paths). In a training step every frame
        between the bucket and the core costs a microsecond or two with the caches
        cold."""
        from .symmetric import VOTE_MARK
        a, dtype, where, piece, srcs, copies = plan
        ph, group = self.ph, self.group
        sym, settled, done = group.sym_all_reduce, self.symmetric_settled, self.DONE
        engine = self.engine
        code, redop = DTYPE_CODE.get(dtype, 0), REDOP_BY_ID[id(op)]
        base = fingerprint(OP_ALL_REDUCE, redop, code, -1, 0)   # (the seq field per round)
        nbytes, (w0, w1) = a.nbytes, where

        def round_(seq: int) -> None:
            try:
                if ph.broken is not None or ph.u64 is None or ph.aborted or engine.pending:
                    large(a, op, seq)
                    return
                fp0 = base | ((seq & 0xFFFFFFFF) << 32)
                ph.op_name, ph.op_seq, ph.fp0, ph.fp1 = "all_reduce", seq, fp0, nbytes
                q = group.phase + 1
                group.phase = q
                call = (piece, srcs, copies, q, fp0 | VOTE_MARK, fp0, nbytes, w0, w1,
                        code, redop)
                status, phase = sym(*call, self.wait_budget, False)
                if status == done:
                    group.phase = q + 1
                elif not settled(call, status, phase):
                    rest(a, op, seq)
            except BaseException as exc:
                ph.fail(exc)
                raise
        return round_

    # ------------------------------------------------------------ single copy
    def cma_reduce(self, piece: np.ndarray, pids: list, addrs: list, op: ReduceOp) -> int:
        """The single copy's step 2 (:mod:`backends.shm.cma`): reduce this rank's piece
        from the peers' arrays and push it into theirs; the kernel's error code (0: done)."""
        return self.group.cma_reduce(piece, pids, addrs, DTYPE_CODE.get(piece.dtype, 0),
                                     REDOP_BY_ID[id(op)])

