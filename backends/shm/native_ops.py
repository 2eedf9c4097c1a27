"""The shm group's hot paths over the compiled core (``_native.c``).

Mixed into ``ShmGroup``. When a group's core is loaded, :meth:`NativePaths._use_native`
binds the native versions of the phase exchange, the one-phase reduce and the pipelined
reduce over the Python ones *on the instance* (and ``ShmGroup.__init__`` the all_reduce
hook, once the engine exists), so a native group runs exactly the protocol of
``ops``/``reduce``: same slots, same fingerprints, same phases, same errors. The Python
path pays only for ``_phase``, a property here: while the group is on the core, the core
keeps the phase counter, because its one-phase all_reduce enters phases without Python.
What differs is who does the work: one C call publishes a phase (release order), waits
for it (spin, yield, futex; the GIL released) and checks the fingerprints; the small
reduce copies, publishes, waits and reduces in one call, as do the pipelined and the
symmetric all_reduce over their phases. The C wait never raises: it returns after at
most ``_LIVENESS_EVERY`` seconds, or at once when a missing peer failed or closed, and
Python raises what it raises today (``CollectiveTimeout``, ``PeerError``,
``CollectiveMismatch``).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from collectives import settings
from collectives.errors import CollectiveError, CollectiveTimeout
from collectives.reduce_op import ReduceOp

from . import segment as sg
from .channels import RecvOp
from .cma import CMA_ENV, cma_from_bytes
from .native import NativeDoorbells, native_module, wait_policy
from .ops import (_DTYPE_CODE, _REDOP_BY_ID, OP_ALL_GATHER, OP_ALL_REDUCE, OP_BARRIER,
                  OP_ALL_TO_ALL, OP_BROADCAST, OP_GATHER, OP_REDUCE_SCATTER, OP_SCATTER,
                  CollectiveOps, fingerprint)
from .reduce import ReduceOps

#: Longest single C wait: the deadline and the peers' pids are checked in between.
_LIVENESS_EVERY = 0.1
#: Longest single futex sleep inside a C wait.
_SLICE = 0.2


class NativePaths:
    """The native ``_exchange``, ``_small_reduce``, ``_pipelined_reduce``, ``_p2p_wait``,
    the gather and scatter families' hooks (``_broadcast``, ``_all_gather``,
    ``_gather``, ``_scatter``, ``_reduce_scatter``) and ``_all_to_all`` (bound on the
    instance by ``_use_native``), and ``_all_reduce`` (by ``ShmGroup.__init__``:
    ``_all_reduce_hook``)."""

    _native = None   # the core's Group for this rank, or None on the Python path
    _native_combine = None   # the core's rank-order reduction (GIL released), or None

    _py_phase = 0   # the phase counter on the Python path (see _phase)

    @property
    def _phase(self) -> int:
        """The last phase this rank entered. On the core, the core keeps it (its
        ``small_all_reduce`` enters phases without Python); else this attribute."""
        core = self._native
        return self._py_phase if core is None else core.phase

    @_phase.setter
    def _phase(self, q: int) -> None:
        core = self._native
        if core is None:
            self._py_phase = q
        else:
            core.phase = q

    @property
    def native(self) -> bool:
        """Whether this group runs on the compiled core (False: the Python path, because
        the core is missing or ``COLLECTIVES_SHM_NATIVE=0``)."""
        return self._native is not None

    def _use_native(self) -> None:
        """Called by ``ShmGroup.__init__`` before the point-to-point engine is made:
        load the core for this group and bind the native paths, or leave everything
        as it is (the Python path)."""
        spin, yld = wait_policy(self.size)
        self._spin_s, self._yield_s = spin, yld
        mod = native_module() if self.size > 1 else None
        if mod is None:
            return
        if settings.SHM_CMA.get() == "auto":
            cma_from_bytes(mod)   # measured now, outside any collective (once per process)
        lay, seg = self._layout, self._seg
        mode = self._bells.mode
        core = mod.Group(seg.mm, lay.ctrl_off, lay.data_off, lay.chunk, self.rank,
                         self.size, spin, yld, _SLICE, mode == "futex")
        core.small_limit = self._small_limit
        self._bells = NativeDoorbells(core, mode)
        self._DONE, self._MISMATCH, self._DECLINED = mod.DONE, mod.MISMATCH, mod.DECLINED
        self._CANCELED, self._NOT_TAKEN = mod.CANCELED, mod.NOT_TAKEN
        self._exchange = self._exchange_native
        self._small_reduce = self._small_reduce_native
        self._native = core   # (from now on the core keeps the phase counter: _phase)
        if type(self)._pipelined_reduce is ReduceOps._pipelined_reduce:
            self._pipelined_reduce = self._pipelined_reduce_native
        self._small_bytes = self._small_limit   # (read per call: no property there)
        self._wait_budget = min(_LIVENESS_EVERY, self.timeout)  # longest single C wait
        self._p2p_wait = self._p2p_wait_native
        self._native_combine = mod.combine
        self._native_module = mod
        for name in ("broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
                     "all_to_all"):
            if getattr(type(self), name) is getattr(CollectiveOps, name):
                setattr(self, name, getattr(self, "_" + name + "_native"))   # (a subclass's stays)

    # ---------------------------------------------------------------- waiting
    def _exchange_native(self, q: int) -> None:
        """``ops._exchange`` in one C call: publish q, wait, compare fingerprints."""
        core = self._native
        fp0, fp1 = self._fp0, self._fp1
        if self._engine.pending:   # point to point in flight: the Python wait moves it
            status = core.exchange(q, fp0, fp1, 0.0, False)
        else:
            status = core.exchange(q, fp0, fp1, min(_LIVENESS_EVERY, self.timeout), False)
        if status != self._DONE:   # (the hot path returns here, past no other frame)
            self._wait_out(q, fp0, fp1, status)

    def _wait_out(self, q: int, fp0: int, fp1: int, status: int) -> None:
        """Phase q, published with ``(fp0, fp1)``, after the core came back with
        ``status`` other than DONE: wait it out (``_settle``) and raise on a mismatch."""
        core = self._native
        status = self._settle(q, lambda budget: core.exchange(q, fp0, fp1, budget, True),
                              status)
        if status == self._MISMATCH:
            self._mismatch(q)

    def _settle(self, q: int, again, status: int) -> int:
        """Keep waiting for phase q (``again(budget)`` waits at most ``budget`` seconds
        and returns the core's status) until it is done or mismatched, and raise, as
        the Python path does, for a missing peer that failed, closed or died, or when
        the group's timeout passes."""
        core, timeout = self._native, self.timeout
        deadline = time.monotonic() + timeout - min(_LIVENESS_EVERY, timeout)
        last_pid_check = time.monotonic()
        while status != self._DONE and status != self._MISMATCH:
            if self._engine.pending:
                self._await_slow(q)   # the Python wait, which also moves p2p traffic
                return again(0.0)
            now = time.monotonic()
            check_pid = now - last_pid_check >= _LIVENESS_EVERY
            if check_pid:
                last_pid_check = now
            for r in range(self.size):
                if core.arrived(r) < q:
                    # done() after the state was read: fence, then an acquire load.
                    self._check_peer(r, self._op_name, self._op_seq, check_pid=check_pid,
                                     done=lambda r=r: (core.fence(), core.arrived(r) >= q)[1])
            now = time.monotonic()
            if now >= deadline:
                missing = [r for r in range(self.size) if core.arrived(r) < q]
                if missing:
                    raise CollectiveTimeout(
                        f"{self.where(self._op_name)} (seq {self._op_seq}): timed out "
                        f"after {timeout:g} s waiting for ranks {missing} (phase {q}); "
                        f"they did not arrive", op=self._op_name, seq=self._op_seq,
                        missing=missing)
            status = again(max(0.0, min(_LIVENESS_EVERY, deadline - now)))
        return status

    def _p2p_wait_native(self, op, timeout: Optional[float], what: str, peer: int) -> None:
        """``ShmGroup._p2p_wait`` for the common case of one receive in flight: sleep in
        C until the ring from ``peer`` moves, instead of polling from Python. Anything
        else (a send waiting for room, several operations in flight) takes the Python
        wait, which moves every pending operation of this rank."""
        engine = self._engine
        if op.done or peer == self.rank or not isinstance(op, RecvOp) or engine.pending != 1:
            return type(self)._p2p_wait(self, op, timeout, what, peer)
        core, u64 = self._native, self._u64
        head_idx = engine._in_head[peer]
        limit = self.timeout if timeout is None else timeout
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
            if engine.closed:
                raise CollectiveError(f"{self.where(what)}: the group was closed")
            if engine.pending != 1:      # another thread posted meanwhile
                return type(self)._p2p_wait(self, op, timeout, what, peer)
            now = time.monotonic()
            if core.wait_change(8 * head_idx, head,
                                max(0.0, min(_LIVENESS_EVERY, deadline - now))) == self._DONE:
                continue
            now = time.monotonic()
            check_pid = now - last_pid_check >= _LIVENESS_EVERY
            if check_pid:
                last_pid_check = now
            self._check_peer(peer, what, -1, fatal_states=(sg.STATE_CLOSED,),
                             check_pid=check_pid, done=lambda: self._progress_once(op))
            if op.done:
                break
            if now >= deadline:
                raise CollectiveTimeout(
                    f"{self.where(what)}: timed out after {limit:g} s; rank {peer} did "
                    f"not send it", op=what, missing=[peer])
        if op.error is not None:
            raise op.error

    # ------------------------------------------- the gather and scatter families
    # A message that fits one slot is one phase, moved by one call of the core
    # (``move``): the slots, fingerprints and phase of ``ops``' Python path, without its
    # Python. Anything larger goes the Python way.
    def _broadcast_native(self, a: np.ndarray, src: int, seq: int) -> None:
        if a.nbytes > self._S:
            return CollectiveOps.broadcast(self, a, src, seq)
        mine = self.rank == src
        self._small_move(self._native_module.MOVE_BROADCAST, OP_BROADCAST,
                         a if mine else None, None if mine else a, src, None, a.nbytes, seq)

    def _all_gather_native(self, out: np.ndarray, inp: np.ndarray, seq: int) -> None:
        if inp.nbytes > self._S:
            return CollectiveOps.all_gather(self, out, inp, seq)
        self._small_move(self._native_module.MOVE_GATHER, OP_ALL_GATHER, inp, out, -1, None,
                         inp.nbytes, seq)

    def _gather_native(self, inp: np.ndarray, out: Optional[np.ndarray], dst: int,
                       seq: int) -> None:
        if inp.nbytes > self._S:
            return CollectiveOps.gather(self, inp, out, dst, seq)
        self._small_move(self._native_module.MOVE_GATHER, OP_GATHER, inp,
                         out if self.rank == dst else None, dst, None, inp.nbytes, seq)

    def _scatter_native(self, out: np.ndarray, inp: Optional[np.ndarray], src: int,
                        seq: int) -> None:
        if self.size * out.nbytes > self._S:
            return CollectiveOps.scatter(self, out, inp, src, seq)
        self._small_move(self._native_module.MOVE_SCATTER, OP_SCATTER,
                         inp if self.rank == src else None, out, src, None, out.nbytes, seq)

    def _reduce_scatter_native(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp,
                               seq: int) -> None:
        if inp.nbytes > self._S:   # (no reduction takes bool: the base class refuses it)
            return CollectiveOps.reduce_scatter(self, out, inp, op, seq)
        self._small_move(self._native_module.MOVE_REDUCE_SCATTER, OP_REDUCE_SCATTER, inp, out,
                         -1, op, out.nbytes, seq)

    def _all_to_all_native(self, out: np.ndarray, inp: np.ndarray, out_counts, in_counts,
                           seq: int) -> None:
        """``ops``' all_to_all with its first phase in one call of the core (the counts,
        the input where it fits behind them, the wait, the check, the copies): the
        whole call where every rank's input fits; else Python goes on from the counts
        (``_all_to_all_rest``: the mismatch error, or the further phases)."""
        out_counts, in_counts = list(out_counts), list(in_counts)
        head, itemsize = self._a2a_head_bytes(), out.itemsize
        core = self._native
        try:
            self._start(OP_ALL_TO_ALL, seq, out.dtype, 0)   # (raises on a broken group)
            fp0 = self._fp0
            q = core.phase = core.phase + 1
            budget = 0.0 if self._engine.pending else self._wait_budget
            status = core.all_to_all(inp, out, in_counts + out_counts, q, fp0, 0, head,
                                     itemsize, budget)
            if status == self._DONE:
                return
            if status != self._MISMATCH and status != self._DECLINED:
                status = self._settle(q, lambda b: core.exchange(q, fp0, 0, b, True), status)
                if status == self._DONE:
                    status = core.all_to_all_take(out, q, head, itemsize)
            if status == self._MISMATCH:
                self._mismatch(q)
            if status != self._DONE:   # DECLINED: the counts disagree, or more phases
                self._all_to_all_rest(out, inp, out_counts, in_counts, seq, q & 1)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _small_move(self, kind: int, opcode: int, inp: Optional[np.ndarray],
                    out: Optional[np.ndarray], root: int, op: Optional[ReduceOp],
                    nbytes: int, seq: int) -> None:
        """One phase of the core's ``move`` (codes, fingerprint and phase found in C, as
        ``small_all_reduce`` does for the all_reduce); a wait that outlasts the core's
        budget, or a call it does not take, goes on in ``_small_move_waits``. Any
        failure breaks the group (``_guard``)."""
        if self._broken is not None or self._seg is None:
            self._start(opcode, seq)   # raises the group's error
        try:
            status = self._native.move(kind, opcode, inp, out, seq, root, op,
                                       0.0 if self._engine.pending else self._wait_budget)
        except BaseException as exc:
            self._small_move_state(opcode, inp, out, root, op, nbytes, seq)
            self._fail(exc)
            raise
        if status != self._DONE:
            self._small_move_waits(kind, opcode, inp, out, root, op, nbytes, seq, status)

    def _small_move_state(self, opcode: int, inp: Optional[np.ndarray],
                          out: Optional[np.ndarray], root: int, op: Optional[ReduceOp],
                          nbytes: int, seq: int) -> tuple[int, int, int]:
        """``ops``' ``_start`` for this move (what the errors read: ``_op_name``,
        ``_op_seq``, ``_fp0``, ``_fp1``); returns (fp0, dtype code, operator code)."""
        dtype = (out if inp is None else inp).dtype
        self._start(opcode, seq, dtype, nbytes, root, op)
        return self._fp0, _DTYPE_CODE.get(dtype, 0), 0 if op is None else _REDOP_BY_ID[id(op)]

    def _small_move_waits(self, kind: int, opcode: int, inp: Optional[np.ndarray],
                          out: Optional[np.ndarray], root: int, op: Optional[ReduceOp],
                          nbytes: int, seq: int, status: int) -> None:
        """After ``move`` came back without its phase done: wait it out (``_settle``,
        then the core finishes the move), or raise; a call ``move`` did not take
        (NOT_TAKEN) runs through ``small_move`` with the codes found here."""
        core = self._native
        try:
            fp0, code, redop = self._small_move_state(opcode, inp, out, root, op, nbytes, seq)
            budget = 0.0 if self._engine.pending else self._wait_budget
            if status == self._NOT_TAKEN:
                q = core.phase = core.phase + 1
                status = core.small_move(kind, inp, out, q, fp0, nbytes, root, code, redop,
                                         budget, False)
            else:
                q = core.phase
            if status != self._DONE:
                if status != self._MISMATCH:
                    status = self._settle(q, lambda b: core.small_move(
                        kind, inp, out, q, fp0, nbytes, root, code, redop, b, True), status)
                if status == self._MISMATCH:
                    self._mismatch(q)
        except BaseException as exc:
            self._fail(exc)
            raise

    # ----------------------------------------------------------------- reduce
    def _all_reduce_hook(self) -> Callable[[np.ndarray, ReduceOp, int], None]:
        """The all_reduce hook on the core (bound by ``ShmGroup.__init__`` once the
        engine exists): a message of the one-phase path is one call of the core
        (``small_all_reduce``: the fast path's call reaches C through this one Python
        frame), anything else (a larger message, point to point in flight, a failed
        group) goes to ``_all_reduce_native``, and a wait that outlasts the core's
        budget to ``_small_all_reduce_waits``. A failure breaks the group, as ``_guard``
        makes every other collective's."""
        small = self._native.small_all_reduce
        DONE, NOT_TAKEN = self._DONE, self._native_module.NOT_TAKEN
        engine, slow = self._engine, self._all_reduce_native

        def all_reduce(a: np.ndarray, op: ReduceOp, seq: int) -> None:
            if engine.pending or self._broken is not None:
                return slow(a, op, seq)
            try:
                status = small(a, op, seq, self._wait_budget)
            except BaseException as exc:
                self._small_all_reduce_state(a, op, seq)
                self._fail(exc)
                raise
            if status != DONE:
                if status == NOT_TAKEN:
                    return slow(a, op, seq)
                self._small_all_reduce_waits(a, op, seq, status)
        return all_reduce

    def _barrier_hook(self) -> Callable[[int], None]:
        """The barrier hook on the core, bound as ``_all_reduce_hook``'s is: one call of
        the core (``barrier``) enters, publishes and waits for the empty phase; Python
        only where point to point is in flight or the group failed (``ops._barrier``),
        or for a wait that outlasts the core's budget (``_barrier_waits``)."""
        barrier = self._native.barrier
        DONE, engine, slow = self._DONE, self._engine, self.barrier

        def hook(seq: int) -> None:
            if engine.pending or self._broken is not None:
                return slow(seq)
            try:
                status = barrier(OP_BARRIER, seq, self._wait_budget)
            except BaseException as exc:
                self._fail(exc)
                raise
            if status != DONE:
                self._barrier_waits(seq, status)
        return hook

    def _barrier_waits(self, seq: int, status: int) -> None:
        """After the core's ``barrier`` came back without its phase done: set the
        group's state as ``ops._start`` would, wait the phase out, or raise."""
        try:
            self._start(OP_BARRIER, seq)
            self._wait_out(self._phase, self._fp0, self._fp1, status)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _small_all_reduce_state(self, a: np.ndarray, op: ReduceOp, seq: int) -> tuple:
        """What ``small_all_reduce`` entered its phase with, into the group's state for
        errors (``_op_name``, ``_op_seq``, ``_fp0``, ``_fp1``); returns (fp0, nbytes,
        dtype code, operator code)."""
        self._op_name, self._op_seq = "all_reduce", seq
        code, redop = _DTYPE_CODE.get(a.dtype, 0), _REDOP_BY_ID.get(id(op), 0)
        fp0 = self._fp0 = fingerprint(OP_ALL_REDUCE, redop, code, -1, seq)
        nbytes = self._fp1 = a.nbytes
        return fp0, nbytes, code, redop

    def _small_all_reduce_waits(self, a: np.ndarray, op: ReduceOp, seq: int,
                                status: int) -> None:
        """After ``small_all_reduce`` came back without its phase done: what
        ``_small_reduce_native`` does then (wait it out, or raise)."""
        try:
            fp0, nbytes, code, redop = self._small_all_reduce_state(a, op, seq)
            self._small_waits(a, self._phase, fp0, nbytes, code, redop, True, status)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _all_reduce_native(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        """The all_reduce hook's way where the core's one call does not serve: a
        message of the one-phase path goes to ``_small_reduce_native`` at once
        (``ReduceOps._reduce_into``'s frames are a tenth of a small all_reduce's time),
        a larger one the way it always goes."""
        if a.nbytes > self._small_bytes:
            return self._reduce_into(a, op, seq, -1, OP_ALL_REDUCE)
        try:
            self._small_reduce_native(a, op, seq, -1, OP_ALL_REDUCE)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _small_reduce_native(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                             opcode: int) -> None:
        """``reduce._small_reduce`` in one C call: copy in, publish, wait, check, and
        reduce the n slots in rank order into ``a`` (where the result is wanted)."""
        if self._broken is not None or self._seg is None:
            self._start(opcode, seq)  # raises the group's error
        self._op_name = "all_reduce" if dst < 0 else "reduce"
        self._op_seq = seq
        code = _DTYPE_CODE.get(a.dtype, 0)
        redop = _REDOP_BY_ID.get(id(op), 0)
        fp0 = self._fp0 = fingerprint(opcode, redop, code, dst, seq)
        nbytes = self._fp1 = a.nbytes
        q = self._phase = self._phase + 1
        want = dst < 0 or dst == self.rank
        core = self._native
        budget = 0.0 if self._engine.pending else self._wait_budget
        status = core.small_reduce(a, q, fp0, nbytes, code, redop, want, budget, False)
        if status != self._DONE:
            self._small_waits(a, q, fp0, nbytes, code, redop, want, status)

    def _small_waits(self, a: np.ndarray, q: int, fp0: int, nbytes: int, code: int,
                     redop: int, want: bool, status: int) -> None:
        """Wait out the one-phase reduce's phase q (published with ``fp0, nbytes``)
        after the core came back with ``status``, and reduce once it is done; raise as
        the Python path does."""
        core = self._native
        if status != self._MISMATCH:
            status = self._settle(
                q, lambda b: core.small_reduce(a, q, fp0, nbytes, code, redop, want, b, True),
                status)
        if status == self._MISMATCH:
            self._mismatch(q)

    def _pipelined_reduce_native(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                                 opcode: int) -> None:
        """``reduce.ReduceOps._pipelined_reduce`` in calls of the core (``pipelined``):
        the same slots, pieces and phases, every step's copies and reduction with the
        GIL released; Python only where a phase's wait outlasts the core's budget (it
        waits that phase out as ``_exchange`` does, and the core goes on from the next
        step)."""
        self._start(opcode, seq, a.dtype, a.nbytes, dst, op)
        core = self._native
        fp0, fp1 = self._fp0, self._fp1
        q0 = self._phase + 1
        code, redop = _DTYPE_CODE.get(a.dtype, 0), _REDOP_BY_ID[id(op)]
        result = dst < 0 or dst == self.rank
        budget = 0.0 if self._engine.pending else self._wait_budget
        j = 0
        while True:
            status, j = core.pipelined(a, q0, fp0, fp1, code, redop, result, j, budget)
            if status == self._DONE:
                self._phase = q0 + j - 1   # the last step's phase
                return
            self._phase = q0 + j
            self._wait_out(q0 + j, fp0, fp1, status)
            j += 1


__all__ = ["NativePaths"]
