"""Context parallelism: the sequence split across the ranks of a group, each holding L/C
tokens of every activation; attention, the one layer that mixes positions, gets the other
ranks' keys and values by a ring of ``isend``/``irecv`` (:func:`ring_attention`) or one
``all_gather`` (:func:`all_gather_attention`), exactly, forward and backward.

Two ranks, a causal sequence of 4096 tokens::

    q_r, k_r, v_r = (shard_sequence(t, pg, 2, "zigzag") for t in (q, k, v))
    o_r = ring_attention(q_r, k_r, v_r, pg, causal=True, layout="zigzag")  # (b, h, 2048, d)
    o = unshard_sequence(o_r, pg, 2, "zigzag")                             # (b, h, 4096, d)

- :mod:`.layout`: the ``contiguous`` and ``zigzag`` layouts, :func:`shard_sequence`,
  :func:`unshard_sequence`.
- :mod:`.blocks`: one block's attention, the log-sum-exp merge, the exact backward, and
  the plan of what is computed (fully masked causal blocks are skipped).
- :mod:`.function`: the autograd function both patterns share.
- :mod:`.ring`, :mod:`.all_gather`: the two patterns.
- :mod:`.memory`: :func:`saved_tensor_bytes`, what autograd keeps.
- :mod:`.module`: :class:`ContextParallelAttention`, for
  :class:`parallel.tp.ParallelTransformerBlock` (``attention=``).
"""

from .all_gather import AllGather, all_gather_attention
from .blocks import Part, plan, work_of
from .memory import saved_tensor_bytes
from .layout import LAYOUTS, chunks_of, positions_of, shard_sequence, unshard_sequence
from .module import ALGORITHMS, ContextParallelAttention
from .ring import Ring, ring_attention

__all__ = ["ALGORITHMS", "AllGather", "ContextParallelAttention", "LAYOUTS", "Part", "Ring",
           "all_gather_attention", "chunks_of", "plan", "positions_of", "ring_attention",
           "saved_tensor_bytes", "shard_sequence", "unshard_sequence", "work_of"]
