"""The model of ``examples/mesh.py``, how it is cut into pipeline stages, and the bytes each
rank's training step moves on each mesh dimension, predicted from the model's sizes.

MNIST as a sequence of 28 rows of 28 pixels -> 10 logits, an ``nn.Sequential`` of pieces::

    RowEmbedding          linear 28 -> hidden, plus a learned position embedding
    TransformerBlock x L  pre-norm, non-causal (ParallelTransformerBlock when split over tp)
    MeanHead              LayerNorm, the mean over the 28 rows, linear hidden -> 10

With experts (``--experts E``), each block is a :class:`BlockWithExperts`: the block, then
``h + MoE(LayerNorm(h))`` over its rows as tokens (E expert MLPs hidden -> ffn -> hidden,
sharded over the ``ep`` ranks by :func:`expert_parallel`; replicated over tp).

Stage s of P holds a contiguous run of the blocks (as even as can be: the first L % P
stages one more), the embedding on stage 0 and the head on stage P-1 (:func:`stage_pieces`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from parallel.cp import ContextParallelAttention, shard_sequence, unshard_sequence
from parallel.ep import MoE
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


class MoEResidual(nn.Module):
    """(b, 28, hidden) -> the same: ``h + MoE(LayerNorm(h))``, each row of each image a
    token."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(moe.dim), moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        return h + self.moe(self.norm(h).reshape(b * s, d)).reshape(b, s, d)


class BlockWithExperts(nn.Module):
    """A transformer block, then an MoE feed-forward: one piece of the pipeline."""

    def __init__(self, block: nn.Module, experts: MoEResidual) -> None:
        super().__init__()
        self.block, self.experts = block, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.block(x))


def row_transformer(hidden: int, heads: int, ffn: int, layers: int, experts: int = 0,
                    top_k: int = 2, capacity_factor: Any = None) -> nn.Sequential:
    """The dense (one-process) model, initialised from torch's global random state; with
    ``experts``, each block followed by a one-process MoE of that many experts."""
    def block() -> nn.Module:
        dense = TransformerBlock(hidden, heads, ffn, causal=False)
        if not experts:
            return dense
        mlps = [nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
                for _ in range(experts)]
        moe = MoE(nn.Linear(hidden, experts, bias=False), mlps, None, top_k=top_k,
                  capacity_factor=capacity_factor)
        return BlockWithExperts(dense, MoEResidual(moe))
    return nn.Sequential(RowEmbedding(hidden), *(block() for _ in range(layers)),
                         MeanHead(hidden))


def tensor_parallel(dense: nn.Sequential, tp_group: Any) -> nn.Sequential:
    """A copy of ``dense`` with every block split over ``tp_group`` (the rest replicated:
    the ranks of one tp group see the same batch)."""
    def split(p: nn.Module) -> nn.Module:
        if isinstance(p, TransformerBlock):
            return ParallelTransformerBlock.from_dense(p, tp_group)
        if isinstance(p, BlockWithExperts):
            return BlockWithExperts(split(p.block), copy.deepcopy(p.experts))
        return copy.deepcopy(p)
    return nn.Sequential(*(split(p) for p in dense))


class ShardedEmbedding(nn.Module):
    """The embedding, then this rank's part of the rows over the cp group (no
    communication; each rank embeds the whole image, a few hundred multiply-adds)."""

    def __init__(self, embed: nn.Module, cp_group: Any, layout: str) -> None:
        super().__init__()
        self.embed, self.cp_group, self.layout = embed, cp_group, layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(self.embed(x), self.cp_group, 1, self.layout)


class GatheredHead(nn.Module):
    """The rows of every cp rank gathered (``unshard_sequence``: all_gather; its backward
    a reduce_scatter), then the head."""

    def __init__(self, head: nn.Module, cp_group: Any, layout: str) -> None:
        super().__init__()
        self.head, self.cp_group, self.layout = head, cp_group, layout

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(unshard_sequence(h, self.cp_group, 1, self.layout))


def context_parallel(model: nn.Sequential, cp_group: Any, layout: str,
                     algorithm: str) -> nn.Sequential:
    """``model`` (split over tp, in place) with its rows split over ``cp_group``: the
    embedding keeps this rank's rows, every block's attention is
    :class:`~parallel.cp.ContextParallelAttention`, the head gathers the rows first. Each
    cp rank's loss is the whole batch's, so every gradient comes out ``cp`` times the
    one-process gradient (the gathered rows' backward sums the ranks' parts): averaging
    over the cp ranks, with the dp ranks, gives the one-process gradient."""
    if cp_group.size == 1:
        return model
    for m in model.modules():
        if isinstance(m, ParallelTransformerBlock):
            m.attention = ContextParallelAttention(cp_group, algorithm=algorithm,
                                                   layout=layout)
    model[0] = ShardedEmbedding(model[0], cp_group, layout)
    model[-1] = GatheredHead(model[-1], cp_group, layout)
    return model


def averaging_groups(mesh: Any) -> dict:
    """The groups a mesh run's gradients are averaged over, by what they hold:

    - ``data``: the ranks that train on batches of their own (dp x ep): the sampler's
      shards;
    - ``replicated``: the ranks holding the same replicated (non-expert) parameters with
      gradients to average (dp x ep x cp: the cp ranks hold parts of one sample's rows);
    - ``experts``: the ranks holding the same experts (dp x cp).

    A collective (``mesh.flatten`` makes each group once, in this order on every rank).
    Dimensions of length 1 are left out (dp is always in): with ep and cp of 1 each is the
    dp group itself, no group is made.
    """
    def over(dims: tuple, name: str) -> Any:
        return mesh.flatten([d for d in dims if d == "dp" or mesh.size(d) > 1], name=name)
    return {"data": over(("dp", "ep"), "data"),
            "replicated": over(("dp", "ep", "cp"), "replicated"),
            "experts": over(("dp", "cp"), "experts")}


def expert_parallel(model: nn.Module, ep_group: Any) -> nn.Module:
    """``model`` (in place) with every one-process MoE replaced by this rank's share of its
    experts over ``ep_group`` (``MoE.from_dense``)."""
    for m in model.modules():
        if isinstance(m, MoEResidual):
            m.moe = MoE.from_dense(m.moe, ep_group)
    return model


def moe_traffic(moe: MoE) -> int:
    """Bytes one training forward and backward of ``moe`` moves on its group by the
    account's rule (each call its largest array): the counts (E int64), then dispatch and
    combine forward and again backward, each ``max(rows sent, rows received)`` float32
    rows of ``dim``. A group of one moves nothing."""
    if moe.group.size == 1:
        return 0
    return 8 * moe.num_experts + 4 * max(moe.sent_rows, moe.received_rows) * moe.dim * FLOAT32


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
    row layers' biases whole). With experts, ``moe``: a block's MoE norm and router
    (replicated), ``experts``: its E/ep local expert MLPs."""
    h, f = args.hidden, args.ffn
    E = getattr(args, "experts", 0)
    moe = {"moe": (2 * h + E * h, 3) if E else (0, 0),
           "experts": ((E // args.ep) * (h * f + f + f * h + h), 4 * (E // args.ep))
           if E else (0, 0)}
    block = (2 * 2 * h                                  # ln1, ln2
             + 3 * (h * h // tp + h // tp)              # q, k, v: column-parallel
             + h * h // tp + h                          # proj: row-parallel, whole bias
             + f * h // tp + f // tp                    # fc1: column-parallel
             + h * f // tp + h)                         # fc2: row-parallel, whole bias
    return {"embed": (COLS * h + h + ROWS * h, 3),      # embed weight, bias; pos
            "block": (block, 16),                       # 8 layers, weight and bias each
            "head": (2 * h + h * CLASSES + CLASSES, 4),  # norm, head: weight and bias
            **moe}


def predicted_bytes(args: Any, coordinate: dict, steps: int, ep_bytes: float = 0.0) -> dict:
    """Bytes per training step this rank's calls move on each mesh dimension (float32; a
    group of one rank: 0), averaged over ``steps`` steps. ``coordinate``: this rank's
    ``{"dp": ..., "ep": ..., "pp": ..., "tp": ...}``. A call counts its whole buffer
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
      once, in the last one's backward. The replicated part is averaged over the dp x ep
      ranks (each trains on its own batch); with experts and dp > 1, one more all_reduce
      of the local experts' gradients over dp (``average_expert_grads``).
    - dp with FSDP (ZeRO-3, each block a unit, the stage's embedding/head and the MoE
      norms and routers its root unit, a unit's flat parameter padded to a multiple of
      dp x ep): per micro-batch the root gathered once and each block twice (forward,
      and again in backward after resharding), and every unit reduce-scattered once per
      step.
    - ep: what the MoE layers report for each training forward (:func:`moe_traffic`),
      summed into ``ep_bytes`` by the caller: it depends on the routing.
    - cp: each rank holds 28/cp rows, so tp's and pp's activations shrink by cp; the
      replicated part is averaged over dp x ep x cp, the experts over dp x cp. Each block's
      attention moves stack(k, v) of its rows and heads, (2, batch, heads/tp, 28/cp,
      head_dim): the ring 2(cp-1) hops forward (a send and a receive each), 2(cp-1) hops
      of it and 2cp of its gradient backward; all_gather, one gather of cp of them
      forward, and a gather and a reduce_scatter of as many backward. The last stage
      gathers the rows (all_gather of (batch, 28, hidden)) and reduce-scatters their
      gradient.
    """
    dp, pp, tp = args.dp, args.pp, args.tp
    cp = getattr(args, "cp", 1)
    replicas = dp * getattr(args, "ep", 1) * cp        # ranks averaging the replicated part
    stage, M = coordinate["pp"], args.microbatches if pp > 1 else 1
    counts, first, last = local_param_counts(args, tp), stage == 0, stage == pp - 1
    blocks = blocks_of_stage(args.layers, pp, stage)
    activations = args.batch_size * (ROWS // cp) * args.hidden * FLOAT32
    out = {"dp": 0.0, "ep": ep_bytes / steps, "pp": 0.0, "cp": 0.0, "tp": 0.0}
    if cp > 1:
        kv = 2 * args.batch_size * (ROWS // cp) * (args.hidden // tp) * FLOAT32
        per_block = ((4 * (cp - 1) + 2 * cp) * kv if args.cp_algorithm == "ring"
                     else 3 * cp * kv)
        gathered = 2 * args.batch_size * ROWS * args.hidden * FLOAT32 if last else 0
        out["cp"] = float(blocks * per_block + gathered)
    if tp > 1:
        out["tp"] = float(4 * blocks * activations)
    if pp > 1:
        neighbours = int(not first) + int(not last)
        total = steps * 2 * neighbours * activations + neighbours * PP_HEADER_BYTES
        out["pp"] = total / steps
    if replicas > 1:
        rest = [counts[k] for k, here in (("embed", first), ("head", last)) if here]
        rest += [counts["moe"]] * blocks
        rest_elems, rest_tensors = sum(n for n, _ in rest), sum(t for _, t in rest)
        block_elems, block_tensors = counts["block"]
        if not args.fsdp:
            out["dp"] = float((rest_elems + blocks * block_elems
                               + rest_tensors + blocks * block_tensors) * FLOAT32)
        else:
            padded = lambda n: math.ceil(n / replicas) * replicas  # noqa: E731
            root, block = padded(rest_elems) if rest_elems else 0, padded(block_elems)
            gathered = M * (root + 2 * blocks * block)
            reduced = root + blocks * block
            out["dp"] = float((gathered + reduced) * FLOAT32)
    if dp * cp > 1 and blocks and counts["experts"][0]:
        out["dp"] += float(blocks * counts["experts"][0] * FLOAT32)
    return out
