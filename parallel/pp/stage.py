"""One pipeline stage: a module, where it sits in the pipeline, and the activations it
keeps between a micro-batch's forward and its backward.

The stage computes; it does not communicate (the schedule's runtime moves tensors
between ranks). Two ranks, two stages::

    stage = PipelineStage(layers_of_my_stage, pg, stage_index=pg.rank, num_stages=2)
    sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.cross_entropy)
    losses = sched.step(x if pg.rank == 0 else None, target=y if pg.rank == 1 else None)

Backward comes in two flavours. :meth:`backward` is one autograd pass: the gradient of
the stage's input (to send upstream) and of its parameters together. For zero-bubble
schedules :meth:`backward_input` computes the gradients of the activations only (the
input's, and, for an ``nn.Sequential``, those between its layers) and
:meth:`backward_weight` later the parameters', layer by layer from the activation
gradients B kept: B + W cost about one backward. (For a module that is not an
``nn.Sequential`` W walks the whole module's graph again.) The first stage's first
layer has no input gradient, so its B is the cheapest.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..arguments import check_group, check_module

__all__ = ["PipelineStage"]


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, computed by ``module`` on this rank of
    ``group``. Stage ``s`` lives on rank ``s % group.size``; with ``num_stages =
    group.size * V`` each rank holds V stages (interleaved schedules).

    Raises ``ValueError`` if ``stage_index`` does not belong on this rank.
    """

    def __init__(self, module: nn.Module, group: Any, stage_index: int, num_stages: int) -> None:
        check_module(module, "PipelineStage")
        check_group(group, "PipelineStage", ("rank", "size", "isend", "irecv"))
        where = f"[rank {group.rank}/{group.size}] PipelineStage"
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where}: `{name}` must be an int, got {value!r}")
        if num_stages < 1 or num_stages % group.size:
            raise ValueError(f"{where}: num_stages={num_stages} must be a positive multiple "
                             f"of the group size {group.size} (stage s lives on rank s % "
                             f"{group.size})")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"{where}: stage_index={stage_index} is outside [0, "
                             f"{num_stages})")
        if stage_index % group.size != group.rank:
            mine = list(range(group.rank, num_stages, group.size))
            raise ValueError(f"{where}: stage {stage_index} lives on rank "
                             f"{stage_index % group.size}; this rank holds stages {mine}")
        self.module, self.group = module, group
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}   # the loss / M on the last stage
        self._layers = list(module) if isinstance(module, nn.Sequential) else [module]
        self._boundaries: dict[int, list[torch.Tensor]] = {}   # each layer's output
        self._layer_grads: dict[int, list[Optional[torch.Tensor]]] = {}

    def __repr__(self) -> str:
        return (f"PipelineStage({self.stage_index}/{self.num_stages}, rank "
                f"{self.group.rank}, {type(self.module).__name__})")

    @property
    def held(self) -> int:
        """Micro-batches whose activations this stage holds now (forward done, backward or,
        split, weight gradient not yet)."""
        return len(self._outputs)

    def forward(self, m: int, x: torch.Tensor) -> torch.Tensor:
        """Run micro-batch ``m`` and keep what its backward needs; returns the output."""
        if not self.is_first:
            x = x.detach().requires_grad_(x.is_floating_point())
        self._inputs[m] = x
        boundaries, out = [], x
        for layer in self._layers:   # what self.module(x) does, keeping each output
            out = layer(out)
            boundaries.append(out)
        self._boundaries[m] = boundaries
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{self!r}: the module must return one tensor, got "
                            f"{type(out).__name__}")
        self._outputs[m] = out
        return out

    def set_loss(self, m: int, scaled_loss: torch.Tensor) -> None:
        """On the last stage: backward starts from ``scaled_loss`` instead of the output."""
        self._outputs[m] = scaled_loss

    def _grad_input(self, m: int) -> Optional[torch.Tensor]:
        x = self._inputs[m]
        return x.grad if not self.is_first and x.requires_grad else None

    def backward(self, m: int, grad_output: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """One backward pass of micro-batch ``m``: parameters' ``.grad`` accumulate; returns
        the gradient of the stage's input (None on the first stage)."""
        out = self._outputs.pop(m)
        del self._boundaries[m]
        if out.requires_grad:
            torch.autograd.backward(out, grad_output)
        grad = self._grad_input(m)
        del self._inputs[m]
        return grad

    def backward_input(self, m: int, grad_output: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """B of a zero-bubble schedule: the gradients of the stage's input and of every
        layer's output (kept for :meth:`backward_weight`), no parameter gradient. Returns
        the input's (None on the first stage)."""
        x, top, boundaries = self._inputs[m], self._outputs[m], self._boundaries[m]
        wanted = ([x] if not self.is_first and x.requires_grad else []) + boundaries
        targets = [t for t in wanted if t.requires_grad]
        grads: dict[int, Optional[torch.Tensor]] = {}
        if targets and top.requires_grad:
            found = torch.autograd.grad(top, targets, grad_output, retain_graph=True,
                                        allow_unused=True)
            grads = {id(t): g for t, g in zip(targets, found)}
        self._layer_grads[m] = [grads.get(id(b)) for b in boundaries]
        if self.is_first or not x.requires_grad:
            return None
        grad = grads.get(id(x))
        return torch.zeros_like(x) if grad is None else grad

    def backward_weight(self, m: int) -> None:
        """W of a zero-bubble schedule: each layer's parameter gradients, from the
        gradient of its output that :meth:`backward_input` kept."""
        self._outputs.pop(m)
        del self._inputs[m]
        boundaries, grads = self._boundaries.pop(m), self._layer_grads.pop(m)
        for layer, out, grad in zip(self._layers, boundaries, grads):
            params = [p for p in layer.parameters() if p.requires_grad]
            if params and grad is not None and out.requires_grad:
                torch.autograd.backward(out, grad, inputs=params, retain_graph=True)
