"""Gradient buckets for data parallelism.

Two pieces, kept apart so that each can be read (and tested) on its own:

- :func:`assign_buckets`, a pure function: which parameter goes into which bucket. No
  torch, no group; a property test hits it directly.
- :class:`Bucket`: one flat gradient buffer. Its parameters' ``.grad`` are views into it,
  it counts the gradients still to come, and it starts its own asynchronous all-reduce when
  told that the last one has landed.

Why buckets: one all-reduce per parameter pays the per-message latency once per tensor;
one all-reduce of everything at the end of backward cannot start before the last gradient
exists. A few buckets of a few MiB each, filled in the order backward produces gradients,
let communication of the late layers' gradients overlap the computation of the early
layers' ones (Li et al., "PyTorch Distributed", VLDB 2020, arXiv 2006.15704, section 3.2.3).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

from collectives import ReduceOp

__all__ = ["Bucket", "assign_buckets"]


def assign_buckets(sizes: Sequence[int], cap_bytes: int, *,
                   keys: Optional[Sequence[Hashable]] = None) -> list[list[int]]:
    """Group tensors into buckets of at most ``cap_bytes`` bytes.

    ``sizes[i]`` is the size in bytes of tensor ``i``; tensors are listed in the order their
    gradients are expected to become ready (for DDP: reverse order of registration).
    ``keys[i]`` (for DDP: dtype and device) separates tensors that cannot share a flat
    buffer: tensors with different keys never share a bucket.

    Greedy, one open bucket per key: tensor ``i`` joins its key's open bucket unless that
    would take the bucket past ``cap_bytes``; then the open bucket is closed and ``i``
    opens a new one. So a bucket holding more than one tensor is never over the cap, and a
    tensor larger than the cap gets a bucket of its own.

    Returns the buckets as lists of indices, each list increasing, the buckets ordered by
    their last index: the order in which they are expected to fill, which is the order DDP
    launches them in.

    >>> assign_buckets([4, 4, 4, 12, 4], cap_bytes=8)
    [[0, 1], [2], [3], [4]]
    >>> assign_buckets([4, 8, 4, 8], cap_bytes=16, keys=["f32", "f64", "f32", "f64"])
    [[0, 2], [1, 3]]
    """
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, (int, float)) or not cap_bytes > 0:
        raise ValueError(f"assign_buckets: argument `cap_bytes` must be a positive number, "
                         f"got {cap_bytes!r}")
    sizes = list(sizes)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"assign_buckets: sizes[{i}]={s!r} is not a non-negative int")
    if keys is None:
        keys = [None] * len(sizes)
    elif len(keys) != len(sizes):
        raise ValueError(f"assign_buckets: got {len(keys)} keys for {len(sizes)} sizes")

    closed: list[list[int]] = []
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}  # key -> (indices, bytes)
    for i, (size, key) in enumerate(zip(sizes, keys)):
        indices, used = open_buckets.get(key, ([], 0))
        if indices and used + size > cap_bytes:
            closed.append(indices)
            indices, used = [], 0
        indices.append(i)
        open_buckets[key] = (indices, used + size)
    closed.extend(indices for indices, _ in open_buckets.values())
    return sorted(closed, key=lambda b: b[-1])


class Bucket:
    """The gradients of some parameters (one dtype, one device) in one flat tensor.

    ``flat`` holds, back to back, every parameter's gradient and then one flag per
    parameter (1 when this rank has a gradient for it, 0 when not). The flags travel in the
    same all-reduce as the gradients, so after it every rank knows, at no extra message,
    which parameters received a gradient on at least one rank.

    Life of a bucket during one synchronised backward pass::

        adopt(slot)          the parameter's .grad becomes its view in `flat` (a copy only
                             when autograd made a fresh tensor, e.g. after
                             zero_grad(set_to_none=True))
        mark_ready(slot)     -> True when it was the last one: the bucket is full
        launch()             start the persistent all_reduce(flat, AVG) made at init (an
                             async all_reduce where the group has none): runs while
                             backward goes on (blocking=True: runs it to the end now)
        fill_missing()       (end of backward, buckets never filled) take what the missing
                             parameters hold, zeros where they have no gradient
        finish()             wait; .grad = view where some rank had a gradient, None elsewhere
    """

    def __init__(self, index: int, params: Sequence[Any], group: Any) -> None:
        import torch

        if not params:
            raise ValueError("Bucket: needs at least one parameter")
        dtype, device = params[0].dtype, params[0].device
        for p in params:
            if p.dtype != dtype or p.device != device:
                raise ValueError(f"Bucket {index}: parameters of one bucket share dtype and "
                                 f"device; got {dtype}/{device} and {p.dtype}/{p.device}")
        self.index = index
        self.params = list(params)
        self.group = group
        self.numel = sum(p.numel() for p in self.params)
        count = self.numel + len(self.params)
        alloc = getattr(group, "alloc_symmetric", None)
        if alloc is not None and device.type == "cpu":
            # Memory the peers may read in place (shm: half the all-reduce's memory
            # traffic); a collective, made where every rank makes its buckets alike.
            itemsize = torch.empty((), dtype=dtype).element_size()
            self.flat = torch.frombuffer(alloc(count * itemsize), dtype=dtype)
        else:
            self.flat = torch.zeros(count, dtype=dtype, device=device)
        self._flags = self.flat[self.numel:]
        self.views = []
        offset = 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._pairs = list(zip(self.params, self.views))
        self._has_grad = [False] * len(self.params)
        self._ready = [False] * len(self.params)
        self._pending = len(self.params)
        # Whether the flags in `flat` hold 1.0 each already (as every pass where all ranks
        # had every gradient leaves them: the average of ones): launch() then has nothing
        # to write, the common case, which saves building a tensor per pass.
        self._flags_are_ones = False
        self._complete = False   # launch(): whether this rank had every gradient
        self.work: Any = None
        # The average of `flat`, checked once and started every pass (a persistent
        # collective, see collectives.persistent); made here, where every rank makes
        # its buckets in the same order. A group without persistent requests gets a
        # plain all_reduce per pass.
        init = getattr(group, "all_reduce_init", None)
        self._request: Any = None if init is None else init(self.flat, ReduceOp.AVG)

    def __repr__(self) -> str:
        return (f"<Bucket {self.index}: {len(self.params)} params, {self.numel} x "
                f"{self.flat.dtype}, {self._pending} pending>")

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    @property
    def full(self) -> bool:
        """Every gradient of this pass has landed (or was filled in)."""
        return self._pending == 0

    @property
    def launched(self) -> bool:
        return self.work is not None

    def _aliases(self, slot: int) -> bool:
        grad, view = self.params[slot].grad, self.views[slot]
        if grad is view:  # the common case, and the cheap test (torch keeps one object)
            return True
        return (grad is not None and grad.data_ptr() == view.data_ptr()
                and grad.shape == view.shape and grad.stride() == view.stride())

    def adopt(self, slot: int) -> bool:
        """Make parameter ``slot``'s ``.grad`` its view in ``flat`` (copying the values in
        when it is another tensor). Returns whether the parameter has a gradient."""
        p = self.params[slot]
        if p.grad is None:
            return False
        if not self._aliases(slot):
            self.views[slot].copy_(p.grad)
            p.grad = self.views[slot]
        return True

    def mark_ready(self, slot: int) -> bool:
        """Record that parameter ``slot``'s gradient is final for this pass; True when it
        was the last one missing."""
        if self._ready[slot]:
            raise RuntimeError(
                f"DDP: parameter {slot} of bucket {self.index} received its gradient twice "
                f"in one backward pass (reentrant checkpointing, or a second backward through "
                f"the same graph before the first one finished?)")
        self._ready[slot] = True
        self._has_grad[slot] = True
        self._pending -= 1
        return self._pending == 0

    def fill_missing(self) -> None:
        """End of backward: every parameter that never reported contributes what its
        ``.grad`` holds (accumulated under ``no_sync``, or left from earlier steps), or
        zeros when it has none."""
        views, ready, has = self.views, self._ready, self._has_grad
        for slot, p in enumerate(self.params):
            if ready[slot]:
                continue
            if p.grad is views[slot]:   # (the last bucket's usual case: nothing to adopt)
                has[slot] = True
            else:
                has[slot] = self.adopt(slot)
                if not has[slot]:
                    views[slot].zero_()
            ready[slot] = True
        self._pending = 0

    def run_adopted(self) -> bool:
        """``fill_missing(); launch(blocking=True); finish()`` in one call, for the last
        bucket at the end of backward in the common case: no gradient was marked (the
        last bucket's hooks only start a pass) and every ``.grad`` is its view already,
        so there is nothing to adopt, every flag is 1 and the round runs at once on this
        thread. Returns False, having changed nothing, where that is not
        the case (the caller then takes the three steps). In a training step the
        caches are cold and every Python frame costs a microsecond or two: the three
        steps are four frames more than this one."""
        request = self._request
        if request is None or self._pending != len(self.params) or not hasattr(request, "run"):
            return False
        for p, view in self._pairs:
            if p.grad is not view:
                return False
        self._flags_all_present()
        request.run()   # (raising: the caller resets every bucket, these flags too)
        # Every flag is above 0 (this rank's 1 is in each average), so every .grad stays
        # its view; whether all are 1 (no rank missed a gradient) saves the next fill.
        self._flags_are_ones = self._round_flags()[1]
        return True

    def _flags_all_present(self) -> None:
        """Every flag 1 (this rank has every gradient), written only where ``flat`` does
        not hold that already."""
        if not self._flags_are_ones:
            self._flags.fill_(1)
            self._flags_are_ones = True

    def _round_flags(self) -> tuple[list, bool]:
        """The flags the round left (averages over the ranks), and whether all are 1."""
        flags = self._flags.tolist()
        return flags, flags.count(1.0) == len(flags)

    def launch(self, *, blocking: bool = False) -> None:
        """Start the asynchronous average of ``flat`` over the group; ``blocking``: run
        it to the end now, on this thread (for the bucket that is waited for at once:
        see :meth:`collectives.PersistentRequest.run`)."""
        if self._pending:
            raise RuntimeError(f"DDP: bucket {self.index} launched with {self._pending} "
                               f"gradients missing")
        self._complete = all(self._has_grad)
        if self._complete:
            self._flags_all_present()
        else:
            self._flags.copy_(self._flags.new_tensor(self._has_grad))
            self._flags_are_ones = False
        request = self._request
        if request is None:  # a group without persistent requests
            self.work = self.group.all_reduce(self.flat, op=ReduceOp.AVG,
                                              async_op=not blocking)
        elif not blocking:
            request.start()
            self.work = request
        elif hasattr(request, "run"):
            request.run()
        else:  # a request from before run() (a user's wrapper)
            request.start()
            request.wait()

    def finish(self) -> None:
        """Wait for the all-reduce and hand the averages to the parameters; get ready for the
        next pass. A parameter that no rank had a gradient for keeps ``.grad = None`` (as in
        one process, where the optimizer then skips it): the flags are bitwise identical on
        every rank, so every rank decides the same."""
        work, self.work = self.work, None
        ones = False
        try:
            if work is not None:
                work.wait()
            flags, ones = self._round_flags()
            # Where every rank had every gradient and so did this one, each .grad is its
            # view already (adopt made it so): nothing to hand out.
            if not (ones and self._complete):
                for slot, p in enumerate(self.params):
                    if flags[slot] > 0:
                        if not self._aliases(slot):
                            p.grad = self.views[slot]
                    else:
                        p.grad = None
        finally:
            self.reset()
            self._flags_are_ones = ones  # what the round left in `flat`'s flags

    def reset(self) -> None:
        work = self.work
        if work is not None and work is self._request:
            # A pass that failed elsewhere: the round still owns `flat` and the request
            # must be waited for before it can start again (the error was raised already).
            try:
                work.wait()
            except BaseException:  # noqa: BLE001
                pass
        self._ready = [False] * len(self.params)
        self._has_grad = [False] * len(self.params)
        self._pending = len(self.params)
        self._flags_are_ones = False  # (finish() sets it from the round's result)
        self._complete = False
        self.work = None
