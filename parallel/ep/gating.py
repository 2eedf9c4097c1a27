"""Routing tokens to experts: top-k gates, the capacity limit and the load-balancing loss.

Pure functions of one rank's router logits, no communication, so that each rule can be
read and tested alone. For ``T`` tokens and ``E`` experts:

- :func:`top_k_gates`: each token's ``k`` largest logits (ties go to the lower expert
  index) and the softmax over those ``k`` (Mixtral's rule: Jiang et al. 2024, arXiv
  2401.04088, section 2.1).
- :func:`capacity_of` and :func:`within_capacity`: an expert accepts at most
  ``ceil(c * T * k / E)`` of this rank's tokens; past that, the tokens with the lowest gate
  are dropped for that expert first (Switch Transformer's capacity, Fedus et al. 2021,
  arXiv 2101.03961, section 2.2; Megatron-Core drops by probability the same way).
- :func:`load_balancing_loss`: Switch Transformer's auxiliary loss ``E * sum_i f_i * P_i``
  (section 2.2, equation 4), ``f_i`` the share of this rank's (token, choice) pairs the
  router sent to expert ``i`` and ``P_i`` the mean router probability of expert ``i``.
  With top-k, ``f_i`` counts each of a token's ``k`` choices, so a perfectly even routing
  gives 1 for any ``k``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["capacity_of", "load_balancing_loss", "top_k_gates", "within_capacity"]


def top_k_gates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(experts, gates)``, both of shape (T, k): each token's ``k`` chosen experts, the
    largest logit first (equal logits: the lower expert index first), and the softmax of
    those ``k`` logits (differentiable through ``logits``).

    >>> top_k_gates(torch.tensor([[0.0, 2.0, 2.0]]), 2)[0]
    tensor([[1, 2]])
    """
    # A stable sort keeps equal logits in index order; torch.topk does not promise to.
    order = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices
    experts = order[:, :k]
    gates = torch.softmax(logits.gather(-1, experts), dim=-1)
    return experts, gates


def capacity_of(capacity_factor: Optional[float], tokens: int, k: int,
                num_experts: int) -> Optional[int]:
    """How many of a rank's ``tokens`` one expert accepts: ``ceil(c * T * k / E)``, or None
    (no limit) when ``capacity_factor`` is None.

    >>> capacity_of(1.0, 10, 2, 8), capacity_of(None, 10, 2, 8)
    (3, None)
    """
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * k / num_experts)


def within_capacity(experts: torch.Tensor, gates: torch.Tensor, num_experts: int,
                    capacity: Optional[int]) -> torch.Tensor:
    """A bool mask of shape (T, k): which (token, choice) pairs their expert accepts. Each
    expert keeps its ``capacity`` pairs of highest gate (equal gates: the earlier token
    first) and drops the rest; ``capacity`` None keeps every pair.

    Capacity 1, two tokens choosing expert 0 with gates 0.6 and 0.9: the first is dropped.

    >>> within_capacity(torch.tensor([[0], [0]]), torch.tensor([[0.6], [0.9]]), 2, 1)
    tensor([[False],
            [ True]])
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    flat_experts, flat_gates = experts.reshape(-1), gates.detach().reshape(-1)
    # Pairs are in token order; sort by gate (descending) and then, stably, by expert:
    # each expert's pairs come out highest gate first, equal gates in token order.
    by_gate = torch.sort(flat_gates, descending=True, stable=True).indices
    by_expert = by_gate[torch.sort(flat_experts[by_gate], stable=True).indices]
    counts = torch.bincount(flat_experts, minlength=num_experts)
    first_of_expert = torch.cumsum(counts, 0) - counts
    place = torch.arange(flat_experts.numel()) - first_of_expert[flat_experts[by_expert]]
    keep = torch.empty_like(flat_experts, dtype=torch.bool)
    keep[by_expert] = place < capacity
    return keep.reshape(experts.shape)


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over this rank's tokens: ``E * sum_i f_i * P_i``,
    ``f_i`` the share of the (token, choice) pairs routed to expert ``i`` (the router's
    choice, before any capacity limit; not differentiable) and ``P_i`` the mean softmax
    probability of expert ``i`` over all ``E`` logits (differentiable). 1 when both are
    uniform; 0 (with a zero gradient) for no tokens.

    >>> float(load_balancing_loss(torch.zeros(4, 2), torch.tensor([[0], [1], [0], [1]])))
    1.0
    """
    tokens, num_experts = logits.shape
    if tokens == 0:
        return logits.sum() * 0.0   # still a node of the router's graph
    probs = torch.softmax(logits, dim=-1).mean(0)                    # P_i, (E,)
    share = torch.bincount(experts.reshape(-1), minlength=num_experts).to(logits.dtype)
    share = share / experts.numel()                                  # f_i, (E,)
    return num_experts * (share * probs).sum()
