"""The two paths of the shm backend, one interface: :class:`PythonCore` (numpy over the
segment) and :class:`~backends.shm.native_core.NativeCore` (the compiled core,
``_native.c``). A group holds one of them, chosen when it is made (``pg.describe()`` says
which); both speak the same protocol over the same words (phases, fingerprints, slots,
doorbells), so a rank of either kind talks to a rank of the other in one group.

The interface, kept by both:

- ``native`` (bool), ``counter`` (an object whose ``phase`` is the last phase entered);
- ``exchange(q)``: publish phase q, wait for every rank's, compare the fingerprints;
- ``combine(out, srcs, op, copies=())``: ``out = srcs[0] op srcs[1] op ...`` in rank order,
  AVG divided once, the result also copied into each of ``copies`` (``out`` may be one of
  ``srcs``);
- ``small_reduce(a, op, seq, dst, opcode)``: the one-phase reduce (all_reduce ``dst`` -1,
  or reduce to ``dst``) of a message that fits the one-phase limit;
- ``pipelined_reduce(a, op, seq, dst, opcode)``: reduce-scatter + all-gather, one chunk
  per phase (:mod:`backends.shm.reduce`);
- ``all_reduce(a, op, seq) -> bool``: the all_reduce's first choice, the one-phase path,
  where it applies (False: the caller takes a large path);
- ``move(opcode, inp, out, root, op, nbytes, seq) -> bool``: a broadcast, gather family
  or scatter family call whose message fits one slot, in one phase (False: not taken;
  :mod:`backends.shm.moves` runs it);
- ``all_to_all(out, inp, out_counts, in_counts, seq)``, ``barrier(seq)``;
- ``p2p_wait(op, timeout, what, peer)``: wait for a posted send or receive;
- ``blocking_calls()``: ``(send_now, recv_now)`` of one call each, or None;
- ``symmetric_all_reduce(plan, op) -> bool`` (:mod:`backends.shm.symmetric`) and
  ``symmetric_round(plan, op, large, rest)``: the in-place all_reduce of a buffer the
  peers map;
- ``cma_reduce(piece, pids, addrs, op) -> int | None``: the single copy's reduce and push
  (None: this path cannot read the peers' memory).

Every call that fails marks the group failed (``Phases.fail``) before it raises.

Two ranks, both: ``core.exchange(phases.enter())`` is one barrier.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives.reduce_op import ReduceOp, finish

from . import moves
from .codes import (DTYPE_CODE, KERNEL_BY_ID, OP_ALL_REDUCE, OP_BARRIER, REDOP_BY_ID,
                    fingerprint)
from .phases import Phases
from .reduce import pipelined_reduce, small_limit

_AVG = ReduceOp.AVG


class PythonCore:
    """The shm protocol in numpy: the path where the compiled core is not built or is
    turned off (``COLLECTIVES_SHM_NATIVE=0``)."""

    native = False

    def __init__(self, phases: Phases) -> None:
        self.ph = phases
        self.counter = phases.counter
        self._small_bytes = small_limit(phases)

    # -------------------------------------------------------------- primitives
    def exchange(self, q: int) -> None:
        self.ph.exchange(q)

    def combine(self, out: np.ndarray, srcs: list, op: ReduceOp,
                copies: Sequence[np.ndarray] = ()) -> None:
        kernel = KERNEL_BY_ID[id(op)]
        if any(s is out for s in srcs[2:]):  # numpy would overwrite it before reading it
            srcs = [s.copy() if s is out else s for s in srcs]
        kernel(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            kernel(out, s, out=out)
        finish(op, out, len(srcs))
        for view in copies:
            np.copyto(view, out)

    def small_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                     opcode: int) -> None:
        """One phase: write the input, barrier, reduce all n slots in rank order."""
        ph = self.ph
        if ph.broken is not None or ph.u64 is None or ph.aborted:
            ph.start(opcode, seq)  # raises the group's error
        dt = a.dtype
        me = ph.rank
        slots = ph.small_views(dt, a.size)
        # What start() computes (codes.fingerprint), inline: this path is all overhead.
        ph.op_name = "all_reduce" if dst < 0 else "reduce"
        ph.op_seq = seq
        fp0 = ph.fp0 = (opcode | (REDOP_BY_ID.get(id(op), 0) << 4)
                        | (DTYPE_CODE.get(dt, 0) << 8) | (((dst + 1) & 0xFFFF) << 16)
                        | ((seq & 0xFFFFFFFF) << 32))
        nbytes = ph.fp1 = a.nbytes
        counter = self.counter
        q = counter.phase = counter.phase + 1
        mine = slots[q & 1]
        i = ph.fp_idx[q & 1][me]
        u64 = ph.u64
        u64[i] = fp0
        u64[i + 1] = nbytes
        mine[me][...] = a
        ph.exchange(q)
        if dst < 0 or dst == me:
            kernel = KERNEL_BY_ID[id(op)]
            kernel(mine[0], mine[1], out=a)
            for r in range(2, ph.size):
                kernel(a, mine[r], out=a)
            if op is _AVG:
                finish(op, a, ph.size)

    def pipelined_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                         opcode: int) -> None:
        pipelined_reduce(self.ph, self, a, op, seq, dst, opcode)

    # ---------------------------------------------------------- the entries
    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> bool:
        if a.nbytes > self._small_bytes:
            return False
        try:
            self.small_reduce(a, op, seq, -1, OP_ALL_REDUCE)
        except BaseException as exc:
            self.ph.fail(exc)
            raise
        return True

    def move(self, opcode: int, inp: Optional[np.ndarray], out: Optional[np.ndarray],
             root: int, op: Optional[ReduceOp], nbytes: int, seq: int) -> bool:
        return False   # the loops of moves.py take every size on this path

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: list,
                   in_counts: list, seq: int) -> None:
        self.ph.guard(moves.all_to_all, self.ph, self, out, inp, out_counts, in_counts, seq)

    def barrier(self, seq: int) -> None:
        """One empty phase."""
        ph = self.ph
        try:
            ph.start(OP_BARRIER, seq)
            ph.exchange(ph.enter())
        except BaseException as exc:
            ph.fail(exc)
            raise

    # ------------------------------------------------------------ the rest
    def p2p_wait(self, op: Any, timeout: Optional[float], what: str, peer: int) -> None:
        self.ph.p2p_wait(op, timeout, what, peer)

    def blocking_calls(self) -> Optional[tuple[Callable, Callable]]:
        return None

    def symmetric_all_reduce(self, plan: tuple, op: ReduceOp) -> bool:
        """Two phases: the vote (is ``a`` at one place in every rank's buffer?), then,
        where it is, reduce this rank's piece from every rank's copy and push the result
        into the peers' copies (fenced: ``Phases.push_into``)."""
        from .symmetric import VOTE_MARK
        ph = self.ph
        _, _, where, piece, srcs, copies = plan
        fp0 = ph.fp0
        ph.fp0 = fp0 | VOTE_MARK  # a rank in another path's first phase: a mismatch
        q = ph.enter()
        bank = q & 1
        words = ph.sv(bank, ph.rank, np.uint64)
        words[0], words[1] = where
        self.exchange(q)
        ph.fp0 = fp0
        if where[0] == 0 or any((int(w[0]), int(w[1])) != where for w in
                                (ph.sv(bank, r, np.uint64) for r in ph.peers)):
            return False
        if piece is not None:
            self.combine(piece, srcs, op)
            for r, view in zip(ph.peers, copies):
                ph.push_into(r, view, piece)
        self.exchange(ph.enter())
        return True

    def symmetric_round(self, plan: tuple, op: ReduceOp, large: Callable,
                        rest: Callable) -> Optional[Callable[[int], None]]:
        return None   # the plain path (symmetric_all_reduce) serves

    def cma_reduce(self, piece: np.ndarray, pids: list, addrs: list,
                   op: ReduceOp) -> Optional[int]:
        return None   # reading the peers' memory needs the compiled core


def exchange_fingerprint(opcode: int, op: Optional[ReduceOp], dtype: np.dtype, root: int,
                         seq: int) -> int:
    """``codes.fingerprint`` from a call's ReduceOp and dtype (as the core computes it)."""
    return fingerprint(opcode, 0 if op is None else REDOP_BY_ID[id(op)],
                       DTYPE_CODE.get(dtype, 0), root, seq)
