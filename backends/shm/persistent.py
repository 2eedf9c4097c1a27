"""The shm backend's persistent collectives: the path an all_reduce round takes (the
one-phase small reduce or the large one, single-copy or pipelined) is picked once, at the
request's init, over flat arrays made once, and each round calls the group's phase
functions directly; all_gather and reduce_scatter rounds call the group's hooks, bound
once (on the core, one call of it for a message that fits a slot). See
:mod:`collectives.persistent` for the contract.

Two ranks::

    req = pg.all_reduce_init(t)     # 4 KiB of float32: the one-phase path, bound now
    req.start(); req.wait()         # one phase: publish, wait for the peer, reduce

An all_reduce past the one-phase size of an array in symmetric memory, on the core
(DDP's bucket), gets a round bound once by the group (``_symmetric_round``): one Python
frame between the request and the core's call, where the large path has five.

For all_reduce, a phase function this module expects and the group lacks (its
internals change) means None: the base class's default round, through the group's
hooks, is used instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives.reduce_op import ReduceOp, finish

from .ops import OP_ALL_REDUCE


def persistent_call(group: Any, op: str, arrays: Sequence[np.ndarray],
                    reduce_op: Optional[ReduceOp]) -> Optional[Callable[[int], None]]:
    """``call(seq)`` running one round of persistent ``op`` on ``group``, or None."""
    if op == "all_reduce":
        a = arrays[0]
        if group.size == 1:
            return lambda seq: finish(reduce_op, a, 1)
        small = a.nbytes <= group._small_limit
        impl = getattr(group, "_small_reduce" if small else "_large_reduce", None)
        if impl is None:
            return None
        fail = group._fail
        bound = getattr(group, "_symmetric_round", None)
        round_ = None if small or bound is None else bound(a, reduce_op)
        if round_ is not None:   # in symmetric memory, on the core: one frame to C
            return round_

        def all_reduce(seq: int) -> None:
            try:
                impl(a, reduce_op, seq, -1, OP_ALL_REDUCE)
            except BaseException as exc:
                fail(exc)
                raise
        return all_reduce
    out, inp = arrays
    if group.size == 1:
        if op == "reduce_scatter":
            def copy_finish(seq: int) -> None:
                out[...] = inp
                finish(reduce_op, out, 1)
            return copy_finish
        return lambda seq: np.copyto(out, inp)
    # The group's hooks, bound now: on the core a message that fits one slot is one
    # call of it (``small_move``), a larger one the phase loops of ``ops``.
    if op == "all_gather":
        gather = group.all_gather
        return lambda seq: gather(out, inp, seq)
    if op == "reduce_scatter":
        scatter = group.reduce_scatter
        return lambda seq: scatter(out, inp, reduce_op, seq)
    return None
