"""All-gather attention, the variant of Llama 3 (arXiv 2407.21783, section 3.3.2): every
rank gathers all keys and values at once (``all_gather``), computes its queries against
them, and in backward the keys' and values' gradients are summed back to their owners
(``reduce_scatter``).

Fewer, larger messages than the ring, and no dependence on the ring's step order; the
gathered blocks live only during the forward computation and are gathered again in
backward, so what autograd keeps is still 1/C of the sequence.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .function import ContextParallelFunction, Timeline, check_inputs

__all__ = ["AllGather", "all_gather_attention"]


class AllGather:
    """The all-gather pattern over ``group``; with ``timeline`` (a list), the computation
    is appended to it as (name, start, end)."""

    name = "all_gather"

    def __init__(self, group: Any, timeline: Optional[list] = None) -> None:
        self.group, self.timeline = group, Timeline(timeline)

    def _gather(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(C, 2, b, h, s, d): every rank's stack(k, v), in rank order."""
        kv = torch.stack((k, v))
        if self.group.size == 1:
            return kv.unsqueeze(0)
        everyone = kv.new_empty((self.group.size, *kv.shape))
        self.group.all_gather(everyone, kv)
        return everyone

    def forward(self, block: Any, k: torch.Tensor, v: torch.Tensor) -> tuple:
        out = torch.zeros(block.q.shape, dtype=block.acc, device=k.device)
        lse = torch.full(block.q.shape[:-1], float("-inf"), dtype=block.acc, device=k.device)
        everyone = self._gather(k, v)
        with self.timeline.span("all_gather forward"):
            for src in range(self.group.size):
                block.forward(everyone[src], src, out, lse)
        return out, lse

    def backward(self, block: Any, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor) -> tuple:
        dq = torch.zeros(block.q.shape, dtype=block.acc, device=k.device)
        everyone = self._gather(k, v)
        with self.timeline.span("all_gather backward"):
            dkv = torch.stack([block.backward(everyone[src], src, dout, lse, delta, dq)
                               for src in range(self.group.size)])   # (C, 2, b, h, s, d)
        if self.group.size == 1:
            return dq, dkv[0, 0], dkv[0, 1]
        mine = dkv.new_empty(dkv.shape[1:])
        self.group.reduce_scatter(mine, dkv)      # my block's, summed over every rank
        return dq, mine[0], mine[1]


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                         causal: bool = False, layout: str = "contiguous",
                         scale: Optional[float] = None) -> torch.Tensor:
    """:func:`~parallel.cp.ring_attention`'s result by the all-gather pattern: this rank's
    shard of softmax(q kᵀ · scale) v over the whole sequence; the same arguments, the same
    layouts and causal mask, an exact backward (reduce_scatter of dK/dV).

    Two ranks, a sequence of 8::

        q_r, k_r, v_r = (shard_sequence(t, pg, 2) for t in (q, k, v))
        o_r = all_gather_attention(q_r, k_r, v_r, pg, causal=True)   # (b, h, 4, d)
    """
    scale = check_inputs(q, k, v, group, layout, scale, "all_gather_attention")
    return ContextParallelFunction.apply(q, k, v, AllGather(group), bool(causal), layout,
                                         scale)
