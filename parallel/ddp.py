"""Distributed data parallel: every rank holds a replica, gradients are averaged.

Written only against the :class:`collectives.ProcessGroup` interface, so the same class
runs over shared memory, ZeroMQ, MPI or torch.distributed::

    pg = collectives.init_process_group()
    model = DDP(MLP(), pg)                       # rank 0's weights everywhere
    for x, y in batches:                         # each rank its own shard
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()                          # returns with averaged .grad
        opt.step()

How a synchronised backward pass goes (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, arXiv 2006.15704):

1. At construction the trainable parameters are packed into buckets of about
   ``bucket_cap_mb`` (one dtype and device per bucket), in reverse order of registration:
   roughly the order in which backward produces their gradients. Each parameter's
   ``.grad`` is a view into its bucket's flat buffer, so the optimizer, the autograd engine
   and the all-reduce all work on the same memory. (A gradient autograd made afresh, after
   ``zero_grad(set_to_none=True)``, is copied in and replaced by the view when its hook
   runs; in the last bucket, at the end of the next synchronised backward.)
2. ``forward`` puts a hook on the module's outputs; backward reaches it before any
   gradient of the module's parameters, and it queues a callback that the autograd
   engine runs once the whole pass has finished (also on a rank where no parameter
   receives a gradient, which then still launches every bucket). A backward that
   reaches the parameters without passing an output we could hook (a penalty on the
   weights alone, a dummy loss ``0 * sum(p.sum() ...)`` on a rank with an empty batch,
   an output type we cannot walk) is started by the first parameter's hook instead,
   so every rank still takes part.
3. A post-accumulate-grad hook on each parameter tells its bucket that the gradient is
   final. When a bucket's last gradient lands it starts its persistent
   ``all_reduce_init(flat, AVG)`` request (made once, with the bucket; see
   ``collectives.persistent``), while backward goes on with earlier layers. The last
   bucket is the exception: when it fills, every parameter's gradient has landed, so
   the end-of-backward callback takes its gradients then (their hooks only start a
   pass) and runs its round on the spot (``request.run()``, through
   :meth:`Bucket.run_adopted` where every ``.grad`` is its view already), which saves
   handing it to the group's thread and back. (Where backward goes on past the
   module's parameters, e.g. into inputs that require grad or into another module, that
   rest of the pass does not overlap the last bucket's round.)
   Buckets are launched strictly in bucket order: a full bucket waits for the ones before
   it. Every rank therefore issues the same all-reduces in the same order, whatever order
   its gradients arrive in; this is what keeps the ranks' collectives matched.
4. The end-of-backward callback launches the buckets not launched yet, in order, filling
   the gradients that never arrived (parameters not used in this step) with what their
   ``.grad`` holds, or zeros, then waits for every bucket. ``loss.backward()`` returns with
   averaged gradients. One flag per parameter travels in its bucket's all-reduce and says
   whether some rank had a gradient for it: where none had, ``.grad`` stays ``None`` on every
   rank, as it would in one process, and the optimizer skips the parameter everywhere.

Under :meth:`DistributedDataParallel.no_sync` nothing is communicated: gradients
accumulate in the buckets, and the next synchronised backward averages the sum.

Not done (torch's DDP does): re-bucketing by the order gradients were observed to arrive
in the first iteration, communication hooks (compression), ``static_graph``, joining
uneven inputs (``Join``). Unused parameters need no flag here (``find_unused_parameters``):
the end-of-backward callback and the per-parameter flags cover them at no extra message.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from .arguments import check_group, check_module, check_same_replicas
from .autograd_hooks import collect_outputs, graph_task_id, queue_callback, replace_outputs
from .bucket import Bucket, assign_buckets

__all__ = ["DDP", "DistributedDataParallel"]

_MIB = 1024 * 1024
#: Module state is broadcast at construction in pieces of at most this many bytes.
_BROADCAST_CAP_BYTES = 256 * _MIB


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves in every ``.grad`` the average of
    the ranks' gradients.

    Two ranks, each with its own batch:

    >>> import torch, collectives
    >>> from parallel import DDP
    >>> def step():
    ...     pg = collectives.init_process_group()
    ...     torch.manual_seed(pg.rank)                  # two different replicas...
    ...     model = DDP(torch.nn.Linear(4, 1), pg)      # ...made rank 0's at construction
    ...     x = torch.full((2, 4), pg.rank + 1.0)       # rank 0 sums 2 per input, rank 1 4
    ...     model(x).sum().backward()                   # .grad: the ranks' average
    ...     grad = model.module.weight.grad.tolist()
    ...     pg.close()
    ...     return grad
    >>> collectives.spawn(step, 2)
    [[[3.0, 3.0, 3.0, 3.0]], [[3.0, 3.0, 3.0, 3.0]]]

    Args:
        module: the replica; it has the same parameters (names, shapes, dtypes) on every
            rank, checked at construction.
        group: the :class:`collectives.ProcessGroup` of the data-parallel ranks.
        bucket_cap_mb: the size of a gradient bucket in MiB. Smaller buckets start
            communicating earlier in backward; larger ones send fewer messages.
        broadcast_buffers: broadcast the module's buffers (e.g. BatchNorm statistics) from
            rank 0 before each forward in training mode, so that replicas stay identical:
            the buffers its modules hold at construction, as torch's DDP, looked up by
            name at each forward (so a buffer assigned anew is the one sent).

    Construction broadcasts every parameter and buffer from rank 0, so replicas start
    identical whatever seeds the ranks used. Parameters with ``requires_grad=False`` are
    broadcast but get no bucket. The ranks must run the same number of synchronised
    backward passes (give them equally many batches: :class:`parallel.ShardSampler` pads
    the shards to equal lengths).

    ``.grad`` of a parameter is a view into its bucket, so averaging needs no copy.
    ``optimizer.zero_grad(set_to_none=True)`` (torch's default) breaks the view: the next
    backward's first gradient is then copied into the bucket once and the view restored;
    ``zero_grad(set_to_none=False)`` keeps the views and saves that copy. Assigning
    ``p.grad`` yourself works the same way (the value is copied in).
    """

    def __init__(self, module: nn.Module, group: Any, *, bucket_cap_mb: float = 25,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        check_module(module, "DDP")
        check_group(group, "DDP", ("rank", "size", "all_reduce", "broadcast",
                                   "all_gather_object"))
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"DDP: argument `bucket_cap_mb` must be a positive number, got "
                             f"{bucket_cap_mb!r}")
        self.module = module
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        self._where = f"[rank {group.rank}/{group.size}] DDP"

        named = list(module.named_parameters())
        for name, p in named:
            if p.is_complex() or p.is_sparse:
                raise TypeError(f"{self._where}: parameter {name!r} is "
                                f"{'complex' if p.is_complex() else 'sparse'}; only dense "
                                f"real parameters are supported")
        check_same_replicas(group, named, self._where)
        self._broadcast_state([p for _, p in named] + list(module.buffers()))
        # (module, name) of every buffer, found once: walking the module tree costs
        # microseconds per forward, and most models have no buffer to send at all.
        self._buffer_slots = [(m, name) for m in module.modules()
                              for name, b in m._buffers.items() if b is not None]

        trainable = [p for _, p in named if p.requires_grad]
        order = trainable[::-1]  # backward produces the last layers' gradients first
        plan = assign_buckets([p.numel() * p.element_size() for p in order],
                              max(1, int(bucket_cap_mb * _MIB)),
                              keys=[(p.dtype, p.device) for p in order])
        self._buckets = [Bucket(i, [order[j] for j in indices], group)
                         for i, indices in enumerate(plan)]
        self._require_sync = True
        # The running backward pass, in a plain object: nn.Module.__setattr__ costs a
        # microsecond or two per assignment, and a pass makes several.
        self._pass = _PassState()
        self._hooks = []
        # Outputs DDP hooked, by id (a tensor's == is elementwise, so no WeakSet): one
        # returned again by a later forward gets a fresh view.
        self._hooked: dict[int, weakref.ref] = {}
        for b, bucket in enumerate(self._buckets):
            for slot, p in enumerate(bucket.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._make_hook(b, slot)))

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def _broadcast_state(self, tensors: list) -> None:
        """Copy rank 0's values into ``tensors`` on every rank, a few flat messages per
        dtype rather than one message per tensor."""
        if self.group.size == 1 or not tensors:
            return
        plan = assign_buckets([t.numel() * t.element_size() for t in tensors],
                              _BROADCAST_CAP_BYTES, keys=[(t.dtype, t.device) for t in tensors])
        for indices in plan:
            chunk = [tensors[i] for i in indices]
            flat = torch.cat([t.detach().reshape(-1) for t in chunk])
            self.group.broadcast(flat, src=0)
            if self.group.rank != 0:
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    # ----------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._buffer_slots and self.broadcast_buffers and self.training \
                and self.group.size > 1:
            buffers = {id(b): b for b in (m._buffers.get(name) for m, name in
                                          self._buffer_slots) if b is not None}
            self._broadcast_state(list(buffers.values()))
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled() or not self._buckets:
            return out
        # A hook on each output tells us when backward reaches it, before any gradient
        # of the module's parameters (a hook costs a third of an autograd Function
        # there). An output that may outlive this forward (a leaf, such as a parameter
        # returned as it is, or a tensor that carries hooks already, such as one a
        # forward returned before) gets a fresh view to carry the hook, so that hooks do
        # not pile up on it and an earlier forward's `sync` never decides a pass.
        on_backward = functools.partial(self._begin_backward, self._require_sync)
        if type(out) is torch.Tensor:   # one tensor, the usual case: no walk
            if not out.requires_grad:
                return out
            out = _fresh(out, self._hooked)
            out.register_hook(on_backward)
            _remember(out, self._hooked)
            return out
        leaves: list = []
        collect_outputs(out, leaves)
        if not leaves:
            return out
        marked = [_fresh(t, self._hooked) for t in leaves]
        for t in marked:
            t.register_hook(on_backward)
            _remember(t, self._hooked)
        if all(m is t for m, t in zip(marked, leaves)):
            return out
        return replace_outputs(out, iter(marked))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally; the first synchronised
        backward after it averages the accumulated sums. The forward pass decides: run
        both forward and backward inside.

        With k micro-batches per step, scale each micro-batch's loss by 1/k to average::

            for i, (x, y) in enumerate(micro_batches):
                ctx = model.no_sync() if i < k - 1 else contextlib.nullcontext()
                with ctx:
                    (loss_fn(model(x), y) / k).backward()
            opt.step()
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # ---------------------------------------------------------------------- backward
    def _begin_backward(self, sync: bool, grad: Any = None) -> None:
        """First event of a backward pass through this module (the hook on its outputs,
        given their gradient ``grad``, or else the first parameter's hook): say whether
        the pass synchronises, and have the autograd engine call :meth:`_end_backward`
        when the pass is over."""
        task = graph_task_id()
        state = self._pass
        if state.sync is not None:
            if task == state.task:
                return  # a second output of the pass that already began
            # The pass we were in ended without its callback: backward raised midway.
            state.sync = None
            for bucket in self._buckets:
                bucket.reset()
            if state.next_launch:
                state.next_launch = 0
                raise RuntimeError(
                    f"{self._where}: the previous backward pass raised after some buckets "
                    f"were sent; the ranks are out of step. Recreate the process group and "
                    f"the DDP module.")
        state.sync, state.task = sync, task
        queue_callback(self._end_backward)

    def _make_hook(self, b: int, slot: int):
        state, bucket = self._pass, self._buckets[b]
        view = bucket.views[slot]
        if b == len(self._buckets) - 1:
            # The last bucket is launched by the end-of-backward callback whatever its
            # hooks saw, and run_adopted() or fill_missing() takes every gradient then:
            # its parameters' hooks only start a pass that no output of ours started.
            def begin_only(param: torch.Tensor) -> None:
                if state.sync is None or state.task != graph_task_id():
                    self._begin_backward(self._require_sync)
            return begin_only

        def hook(param: torch.Tensor) -> None:
            if state.sync is None or state.task != graph_task_id():
                self._begin_backward(self._require_sync)  # no output of ours in this pass
            if param.grad is not view:  # (else adopt has nothing to do)
                bucket.adopt(slot)
            if state.sync and bucket.mark_ready(slot):
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        """Launch the full buckets at the head of the line, in bucket order; not the last
        bucket, which the end of backward runs and waits for at once."""
        state = self._pass
        while (state.next_launch < len(self._buckets) - 1
               and self._buckets[state.next_launch].full):
            self._buckets[state.next_launch].launch()
            state.next_launch += 1

    def _end_backward(self) -> None:
        state = self._pass
        sync, state.sync = state.sync, None
        if not sync:
            return
        buckets, first = self._buckets, state.next_launch
        state.next_launch = 0
        last = buckets[-1]
        ran_last = False   # the last bucket's round ran and handed out (run_adopted)
        error = None
        try:
            for bucket in buckets[first:-1]:
                bucket.fill_missing()
                bucket.launch()
            ran_last = last.run_adopted()
            if not ran_last:
                last.fill_missing()
                last.launch(blocking=True)
        except BaseException as exc:
            error = exc  # (a failed round: no bucket hands out what it holds)
            raise
        finally:
            for bucket in buckets:
                if error is None:
                    if ran_last and bucket is last:
                        continue
                    try:
                        bucket.finish()  # waits, hands out the averages, resets
                    except BaseException as exc:  # noqa: BLE001 - re-raised below
                        error = exc
                else:
                    bucket.reset()
            if error is not None:
                raise error  # (the launch's own error, when it was one, is in flight)

    # -------------------------------------------------------------------- inspection
    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (read-only use)."""
        return list(self._buckets)

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{b.nbytes / _MIB:.2f}" for b in self._buckets)
        return (f"world={self.group.size}, backend={getattr(self.group, 'backend', '?')}, "
                f"buckets MiB=[{sizes}]")


#: The short name, as in ``from parallel import DDP``.
DDP = DistributedDataParallel


class _PassState:
    """The backward pass a DDP module is in: ``sync`` (None while none runs; else whether
    it averages), the autograd ``task`` it belongs to, and the next bucket to launch."""

    __slots__ = ("sync", "task", "next_launch")

    def __init__(self) -> None:
        self.sync: bool | None = None
        self.task: int | None = None
        self.next_launch = 0


def _fresh(t: torch.Tensor, hooked: dict) -> torch.Tensor:
    """``t`` where it was made by an autograd op and DDP has not hooked it yet, else a new
    view of it (a leaf, or a tensor an earlier forward returned and hooked), so that
    DDP's hooks never pile up on one tensor."""
    ref = hooked.get(id(t))
    if t.grad_fn is not None and (ref is None or ref() is not t):
        return t
    return t.view_as(t)


def _remember(t: torch.Tensor, hooked: dict) -> None:
    """Note that DDP hooked ``t`` (forgotten when ``t`` dies, before its id can be
    reused)."""
    key = id(t)
    hooked[key] = weakref.ref(t, lambda _, key=key, hooked=hooked: hooked.pop(key, None))
