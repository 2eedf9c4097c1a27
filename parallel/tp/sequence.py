"""Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, arXiv 2205.05198, section 4.2.2).

Between the tensor-parallel regions of a transformer block (its LayerNorms, dropouts and
residual additions) plain tensor parallelism keeps the activations replicated: every rank
computes the same thing. Sequence parallelism splits those regions along the sequence
dimension instead, so each rank stores and computes 1/n of them. The all_reduce that ends
a tensor-parallel region becomes a reduce_scatter (sum, keep my sequence block), and the
identity that starts one becomes an all_gather (the whole sequence for the column layer).
An all_reduce is a reduce_scatter followed by an all_gather, so the pair moves the same
bytes as the all_reduce it replaces.

===========================  =========================  ===========================
function                     forward                    backward
===========================  =========================  ===========================
scatter_to_sequence          keep my sequence block     all_gather
gather_from_sequence         all_gather                 reduce_scatter (grad summed)
reduce_scatter_to_sequence   reduce_scatter             all_gather
===========================  =========================  ===========================

``gather_from_sequence(..., reduce_grad=False)`` splits the gradient instead of
reduce-scattering it: use it where the gathered tensor feeds replicated computation
(every rank computes the same gradient), e.g. to gather a block's output for the loss.

Parameters that act on the sequence blocks but are replicated (the LayerNorms' and the
row layers' biases) receive only this rank's part of their gradient;
:func:`sum_grads_over_group` makes autograd add the parts up, in one all_reduce for all.
"""

from __future__ import annotations

from typing import Any

import torch

from .regions import all_gather_along, check_group, reduce_scatter_along, split_along

__all__ = ["gather_from_sequence", "reduce_scatter_to_sequence", "scatter_to_sequence",
           "sum_grads_over_group"]


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split_along(x, dim, group, "scatter_to_sequence")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int,
                reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.reduce_grad:
            grad = reduce_scatter_along(grad, ctx.dim, ctx.group, "gather_from_sequence")
        else:
            grad = split_along(grad, ctx.dim, ctx.group, "gather_from_sequence")
        return grad, None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, dim, group, "reduce_scatter_to_sequence")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def _check(name: str, x: Any, group: Any, dim: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: argument `x` must be a torch.Tensor, got {type(x).__name__}")
    check_group(group, name)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"[rank {group.rank}/{group.size}] {name}: argument `dim` must be "
                         f"an int in [{-x.dim()}, {x.dim()}), got {dim!r}")


def scatter_to_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous block of ``x`` along ``dim`` (the sequence); backward gathers.

    Two ranks, ``x`` (b, 8, h): rank 0 gets ``x[:, :4]``, rank 1 ``x[:, 4:]``. The size of
    ``dim`` must be divisible by the group size (else a ``ValueError``).
    """
    _check("scatter_to_sequence", x, group, dim)
    return x if group.size == 1 else _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group: Any, dim: int = 1, *,
                         reduce_grad: bool = True) -> torch.Tensor:
    """The ranks' sequence blocks concatenated along ``dim``; backward reduce-scatters the
    gradient (``reduce_grad=True``: the gathered tensor feeds a tensor-parallel region, each
    rank's gradient is partial) or keeps this rank's block of it (``False``).

    Two ranks, ``x`` (b, 4, h) each: the result has shape (b, 8, h) on both.
    """
    _check("gather_from_sequence", x, group, dim)
    return x if group.size == 1 else _GatherFromSequence.apply(x, group, dim,
                                                               bool(reduce_grad))


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Sum the ranks' partial ``x`` and keep this rank's block along ``dim``; backward
    all_gathers.

    Two ranks, ``x`` (b, 8, h) each: rank r gets ``(x_0 + x_1)[:, 4r:4r + 4]``.
    """
    _check("reduce_scatter_to_sequence", x, group, dim)
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, group, dim)


class _SumGrads(torch.autograd.Function):
    """Identity on parameters; backward sums their gradients over the group in one
    all_reduce of the concatenated gradients."""

    @staticmethod
    def forward(ctx: Any, group: Any, *params: torch.Tensor):
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])
        ctx.group.all_reduce(flat)
        out, offset = [], 0
        for g in grads:
            out.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return (None, *out)


def sum_grads_over_group(params: list, group: Any) -> list:
    """Views of ``params`` whose gradients autograd sums over ``group`` (one all_reduce for
    all of them, when backward reaches this point). Use the views in place of the
    parameters in forward.

    Two ranks: ``w, = sum_grads_over_group([ln.weight], pg)``; ``F.layer_norm(x_r, ..., w)``
    on each rank's sequence block leaves the whole sequence's gradient in ``ln.weight.grad``.
    """
    check_group(group, "sum_grads_over_group")
    if group.size == 1 or not params:
        return list(params)
    return list(_SumGrads.apply(group, *params))
