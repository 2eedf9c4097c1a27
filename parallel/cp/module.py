"""Context-parallel attention as a module that a transformer block calls in place of
``F.scaled_dot_product_attention``: inside :class:`parallel.tp.ParallelTransformerBlock`
the heads are split over the tp group and the sequence over this module's group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .all_gather import AllGather
from .function import ContextParallelFunction, check_inputs
from .layout import check_layout
from .ring import Ring

__all__ = ["ALGORITHMS", "ContextParallelAttention"]

#: The communication patterns, by the name ``examples/cp.py --cp-algorithm`` takes.
ALGORITHMS = {"ring": Ring, "all_gather": AllGather}


class ContextParallelAttention(nn.Module):
    """``attention(q, k, v, causal=...)`` over the whole sequence, from this rank's shards
    (batch, heads, L/C, head_dim) laid out by ``layout`` over ``group``. With
    ``record=True``, every call appends its computation's (name, start, end) to
    :attr:`timeline` (``time.time()`` seconds) for a trace; the caller empties it.

    Two ranks, tensor parallel over ``tp`` and context parallel over ``cp``::

        attn = ContextParallelAttention(mesh["cp"], algorithm="ring", layout="zigzag")
        block = ParallelTransformerBlock.from_dense(dense, mesh["tp"], attention=attn)
        y_r = block(shard_sequence(x, mesh["cp"], 1, "zigzag"))  # (b, L/C, hidden)
    """

    def __init__(self, group: Any, *, algorithm: str = "ring", layout: str = "contiguous",
                 record: bool = False) -> None:
        super().__init__()
        where = f"[rank {group.rank}/{group.size}] ContextParallelAttention"
        if algorithm not in ALGORITHMS:
            raise ValueError(f"{where}: argument `algorithm` must be one of "
                             f"{sorted(ALGORITHMS)}, got {algorithm!r}")
        self.group, self.algorithm = group, algorithm
        self.layout = check_layout(layout, where)
        self.timeline: Optional[list] = [] if record else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
        op = f"ContextParallelAttention({self.algorithm})"
        scale = check_inputs(q, k, v, self.group, self.layout, scale, op)
        pattern = ALGORITHMS[self.algorithm](self.group, self.timeline)
        return ContextParallelFunction.apply(q, k, v, pattern, bool(causal), self.layout,
                                             scale)

    def extra_repr(self) -> str:
        return f"algorithm={self.algorithm}, layout={self.layout}, group_size={self.group.size}"
