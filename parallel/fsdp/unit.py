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
            self.meter.add(flat.full_bytes)
        inp = flat.gather_input()
        as_int = _INT_OF_WIDTH[inp.element_size()]
        self._gather_input = inp.view(as_int)        # kept alive while the gather runs
        work = self.group.all_gather(host_alias(flat.full), self._gather_input,
                                     async_op=async_op)
        self._gathered_version = flat.shard._version
        if async_op:
            self._gather_work = work
        else:
            self._gather_input = None
        return True

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
