"""The shm backend's persistent collectives: the path an all_reduce round takes (the
one-phase small reduce or the large one: symmetric, single-copy or pipelined) is picked
once, at the request's init, over flat arrays made once, and each round calls that path
directly; all_gather and reduce_scatter rounds call the backend's methods (on the core, a
message that fits a slot is one call of it). See :mod:`collectives.persistent` for the
contract.

Two ranks, three rounds of one request:

>>> import numpy as np, collectives
>>> def rounds():
...     pg = collectives.init_process_group("shm")
...     t = np.zeros(1024, np.float32)   # 4 KiB: the one-phase path, bound now
...     req = pg.all_reduce_init(t)
...     sums = []
...     for step in range(3):
...         t[:] = pg.rank + step
...         req.start(); req.wait()      # one phase: publish, wait for the peer, reduce
...         sums.append(float(t[0]))
...     req.free()
...     pg.close()
...     return sums
>>> collectives.spawn(rounds, 2)
[[1.0, 3.0, 5.0], [1.0, 3.0, 5.0]]

An all_reduce past the one-phase size of an array in symmetric memory, on the core
(DDP's bucket), gets a round bound once by the core (``NativeCore.symmetric_round``): one
Python frame between the request and the core's call.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives.reduce_op import ReduceOp, finish

from .codes import OP_ALL_REDUCE


def persistent_call(backend: Any, op: str, arrays: Sequence[np.ndarray],
                    reduce_op: Optional[ReduceOp]) -> Optional[Callable[[int], None]]:
    """``call(seq)`` running one round of persistent ``op`` on ``backend``, or None."""
    if op == "all_reduce":
        return _all_reduce_round(backend, arrays[0], reduce_op)
    out, inp = arrays
    if backend.size == 1:
        if op == "reduce_scatter":
            def copy_finish(seq: int) -> None:
                out[...] = inp
                finish(reduce_op, out, 1)
            return copy_finish
        return lambda seq: np.copyto(out, inp)
    if op == "all_gather":
        gather = backend.all_gather
        return lambda seq: gather(out, inp, seq)
    if op == "reduce_scatter":
        scatter = backend.reduce_scatter
        return lambda seq: scatter(out, inp, reduce_op, seq)
    return None


def _all_reduce_round(backend: Any, a: np.ndarray,
                      op: ReduceOp) -> Callable[[int], None]:
    if backend.size == 1:
        return lambda seq: finish(op, a, 1)
    core, fail = backend.core, backend.phases.fail
    if a.nbytes <= backend._small_bytes:
        small = core.small_reduce

        def small_round(seq: int) -> None:
            try:
                small(a, op, seq, -1, OP_ALL_REDUCE)
            except BaseException as exc:
                fail(exc)
                raise
        return small_round
    bound = backend.heap.round(a, op, backend.large_all_reduce, backend.unplaced_all_reduce)
    if bound is not None:   # in symmetric memory, on the core: one frame to C
        return bound
    large = backend.large_all_reduce

    def large_round(seq: int) -> None:
        try:
            large(a, op, seq)
        except BaseException as exc:
            fail(exc)
            raise
    return large_round
