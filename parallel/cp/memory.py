"""How many bytes autograd keeps for backward: the measure of context parallelism's
memory claim (each rank keeps 1/C of dense attention's tensors plus per-row statistics).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["saved_tensor_bytes"]


def saved_tensor_bytes(fn: Callable[[], Any]) -> int:
    """The bytes of every tensor autograd saves for backward while ``fn()`` runs (counted
    by ``torch.autograd.graph.saved_tensors_hooks``; a tensor saved twice counts twice).

    On each of two ranks, for a sequence of 4096::

        dense = saved_tensor_bytes(lambda: F.scaled_dot_product_attention(q, k, v))
        mine = saved_tensor_bytes(lambda: ring_attention(q_r, k_r, v_r, pg))
        # mine <= dense / 2 + 4 * batch * heads * 2048   (one float32 per query row)
    """
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total
