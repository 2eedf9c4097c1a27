"""Ring attention (Liu, Zaharia and Abbeel 2023, arXiv 2310.01889): key/value blocks
travel around the ranks of the group while each rank computes with the block it holds.

Forward, C ranks, rank r: at step i it holds the keys and values of rank (r - i) mod C.
Before computing with them it posts their send to rank r+1 and the receive of the next
block from rank r-1 (``isend``/``irecv``), so the transfer overlaps the computation; the
partial results merge by the log-sum-exp rule (:mod:`.blocks`). C-1 hops of stack(k, v).

Backward: the blocks go around again. The gradient of a block's keys and values from
every rank's queries is summed along the way: rank r adds its share of block (r - i)'s
dK/dV to what it received from rank r-1 and sends the sum on to rank r+1, which holds
that block at step i+1. After C steps the sum has visited every rank and one last hop
brings it home. C-1 hops of stack(k, v) and C hops of stack(dk, dv) (accumulation dtype);
each hop overlaps the next step's computation.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .function import ContextParallelFunction, Exchange, Timeline, check_inputs

__all__ = ["Ring", "ring_attention"]

#: Tags of the three streams of blocks, so that a step's messages never pair with another's.
TAG_KV, TAG_KV_BACKWARD, TAG_DKV = 3201, 3202, 3203


class Ring:
    """The ring pattern over ``group``; with ``timeline`` (a list), each step's
    computation is appended to it as (name, start, end)."""

    name = "ring"

    def __init__(self, group: Any, timeline: Optional[list] = None) -> None:
        self.group, self.timeline = group, Timeline(timeline)

    def forward(self, block: Any, k: torch.Tensor, v: torch.Tensor) -> tuple:
        size, rank = self.group.size, self.group.rank
        out = torch.zeros(block.q.shape, dtype=block.acc, device=k.device)
        lse = torch.full(block.q.shape[:-1], float("-inf"), dtype=block.acc, device=k.device)
        kv = torch.stack((k, v))
        for step in range(size):
            hop = Exchange(self.group, kv, TAG_KV) if step + 1 < size else None
            with self.timeline.span(f"ring forward step {step}"):
                block.forward(kv, (rank - step) % size, out, lse)
            if hop is not None:
                kv = hop.wait()
        return out, lse

    def backward(self, block: Any, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor) -> tuple:
        size, rank = self.group.size, self.group.rank
        dq = torch.zeros(block.q.shape, dtype=block.acc, device=k.device)
        kv, travelling = torch.stack((k, v)), None
        for step in range(size):
            hop = Exchange(self.group, kv, TAG_KV_BACKWARD) if step + 1 < size else None
            with self.timeline.span(f"ring backward step {step}"):
                dkv = block.backward(kv, (rank - step) % size, dout, lse, delta, dq)
            if travelling is not None:
                dkv += travelling.wait()        # the other ranks' share of this block
            if size > 1:
                travelling = Exchange(self.group, dkv, TAG_DKV)
            if hop is not None:
                kv = hop.wait()
        if travelling is not None:
            dkv = travelling.wait()             # my own block's, summed over every rank
        return dq, dkv[0], dkv[1]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                   causal: bool = False, layout: str = "contiguous",
                   scale: Optional[float] = None) -> torch.Tensor:
    """This rank's shard of softmax(q kᵀ · scale) v over the whole sequence, from this
    rank's shards ``q``, ``k``, ``v`` of shape (batch, heads, L/C, head_dim) (as
    :func:`shard_sequence` with ``layout`` cuts them). ``scale`` defaults to
    1/sqrt(head_dim); with ``causal`` the mask is on global positions. Differentiable:
    the backward is exact, dK/dV travel back around the ring to their owners.

    Two ranks, a sequence of 8::

        q_r, k_r, v_r = (shard_sequence(t, pg, 2, "zigzag") for t in (q, k, v))
        o_r = ring_attention(q_r, k_r, v_r, pg, causal=True, layout="zigzag")
        o = unshard_sequence(o_r, pg, 2, "zigzag")   # == F.scaled_dot_product_attention(
                                                     #      q, k, v, is_causal=True)
    """
    scale = check_inputs(q, k, v, group, layout, scale, "ring_attention")
    return ContextParallelFunction.apply(q, k, v, Ring(group), bool(causal), layout, scale)
