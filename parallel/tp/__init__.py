"""Tensor parallelism in the style of Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053).

Every layer takes its group as an argument (a :class:`collectives.ProcessGroup`, or a
device mesh's dimension) and keeps rank r's contiguous block of the dense layer::

    fc1 = ColumnParallelLinear.from_dense(nn.Linear(784, 256), pg)  # rows of W, b
    fc2 = RowParallelLinear.from_dense(nn.Linear(256, 64), pg)      # columns of W
    y = fc2(torch.relu(fc1(x)))     # one all_reduce forward, one backward

- :mod:`.regions`: the four autograd regions copy_to, reduce_from, scatter_to, gather_from.
- :mod:`.linear`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`.
"""

from .linear import ColumnParallelLinear, RowParallelLinear
from .regions import (CopyTo, GatherFrom, ReduceFrom, ScatterTo, copy_to, gather_from,
                      reduce_from, scatter_to)

__all__ = ["ColumnParallelLinear", "CopyTo", "GatherFrom", "ReduceFrom",
           "RowParallelLinear", "ScatterTo", "copy_to", "gather_from", "reduce_from",
           "scatter_to"]
