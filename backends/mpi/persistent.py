"""The mpi backend's persistent collectives: MPI-4's ``MPI_Allreduce_init``,
``MPI_Allgather_init`` and ``MPI_Reduce_scatter_block_init`` (mpi4py >= 4 on an MPI-4
library), one request made at the persistent request's init and started every round.

Where the library lacks them (``NotImplementedError`` from mpi4py, or an MPI-3
library), :func:`persistent_call` returns None and the group's default round (the
backend's ``Iallreduce``) is used instead: the same results, one MPI request per
round. See :mod:`collectives.persistent` for the contract, and its note on binding alike
on every rank: a rank whose arguments are staged (or whose tensor moved) runs
``Iallreduce`` while its peers run the persistent request, which MPI does not match.

Four ranks, ``mpiexec -n 4 python script.py``::

    req = pg.all_reduce_init(t)      # MPI_Allreduce_init(MPI_IN_PLACE, t, ...)
    req.start(); req.wait()          # MPI_Start, then MPI_Test until done
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives.reduce_op import ReduceOp

from .library import byte_buffer, reduction
from .work import MpiWork


def persistent_call(group: Any, op: str, arrays: Sequence[np.ndarray],
                    reduce_op: Optional[ReduceOp]) -> Optional[Callable[[int], Any]]:
    """``call(seq) -> MpiWork`` starting one round of MPI's persistent ``op`` over the
    flat ``arrays``; None where MPI has no persistent collectives. Collective: every rank
    calls it at the same point (the request's init), as MPI requires."""
    from mpi4py import MPI

    comm = group.comm
    if comm is None or not hasattr(comm, "Allreduce_init"):
        return None
    then = None
    try:
        if op == "all_reduce":
            a = arrays[0]
            buf, mop = reduction(a, reduce_op)
            request = comm.Allreduce_init(MPI.IN_PLACE, buf, mop)
            then = group._avg(a, reduce_op)
        elif op == "all_gather":
            out, inp = arrays
            request = comm.Allgather_init(byte_buffer(inp), byte_buffer(out))
        elif op == "reduce_scatter":
            out, inp = arrays
            send, mop = reduction(inp, reduce_op)
            recv, _ = reduction(out, reduce_op)
            request = comm.Reduce_scatter_block_init(send, recv, mop)
            then = group._avg(out, reduce_op)
        else:
            return None
    except NotImplementedError:  # mpi4py built against an MPI-3 library
        return None
    requests = group.persistent_requests
    requests.append(request)
    keep = tuple(arrays)

    def call(seq: int) -> Any:
        request.Start()
        return MpiWork(group, op, seq, [request], then, (), keep)

    def release() -> None:  # the request's free(), or a re-binding: MPI_Request_free
        if request in requests:
            requests.remove(request)
            try:
                if not MPI.Is_finalized() and request != MPI.REQUEST_NULL:
                    request.Free()
            except MPI.Exception:
                pass

    call.release = release
    return call


def free_requests(group: Any) -> None:
    """Free the group's persistent requests (at close, before its communicator)."""
    from mpi4py import MPI

    requests, group.persistent_requests = group.persistent_requests, []
    for request in requests:
        try:
            if request != MPI.REQUEST_NULL:
                request.Free()
        except MPI.Exception:
            pass
