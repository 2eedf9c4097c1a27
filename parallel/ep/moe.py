"""The mixture-of-experts layer whose experts live on different ranks (expert parallelism).

One forward on rank r of P, with E experts (L = E/P of them here, global indices
``r*L .. r*L+L-1``) and this rank's T tokens::

    logits = router(x)                          # (T, E), the router replicated everywhere
    experts, gates = top_k_gates(logits, k)     # (T, k) each: Mixtral's gating
    keep = within_capacity(...)                 # capacity_factor: drop the lowest gates
    counts -> exchange_counts                   # (P, L): who sends me how many rows
    rows = x[tokens sorted by expert]           # (sum of kept pairs, dim)
    arrived = exchange_rows(rows, ...)          # dispatch: all_to_all, uneven splits
    out_j = expert_j(arrived rows of expert j)  # each local expert once, expert-major
    back = exchange_rows(out, ...)              # combine: the reverse all_to_all
    y[t] = sum over t's kept pairs of gate * back

Both exchanges are differentiable (:mod:`.exchange`): backward runs them in reverse, so an
expert's gradient on its owner sums every rank's tokens, and each rank gets the gradient
of its own inputs and its router's share from its own tokens. The routing rules are in
:mod:`.gating`.
"""

from __future__ import annotations

import copy
import numbers
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..arguments import check_group
from .exchange import exchange_counts, exchange_rows, expert_major
from .gating import capacity_of, load_balancing_loss, top_k_gates, within_capacity

__all__ = ["MoE"]

_GROUP_ATTRS = ("rank", "size", "all_to_all", "all_gather_object")


class _Alone:
    """The group of ``MoE(..., group=None)``: one rank, so no collective is ever called."""

    rank, size = 0, 1

    def all_to_all(self, *args, **kwargs):   # pragma: no cover - a group of one never calls
        raise AssertionError("MoE alone: all_to_all called")

    all_gather_object = all_to_all


_ALONE = _Alone()


class MoE(nn.Module):
    """A mixture-of-experts layer with this rank's share of the experts.

    Args:
        router: ``nn.Linear(dim, E, bias=False)``, the same on every rank (replicate it:
            DDP, FSDP or one seed).
        experts: this rank's E/P expert modules, each mapping (n, dim) -> (n, dim); local
            expert j of rank r is global expert ``r * E/P + j``.
        group: the :class:`collectives.ProcessGroup` of the expert-parallel ranks (P of
            them; E must be divisible by P). None: this process alone holds all E experts
            (the one-process layer; nothing is sent).
        top_k: experts per token (1..E); each token's output is the sum of its chosen
            experts' outputs weighted by the softmax of their k logits (ties: the lower
            expert index).
        capacity_factor: None (no limit), or c > 0: each expert accepts at most
            ``ceil(c * T * k / E)`` of each rank's T tokens, dropping those of lowest gate
            first (a dropped choice adds nothing to its token's output).

    After each forward: ``aux_loss`` (a scalar tensor: Switch Transformer's load-balancing
    loss over this rank's tokens, differentiable through the router; add it, scaled, to
    the loss), ``tokens_per_expert`` (int64, (E,): how many of this rank's tokens each
    expert accepted), ``dropped`` (how many (token, expert) choices the capacity dropped)
    and ``sent_rows``/``received_rows`` (rows this rank sent to / received from the
    experts' ranks, itself included).

    ``forward(x)`` takes this rank's tokens (T, dim), T may differ between ranks and be 0,
    and returns (T, dim). It is a collective of ``group`` (so is backward): every rank
    calls it, and every rank that runs backward through one forward's output runs it
    through every rank's.

    Two ranks, four experts (two here)::

        router = nn.Linear(16, 4, bias=False)              # same weights on both ranks
        moe = MoE(router, [make_expert() for _ in range(2)], pg, top_k=2)
        y = moe(x)                                         # x (T_r, 16) -> (T_r, 16)
        (loss_fn(y) + 0.01 * moe.aux_loss).backward()
    """

    def __init__(self, router: nn.Module, experts: Sequence[nn.Module], group: Any, *,
                 top_k: int = 2, capacity_factor: Optional[float] = None) -> None:
        super().__init__()
        group = _ALONE if group is None else group
        check_group(group, "MoE", _GROUP_ATTRS)
        where = self._where = f"[rank {group.rank}/{group.size}] MoE"
        if not isinstance(router, nn.Linear) or router.bias is not None:
            raise TypeError(f"{where}: argument `router` must be an nn.Linear(dim, E, "
                            f"bias=False), got {_describe(router)}")
        dim, num_experts = router.in_features, router.out_features
        if num_experts % group.size:
            raise ValueError(f"{where}: the router's E={num_experts} experts are not "
                             f"divisible by the group size P={group.size}; each rank holds "
                             f"E/P of them")
        local = num_experts // group.size
        if (isinstance(experts, nn.Module) and not isinstance(experts, nn.ModuleList)) or \
                not hasattr(experts, "__iter__"):
            raise TypeError(f"{where}: argument `experts` must be a list of nn.Module, got "
                            f"{type(experts).__name__}")
        experts = list(experts)
        bad = [i for i, e in enumerate(experts) if not isinstance(e, nn.Module)]
        if bad:
            raise TypeError(f"{where}: argument `experts` must hold nn.Modules; item "
                            f"{bad[0]} is {type(experts[bad[0]]).__name__}")
        if len(experts) != local:
            raise ValueError(f"{where}: argument `experts` holds {len(experts)} experts, "
                             f"expected E/P = {num_experts}/{group.size} = {local} (this "
                             f"rank's share of the router's {num_experts})")
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or \
                not 1 <= top_k <= num_experts:
            raise ValueError(f"{where}: argument `top_k` must be an int in [1, "
                             f"{num_experts}], got {top_k!r}")
        if capacity_factor is not None and (
                isinstance(capacity_factor, bool)
                or not isinstance(capacity_factor, numbers.Real)
                or not capacity_factor > 0 or capacity_factor == float("inf")):
            raise ValueError(f"{where}: argument `capacity_factor` must be None or a "
                             f"positive finite number, got {capacity_factor!r}")
        self.router, self.experts, self.group = router, nn.ModuleList(experts), group
        self.dim, self.num_experts, self.local_experts = dim, num_experts, local
        self.top_k = int(top_k)
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.first_expert = group.rank * local
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
        self.dropped = 0
        self.sent_rows = self.received_rows = 0
        self._check_alike()

    @classmethod
    def from_dense(cls, moe: "MoE", group: Any) -> "MoE":
        """This rank's share of a one-process ``moe`` (``group=None``, all E experts): copies
        of its router and of experts ``r*E/P .. (r+1)*E/P - 1``, the same top_k and
        capacity_factor. A collective of ``group`` (the layer's construction is).

        Two ranks: ``MoE.from_dense(MoE(router, eight_experts, None), pg)`` holds experts
        0-3 on rank 0 and 4-7 on rank 1.
        """
        size = 1 if group is None else group.size
        rank = 0 if group is None else group.rank
        if not isinstance(moe, MoE) or moe.group.size != 1:
            got = (f"an MoE over {moe.group.size} ranks" if isinstance(moe, MoE)
                   else type(moe).__name__)
            raise TypeError(f"[rank {rank}/{size}] MoE.from_dense: argument `moe` must be a "
                            f"one-process MoE (group=None), got {got}")
        if moe.num_experts % size:
            raise ValueError(f"[rank {rank}/{size}] MoE.from_dense: the layer's "
                             f"E={moe.num_experts} experts are not divisible by the group "
                             f"size P={size}")
        share = moe.num_experts // size
        mine = [copy.deepcopy(e) for e in moe.experts[rank * share:(rank + 1) * share]]
        return cls(copy.deepcopy(moe.router), mine, group, top_k=moe.top_k,
                   capacity_factor=moe.capacity_factor)

    def _check_alike(self) -> None:
        """``ValueError`` on every rank unless every rank has the same layer (the sizes of
        every all_to_all depend on it)."""
        if self.group.size == 1:
            return
        mine = (self.dim, self.num_experts, self.top_k, self.capacity_factor)
        everyone = self.group.all_gather_object(mine)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise ValueError(f"{self._where}: the ranks' layers differ: (dim, E, top_k, "
                                 f"capacity_factor) is {everyone[0]} on rank 0 and {theirs} "
                                 f"on rank {rank}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{self._where}.forward: argument `x` must be a tensor of shape "
                             f"(tokens, {self.dim}), got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        P, L, E, k = self.group.size, self.local_experts, self.num_experts, self.top_k
        T = x.shape[0]
        logits = self.router(x)                                       # (T, E)
        experts, gates = top_k_gates(logits, k)                       # (T, k) each
        self.aux_loss = load_balancing_loss(logits, experts)
        keep = within_capacity(experts, gates, E, capacity_of(self.capacity_factor, T, k, E))

        # The kept (token, expert) pairs, grouped by expert (so by destination rank),
        # each expert's in token order.
        keep = keep.reshape(-1)
        chosen = experts.reshape(-1)[keep]
        order = torch.sort(chosen, stable=True).indices
        chosen = chosen[order]
        tokens = torch.arange(T).repeat_interleave(k)[keep][order]
        weights = gates.reshape(-1)[keep][order]                      # differentiable
        per_expert = torch.bincount(chosen, minlength=E)              # (E,)
        arriving = exchange_counts(per_expert.reshape(P, L), self.group)   # (P, L)
        send = per_expert.reshape(P, L).sum(1).tolist()
        receive = arriving.sum(1).tolist()

        rows = x.index_select(0, tokens)
        if torch.is_grad_enabled() and not rows.requires_grad:
            # Backward must run both exchanges on every rank, whatever needs a gradient
            # here: a leaf that wants one keeps this rank's dispatch in the graph.
            rows = rows.detach().requires_grad_()
        arrived = exchange_rows(rows, send, receive, self.group)      # dispatch
        regroup = expert_major(arriving)
        out = self._run_experts(arrived.index_select(0, regroup), arriving.sum(0).tolist())
        out = out.index_select(0, torch.argsort(regroup))             # back source-major
        back = exchange_rows(out, receive, send, self.group)          # combine

        self.tokens_per_expert = per_expert
        self.dropped = int(keep.numel() - chosen.numel())
        self.sent_rows, self.received_rows = len(tokens), int(sum(receive))
        y = back.new_zeros((T, back.shape[1]))
        return y.index_add(0, tokens, back * weights.unsqueeze(1).to(back.dtype))

    def _run_experts(self, rows: torch.Tensor, sizes: list) -> torch.Tensor:
        """Each local expert once, on its rows (``rows`` expert-major, ``sizes[j]`` rows of
        expert j; an expert with none runs on zero rows, so that every rank's graph has
        the same exchanges)."""
        outs = []
        for j, (expert, chunk) in enumerate(zip(self.experts, rows.split(sizes))):
            out = expert(chunk)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(chunk), self.dim):
                raise ValueError(f"{self._where}: expert {self.first_expert + j} (local "
                                 f"{j}) must map ({len(chunk)}, {self.dim}) to "
                                 f"({len(chunk)}, {self.dim}), got "
                                 f"{tuple(getattr(out, 'shape', ())) or type(out).__name__}")
            outs.append(out)
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, experts={self.first_expert}..."
                f"{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
                f"group_size={self.group.size}")


def _describe(obj: Any) -> str:
    if isinstance(obj, nn.Linear):
        return f"nn.Linear({obj.in_features}, {obj.out_features}, bias=True)"
    return type(obj).__name__
