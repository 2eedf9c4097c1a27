"""Memory accounting for FSDP: what each rank holds, by category, in bytes.

The categories follow ZeRO's accounting (Rajbhandari et al. 2020, arXiv 1910.02054,
section 3): parameters, gradients and optimizer state, each either sharded (1/N of the
model per rank, plus padding) or whole. Full parameters are the gathered copies of the
units; they come and go during a step, so their peak since the last reset is kept too.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

__all__ = ["FullParamMeter", "optimizer_state_bytes", "tensor_bytes"]


class FullParamMeter:
    """Bytes of full (gathered) parameters held now, and the peak since :meth:`reset_peak`."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def sub(self, nbytes: int) -> None:
        self.held -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.held


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the (distinct) tensors, ``None`` ignored."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: Any, params: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors in ``optimizer.state`` for ``params`` (momentum, Adam moments,
    step counters)."""
    if optimizer is None:
        return 0
    state = getattr(optimizer, "state", None)
    if state is None:
        raise TypeError(f"FSDP.memory: argument `optimizer` has no `state` (got "
                        f"{type(optimizer).__name__}); pass a torch.optim.Optimizer")
    tensors = []
    for p in params:
        for value in state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
    return tensor_bytes(tensors)
