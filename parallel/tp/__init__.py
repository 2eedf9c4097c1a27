"""Tensor parallelism in the style of Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053).

Every layer takes its group as an argument (a :class:`collectives.ProcessGroup`, or a
device mesh's dimension) and keeps rank r's contiguous block of the dense layer::

    fc1 = ColumnParallelLinear.from_dense(nn.Linear(784, 256), pg)  # rows of W, b
    fc2 = RowParallelLinear.from_dense(nn.Linear(256, 64), pg)      # columns of W
    y = fc2(torch.relu(fc1(x)))     # one all_reduce forward, one backward

- :mod:`.regions`: the four autograd regions copy_to, reduce_from, scatter_to, gather_from.
- :mod:`.linear`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`.
- :mod:`.vocab`: :class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`.
- :mod:`.sequence`: sequence parallelism's regions (arXiv 2205.05198).
- :mod:`.block`: :class:`ParallelTransformerBlock` and its dense reference
  :class:`TransformerBlock`.
"""

from .block import ParallelTransformerBlock, TransformerBlock
from .linear import ColumnParallelLinear, RowParallelLinear
from .regions import (CopyTo, GatherFrom, ReduceFrom, ScatterTo, copy_to, gather_from,
                      reduce_from, scatter_to)
from .sequence import (gather_from_sequence, reduce_scatter_to_sequence, scatter_to_sequence,
                       sum_grads_over_group)
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "CopyTo", "GatherFrom", "ParallelTransformerBlock",
           "ReduceFrom", "RowParallelLinear", "ScatterTo", "TransformerBlock",
           "VocabParallelEmbedding", "copy_to", "gather_from", "gather_from_sequence",
           "reduce_from", "reduce_scatter_to_sequence", "scatter_to", "scatter_to_sequence",
           "sum_grads_over_group", "vocab_parallel_cross_entropy"]
