"""A plain SGD with momentum for the equivalence tests of the strategies.

torch.optim.SGD(params, lr, momentum) in a few lines: the first torch optimizer a process
creates imports torch._dynamo, seconds per spawned rank on a small machine.
"""

from __future__ import annotations

import torch


class LightSGD:
    """``torch.optim.SGD(params, lr, momentum)`` for these tests."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.bufs: dict = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.bufs.get(p)
            if buf is None:
                buf = self.bufs[p] = p.grad.clone()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)
