"""The model of ``examples/mesh.py``, how it is cut into pipeline stages, and the bytes each
rank's training step moves on each mesh dimension, predicted from the model's sizes.

MNIST as a sequence of 28 rows of 28 pixels -> 10 logits, an ``nn.Sequential`` of pieces::

    RowEmbedding          linear 28 -> hidden, plus a learned position embedding
    TransformerBlock x L  pre-norm, non-causal (ParallelTransformerBlock when split over tp)
    MeanHead              LayerNorm, the mean over the 28 rows, linear hidden -> 10

Stage s of P holds a contiguous run of the blocks (as even as can be: the first L % P
stages one more), the embedding on stage 0 and the head on stage P-1 (:func:`stage_pieces`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from parallel.tp import ParallelTransformerBlock, TransformerBlock

ROWS = COLS = 28
CLASSES = 10
FLOAT32 = 4
#: Bytes of the header the pipeline sends once per stage boundary, before the first
#: activation (dtype, ndim, 8 dims, int64: ``parallel.pp.runtime``).
PP_HEADER_BYTES = 10 * 8


class RowEmbedding(nn.Module):
    """(b, 784) images -> (b, 28, hidden): each row embedded, plus its position."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Linear(COLS, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(ROWS, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x.reshape(-1, ROWS, COLS)) + self.pos


class MeanHead(nn.Module):
    """(b, 28, hidden) -> (b, 10) logits: LayerNorm, mean over the rows, linear."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h).mean(dim=1))


def row_transformer(hidden: int, heads: int, ffn: int, layers: int) -> nn.Sequential:
    """The dense (one-process) model, initialised from torch's global random state."""
    return nn.Sequential(RowEmbedding(hidden),
                         *(TransformerBlock(hidden, heads, ffn, causal=False)
                           for _ in range(layers)),
                         MeanHead(hidden))


def tensor_parallel(dense: nn.Sequential, tp_group: Any) -> nn.Sequential:
    """A copy of ``dense`` with every block split over ``tp_group`` (the rest replicated:
    the ranks of one tp group see the same batch)."""
    return nn.Sequential(*(ParallelTransformerBlock.from_dense(p, tp_group)
                           if isinstance(p, TransformerBlock) else copy.deepcopy(p) for p in dense))


def stage_pieces(layers: int, pp: int, stage: int) -> range:
    """The indices, in the ``nn.Sequential``, of stage ``stage``'s pieces.

    ``stage_pieces(2, 2, 0)`` -> ``range(0, 2)`` (embedding and block 0);
    ``stage_pieces(2, 2, 1)`` -> ``range(2, 4)`` (block 1 and the head).
    """
    if not 1 <= pp <= layers:
        raise ValueError(f"mesh model: {pp} pipeline stages need at least as many blocks, "
                         f"got --layers {layers}")
    base, extra = divmod(layers, pp)
    first = stage * base + min(stage, extra)          # first block of the stage
    count = base + (stage < extra)
    lo = 1 + first if stage > 0 else 0                # piece 0 is the embedding
    hi = 1 + first + count + (1 if stage == pp - 1 else 0)
    return range(lo, hi)


def blocks_of_stage(layers: int, pp: int, stage: int) -> int:
    pieces = stage_pieces(layers, pp, stage)
    return sum(1 for i in pieces if 1 <= i <= layers)


# ------------------------------------------------------------------ the account
def local_param_counts(args: Any, tp: int) -> dict:
    """Elements and tensors of one rank's parameters per piece, from the sizes (each tp
    rank holds 1/tp of q, k, v, fc1 and the input columns of proj, fc2; LayerNorms and the
    row layers' biases whole)."""
    h, f = args.hidden, args.ffn
    block = (2 * 2 * h                                  # ln1, ln2
             + 3 * (h * h // tp + h // tp)              # q, k, v: column-parallel
             + h * h // tp + h                          # proj: row-parallel, whole bias
             + f * h // tp + f // tp                    # fc1: column-parallel
             + h * f // tp + h)                         # fc2: row-parallel, whole bias
    return {"embed": (COLS * h + h + ROWS * h, 3),      # embed weight, bias; pos
            "block": (block, 16),                       # 8 layers, weight and bias each
            "head": (2 * h + h * CLASSES + CLASSES, 4)}  # norm, head: weight and bias


def predicted_bytes(args: Any, coordinate: dict, steps: int) -> dict:
    """Bytes per training step this rank's calls move on each mesh dimension (float32; a
    group of one rank: 0), averaged over ``steps`` steps. ``coordinate``: this rank's
    ``{"dp": ..., "pp": ..., "tp": ...}``. A call counts its whole buffer
    (``examples/common/comm_account.py``).

    - tp: each block all-reduces its (batch, 28, hidden) activations twice in forward
      (after proj and fc2) and their gradients twice in backward (before q/k/v and fc1);
      with micro-batches, the same bytes in M pieces.
    - pp: a stage sends its output activations to the next stage and receives their
      gradients back; it receives its input from the previous stage and sends the input's
      gradient back: (batch, 28, hidden) each way per neighbour, plus, once in the whole
      run, the 80-byte shape header per boundary (sent by one side, received by the other).
    - dp with DDP: one all_reduce of every local gradient of the stage, plus one float per
      parameter tensor (each bucket's "gradient ready" flags travel with it;
      parallel/bucket.py): gradients accumulate over the micro-batches and are reduced
      once, in the last one's backward.
    - dp with FSDP (ZeRO-3, each block a unit, the stage's embedding/head its root unit, a
      unit's flat parameter padded to a multiple of dp): per micro-batch the root gathered
      once and each block twice (forward, and again in backward after resharding), and
      every unit reduce-scattered once per step.
    """
    dp, pp, tp = args.dp, args.pp, args.tp
    stage, M = coordinate["pp"], args.microbatches if pp > 1 else 1
    counts, first, last = local_param_counts(args, tp), stage == 0, stage == pp - 1
    blocks = blocks_of_stage(args.layers, pp, stage)
    activations = args.batch_size * ROWS * args.hidden * FLOAT32
    out = {"dp": 0.0, "pp": 0.0, "tp": 0.0}
    if tp > 1:
        out["tp"] = float(4 * blocks * activations)
    if pp > 1:
        neighbours = int(not first) + int(not last)
        total = steps * 2 * neighbours * activations + neighbours * PP_HEADER_BYTES
        out["pp"] = total / steps
    if dp > 1:
        rest = [counts[k] for k, here in (("embed", first), ("head", last)) if here]
        rest_elems, rest_tensors = sum(n for n, _ in rest), sum(t for _, t in rest)
        block_elems, block_tensors = counts["block"]
        if not args.fsdp:
            out["dp"] = float((rest_elems + blocks * block_elems
                               + rest_tensors + blocks * block_tensors) * FLOAT32)
        else:
            padded = lambda n: math.ceil(n / dp) * dp  # noqa: E731
            root, block = padded(rest_elems) if rest_elems else 0, padded(block_elems)
            gathered = M * (root + 2 * blocks * block)
            reduced = root + blocks * block
            out["dp"] = float((gathered + reduced) * FLOAT32)
    return out
