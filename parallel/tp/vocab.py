"""Vocabulary parallelism: the embedding table and the softmax loss split along the
vocabulary (Megatron-LM, arXiv 1909.08053, section 3, "input embedding" and the fused
cross-entropy that avoids gathering the logits).

Over n ranks, rank r holds the token ids ``[r*V/n, (r+1)*V/n)``:

- :class:`VocabParallelEmbedding` looks up the ids it holds, writes zeros for the others,
  and one all_reduce sums the ranks' rows: each id's row comes from exactly one rank.
- :func:`vocab_parallel_cross_entropy` takes the logits block (..., V/n) of a
  :class:`~parallel.tp.ColumnParallelLinear` output layer and computes the cross-entropy of
  the whole vocabulary with the full logits never on one rank: the max over the vocabulary
  (all_reduce MAX), then the target's logit and the sum of exponentials (one all_reduce SUM
  of both). Its backward is local: softmax minus one-hot, in this rank's block.

The vocabulary must split into equal blocks (Megatron pads it to a multiple of the group
size); otherwise a ``ValueError`` names the layer, the size and the group size.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from collectives import ReduceOp

from .regions import all_gather_along, block_size, check_group, reduce_from

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def _check_ids(ids: Any, vocab: int, where: str, what: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: `{what}` must be an int32 or int64 torch.Tensor, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{where}: `{what}` holds ids outside [0, {vocab}): min "
                         f"{int(ids.min())}, max {int(ids.max())}")


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows (the vocabulary) split
    over ``group``: rank r holds rows ``[r*V/n, (r+1)*V/n)`` as ``.weight`` (V/n, dim).

    The input (token ids, any shape, the same on every rank) gives the dense embedding's
    output (..., dim), bitwise the same on every rank. Each rank's ``.weight.grad`` is the
    dense gradient's block. The constructor is a collective unless ``seed`` is given (rank
    0 draws the seed of the dense ``nn.Embedding`` initialisation, N(0, 1)).

    Two ranks, each with half of the vocabulary; every id's row comes out on both:

    >>> import torch, collectives
    >>> from torch import nn
    >>> from parallel.tp import VocabParallelEmbedding
    >>> def embed():
    ...     pg = collectives.init_process_group()
    ...     torch.manual_seed(0)                                 # the same table on both
    ...     dense = nn.Embedding(10, 4)
    ...     emb = VocabParallelEmbedding.from_dense(dense, pg)   # .weight (5, 4): its ids
    ...     ids = torch.tensor([[0, 9, 4, 5]])                   # (b, s), the same on both
    ...     h = emb(ids)                                         # (1, 4, 4) on both
    ...     same = torch.equal(h, dense(ids))
    ...     pg.close()
    ...     return tuple(emb.weight.shape), tuple(h.shape), same
    >>> collectives.spawn(embed, 2)
    [((5, 4), (1, 4, 4), True), ((5, 4), (1, 4, 4), True)]
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, *,
                 seed: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        check_group(group, "VocabParallelEmbedding")
        for name, value in (("num_embeddings", num_embeddings),
                            ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VocabParallelEmbedding: argument `{name}` must be a "
                                 f"positive int, got {value!r}")
        self._setup(num_embeddings, embedding_dim, group)
        if seed is None:
            mine = int(torch.randint(0, 2**62, ())) if group.rank == 0 else None
            seed = group.broadcast_object(mine, src=0) if group.size > 1 else mine
        gen = torch.Generator().manual_seed(seed)
        full = torch.randn(num_embeddings, embedding_dim, generator=gen, dtype=dtype)
        self._take_block(full)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: Any) -> "VocabParallelEmbedding":
        """This rank's block of rows of ``embedding`` (the same on every rank; copied)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_dense: argument `embedding` must "
                            f"be a torch.nn.Embedding, got {type(embedding).__name__}")
        unsupported = [name for name in ("padding_idx", "max_norm")
                       if getattr(embedding, name) is not None]
        if embedding.sparse or embedding.scale_grad_by_freq:
            unsupported += ["sparse" if embedding.sparse else "scale_grad_by_freq"]
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding.from_dense: the embedding uses "
                             f"{', '.join(unsupported)}, which is not supported")
        check_group(group, "VocabParallelEmbedding")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(embedding.num_embeddings, embedding.embedding_dim, group)
        layer._take_block(embedding.weight.detach())
        return layer

    def _setup(self, num_embeddings: int, embedding_dim: int, group: Any) -> None:
        self.num_embeddings, self.embedding_dim, self.group = \
            num_embeddings, embedding_dim, group
        self._block = block_size(num_embeddings, group, "VocabParallelEmbedding",
                                 "num_embeddings")
        self.vocab_start = group.rank * self._block
        self.vocab_end = self.vocab_start + self._block
        self._where = f"[rank {group.rank}/{group.size}] VocabParallelEmbedding"

    def _take_block(self, full: torch.Tensor) -> None:
        self.weight = nn.Parameter(full[self.vocab_start:self.vocab_end].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings, self._where, "ids")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight)              # (...) -> (..., dim)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)  # ids another rank holds: 0
        return reduce_from(rows, self.group)                  # each id's row from one rank

    def to_dense(self) -> nn.Embedding:
        """The whole table as an ``nn.Embedding`` on every rank (a collective)."""
        with torch.no_grad():
            full = all_gather_along(self.weight.detach(), 0, self.group)
        return nn.Embedding.from_pretrained(full.clone(), freeze=False)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"rows=[{self.vocab_start}, {self.vocab_end}), group_size={self.group.size}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any):
        ctx.dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # sums of exponentials in 16 bits lose the small terms
        block = logits.shape[-1]
        start = group.rank * block
        # Subtract the max over the whole vocabulary: exp() then cannot overflow.
        top = logits.max(dim=-1).values                         # (...)
        if group.size > 1:
            group.all_reduce(top, ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)                    # (..., V/n)
        mine = (target >= start) & (target < start + block)     # the target is in my block
        local = (target.long() - start).masked_fill(~mine, 0)   # gather wants int64
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        both = torch.stack([picked, exp.sum(dim=-1)])           # (2, ...): one message
        if group.size > 1:
            group.all_reduce(both)
        picked, sum_exp = both[0], both[1]
        exp /= sum_exp.unsqueeze(-1)                            # softmax, this block
        ctx.save_for_backward(exp, mine, local)
        return sum_exp.log() - picked                           # -log softmax[target]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        softmax, mine, local = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), the one-hot in its owner's block.
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 group: Any) -> torch.Tensor:
    """The cross-entropy of every position, ``-log softmax(logits)[target]`` over the whole
    vocabulary, from this rank's block of the logits; shape ``target.shape``, the same on
    every rank (take ``.mean()`` for ``F.cross_entropy``'s default).

    ``logits_shard`` (..., V/n) is rank r's block of vocabulary ids ``[r*V/n, (r+1)*V/n)``
    (a :class:`ColumnParallelLinear` output layer's output); ``target`` (...) holds ids in
    ``[0, V)``, the same on every rank. 16-bit logits are computed in float32 (the loss
    is float32; the gradient has the logits' dtype). Two all_reduces in forward (a max, then the target
    logit and the sum of exponentials together), none in backward; the gradient of
    ``logits_shard`` is exact.

    Two ranks, V = 8::

        logits = head(h)                 # ColumnParallelLinear(64, 8): (b, 4) on each
        loss = vocab_parallel_cross_entropy(logits, y, pg).mean()  # = F.cross_entropy
    """
    where = "vocab_parallel_cross_entropy"
    check_group(group, where)
    if not isinstance(logits_shard, torch.Tensor) or not logits_shard.is_floating_point():
        raise TypeError(f"{where}: `logits_shard` must be a floating-point torch.Tensor, "
                        f"got {getattr(logits_shard, 'dtype', type(logits_shard).__name__)}")
    if logits_shard.dim() == 0 or logits_shard.shape[-1] == 0:
        raise ValueError(f"{where}: `logits_shard` must have a non-empty last dim (the "
                         f"vocabulary block), got shape {tuple(logits_shard.shape)}")
    vocab = logits_shard.shape[-1] * group.size
    _check_ids(target, vocab, f"[rank {group.rank}/{group.size}] {where}", "target")
    if tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"[rank {group.rank}/{group.size}] {where}: `target` must have "
                         f"shape {tuple(logits_shard.shape[:-1])} (logits_shard's without "
                         f"its last dim), got {tuple(target.shape)}")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group)
