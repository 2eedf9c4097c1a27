"""The autograd function both context-parallel attentions share, and their argument
checks. What differs between them is how key/value blocks reach a rank and how their
gradients go back: a *pattern* object (:class:`~parallel.cp.ring.Ring`,
:class:`~parallel.cp.all_gather.AllGather`) with ``forward(block, k, v)`` -> (out, lse)
and ``backward(block, k, v, dout, lse, delta)`` -> (dq, dk, dv).

Saved for backward, per rank: this rank's q, k, v and output (input dtype) and the
log-sum-exp of each query row (accumulation dtype): 1/C of what dense attention keeps,
plus per-row statistics. Other ranks' blocks are fetched again in backward, not kept.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator, Optional

import torch

from .blocks import BlockAttention
from .layout import check_layout, check_length

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(q: Any, k: Any, v: Any, group: Any, layout: Any, scale: Any,
                 op: str) -> float:
    """The scale to use, after checking the arguments; a ``TypeError`` or ``ValueError``
    naming the rank, ``op`` and the argument otherwise."""
    where = f"[rank {getattr(group, 'rank', '?')}/{getattr(group, 'size', '?')}] {op}"
    for attr in ("rank", "size", "isend", "irecv", "all_gather", "reduce_scatter"):
        if not hasattr(group, attr):
            raise TypeError(f"{where}: argument `group` must be a collectives.ProcessGroup "
                            f"(it has no `{attr}`), got {type(group).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: argument `{name}` must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{where}: argument `{name}` must be a floating tensor, got "
                            f"{t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{where}: argument `{name}` must have shape (batch, heads, "
                             f"L/C, head_dim), got {tuple(t.shape)}")
    if k.shape != q.shape or v.shape != q.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{where}: arguments `q`, `k`, `v` must have one shape and dtype, "
                         f"got {tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, "
                         f"{tuple(v.shape)} {v.dtype}")
    check_layout(layout, where)
    check_length(q.shape[2] * group.size, group.size, layout, where)
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{where}: argument `scale` must be a float or None, got "
                        f"{type(scale).__name__}")
    return float(scale)


class Timeline:
    """Where a pattern records its computation: (name, start, end) in ``time.time()``
    seconds, appended to ``entries`` (a list owned by the caller) when there is one."""

    def __init__(self, entries: Optional[list]) -> None:
        self.entries = entries

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        if self.entries is None:
            yield
            return
        start = time.time()
        yield
        self.entries.append((name, start, time.time()))


class Exchange:
    """One hop of a ring: ``tensor`` sent to the next rank and a block of its shape
    received from the previous one, both in flight until :meth:`wait`."""

    def __init__(self, group: Any, tensor: torch.Tensor, tag: int) -> None:
        self.received = torch.empty_like(tensor)
        size, rank = group.size, group.rank
        self._works = (group.irecv(self.received, src=(rank - 1) % size, tag=tag),
                       group.isend(tensor, dst=(rank + 1) % size, tag=tag))

    def wait(self) -> torch.Tensor:
        """The received block (each wait bounded by the group's timeout)."""
        for work in self._works:
            work.wait()
        return self.received


class ContextParallelFunction(torch.autograd.Function):
    """Exact attention over the whole sequence from each rank's shards, forward and
    backward, the blocks moved by ``pattern``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Any,
                causal: bool, layout: str, scale: float) -> torch.Tensor:
        group = pattern.group
        block = BlockAttention(q, group.rank, group.size, layout, causal, scale)
        out, lse = pattern.forward(block, k, v)
        out = out.to(q.dtype)
        ctx.pattern, ctx.args = pattern, (layout, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.pattern.group
        block = BlockAttention(q, group.rank, group.size, *ctx.args)
        dout = dout.to(block.acc)
        delta = (dout * out.to(block.acc)).sum(-1)                  # (b, h, s)
        dq, dk, dv = ctx.pattern.backward(block, k, v, dout, lse, delta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
