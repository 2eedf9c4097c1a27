"""The four communication regions of Megatron-LM's tensor parallelism, as autograd functions.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019, arXiv 1909.08053, section 3 (their functions f and g). Each region is
a pair of conjugate operations, one in forward and the other in backward, so that the
gradients are exact, not only the outputs:

=============  ===========================  ===========================
region         forward                      backward
=============  ===========================  ===========================
copy_to        identity                     all_reduce (sum)
reduce_from    all_reduce (sum)             identity
scatter_to     split the last dim, keep     all_gather along the last dim
               this rank's block
gather_from    all_gather along the last    split the last dim, keep this
               dim                          rank's block
=============  ===========================  ===========================

A column-parallel linear layer is ``copy_to`` then a local matmul (then, optionally,
``gather_from``); a row-parallel one is a local matmul then ``reduce_from``. Every
function takes the group as an argument: no global tensor-parallel group, so the same
layer runs over any :class:`collectives.ProcessGroup` (a mesh dimension included).

Blocks are contiguous and in rank order: rank r holds block r of ``size`` equal blocks
(Megatron's layout). With a group of one rank every region is the identity and nothing
is sent.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import arguments

__all__ = ["CopyTo", "GatherFrom", "ReduceFrom", "ScatterTo", "check_group", "copy_to",
           "gather_from", "reduce_from", "scatter_to", "block_size", "all_gather_along",
           "reduce_scatter_along", "split_along"]

_GROUP_ATTRS = ("rank", "size", "all_reduce", "all_gather", "reduce_scatter")


def check_group(group: Any, where: str) -> None:
    """Raise ``TypeError`` unless ``group`` has what tensor parallelism calls."""
    arguments.check_group(group, where, _GROUP_ATTRS)


def block_size(size: int, group: Any, where: str, what: str) -> int:
    """``size // group.size``, or a ``ValueError`` naming ``where``, ``what``, the size and the
    group size when ``size`` does not split into equal blocks.

    Two ranks: ``block_size(256, pg, "ColumnParallelLinear", "out_features")`` -> 128.
    """
    if size % group.size:
        raise ValueError(f"[rank {group.rank}/{group.size}] {where}: {what}={size} is not "
                         f"divisible by the group size {group.size}; tensor parallelism "
                         f"splits it into {group.size} equal contiguous blocks")
    return size // group.size


# ------------------------------------------------------------------ the communication
def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over the group, in a new tensor (``x`` may be saved by autograd elsewhere)."""
    out = x.clone(memory_format=torch.contiguous_format)
    group.all_reduce(out)
    return out


def split_along(x: torch.Tensor, dim: int, group: Any, where: str = "split") -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (contiguous, no communication).

    Two ranks, ``x`` of shape (3, 8): rank 0 gets ``x[:, :4]``, rank 1 ``x[:, 4:]``.
    """
    if group.size == 1:
        return x
    n = block_size(x.shape[dim], group, where, f"size of dim {dim}")
    return x.narrow(dim, group.rank * n, n).contiguous()


def all_gather_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order.

    Two ranks, ``x`` of shape (3, 4) each: the result has shape (3, 8) on both.
    """
    if group.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((group.size, *x.shape))  # the group concatenates along dim 0
    group.all_gather(out, x)
    if dim % max(x.dim(), 1) == 0:
        return out.reshape(-1, *x.shape[1:])  # already in place: no copy
    return torch.cat(out.unbind(0), dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Any,
                         where: str = "reduce_scatter") -> torch.Tensor:
    """Sum ``x`` over the group, and keep this rank's block along ``dim``.

    Two ranks, ``x`` of shape (8, 3) each: rank r gets ``(x0 + x1)[4r:4r + 4]``.
    """
    if group.size == 1:
        return x
    n = block_size(x.shape[dim], group, where, f"size of dim {dim}")
    # The group scatters contiguous blocks of dim 0: move `dim`'s blocks there.
    blocks = torch.stack(x.split(n, dim=dim), 0).contiguous() if dim != 0 else x.contiguous()
    out_shape = list(x.shape)
    out_shape[dim] = n
    out = x.new_empty(out_shape)
    group.reduce_scatter(out, blocks)
    return out


# ------------------------------------------------------------------ the four regions
class CopyTo(torch.autograd.Function):
    """Identity forward; all_reduce (sum) of the gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class ReduceFrom(torch.autograd.Function):
    """all_reduce (sum) forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


class ScatterTo(torch.autograd.Function):
    """Keep this rank's block of the last dim forward; all_gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return split_along(x, -1, group, "scatter_to")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_gather_along(grad, -1, ctx.group), None


class GatherFrom(torch.autograd.Function):
    """all_gather along the last dim forward; keep this rank's block of the gradient
    backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return split_along(grad, -1, ctx.group, "gather_from"), None


def _apply(fn: Any, name: str, x: torch.Tensor, group: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: argument `x` must be a torch.Tensor, got {type(x).__name__}")
    check_group(group, name)
    if group.size == 1:
        return x
    return fn.apply(x, group)


def copy_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated ``x``: identity now, and backward
    sums the ranks' gradients of ``x`` (each rank's region used only its part of the
    weights, so each holds only part of dL/dx).

    Two ranks: ``y = copy_to(x, pg)`` is ``x``; ``y.backward(g_r)`` leaves ``g_0 + g_1`` in
    ``x.grad`` on both.
    """
    return _apply(CopyTo, "copy_to", x, group)


def reduce_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a tensor-parallel region: the sum of the ranks' partial ``x``; the gradient
    passes through unchanged (every rank's partial contributed to the sum with weight 1).

    Two ranks: ``reduce_from(torch.full((2,), pg.rank + 1.0), pg)`` -> ``[3., 3.]`` on both.
    """
    return _apply(ReduceFrom, "reduce_from", x, group)


def scatter_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous block of the last dim of a replicated ``x``; backward gathers
    the blocks' gradients.

    Two ranks, ``x`` of shape (3, 8): rank 0 gets ``x[:, :4]``, rank 1 ``x[:, 4:]``.
    """
    return _apply(ScatterTo, "scatter_to", x, group)


def gather_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along the last dim; backward keeps this rank's block.

    Two ranks, ``x`` of shape (3, 4) each: the result has shape (3, 8) on both.
    """
    return _apply(GatherFrom, "gather_from", x, group)
