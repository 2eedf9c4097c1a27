"""Which tokens of the sequence each rank of a context-parallel group holds, and moving a
tensor between its full and its sharded form.

Two layouts of a sequence of length L over C ranks:

- ``contiguous``: rank r holds the r-th of C equal blocks, positions ``[r*L/C, (r+1)*L/C)``.
- ``zigzag``: the sequence is cut into 2C equal chunks and rank r holds chunks r and
  2C-1-r, in that order. Under a causal mask the work of a query grows with its position;
  pairing an early chunk with a late one gives every rank the same work (the head-tail
  balancing of Megatron's and PyTorch's context parallelism).

Eight tokens over two ranks: contiguous gives rank 0 positions 0..3 and rank 1 4..7;
zigzag gives rank 0 positions 0, 1, 6, 7 and rank 1 positions 2, 3, 4, 5.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tp.regions import all_gather_along, reduce_scatter_along

__all__ = ["LAYOUTS", "chunks_of", "positions_of", "shard_sequence", "unshard_sequence"]

#: The layouts, by name.
LAYOUTS = ("contiguous", "zigzag")


def _where(group: Any, op: str) -> str:
    return f"[rank {group.rank}/{group.size}] {op}"


def check_layout(layout: Any, where: str) -> str:
    """``layout`` itself, or a ``ValueError`` naming ``where`` and the layouts."""
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: argument `layout` must be one of {LAYOUTS}, got "
                         f"{layout!r}")
    return layout


def chunk_count(size: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: C, or 2C for zigzag."""
    return size if layout == "contiguous" else 2 * size


def check_length(length: int, size: int, layout: str, where: str) -> int:
    """The length of one chunk, or a ``ValueError`` naming the length, C and the layout."""
    chunks = chunk_count(size, layout)
    if length % chunks:
        raise ValueError(f"{where}: the sequence length {length} is not divisible into "
                         f"{chunks} equal chunks (C={size} ranks, layout={layout!r})")
    return length // chunks


def chunks_of(rank: int, size: int, layout: str) -> tuple:
    """The chunk indices rank ``rank`` holds, in its local order.

    ``chunks_of(1, 4, "contiguous")`` -> ``(1,)``; ``chunks_of(1, 4, "zigzag")`` -> ``(1, 6)``.
    """
    return (rank,) if layout == "contiguous" else (rank, 2 * size - 1 - rank)


def positions_of(rank: int, size: int, local_length: int, layout: str) -> torch.Tensor:
    """The global positions of the ``local_length`` tokens rank ``rank`` holds (int64).

    ``positions_of(0, 2, 4, "zigzag")`` -> ``tensor([0, 1, 6, 7])``.
    """
    chunks = chunks_of(rank, size, layout)
    per_chunk = local_length // len(chunks)
    return torch.cat([torch.arange(c * per_chunk, (c + 1) * per_chunk) for c in chunks])


def _rank_order(size: int, local_length: int, layout: str) -> torch.Tensor:
    """The global positions of the ranks' tokens, rank after rank (what all_gather gives)."""
    return torch.cat([positions_of(r, size, local_length, layout) for r in range(size)])


def _check(x: Any, group: Any, dim: Any, op: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_where(group, op)}: argument `x` must be a torch.Tensor, got "
                        f"{type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{_where(group, op)}: argument `dim` must be a dimension of the "
                         f"tensor of shape {tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, group: Any, dim: int,
                   layout: str = "contiguous") -> torch.Tensor:
    """This rank's part of the full tensor ``x`` (the same on every rank) along ``dim``.
    No communication; backward puts the gradient back at this rank's positions (zeros
    elsewhere).

    Two ranks, ``x`` of shape (1, 8)::

        shard_sequence(x, pg, 1)                  # rank 0: x[:, 0:4]; rank 1: x[:, 4:8]
        shard_sequence(x, pg, 1, "zigzag")        # rank 0: x[:, [0, 1, 6, 7]]

    A length that does not divide into C (zigzag: 2C) equal chunks is a ``ValueError``
    naming the length, C and the layout.
    """
    where = _where(group, "shard_sequence")
    dim = _check(x, group, dim, "shard_sequence")
    check_layout(layout, where)
    chunk = check_length(x.shape[dim], group.size, layout, where)
    pieces = [x.narrow(dim, c * chunk, chunk) for c in chunks_of(group.rank, group.size, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


class _Unshard(torch.autograd.Function):
    """all_gather forward; backward sums the ranks' gradients of this rank's part
    (reduce_scatter): each rank's use of the full tensor contributes to the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, layout: str) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.layout = group, dim, layout
        gathered = all_gather_along(x, dim, group)            # rank after rank
        if layout == "contiguous" or group.size == 1:
            return gathered
        order = _rank_order(group.size, x.shape[dim], layout)
        return gathered.index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        if ctx.layout != "contiguous" and group.size > 1:
            order = _rank_order(group.size, grad.shape[dim] // group.size, ctx.layout)
            grad = grad.index_select(dim, order)              # back to rank after rank
        return reduce_scatter_along(grad, dim, group, "unshard_sequence"), None, None, None


def unshard_sequence(x_local: torch.Tensor, group: Any, dim: int,
                     layout: str = "contiguous") -> torch.Tensor:
    """The full tensor on every rank, from each rank's part ``x_local`` along ``dim``
    (a collective: all_gather). Backward returns, on each rank, the sum over the ranks of
    the gradient at its positions (reduce_scatter): the gradient of the sum of the ranks'
    losses, so a loss computed alike on every rank counts C times.

    Two ranks, ``y_r`` of shape (1, 4) each::

        y = unshard_sequence(y_r, pg, 1)            # (1, 8): y_0 then y_1
        y = unshard_sequence(y_r, pg, 1, "zigzag")  # positions 0,1,6,7 from rank 0
    """
    where = _where(group, "unshard_sequence")
    dim = _check(x_local, group, dim, "unshard_sequence")
    check_layout(layout, where)
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(f"{where}: the sequence length {x_local.shape[dim] * group.size} is "
                         f"not divisible into {2 * group.size} equal chunks (C={group.size} "
                         f"ranks, layout='zigzag')")
    return _Unshard.apply(x_local, group, dim, layout)
