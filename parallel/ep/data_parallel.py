"""Expert parallelism beside data parallelism: experts sharded over the ``ep`` ranks, the
rest of the model (routers included) replicated and averaged by DDP or FSDP.

Every rank trains on its own batch; with ``dp`` replicas of each ``ep`` group there are
``N = dp * ep`` batches per step and the objective is the mean of the N ranks' losses.

- The replicated parameters: the ordinary data-parallel average over all N ranks. DDP or
  FSDP does it, over the group of the N ranks (``mesh.flatten(("dp", "ep"))``, or the
  world when ``dp`` is 1), built by :func:`replicate_outside_experts` so that the wrapper
  never sees the experts: it would broadcast rank 0's experts over every other rank's
  and average gradients of different experts.
- An expert's gradient: on its owner, backward already summed every ``ep`` rank's
  contribution (the exchanges carry the gradients back to it); the ``dp`` replicas of
  that owner hold the other slices' sums. :func:`average_expert_grads` sums over the
  replicas and divides by N, which is the gradient of the mean loss.

Four ranks as dp=2 x ep=2, experts 0-3 of 8 on ep rank 0::

    model = replicate_outside_experts(net, lambda m: DDP(m, mesh.flatten(("dp", "ep"))),
                                      expert_replicas=mesh["dp"])
    loss = F.cross_entropy(model(x), y) + 0.01 * aux
    loss.backward()                            # the rest: averaged over the 4 ranks
    average_expert_grads(net, mesh["dp"])      # experts: summed over dp, divided by 4
    opt.step()                                 # opt over model.parameters(): both kinds
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .moe import MoE

__all__ = ["average_expert_grads", "expert_parameters", "replicate_outside_experts"]


def _layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> list:
    """The parameters of every :class:`MoE`'s local experts in ``model``, in module order."""
    return [p for moe in _layers(model) for p in moe.experts.parameters()]


@contextlib.contextmanager
def _experts_set_aside(model: nn.Module) -> Iterator[None]:
    """Inside, every MoE of ``model`` holds its experts outside the module tree; after, they
    are back in their place (the same position among the MoE's children)."""
    layers = _layers(model)
    saved = [(moe, list(moe._modules), moe._modules.pop("experts")) for moe in layers]
    try:
        yield
    finally:
        for moe, names, experts in saved:
            children = dict(moe._modules)
            children["experts"] = experts
            moe._modules = {name: children.pop(name) for name in names if name in children}
            moe._modules.update(children)   # anything the wrapper added, after


@torch.no_grad()
def _in_flat_pieces(tensors: list, fn: Callable[[torch.Tensor], None]) -> None:
    """``fn`` on one flat copy of ``tensors`` per dtype (the same order on every rank),
    the result copied back: one message per dtype instead of one per tensor."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        chunk = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        fn(flat)
        for t, piece in zip(chunk, flat.split([t.numel() for t in chunk])):
            t.copy_(piece.view_as(t))


def replicate_outside_experts(model: nn.Module, wrap: Callable[[nn.Module], nn.Module], *,
                              expert_replicas: Optional[Any] = None) -> nn.Module:
    """``wrap(model)`` (``DDP(m, group)``, ``FSDP(m, group, ...)``) built while every
    :class:`MoE` of ``model`` has its experts set aside, so the wrapper replicates and
    averages everything else only. The experts are back in ``model`` afterwards, so the
    wrapper's ``parameters()`` lists them too (give those to the optimizer), and their
    gradients are left to :func:`average_expert_grads`.

    ``expert_replicas``: the group of the ranks that hold the same experts (the ``dp``
    dimension); their experts start from its rank 0's values, as the wrapper does for
    the rest. A collective of the wrapper's group (and of ``expert_replicas``).

    Two ranks, both in one ep group (dp = 1)::

        model = replicate_outside_experts(net, lambda m: DDP(m, pg))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"replicate_outside_experts: argument `model` must be an nn.Module, "
                        f"got {type(model).__name__}")
    if not callable(wrap):
        raise TypeError(f"replicate_outside_experts: argument `wrap` must be a callable "
                        f"module -> wrapped module, got {type(wrap).__name__}")
    if expert_replicas is not None and expert_replicas.size > 1:
        _in_flat_pieces(expert_parameters(model),
                        lambda flat: expert_replicas.broadcast(flat, src=0))
    with _experts_set_aside(model):
        wrapped = wrap(model)
    return wrapped


@torch.no_grad()
def average_expert_grads(model: nn.Module, replicas: Optional[Any] = None) -> None:
    """After backward: every local expert's ``.grad`` becomes the gradient of the mean of
    all ``dp * ep`` ranks' losses. Sums each gradient over ``replicas`` (the ranks holding
    the same experts, the ``dp`` dimension; None: there are no others) and divides by
    ``replicas.size * moe.group.size``. A gradient that is None counts as zeros. A
    collective of ``replicas``: every rank calls it after every synchronised backward.

    Two ranks, both in one ep group: ``average_expert_grads(net)`` halves every expert's
    gradient (each owner's gradient summed both ranks' mean losses).
    """
    dp = 1 if replicas is None else replicas.size
    scaled = []                       # (gradients, 1 / N) per layer
    for moe in _layers(model):
        params = [p for p in moe.experts.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        scaled.append(([p.grad for p in params], 1.0 / (dp * moe.group.size)))
    if dp > 1:   # every layer's gradients in one all_reduce per dtype
        _in_flat_pieces([g for grads, _ in scaled for g in grads], replicas.all_reduce)
    for grads, scale in scaled:
        for g in grads:
            g.mul_(scale)
