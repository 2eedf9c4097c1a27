"""FullyShardedDataParallel: every rank holds 1/N of each unit's parameters, gradients and
optimizer state (ZeRO stage 3; Rajbhandari et al. 2020, arXiv 1910.02054), and gathers a
unit's parameters only while the unit computes.

Two ranks, each with half of a batch, take the step one process takes on all of it:

>>> import torch, collectives
>>> import torch.nn.functional as F
>>> from torch import nn
>>> from parallel import FSDP
>>> def net():
...     torch.manual_seed(0)
...     return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> def step():
...     pg = collectives.init_process_group()
...     model = FSDP(net(), pg, wrap=nn.Linear)             # each Linear a unit
...     opt = torch.optim.SGD(model.parameters(), lr=0.1)   # only this rank's shards
...     torch.manual_seed(1)
...     x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))  # the same draw on both...
...     mine = slice(2 * pg.rank, 2 * pg.rank + 2)           # ...each rank its half
...     loss = F.cross_entropy(model(x[mine]), y[mine])
...     opt.zero_grad()
...     loss.backward()                   # each shard's .grad: the ranks' average
...     opt.step()
...     state = model.full_state_dict()
...     pg.close()
...     dense = net()                     # one process, the whole batch
...     dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
...     F.cross_entropy(dense(x), y).backward()
...     dense_opt.step()
...     return all(torch.allclose(state[k], v, atol=1e-6) for k, v in dense.state_dict().items())
>>> collectives.spawn(step, 2)
[True, True]

One step of unit ``k`` (see :mod:`.unit` for the mechanics, :mod:`.prefetch` for the
order every rank keeps): its forward pre-hook waits for its all_gather (started while
unit ``k - 1`` computed) and starts unit ``k + 1``'s; its forward hook frees it and wraps
its outputs in an identity whose backward gathers it again (and prefetches the next
one) before autograd computes its gradients. Autograd sums the gradients of every
parameter view into the unit's flat gradient; a hook then reduce-scatters it, averaged,
so each rank keeps its shard. ``loss.backward()`` returns once every reduction finished.

``strategy="zero2"`` keeps the full parameters resident between steps (gathered again
only after the optimizer changed the shards); ``"zero1"`` also all-reduces whole
gradients and keeps them; only the optimizer state is then sharded. All three train
the same numbers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..arguments import check_group, check_module, check_same_replicas
from ..autograd_hooks import collect_outputs, graph_task_id, replace_outputs
from . import checkpoint, state_dict
from .flat_param import FlatParam, detach_parameters
from .memory import FullParamMeter, optimizer_state_bytes, tensor_bytes
from .prefetch import BackwardPlan, ForwardOrder
from .unit import Unit
from .wrap import as_predicate, assign_parameters, broadcast_tensors

__all__ = ["FSDP", "FullyShardedDataParallel"]

STRATEGIES = ("zero1", "zero2", "zero3")
_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over ``group``, unit by unit.

    Two ranks, ``nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))`` with ``wrap=nn.Linear``:
    two units of 15 and 8 elements; rank 0 holds elements 0-7 and 0-3 of them, rank 1
    elements 8-14 (plus one padding zero) and 4-7. ``list(model.parameters())`` is those
    two shards; ``model.full_state_dict()["0.weight"]`` the whole (3, 4) weight on both.

    Args:
        module: the model, the same (names, shapes) on every rank; rank 0's values are
            broadcast at construction.
        group: the :class:`collectives.ProcessGroup` of the data-parallel ranks.
        wrap: which submodules become units: a module class, a tuple of classes, or a
            predicate ``module -> bool``. Each owns one flat parameter; the root owns the
            rest. None: the whole model is one unit.
        strategy: ``"zero3"`` (parameters, gradients and optimizer state sharded),
            ``"zero2"`` (gradients and optimizer state), ``"zero1"`` (optimizer state).
        prefetch: start the next unit's all_gather before the current one computes, in
            forward and in backward.
        reshard_after_forward: free each unit's full parameters after its forward (zero3);
            False keeps them until the unit's backward (less communication, more memory).
        param_dtype: compute (and gather) in this dtype, e.g. ``torch.bfloat16``; the
            sharded master parameters stay float32. Floating inputs of each unit are cast.
        reduce_dtype: reduce gradients in this dtype (default: ``param_dtype``).
        broadcast_buffers: broadcast rank 0's buffers before each training forward (as
            DDP does), so that replicas' buffers (BatchNorm statistics) stay identical.

    Every rank must run the same units' forwards in the same order and the same
    backward structure, as with PyTorch's FSDP. A unit whose forward did not run in a
    step is not communicated (its shards keep ``.grad`` None, as in one process); a unit
    that ran but whose outputs got no gradient on some rank contributes zeros there.
    """

    def __init__(self, module: nn.Module, group: Any, *, wrap: Any = None,
                 strategy: str = "zero3", prefetch: bool = True,
                 reshard_after_forward: bool = True, param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        check_module(module, "FSDP")
        check_group(group, "FSDP", ("rank", "size", "all_gather", "reduce_scatter",
                                    "all_gather_object"))
        where = self._where = f"[rank {group.rank}/{group.size}] FSDP"
        if strategy not in STRATEGIES:
            raise ValueError(f"{where}: argument `strategy` must be one of {STRATEGIES}, "
                             f"got {strategy!r}")
        for name, value in (("prefetch", prefetch), ("reshard_after_forward",
                                                     reshard_after_forward),
                            ("broadcast_buffers", broadcast_buffers)):
            if not isinstance(value, bool):
                raise TypeError(f"{where}: argument `{name}` must be a bool, got {value!r}")
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in _LOW_PRECISION:
                raise TypeError(f"{where}: argument `{name}` must be None or one of "
                                f"{_LOW_PRECISION}, got {value!r}")
        predicate = as_predicate(wrap)
        self.module, self.group, self.strategy = module, group, strategy
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.param_dtype, self.broadcast_buffers = param_dtype, broadcast_buffers
        self.reduce_dtype = reduce_dtype or param_dtype or torch.float32
        compute_dtype = param_dtype or torch.float32

        self._state_dict_keys = list(module.state_dict().keys())
        check_same_replicas(group, module.named_parameters(), where)
        found, self._frozen = assign_parameters(module, predicate, where)
        broadcast_tensors(group, list(module.parameters()) + list(module.buffers()))
        self._meter = FullParamMeter()
        self.units: list[Unit] = []
        self._root_unit: Optional[Unit] = None
        for name, owner, entries in found:
            if not entries:
                continue
            flat = FlatParam(entries, group.rank, group.size, compute_dtype=compute_dtype,
                             where=f"{where} unit {name or '(root)'!r}")
            detach_parameters(entries)
            flat.install_placeholders()
            unit = Unit(len(self.units), name, owner, flat, group, strategy=strategy,
                        reduce_dtype=self.reduce_dtype, meter=self._meter)
            unit.on_grad_ready = self._on_grad_ready
            self.units.append(unit)
            if owner is module:
                self._root_unit = unit
            else:
                owner.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True)
                owner.register_forward_hook(self._make_post_forward(unit))
        self.flat_params = nn.ParameterList([u.flat.shard for u in self.units])
        self._order = ForwardOrder([u for u in self.units if u is not self._root_unit])
        self._require_sync = True
        self._forward_sync = True
        self._plan: Optional[BackwardPlan] = None
        self._pass_sync: Optional[bool] = None
        self._pass_task: Optional[int] = None

    # ----------------------------------------------------------------------- forward
    def _cast(self, obj: Any) -> Any:
        if self.param_dtype is None:
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(self.param_dtype) if obj.is_floating_point() else obj
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._cast(o) for o in obj)
        if isinstance(obj, dict):
            return type(obj)((k, self._cast(v)) for k, v in obj.items())
        return obj

    def _unshard_for_forward(self, unit: Unit) -> None:
        if torch.is_grad_enabled():
            self._order.record(unit)
            unit.ran_forward = True
        unit.unshard(async_op=True)
        if self.prefetch:
            following = self._order.after(unit)
            if following is not None:
                following.unshard(async_op=True)
        unit.wait_unshard()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if self._plan is not None:  # the last backward raised before its end
            self._abandon_pass()
        if self.broadcast_buffers and self.training and grad and self.group.size > 1:
            broadcast_tensors(self.group, list(self.module.buffers()))
        self._forward_sync = self._require_sync
        root = self._root_unit
        if root is not None:
            if grad:
                root.ran_forward = True
            root.unshard(async_op=True)
        if self.prefetch:
            first = self._order.first()
            if first is not None:
                first.unshard(async_op=True)
        if root is not None:
            root.wait_unshard()
        out = self.module(*self._cast(args), **self._cast(kwargs))
        ran = {u.index for u in self._order.current}
        for unit in self.units:  # prefetched on a guess, never run: free again
            if unit is not root and (unit.index not in ran or not grad):
                unit.reshard()
        if not grad:
            if root is not None:
                root.reshard()
            return out
        leaves: list = []
        collect_outputs(out, leaves)
        if not leaves:
            return out
        return replace_outputs(out, iter(_PreBackward.apply(self, None, self._forward_sync, *leaves)))

    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            self._unshard_for_forward(unit)
            if self.param_dtype is not None:
                return self._cast(args), self._cast(kwargs)
            return None
        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, output: Any):
            grad = torch.is_grad_enabled()
            if not grad or self.reshard_after_forward:
                unit.reshard()
            if not grad:
                return output
            leaves: list = []
            collect_outputs(output, leaves)
            if not leaves:
                return output
            return replace_outputs(output, iter(_PreBackward.apply(self, unit, self._forward_sync,
                                                             *leaves)))
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates each unit's full gradient locally (memory: the
        whole model's gradients) and communicates no gradient; the first synchronised
        backward after it reduces the sums. Run forward and backward inside, scaling
        each micro-batch's loss by 1/k to average k of them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # ---------------------------------------------------------------------- backward
    def _pre_backward(self, unit: Optional[Unit], sync: bool) -> None:
        task = graph_task_id()
        if self._pass_sync is None or task != self._pass_task:
            self._begin_backward(sync, task)
        # The root's outputs (unit None) come first: its backward needs its parameters
        # too. After one forward they are still there, but with several forwards ahead of
        # their backwards (micro-batches in a pipeline, under no_sync) an earlier pass
        # freed them when their gradient was complete, and they are gathered again.
        root = self._root_unit
        if unit is None and root is not None and root.ran_forward:
            unit = root
        if unit is not None:
            self._plan.before_unit(unit)

    def _begin_backward(self, sync: bool, task: Optional[int]) -> None:
        if self._plan is not None:
            self._abandon_pass()
        schedule = self._order.current[::-1]
        reduce_order = list(schedule)
        if sync:
            scheduled = {u.index for u in schedule}
            reduce_order += [u for u in self.units if u.ran_forward and u.index not in scheduled
                             and u is not self._root_unit]
            if self._root_unit is not None and self._root_unit.ran_forward:
                reduce_order.append(self._root_unit)
        self._plan = BackwardPlan(schedule, reduce_order, prefetch=self.prefetch)
        self._pass_sync, self._pass_task = sync, task
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._plan.start()

    def _on_grad_ready(self, unit: Unit) -> None:
        if self._plan is None:
            raise RuntimeError(f"{self._where}: {unit.label} received a gradient outside a "
                               f"backward pass through the FSDP module's outputs")
        # Its gradient is complete, so no backward node needs its values any more.
        unit.reshard()
        if self._pass_sync:
            self._plan.launch_ready()

    def _end_backward(self) -> None:
        plan, sync = self._plan, self._pass_sync
        try:
            plan.finish_gathers()
            if sync:
                plan.launch_rest()
                for unit in plan.reduce_order:
                    unit.finish_reduce()
                for unit in self.units:
                    unit.ran_forward = False
        except BaseException:
            self._reset_pass(quiet=True)   # the error that matters is this one
            raise
        self._reset_pass(quiet=False)

    def _abandon_pass(self) -> None:
        """A backward pass that raised midway (its callback never ran): wait for what it
        left in flight, so no late write lands in the next step."""
        self._reset_pass(quiet=True)

    def _reset_pass(self, *, quiet: bool) -> None:
        """Back to between steps: no reduction or gather in flight, zero3 copies freed.
        ``quiet``: after a failure, errors of what is waited for here are not raised."""
        self._plan, self._pass_sync, self._pass_task = None, None, None
        error = None
        for unit in self.units:
            unit.reset_pass()
            if quiet:                       # a failed pass: what it accumulated is lost
                unit.ran_forward = False
            for step in (unit.drop_reduce, unit.reshard):   # each, whatever the other did
                try:
                    step()
                except BaseException as exc:  # noqa: BLE001 - re-raised below unless quiet
                    error = error or exc
        self._order.end_step()
        if error is not None and not quiet:
            raise error

    # --------------------------------------------------------------- state, memory
    def full_state_dict(self) -> dict:
        """The original ``module.state_dict()``'s keys and shapes, full current values,
        on every rank (a collective: call it on every rank)."""
        return state_dict.full_state_dict(self)

    def load_full_state_dict(self, sd: dict) -> None:
        """Load a full state dict (as :meth:`full_state_dict` returns) into the shards."""
        state_dict.load_full_state_dict(self, sd)

    def save_sharded(self, path: str, optimizer: Any = None) -> None:
        """Write one file per rank under the folder ``path``: this rank's parameter shards,
        ``optimizer``'s state for them, and the layout (a collective)."""
        checkpoint.save_sharded(self, path, optimizer)

    def load_sharded(self, path: str, optimizer: Any = None) -> None:
        """Read a folder written by :meth:`save_sharded` at any world size, resharding."""
        checkpoint.load_sharded(self, path, optimizer)

    def memory(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds, by category: ``param_shards``, ``grad_shards``,
        ``optimizer_state`` (of ``optimizer``, when given), ``full_params`` (gathered now),
        ``full_params_peak`` (since :meth:`reset_peak_memory`), ``full_grads`` (zero1's
        resident averages and no_sync's accumulated gradients)."""
        shards = [u.flat.shard for u in self.units]
        zero1 = self.strategy == "zero1"
        return {
            "param_shards": tensor_bytes(shards),
            "grad_shards": 0 if zero1 else tensor_bytes(p.grad for p in shards),
            "optimizer_state": optimizer_state_bytes(optimizer, shards),
            "full_params": self._meter.held,
            "full_params_peak": self._meter.peak,
            "full_grads": tensor_bytes([u.full_grad for u in self.units]
                                       + [u.flat.full.grad for u in self.units]),
        }

    def reset_peak_memory(self) -> None:
        self._meter.reset_peak()

    def extra_repr(self) -> str:
        return (f"strategy={self.strategy}, world={self.group.size}, units={len(self.units)}, "
                f"prefetch={self.prefetch}")


#: The short name, as in ``from parallel import FSDP``.
FSDP = FullyShardedDataParallel


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's (or the root's) outputs; its backward runs as the unit's
    outputs' gradients arrive, before its parameters' gradients are computed."""

    @staticmethod
    def forward(ctx: Any, fsdp: FullyShardedDataParallel, unit: Optional[Unit], sync: bool,
                *tensors: torch.Tensor):
        ctx.fsdp, ctx.unit, ctx.sync = fsdp, unit, sync
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        ctx.fsdp._pre_backward(ctx.unit, ctx.sync)
        return (None, None, None, *grads)
