"""One FSDP unit: gather its parameters, free them, reduce its gradient.

A unit is a submodule (or the root's leftover parameters) owning one
:class:`~parallel.fsdp.flat_param.FlatParam`. Its life in one training step::

    unshard()            allocate the full copy, all_gather the shards into it
                         (async: a prefetch; wait_unshard() before use)
    ... forward ...      the module's parameters are views into the full copy
    reshard()            free the full copy (zero3, after forward unless
                         reshard_after_forward=False; after backward always)
    unshard() again      in backward, before the unit's gradients are computed
    on full.grad         autograd summed every view's gradient into one flat vector
    launch_reduce()      reduce_scatter it, averaged (zero2/zero3), or all_reduce it (zero1)
    finish_reduce()      wait, add this rank's slice to shard.grad (float32)

Which unit does what when (the order every rank keeps) is decided by
:mod:`parallel.fsdp.api` and :mod:`parallel.fsdp.prefetch`; a unit only does what it is told.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from collectives import ReduceOp

from .flat_param import FlatParam, host_alias
from .memory import FullParamMeter

__all__ = ["Unit"]

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class Unit:
    """A unit's flat parameter and its communication. ``strategy`` is one of zero1, zero2,
    zero3: with zero1 and zero2 the full copy stays resident and is gathered again only
    when the shard changed (the optimizer stepped), found by the shard's version counter."""

    def __init__(self, index: int, name: str, module: nn.Module, flat: FlatParam, group: Any,
                 *, strategy: str, reduce_dtype: torch.dtype, meter: FullParamMeter) -> None:
        self.index, self.name, self.module, self.flat = index, name, module, flat
        self.group, self.strategy, self.reduce_dtype = group, strategy, reduce_dtype
        self.meter = meter
        self._gather_work: Any = None
        self._gather_input: Optional[torch.Tensor] = None
        self._gathered_version = -1
        # The persistent all_gather into the full copy (collectives.persistent), bound
        # to the memory of one allocation: made again after each re-allocation (zero3
        # frees after every use), at the same point on every rank, since a native
        # binding (MPI's) is made collectively.
        self._gather_request: Any = None
        self._gather_buffer: Optional[torch.Tensor] = None   # the shard in compute dtype
        self._allocations = 0
        self._request_allocation = -1
        self._reduce_req: Any = None              # see _reduce_request
        self._reduce_buffers: Optional[tuple] = None
        self._reduce: Optional[tuple] = None      # (work, grad sent, output)
        self.full_grad: Optional[torch.Tensor] = None   # zero1: the averaged full gradient
        self.grad_ready = False                   # full.grad final for this pass
        self.gathered_in_backward = False
        self.ran_forward = False                  # since the last synchronised backward
        flat.full.register_post_accumulate_grad_hook(self._on_grad)
        self.on_grad_ready = None                 # set by the wrapper: callback(unit)

    def __repr__(self) -> str:
        return (f"<FSDP unit {self.index} {self.name or '(root)'}: {self.flat.total} "
                f"elements, shard {self.flat.shard_numel}>")

    @property
    def label(self) -> str:
        return f"unit {self.index} ({self.name or 'root'}: {type(self.module).__name__})"

    # ------------------------------------------------------------------- gather
    @property
    def up_to_date(self) -> bool:
        """The full copy holds the current shards (nothing to gather)."""
        return (self.flat.allocated and self._gathered_version == self.flat.shard._version
                and self._gather_work is None)

    @property
    def gathering(self) -> bool:
        return self._gather_work is not None

    def unshard(self, *, async_op: bool) -> bool:
        """Start gathering the full copy unless it is current or on its way. Returns
        whether a collective was issued."""
        if self._gather_work is not None or self.up_to_date:
            return False
        flat = self.flat
        if not flat.allocated:
            flat.allocate()
            self._allocations += 1
            self.meter.add(flat.full_bytes)
        request = self._gather_request_now()
        if request is None:  # a group without persistent requests
            inp = flat.gather_input()
            self._gather_input = inp.view(_INT_OF_WIDTH[inp.element_size()])  # kept alive
            work = self.group.all_gather(host_alias(flat.full), self._gather_input,
                                         async_op=True)
        else:
            if self._gather_buffer is not None:  # mixed precision: this round's cast
                self._gather_buffer.copy_(flat.shard.detach())
            request.start()
            work = request
        self._gathered_version = flat.shard._version
        if async_op:
            self._gather_work = work
        else:
            work.wait()
            self._gather_input = None
        return True

    def _gather_request_now(self) -> Any:
        """The persistent all_gather for the current allocation of the full copy (None
        where the group has no ``all_gather_init``)."""
        init = getattr(self.group, "all_gather_init", None)
        if init is None:
            return None
        if self._gather_request is None or self._request_allocation != self._allocations:
            flat = self.flat
            if self._gather_request is not None:
                self._gather_request.free()
            shard = flat.shard.detach()
            if shard.dtype != flat.compute_dtype:
                if self._gather_buffer is None:
                    self._gather_buffer = torch.empty(shard.shape, dtype=flat.compute_dtype)
                shard = self._gather_buffer
            self._gather_input = shard.view(_INT_OF_WIDTH[shard.element_size()])
            self._gather_request = init(host_alias(flat.full), self._gather_input)
            self._request_allocation = self._allocations
        return self._gather_request

    def wait_unshard(self, *, install: bool = True) -> None:
        """Block until the full copy is there; make the module's parameters its views
        (``install``; backward needs only the storage refilled: autograd kept its views)."""
        if self._gather_work is None and not self.flat.allocated:
            self.unshard(async_op=False)
        work, self._gather_work = self._gather_work, None
        if work is not None:
            work.wait()
            self._gather_input = None
        if install:
            self.flat.install_views()

    def reshard(self) -> None:
        """Free the full copy (zero3 only: zero1 and zero2 keep it). A prefetch that was
        never used is waited for first, in every strategy: nothing may still be reading
        the shard when the optimizer steps."""
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = self._gather_input = None
        if self.strategy != "zero3" or not self.flat.allocated:
            return
        self.flat.free()
        self.meter.sub(self.flat.full_bytes)

    # ------------------------------------------------------------------- gradients
    def _on_grad(self, full: torch.Tensor) -> None:
        self.grad_ready = True
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    @property
    def launched(self) -> bool:
        return self._reduce is not None

    def launch_reduce(self) -> None:
        """Average the flat gradient over the ranks, asynchronously. A unit with no
        gradient on this rank (it ran, but its outputs did not reach the loss) sends
        zeros: every rank must take part."""
        full = self.flat.full
        grad = full.grad
        full.grad = None
        request = self._reduce_request(grad)
        if request is not None:
            buffer, out = self._reduce_buffers
            if grad is None:
                buffer.zero_()
            else:
                buffer.copy_(grad)   # the cast to reduce_dtype, into the bound buffer
            request.start()
            self._reduce = (request, buffer, out)
            return
        if grad is None:
            grad = torch.zeros(self.flat.padded, dtype=self.reduce_dtype)
        elif grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        elif not grad.is_contiguous():
            grad = grad.contiguous()
        if self.strategy == "zero1":
            work = self.group.all_reduce(grad, op=ReduceOp.AVG, async_op=True)
            self._reduce = (work, grad, grad)
        else:
            out = torch.empty(self.flat.shard_numel, dtype=self.reduce_dtype)
            work = self.group.reduce_scatter(out, grad, op=ReduceOp.AVG, async_op=True)
            self._reduce = (work, grad, out)

    def _reduce_request(self, grad: Optional[torch.Tensor]) -> Any:
        """The persistent reduction of the gradient, where it costs no extra copy: when
        the gradient is cast to a ``reduce_dtype`` other than float32 anyway (the cast
        then writes into the bound buffer, and the result is cast back to float32, so
        nothing keeps a view of the bound memory). Otherwise (float32 reductions) a
        plain async call on autograd's own tensor: binding would cost a copy of the
        whole flat gradient per step, more than the microseconds a request saves."""
        if self.reduce_dtype == torch.float32 or (
                grad is not None and grad.dtype == self.reduce_dtype):
            return None
        if self._reduce_req is None:
            init_name = "all_reduce_init" if self.strategy == "zero1" else \
                "reduce_scatter_init"
            if getattr(self.group, init_name, None) is None:
                return None
            buffer = torch.empty(self.flat.padded, dtype=self.reduce_dtype)
            if self.strategy == "zero1":
                out = buffer
                self._reduce_req = self.group.all_reduce_init(buffer, ReduceOp.AVG)
            else:
                out = torch.empty(self.flat.shard_numel, dtype=self.reduce_dtype)
                self._reduce_req = self.group.reduce_scatter_init(out, buffer, ReduceOp.AVG)
            self._reduce_buffers = (buffer, out)
        return self._reduce_req

    def finish_reduce(self) -> None:
        """Wait for the average and add this rank's slice to ``shard.grad``, as autograd
        would add to ``.grad`` in one process."""
        work, grad, out = self._reduce
        self._reduce = None
        work.wait()
        if self.strategy == "zero1":
            self.full_grad = grad if grad.dtype == torch.float32 else grad.float()
            start, stop = self.flat.shard_range(self.group.rank)
            mine = self.full_grad[start:stop]
        else:
            mine = out if out.dtype == torch.float32 else out.float()
        shard = self.flat.shard
        if shard.grad is None:
            shard.grad = mine   # zero1: a view into the resident full gradient
        else:
            shard.grad.add_(mine)

    def drop_reduce(self) -> None:
        """Forget a reduction in flight (the pass failed); wait so nothing writes later."""
        work, self._reduce = (self._reduce or (None,))[0], None
        if work is not None:
            work.wait()

    def reset_pass(self) -> None:
        self.grad_ready = False
        self.gathered_in_backward = False
