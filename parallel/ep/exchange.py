"""Moving tokens between ranks: the counts, the rows, and the order the experts want them in.

Expert parallelism's communication is one collective, ``all_to_all`` with uneven split
sizes, used twice per layer and direction (torchtitan's expert parallel; DeepEP's
dispatch/combine):

=============  ==========================================  ==========================
step           forward                                     backward
=============  ==========================================  ==========================
dispatch       rank r sends rank q the rows of q's          the gradients of those rows
               experts (``send_counts[q]`` rows)            come back: a combine
combine        the expert outputs go back to their          their gradients go out
               tokens' ranks (the counts swapped)           again: a dispatch
=============  ==========================================  ==========================

So one autograd function, :class:`ExchangeRows`, is both: forward an all_to_all with
``(send, receive)`` split sizes, backward the same call with the two swapped. Before it,
:func:`exchange_counts` tells every rank how many rows each peer will send for each of
its local experts (a small all_to_all of equal parts), so that receive buffers can be
sized. Rows arrive grouped by source rank; :func:`expert_major` is the permutation that
groups them by local expert instead, so each expert runs once on all its rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["ExchangeRows", "exchange_counts", "exchange_rows", "expert_major"]


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """Every peer's counts for this rank's experts. ``counts`` (P, L), int64: row q holds
    how many rows this rank sends each of rank q's L local experts. Returns (P, L): row s
    holds how many rows rank s sends each of this rank's local experts.

    Two ranks, one expert each: rank 0 passes ``[[3], [1]]``, rank 1 ``[[2], [0]]``; rank 0
    gets ``[[3], [2]]``, rank 1 ``[[1], [0]]``.
    """
    if group.size == 1:
        return counts
    received = torch.empty_like(counts)
    group.all_to_all(received, counts.contiguous())
    return received


def _all_to_all_rows(rows: torch.Tensor, send: Sequence[int], receive: Sequence[int],
                     group: Any) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    group.all_to_all(out, rows, output_split_sizes=list(receive),
                     input_split_sizes=list(send))
    return out


class ExchangeRows(torch.autograd.Function):
    """All_to_all of rows with uneven split sizes forward; the reverse all_to_all of the
    gradients backward (the counts swapped)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list, receive: list,
                group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all_rows(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_to_all_rows(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def exchange_rows(rows: torch.Tensor, send: Sequence[int], receive: Sequence[int],
                  group: Any) -> torch.Tensor:
    """Send ``send[q]`` consecutive rows of ``rows`` to rank q, and receive ``receive[s]``
    rows from rank s, concatenated in rank order; differentiable (backward sends the rows'
    gradients back where the rows came from). A collective of ``group``.

    Two ranks: rank 0 ``exchange_rows(a, [1, 2], [1, 0], pg)`` with ``a`` of 3 rows, rank 1
    ``exchange_rows(b, [0, 0], [2, 0], pg)`` with ``b`` of 0 rows: rank 0 gets ``a[:1]``,
    rank 1 gets ``a[1:]``.
    """
    if group.size == 1:
        return rows
    return ExchangeRows.apply(rows, [int(n) for n in send], [int(n) for n in receive], group)


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups received rows by local expert. ``counts`` (P, L): row
    s holds how many rows source rank s sent each local expert; the rows arrived
    source-major (source 0's for experts 0..L-1, then source 1's...). Returns indices
    ``idx`` such that ``rows[idx]`` is expert-major (expert 0's rows from sources 0..P-1,
    then expert 1's...), each source's rows keeping their order.

    >>> expert_major(torch.tensor([[1, 2], [1, 0]]))   # arrived: s0e0 s0e1 s0e1 s1e0
    tensor([0, 3, 1, 2])
    """
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(counts.shape)   # source-major offsets
    lengths = counts.t().reshape(-1)                                # expert-major segments
    seg_starts = starts.t().reshape(-1)
    seg_first = torch.cumsum(lengths, 0) - lengths                  # where each lands
    total = int(flat.sum())
    return (torch.repeat_interleave(seg_starts - seg_first, lengths)
            + torch.arange(total, dtype=counts.dtype))
