"""A pre-norm transformer block, dense and tensor-parallel (Megatron-LM, arXiv 1909.08053,
section 3, figure 3; with sequence parallelism, arXiv 2205.05198, figure 5).

The block, on ``x`` of shape (batch, seq, hidden)::

    x = x + dropout(proj(attention(q(ln1(x)), k(ln1(x)), v(ln1(x)))))   # attention
    x = x + dropout(fc2(gelu(fc1(ln2(x)))))                             # MLP

Tensor-parallel over n ranks: q, k and v are column-parallel, so rank r computes heads
``[r*H/n, (r+1)*H/n)`` (a head's q/k/v features are contiguous rows of the dense weights)
and attention needs no communication; proj is row-parallel. fc1 is column-parallel, fc2
row-parallel. Each sub-block therefore costs one all_reduce in forward (``reduce_from``
after the row layer) and one in backward (``copy_to`` before q/k/v or fc1, on the
gradient of the LayerNorm's output).

With ``sequence_parallel=True`` the input and output are this rank's block of the
sequence, (batch, seq/n, hidden), and so are the LayerNorms, dropouts and residuals: each
sub-block's all_reduce becomes an all_gather before the column layers and a
reduce_scatter after the row layer (forward), and a reduce_scatter and an all_gather
(backward). The replicated parameters used on sequence blocks (both LayerNorms, the
biases of proj and fc2) then get one more all_reduce in backward, of all their gradients
together (:func:`~parallel.tp.sequence.sum_grads_over_group`).

Dropout: with p > 0 outside sequence parallelism, the residual dropouts act on replicated
activations and must draw the same mask on every rank (seed the ranks alike).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear, dense_linear_init
from .regions import block_size, check_group, copy_to, reduce_from
from .sequence import gather_from_sequence, reduce_scatter_to_sequence, sum_grads_over_group

__all__ = ["ParallelTransformerBlock", "TransformerBlock"]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
               causal: bool, attention: Optional[Callable] = None) -> torch.Tensor:
    """(b, s, heads*d) x3 -> (b, s, heads*d): scaled dot-product attention per head, by
    ``attention(q, k, v, causal=...)`` on (b, H, s, d) when given (context parallelism)."""
    b, s, _ = q.shape
    q, k, v = (t.reshape(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))  # (b, H, s, d)
    if attention is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)       # (b, H, s, d)
    else:
        out = attention(q, k, v, causal=causal)                               # (b, H, s, d)
    return out.transpose(1, 2).reshape(b, s, -1)                               # (b, s, H*d)


def _check_sizes(where: str, hidden: int, num_heads: int, ffn_hidden: int) -> None:
    for name, value in (("hidden", hidden), ("num_heads", num_heads),
                        ("ffn_hidden", ffn_hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: argument `{name}` must be a positive int, got "
                             f"{value!r}")
    if hidden % num_heads:
        raise ValueError(f"{where}: hidden={hidden} is not divisible by num_heads="
                         f"{num_heads}")


class TransformerBlock(nn.Module):
    """The dense pre-norm block (one process): the reference that
    :class:`ParallelTransformerBlock` splits. Input and output (batch, seq, hidden)."""

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: Optional[int] = None, *,
                 causal: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        ffn_hidden = 4 * hidden if ffn_hidden is None else ffn_hidden
        _check_sizes("TransformerBlock", hidden, num_heads, ffn_hidden)
        self.num_heads, self.causal = num_heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn_hidden), nn.Linear(ffn_hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a = _attention(self.q(h), self.k(h), self.v(h), self.num_heads, self.causal)
        x = x + self.dropout(self.proj(a))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ParallelTransformerBlock(nn.Module):
    """:class:`TransformerBlock` with its heads and MLP features split over ``group``.

    Holds ``ln1``, ``ln2`` (replicated ``nn.LayerNorm``), ``q``, ``k``, ``v``, ``fc1``
    (:class:`ColumnParallelLinear`) and ``proj``, ``fc2`` (:class:`RowParallelLinear`).
    ``num_heads`` and ``ffn_hidden`` must be divisible by the group size (else a
    ``ValueError`` naming the layer, the size and the group size); with
    ``sequence_parallel=True`` the sequence length too.

    Input and output: (batch, seq, hidden), the same on every rank; with
    ``sequence_parallel=True``, rank r's block (batch, seq/n, hidden) of the sequence.

    Two ranks, each with half of the heads and of the MLP; with sequence parallelism,
    each with half of the positions:

    >>> import torch, collectives
    >>> from parallel.tp import (ParallelTransformerBlock, TransformerBlock,
    ...                          scatter_to_sequence)
    >>> def blocks():
    ...     pg = collectives.init_process_group()
    ...     torch.manual_seed(0)                        # the same dense block and input
    ...     dense = TransformerBlock(16, 4)
    ...     x = torch.randn(2, 6, 16)
    ...     block = ParallelTransformerBlock.from_dense(dense, pg)   # heads 2r, 2r+1 here
    ...     y = block(x)                                # (2, 6, 16) on both
    ...     sp = ParallelTransformerBlock.from_dense(dense, pg, sequence_parallel=True)
    ...     y_r = sp(scatter_to_sequence(x, pg))        # (2, 3, 16): this rank's positions
    ...     want = dense(x)
    ...     mine = want[:, 3 * pg.rank:3 * pg.rank + 3]
    ...     pg.close()
    ...     return (torch.allclose(y, want, atol=1e-5), tuple(y_r.shape),
    ...             torch.allclose(y_r, mine, atol=1e-5))
    >>> collectives.spawn(blocks, 2)
    [(True, (2, 3, 16), True), (True, (2, 3, 16), True)]
    """

    def __init__(self, hidden: int, num_heads: int, group: Any,
                 ffn_hidden: Optional[int] = None, *, causal: bool = True,
                 dropout: float = 0.0, sequence_parallel: bool = False,
                 seed: Optional[int] = None, attention: Optional[nn.Module] = None) -> None:
        check_group(group, "ParallelTransformerBlock")
        if seed is None:
            mine = int(torch.randint(0, 2**62, ())) if group.rank == 0 else None
            seed = group.broadcast_object(mine, src=0) if group.size > 1 else mine
        dense = TransformerBlock(hidden, num_heads, ffn_hidden, causal=causal,
                                 dropout=dropout)
        # nn.Linear's initialisation, from a generator of the shared seed rather than the
        # global random state (which the threads of one process would share).
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in (dense.q, dense.k, dense.v, dense.proj, dense.fc1, dense.fc2):
                weight, bias = dense_linear_init(m.in_features, m.out_features, True, gen)
                m.weight.copy_(weight)
                m.bias.copy_(bias)
        super().__init__()
        self._build(dense, group, sequence_parallel, attention)

    @classmethod
    def from_dense(cls, block: TransformerBlock, group: Any, *,
                   sequence_parallel: bool = False,
                   attention: Optional[nn.Module] = None) -> "ParallelTransformerBlock":
        """This rank's part of ``block`` (the same on every rank; copied)."""
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"ParallelTransformerBlock.from_dense: argument `block` must "
                            f"be a parallel.tp.TransformerBlock, got {type(block).__name__}")
        check_group(group, "ParallelTransformerBlock")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(block, group, sequence_parallel, attention)
        return layer

    def _build(self, dense: TransformerBlock, group: Any, sequence_parallel: bool,
               attention: Optional[nn.Module] = None) -> None:
        self.group, self.sequence_parallel = group, bool(sequence_parallel)
        self.attention = attention
        self.num_heads, self.causal = dense.num_heads, dense.causal
        self.hidden, self.ffn_hidden = dense.q.in_features, dense.fc1.out_features
        self.local_heads = block_size(dense.num_heads, group, "ParallelTransformerBlock",
                                      "num_heads")
        block_size(self.ffn_hidden, group, "ParallelTransformerBlock", "ffn_hidden")
        self._where = f"[rank {group.rank}/{group.size}] ParallelTransformerBlock"
        copy = lambda m: nn.LayerNorm(m.normalized_shape, eps=m.eps)  # noqa: E731
        self.ln1, self.ln2 = copy(dense.ln1), copy(dense.ln2)
        self.ln1.load_state_dict(dense.ln1.state_dict())
        self.ln2.load_state_dict(dense.ln2.state_dict())
        self.q, self.k, self.v, self.fc1 = (ColumnParallelLinear.from_dense(m, group)
                                            for m in (dense.q, dense.k, dense.v, dense.fc1))
        self.proj = RowParallelLinear.from_dense(dense.proj, group)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, group)
        self.dropout = nn.Dropout(dense.dropout.p)

    # The layers' own forward would each enter the region (copy_to) again: here q, k and
    # v share one entry, so the block calls F.linear on their blocks directly.
    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence(x, self.group, dim=1)   # (b, s/n, h) -> (b, s, h)
        return copy_to(x, self.group)                           # backward: all_reduce

    def _leave(self, partial: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(partial, self.group, dim=1)  # -> (b, s/n, h)
        else:
            out = reduce_from(partial, self.group)                         # (b, s, h)
        return out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden:
            raise ValueError(f"{self._where}: the input must be a tensor of shape (batch, "
                             f"seq, {self.hidden}), got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        ln1_w, ln1_b, ln2_w, ln2_b, proj_b, fc2_b = (
            self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias,
            self.proj.bias, self.fc2.bias)
        if self.sequence_parallel:  # each rank's part of their gradients, summed in backward
            ln1_w, ln1_b, ln2_w, ln2_b, proj_b, fc2_b = sum_grads_over_group(
                [ln1_w, ln1_b, ln2_w, ln2_b, proj_b, fc2_b], self.group)
        norm = self.ln1.normalized_shape

        h = self._enter(F.layer_norm(x, norm, ln1_w, ln1_b, self.ln1.eps))   # (b, s, h)
        q, k, v = (F.linear(h, m.weight, m.bias)    # (b, s, h) @ (h, h/n) -> (b, s, h/n)
                   for m in (self.q, self.k, self.v))
        a = _attention(q, k, v, self.local_heads, self.causal,   # (b, s, h/n): my heads
                       self.attention)
        a = F.linear(a, self.proj.weight)           # (b, s, h/n) @ (h/n, h) -> (b, s, h)
        x = x + self.dropout(self._leave(a, proj_b))

        h = self._enter(F.layer_norm(x, norm, ln2_w, ln2_b, self.ln2.eps))   # (b, s, h)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias))  # (b, s, h) -> (b, s, f/n)
        h = F.linear(h, self.fc2.weight)            # (b, s, f/n) @ (f/n, h) -> (b, s, h)
        return x + self.dropout(self._leave(h, fc2_b))

    def to_dense(self) -> TransformerBlock:
        """The whole block as a :class:`TransformerBlock` on every rank (a collective)."""
        dense = TransformerBlock(self.hidden, self.num_heads, self.ffn_hidden,
                                 causal=self.causal, dropout=self.dropout.p)
        for name in ("q", "k", "v", "proj", "fc1", "fc2"):
            setattr(dense, name, getattr(self, name).to_dense())
        dense.ln1.load_state_dict(self.ln1.state_dict())
        dense.ln2.load_state_dict(self.ln2.state_dict())
        return dense

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, heads={self.local_heads}/{self.num_heads}, "
                f"ffn_hidden={self.ffn_hidden}, causal={self.causal}, "
                f"sequence_parallel={self.sequence_parallel}, group_size={self.group.size}")
