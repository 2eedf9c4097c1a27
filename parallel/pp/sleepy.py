"""A layer whose cost is a sleep, for measuring schedules against theory: a sleeping
thread does not compete for the cores, so the timings hold on a loaded machine.

``SleepyMul(t)`` computes ``x * w`` and sleeps ``t`` in its forward, ``t`` in the input
gradient and ``t`` in the weight gradient (each its own autograd node, so a zero-bubble
schedule's B and W split them). Two in a stage make that stage's costs, in units of 2t,
those of :func:`sleepy_costs`. Two ranks::

    stage = PipelineStage(nn.Sequential(SleepyMul(0.01), SleepyMul(0.01)), pg, pg.rank, 2)
    replay(sched.schedule, 2, sleepy_costs(split=False))     # what the run should take
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from .actions import B

__all__ = ["SleepyMul", "sleepy_costs"]


class _SleepInput(torch.autograd.Function):
    """x * w with the gradient of x only; forward and backward sleep ``t``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
        ctx.t = t
        ctx.save_for_backward(w)
        time.sleep(t)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        time.sleep(ctx.t)
        return grad * ctx.saved_tensors[0], None, None


class _SleepWeight(torch.autograd.Function):
    """x * w with the gradient of w only; its backward sleeps ``t``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
        ctx.t = t
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        time.sleep(ctx.t)
        return None, (grad * ctx.saved_tensors[0]).sum(0), None


class SleepyMul(nn.Module):
    """x * w (w: 4 ones) costing ``t`` forward, ``t`` for the input gradient and ``t``
    for the weight gradient; ``t`` may be changed between steps."""

    def __init__(self, t: float = 0.0) -> None:
        super().__init__()
        self.t, self.w = t, nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return (_SleepInput.apply(x, w.detach(), self.t)
                + _SleepWeight.apply(x.detach(), w, self.t) - (x * w).detach())


def sleepy_costs(split: bool) -> Callable[[Any], float]:
    """The costs of a stage of two :class:`SleepyMul`, in units of 2t: F 1; B 2 (B 1 and
    W 1 when ``split``); the first stage's first layer has no input gradient, so its B is
    1.5 (0.5 split)."""
    def cost(action: Any) -> float:
        if action.kind == B:
            return (1.0 if split else 2.0) - (0.5 if action.stage == 0 else 0.0)
        return 1.0
    return cost
