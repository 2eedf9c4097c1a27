"""Persistent collectives: a collective bound once to its arguments and started many
times, as MPI-4's ``MPI_Allreduce_init`` / ``MPI_Start`` / ``MPI_Wait`` and torchcomms'
persistent all-gather.

The contract (every backend keeps it):

- ``req = pg.all_reduce_init(tensor, op=SUM)``, ``pg.all_gather_init(output, input)``,
  ``pg.reduce_scatter_init(output, input, op=SUM)`` take the same arguments, in the same
  order, as ``all_reduce``, ``all_gather`` and ``reduce_scatter``, check them once (the
  same typed errors, naming ``all_reduce_init`` and so on) and return a
  :class:`PersistentRequest`. Nothing moves at init. Every rank creates its requests in
  the same order relative to its other collectives (MPI requires it of its own).
- ``req.start()`` starts one round of the collective on the tensors' **current
  contents** and returns at once; the round takes the group's next sequence number, goes
  into the flight record and, with ``COLLECTIVES_DEBUG=1``, through the per-call check,
  like any collective. Every rank starts its rounds in the same order relative to its
  other collectives. Between ``start()`` and ``wait()`` the tensors belong to the
  library: do not read or write them.
- ``req.run()`` is ``start()`` then ``wait()`` in one call, run like a blocking
  collective: on the calling thread when no async op is queued (else after them, in
  issue order); for a round that nothing overlaps it saves the hand-over to the group's
  thread.
- ``req.wait(timeout=None)`` blocks until the round finished (results in the output
  tensor) and re-raises its error. ``wait(timeout)`` raises ``CollectiveTimeout`` when
  it is still running after ``timeout`` seconds; the request then stays active and may
  be waited for again. ``wait()`` on a request that is not started returns at once (as
  ``MPI_Wait`` on an inactive request). ``req.is_completed()`` says whether the round
  finished (it is ``wait()`` that makes the request ready for the next ``start()``).
- ``start()`` on a request that was started and not waited for is a ``RuntimeError``;
  on a closed group (at init too) a ``CollectiveError``. ``req.free()`` releases it
  (``MPI_Request_free``; a freed request cannot be started).
- The tensors are bound by identity. A torch tensor whose memory moved (FSDP frees and
  re-allocates its flat parameter with ``untyped_storage().resize_``) is bound again at
  the next ``start()``; a changed shape or dtype is a ``ValueError``. Tensors that need
  staging (non-contiguous views, CUDA tensors) are staged again at every start.
- On mpi, whose rounds are MPI's own persistent requests where every argument is
  zero-copy, a re-bound or staged rank runs MPI's non-blocking call instead, and MPI
  does not match a persistent collective with a non-blocking one: there, bind alike on
  every rank (all contiguous, or all staged) and move memory on every rank before the
  same round, or make new requests on every rank (as FSDP does after each
  re-allocation).

The group gives every backend a default: the checked, flat host arrays go straight to
the backend's collective method (``all_reduce`` ...) on the group's thread, in issue
order with the other async ops; a ``wait()`` that finds its round still queued behind
nothing runs it on the waiting thread instead (no thread hand-over for a start followed
at once by a wait). A backend that declares ``Capabilities.persistent`` gives a native
round through ``Backend.persistent`` (shm: the path picked once; MPI:
``MPI_Allreduce_init``, ``MPI_Allgather_init``, ``MPI_Reduce_scatter_block_init``).

Two ranks, a bucket averaged every step::

    flat = torch.zeros(1024)
    req = pg.all_reduce_init(flat, ReduceOp.AVG)     # checked once
    for step in range(100):
        flat.copy_(grads())                           # new contents each round
        req.start()                                   # returns at once
        other_work()                                  # overlaps with the transfer
        req.wait()                                    # flat holds the average
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import running
from .buffers import HostBuffer, host_dtype
from .errors import CollectiveTimeout
from .reduce_op import ReduceOp, check_reducible
from .work import CompletedWork, Work

__all__ = ["PersistentRequest", "all_gather_init", "all_reduce_init", "reduce_scatter_init"]

Tensor = Any  # torch.Tensor or numpy.ndarray


def _address(obj: Any) -> tuple:
    """What a round relies on: (data_ptr, shape, dtype) of a torch tensor; (0, shape,
    dtype) of a numpy array (its memory cannot move while a view of it exists, but its
    shape and dtype can be reassigned in place)."""
    if isinstance(obj, np.ndarray):
        return 0, obj.shape, obj.dtype
    return obj.data_ptr(), tuple(obj.shape), obj.dtype


def _is_view_of(obj: Any, array: Any) -> bool:
    """Whether ``array`` (what the group's staging returned) is ``obj``'s own memory, not a
    staged copy."""
    if array is obj:
        return True
    if isinstance(obj, np.ndarray) or not isinstance(array, np.ndarray):
        return False
    return (obj.is_cpu and array.__array_interface__["data"][0] == obj.data_ptr()
            and array.nbytes == obj.numel() * obj.element_size())


class PersistentRequest:
    """One collective bound to its arguments: ``start()``, ``wait()``, many rounds.

    Both ranks::

        t = np.zeros(4, np.float32)
        req = pg.all_reduce_init(t)
        for i in range(3):
            t[:] = pg.rank + i        # rank 0: i, rank 1: i + 1
            req.start()
            req.wait()                # t == 2 * i + 1 on both ranks
    """

    __slots__ = ("_group", "_op", "_args", "_reduce_op", "_where", "_hosts", "_flat",
                 "_addresses", "_zero_copy", "_call", "_work", "_shape", "_dtype", "_freed",
                 "native")

    def __init__(self, group: Any, op: str, args: Sequence[tuple[str, Any, bool]],
                 reduce_op: Optional[ReduceOp], where: str) -> None:
        self._group, self._op, self._args = group, op, tuple(args)
        self._reduce_op, self._where = reduce_op, where
        self._work: Optional[Work] = None
        self._freed = False
        #: Whether rounds run the backend's own persistent operation (``_persistent_call``).
        self.native = False
        self._bind(native=True)

    def __repr__(self) -> str:
        state = "active" if self._work is not None else "inactive"
        return f"<PersistentRequest {self._where} {state}>"

    def _bind(self, *, native: bool) -> None:
        """Stage the arguments and pick the round's function (native where the backend
        has one, unless the memory moved: a native binding is made collectively at
        init and cannot be remade by one rank alone)."""
        g, w = self._group, self._where
        self._hosts = [g._stage(obj, where=w, arg=name, write=write)
                       for name, obj, write in self._args]
        self._flat = [h.array.reshape(-1) for h in self._hosts]
        self._addresses = [_address(obj) for _, obj, _ in self._args]
        self._zero_copy = all(h.writeback is None and _is_view_of(obj, h.array)
                              for h, (_, obj, _) in zip(self._hosts, self._args))
        described = self._hosts[-1].array  # all_reduce: the tensor; the others: input...
        if self._op == "reduce_scatter":
            described = self._hosts[0].array  # ... as the flight record of the plain call
        self._shape, self._dtype = described.shape, described.dtype
        transport = g.transport
        call = transport.persistent(self._op, self._flat, self._reduce_op) if (
            native and self._zero_copy and transport.capabilities.persistent) else None
        if not native:
            self._release()
        self.native = call is not None
        self._call = call if call is not None else self._default_call()

    def _release(self) -> None:
        release = getattr(getattr(self, "_call", None), "release", None)
        if release is not None:
            release()

    def _default_call(self) -> Callable[[int], Optional[Work]]:
        b, flat, op = self._group.transport, self._flat, self._reduce_op
        if self._op == "all_reduce":
            a = flat[0]
            return lambda seq: b.all_reduce(a, op, seq)
        out, inp = flat
        if self._op == "all_gather":
            return lambda seq: b.all_gather(out, inp, seq)
        return lambda seq: b.reduce_scatter(out, inp, op, seq)

    def _rebind_if_moved(self) -> None:
        if not self._zero_copy:  # staged: take the tensors' current contents
            self._bind(native=False)
            return
        for (name, obj, _), before in zip(self._args, self._addresses):
            if not isinstance(obj, np.ndarray) and obj.data_ptr() == before[0] \
                    and obj.dtype is before[2] and obj.shape == before[1]:
                continue  # (the usual case, checked without building a tuple)
            now = _address(obj)
            if now != before:
                if now[1:] != before[1:]:
                    raise ValueError(
                        f"{self._where}: argument `{name}` changed from shape {before[1]} "
                        f"{before[2]} to {now[1]} {now[2]} since the request was made; "
                        f"make a new request")
                self._bind(native=False)
                return

    def _ready_to_start(self, method: str) -> None:
        if self._work is not None:
            raise RuntimeError(f"{self._where}: {method}() called on a request that is "
                               f"still active; call wait() before starting it again")
        if self._freed:
            raise RuntimeError(f"{self._where}: {method}() called on a freed request")
        running.check_open(self._group, self._op + "_init")
        self._rebind_if_moved()

    def start(self) -> None:
        """Start one round on the bound tensors' current contents; returns at once."""
        self._ready_to_start("start")
        self._work = _start_round(self._group, self._op, self._call, self._hosts,
                                  self._shape, self._dtype, self._reduce_op)

    def run(self) -> None:
        """One round, blocking: what ``start(); wait()`` does, run on the calling thread.

        For a round that would be waited for at once (DDP's last bucket): ``start()``
        hands the round to the group's thread so that it can overlap the caller's work,
        and waking that thread costs tens of microseconds on a busy machine even when
        ``wait()`` takes the round back. ``run()`` numbers, records and runs it like a
        blocking collective instead (after the group's queued async ops, in issue order).
        """
        g = self._group
        if self._work is not None or self._freed or g._closed:
            self._ready_to_start("run")   # raises what is wrong
        blocked = getattr(g._recorder, "blocked", None)
        if blocked is not None:   # a traced group (collectives.trace): the wait is a slice
            with blocked(self._op):
                self._run_here(g)
            return
        self._run_here(g)

    def _run_here(self, g: Any) -> None:
        self._rebind_if_moved()
        if g._fast and self._zero_copy and not g._pending:  # as a blocking call's fast path
            running.run_numbered(g, self._op, self._call, (), self._shape, self._dtype, -1,
                                 self._reduce_op)
            return
        running.dispatch(g, self._op, self._call, (), self._hosts, False, self._shape,
                         self._dtype, -1, self._reduce_op)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the round finished; re-raise its error. ``timeout`` (seconds)
        bounds this wait only: past it, ``CollectiveTimeout``, and the round goes on."""
        work = self._work
        if work is None:
            return
        try:
            work.wait(timeout)
        except CollectiveTimeout:
            if timeout is None:  # the group's own timeout: the round is over, failed
                self._work = None
            raise
        except BaseException:
            self._work = None
            raise
        self._work = None

    def is_completed(self) -> bool:
        """True when no round is running: not started, or finished (wait() still
        reports its result and readies the request)."""
        work = self._work
        return work is None or work.is_completed()

    def free(self) -> None:
        """Release the request (``MPI_Request_free``); an active round is waited for
        first. A freed request cannot be started."""
        if self._work is not None:
            self.wait()
        if not self._freed:
            self._freed = True
            self._release()

    @property
    def active(self) -> bool:
        """Started and not yet waited for."""
        return self._work is not None


class _QueuedWork(Work):
    """A round of the default request on the group's thread, in issue order with the
    group's other async ops. ``wait()`` runs it on the waiting thread instead when it is
    still queued and nothing is ahead of it: the thread hand-over (tens of
    microseconds on a busy machine) is then saved."""

    __slots__ = ("_group", "_op", "_seq", "_call", "_buffers", "_future", "_ran")

    def __init__(self, group: Any, op: str, seq: int, call: Callable[[int], Any],
                 buffers: Sequence[HostBuffer]) -> None:
        self._group, self._op, self._seq = group, op, seq
        self._call, self._buffers = call, buffers
        self._ran = False
        with group._pending_lock:
            group._pending += 1
        try:
            self._future = running.executor(group).submit(self._task)
        except BaseException:
            with group._pending_lock:
                group._pending -= 1
            raise

    def _body(self) -> None:
        try:
            self._call(self._seq)
        except BaseException as exc:
            raise running.failed(self._group, exc, self._op, self._seq)
        for b in self._buffers:
            b.commit()

    def _task(self) -> None:
        try:
            self._body()
        finally:
            group = self._group
            with group._pending_lock:
                group._pending -= 1

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._ran:
            return
        future, group = self._future, self._group
        if timeout is None and not future.done():  # (a bounded wait must not run it)
            with group._pending_lock:
                stolen = group._pending == 1 and future.cancel()
                if stolen:
                    group._pending -= 1
            if stolen:
                self._ran = True
                self._body()
                return
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            description = f"{group._where(self._op)} (seq {self._seq})"
            raise CollectiveTimeout(
                f"{description}: still running after wait(timeout={timeout})",
                op=self._op, seq=self._seq) from None
        except concurrent.futures.CancelledError:   # queued when the group was aborted
            raise group.aborted_error(self._op, self._seq) from None

    def is_completed(self) -> bool:
        return self._ran or self._future.done()


def all_reduce_init(group: Any, tensor: Tensor, op: ReduceOp) -> PersistentRequest:
    """``pg.all_reduce_init(tensor, op)``: a persistent ``all_reduce``, checked now."""
    w = group._where("all_reduce_init")
    running.check_open(group, "all_reduce_init")
    group._args.tensor(tensor, "tensor", w)
    op = check_reducible(op, host_dtype(tensor), w)
    return PersistentRequest(group, "all_reduce", [("tensor", tensor, True)], op, w)


def all_gather_init(group: Any, output: Tensor, input: Tensor) -> PersistentRequest:
    """``pg.all_gather_init(output, input)``: a persistent ``all_gather``, checked now."""
    w = group._where("all_gather_init")
    running.check_open(group, "all_gather_init")
    group._args.pair(output, input, ("output", "input"), w)
    return PersistentRequest(group, "all_gather",
                             [("output", output, True), ("input", input, False)], None, w)


def reduce_scatter_init(group: Any, output: Tensor, input: Tensor,
                        op: ReduceOp) -> PersistentRequest:
    """``pg.reduce_scatter_init(output, input, op)``: a persistent ``reduce_scatter``."""
    w = group._where("reduce_scatter_init")
    running.check_open(group, "reduce_scatter_init")
    group._args.tensor(output, "output", w)
    group._args.tensor(input, "input", w)
    group._args.same_dtype(output, input, ("output", "input"), w)
    op = check_reducible(op, host_dtype(input), w, "input")
    group._args.multiple(input, output, ("input", "output"), w)
    return PersistentRequest(group, "reduce_scatter",
                             [("output", output, True), ("input", input, False)], op, w)


def _start_round(group: Any, op: str, call: Callable[[int], Any],
                 buffers: Sequence[HostBuffer], shape: Any, dtype: Any,
                 reduce_op: Optional[ReduceOp]) -> Work:
    """Number one round, check it (debug mode), record it and start it: what
    ``running.dispatch`` does for ``async_op=True``, with pre-checked arguments."""
    check_seq = running.next_seq(group, op) if group._debug else -1
    seq = running.next_seq(group, op)
    recorder = group._recorder
    rec = None if recorder is None else recorder.start(seq, op, shape, dtype, -1,
                                                       reduce_op, -1)
    try:
        if check_seq >= 0:
            running.check_same_call(group, op, check_seq, seq, shape, dtype, -1, reduce_op,
                                    None)
        if group._returns_work:
            work = running.run_started(group, op, seq, call, (), buffers, True)
            if work is None:  # done already (a world of one)
                work = CompletedWork()
        else:
            work = _QueuedWork(group, op, seq, call, buffers)
    except BaseException as exc:
        running.record_failure(group, rec, exc)
        raise
    if isinstance(work, running.GroupWork):
        work.rec = rec
        return work
    return running.GroupWork(work, group, op, seq, rec, ())
