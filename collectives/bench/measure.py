"""The timing loop, the same for every implementation, and our ProcessGroup under it.

An implementation (ours or a raw peer library) is a :class:`Runner`: it binds a
:class:`~collectives.bench.cases.Case` to a zero-argument call of its own op, and gives a
barrier and two reductions over ranks used only outside the timed region. Per iteration,
on every rank and for each runner in turn: reset the buffers (:meth:`Case.prepare`), the
runner's barrier, time one call. After the loop the per-rank times are reduced with MAX
(the slowest rank's time per iteration, the iteration's time) and the median over the
timed iterations is reported; the result of the last iteration is checked and the wrong
elements summed over ranks.

Also here: :class:`MemcpyRunner`, the single-process copy that is the machine's ceiling for
moving bytes through memory, timed in the same loop.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from ..group import ProcessGroup
from .cases import ROOT, Case, bandwidths, make_case


class Unsupported(Exception):
    """The implementation cannot run this op/dtype; the reason is the message."""


class Runner(Protocol):
    """One implementation on one rank."""

    #: Name in the rows: the backend (``shm``) or the peer (``mpi4py``).
    impl: str
    rank: int
    size: int

    def bind(self, case: Case) -> Callable[[], None]:
        """A call that runs ``case.op`` once on ``case``'s buffers (:class:`Unsupported`
        if this implementation cannot)."""

    def barrier(self) -> None:
        """Return once every rank arrived."""

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """Element-wise maximum of a float64 array over ranks (every rank gets it)."""

    def sum_over_ranks(self, value: int) -> int:
        """Sum of an int over ranks (every rank gets it)."""

    def close(self) -> None:
        """Leave the group."""


def iterations(nbytes: int, iters: int, warmup: int, byte_budget: int) -> tuple[int, int]:
    """``(timed, warm-up)`` iterations for one size: at most ``byte_budget`` bytes in the
    timed ones (at least 3), so large sizes run fewer, and the warm-up shrinks in the same
    proportion (at least 1 unless ``warmup`` is 0).

    >>> iterations(64 << 20, 50, 5, 512 << 20)
    (8, 1)
    >>> iterations(4, 50, 5, 512 << 20)
    (50, 5)
    """
    timed = max(3, min(iters, byte_budget // max(nbytes, 1)))
    if warmup <= 0:
        return timed, 0
    return timed, max(1, min(warmup, round(warmup * timed / iters)))


def time_case(runners: Sequence[Runner], calls: Sequence[Callable[[], None]], case: Case,
              iters: int, warmup: int) -> list[tuple[np.ndarray, int]]:
    """Per runner (``calls[k]`` is ``runners[k].bind(case)``): the slowest rank's seconds
    for each of ``iters`` timed iterations, and the wrong elements of its last iteration's
    result summed over ranks.

    The runners take turns iteration by iteration on the same buffers (which one goes
    first alternates), so that a burst of load on the machine hits them alike. Each turn:
    reset the buffers, the runner's barrier, one timed call; in the last iteration the
    result is checked right after the call, before the next runner overwrites it."""
    total = warmup + iters
    mine = np.empty((len(runners), iters), np.float64)
    wrong = [0] * len(runners)
    order = list(range(len(runners)))
    for i in range(total):
        final = i == total - 1
        for k in (order if i % 2 == 0 else order[::-1]):
            case.prepare(final=final)
            runners[k].barrier()
            start = time.perf_counter()
            calls[k]()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                mine[k, i - warmup] = elapsed
            if final:
                wrong[k] = case.wrong()
    # Only now, outside the loop: the ranks' times, and the sums of the checks.
    return [(runner.max_over_ranks(mine[k]), runner.sum_over_ranks(wrong[k]))
            for k, runner in enumerate(runners)]


def row(impl: str, case: Case, slowest: np.ndarray, wrong: int) -> dict:
    """One row of the contract (see :mod:`collectives.bench`): the median of the
    slowest rank's times. Extra fields: ``count``, ``iters``, ``min_time_us``."""
    seconds = float(np.median(slowest))
    algbw, busbw = bandwidths(case.op, case.nbytes, case.world_size, seconds)
    return {"impl": impl, "op": case.op, "world_size": case.world_size,
            "bytes": case.nbytes, "count": case.count, "dtype": case.dtype,
            "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw,
            "wrong": int(wrong), "iters": int(slowest.size),
            "min_time_us": float(slowest.min()) * 1e6, **(
                {"uneven": True} if case.splits is not None else {})}


def measure_many(runners: list[Runner], ops: list[str], sizes: list[int], dtype: str,
                 iters: int, warmup: int, byte_budget: int,
                 skipped: Optional[list[str]] = None, uneven: bool = False) -> list[dict]:
    """Every op at every size through every runner (interleaved, see :func:`time_case`);
    every rank returns the same rows, ours (the first runner) first. Ops a runner cannot
    do are left out and the reason appended to ``skipped``. ``uneven``: all_to_all with
    uneven split sizes (rows get ``"uneven": true``)."""
    rank, size = runners[0].rank, runners[0].size
    rows: list[dict] = []
    for op in ops:
        for nbytes in sizes:
            case = make_case(op, nbytes, dtype, rank, size, uneven=uneven)
            able, calls = [], []
            for runner in runners:
                try:  # decided alike on every rank, before any call
                    calls.append(runner.bind(case))
                    able.append(runner)
                except Unsupported as why:
                    note = f"{runner.impl}: {op} {case.dtype} skipped: {why}"
                    if skipped is not None and note not in skipped:
                        skipped.append(note)
            if able:
                timed, warm = iterations(case.nbytes, iters, warmup, byte_budget)
                results = time_case(able, calls, case, timed, warm)
                rows += [row(runner.impl, case, slowest, wrong)
                         for runner, (slowest, wrong) in zip(able, results)]
            del case
    return rows


class GroupRunner:
    """Our :class:`~collectives.group.ProcessGroup` as a :class:`Runner` (numpy buffers,
    the library's native host type)."""

    #: The ops that ``persistent=True`` times as a persistent request's start + wait.
    PERSISTENT_OPS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, pg: ProcessGroup, impl: Optional[str] = None, *,
                 persistent: bool = False, symmetric: bool = False) -> None:
        self.pg = pg
        self.impl = impl or pg.backend
        self.rank, self.size = pg.rank, pg.size
        self.persistent = persistent
        self.symmetric = symmetric
        self._requests: list = []

    def bind(self, case: Case) -> Callable[[], None]:
        if self.symmetric:
            self._move_to_symmetric(case)
        pg, send, recv = self.pg, case.send, case.recv
        if self.persistent:
            return self._bind_persistent(case)
        calls: dict[str, Callable[[], None]] = {
            "all_reduce": lambda: pg.all_reduce(recv),
            "reduce": lambda: pg.reduce(recv, dst=ROOT),
            "broadcast": lambda: pg.broadcast(recv, src=ROOT),
            "all_gather": lambda: pg.all_gather(recv, send),
            "gather": lambda: pg.gather(send, recv, dst=ROOT),
            "scatter": lambda: pg.scatter(recv, send, src=ROOT),
            "reduce_scatter": lambda: pg.reduce_scatter(recv, send),
            "all_to_all": lambda: pg.all_to_all(recv, send),
        }
        if case.splits is not None:
            out_splits, in_splits = case.recv_splits, case.send_splits
            return lambda: pg.all_to_all(recv, send, output_split_sizes=out_splits,
                                         input_split_sizes=in_splits)
        return calls[case.op]

    def _move_to_symmetric(self, case: Case) -> None:
        """``--symmetric``: the all_reduce's buffer moves into ``pg.alloc_symmetric``
        memory (a collective, here where every rank binds alike; the runners after this
        one in the job then use it too). The other ops have no path that reads it."""
        if case.op != "all_reduce":
            raise Unsupported("symmetric memory serves all_reduce only")
        buf = self.pg.alloc_symmetric(case.recv.nbytes).view(case.recv.dtype)
        np.copyto(buf, case.recv)
        case.recv = buf

    def _bind_persistent(self, case: Case) -> Callable[[], None]:
        """``start(); wait()`` of a request made once for ``case`` (``--persistent``)."""
        pg, send, recv = self.pg, case.send, case.recv
        if case.op not in self.PERSISTENT_OPS:
            raise Unsupported(f"no persistent form (only {', '.join(self.PERSISTENT_OPS)})")
        for old in self._requests:  # the previous case's buffers are gone
            old.free()
        if case.op == "all_reduce":
            request = pg.all_reduce_init(recv)
        elif case.op == "all_gather":
            request = pg.all_gather_init(recv, send)
        else:
            request = pg.reduce_scatter_init(recv, send)
        self._requests = [request]
        start, wait = request.start, request.wait

        def round_trip() -> None:
            start()
            wait()
        return round_trip

    def barrier(self) -> None:
        self.pg.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        from ..reduce_op import ReduceOp
        out = np.ascontiguousarray(values, np.float64).copy()
        self.pg.all_reduce(out, ReduceOp.MAX)
        return out

    def sum_over_ranks(self, value: int) -> int:
        total = np.array([value], np.int64)
        self.pg.all_reduce(total)
        return int(total[0])

    def close(self) -> None:
        for request in self._requests:
            request.free()
        self._requests = []
        self.pg.close()


class MemcpyRunner:
    """The physical ceiling, timed in the same loop as the others (so that the machine's
    load hits it alike): rank 0 copies the case's ``nbytes`` between two preallocated
    arrays with ``np.copyto``, a single-process memory copy; the other ranks do nothing
    (their time is ~0, so the slowest rank's time is rank 0's). Barrier and reductions
    are those of ``base``."""

    impl = "memcpy"

    def __init__(self, base: Runner) -> None:
        self.base = base
        self.rank, self.size = base.rank, base.size

    def bind(self, case: Case) -> Callable[[], None]:
        if self.rank != 0:
            return lambda: None
        src = np.ones(max(case.nbytes, 1), np.uint8)
        dst = np.zeros_like(src)
        np.copyto(dst, src)  # fault every page in now, not in the first iteration
        return lambda: np.copyto(dst, src)

    def barrier(self) -> None:
        self.base.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        return self.base.max_over_ranks(values)

    def sum_over_ranks(self, value: int) -> int:
        return self.base.sum_over_ranks(value)

    def close(self) -> None:
        pass  # the base runner's group is closed by its owner
