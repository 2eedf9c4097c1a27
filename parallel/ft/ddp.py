"""``FaultTolerantDDP``: data parallelism whose participants may change every step.

Each step trains on one *global* batch, the next ``global_batch`` samples of the epoch's
order (a permutation drawn from the seed and the epoch, the same on every replica);
the step's participants split it in rank order (:func:`split_batch`). The position in
the epoch is the number of *committed* steps (the manager's ``step``, which healing
copies too), so a step that is not committed is retried with the same samples, and a
change of participants only changes how a batch is split: no sample of an epoch is
lost or seen twice because of a failure.

The gradient is the mean over the global batch whatever the split: each replica's loss
is the *sum* over its samples divided by the global batch's size
(:meth:`FaultTolerantDDP.loss_scale`), and the gradients are summed over the
participants in one flat all_reduce, whose result is bitwise identical everywhere, so
the replicas stay bitwise equal.

Two replicas::

    ddp = FaultTolerantDDP(model, manager, dataset_size=60000, global_batch=64, seed=0)
    while ddp.epoch < epochs and manager.start_step():
        idx = ddp.local_indices()                  # this replica's part of the batch
        loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * ddp.loss_scale()
        loss.backward(); ddp.sync_gradients()
        if manager.should_commit(): opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .manager import Manager

__all__ = ["FaultTolerantDDP", "split_batch"]


def split_batch(indices: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous part of ``indices`` among ``size`` participants (the
    first ``len % size`` parts one longer).

    >>> split_batch(np.arange(5), 1, 2).tolist()
    [3, 4]
    """
    return np.array_split(indices, size)[rank]


class FaultTolerantDDP(torch.nn.Module):
    """``module`` trained by the participants of each step of ``manager`` (see the
    module docstring); ``dataset_size`` samples per epoch in batches of
    ``global_batch``, ordered by ``seed``."""

    def __init__(self, module: torch.nn.Module, manager: Manager, *, dataset_size: int,
                 global_batch: int, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(manager, Manager):
            raise TypeError(f"FaultTolerantDDP: argument `manager` must be a "
                            f"parallel.ft.Manager, got {type(manager).__name__}")
        for name, value in (("dataset_size", dataset_size), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FaultTolerantDDP: argument `{name}` must be an int >= 1, "
                                 f"got {value!r}")
        self.module, self.manager = module, manager
        self.dataset_size, self.global_batch, self.seed = dataset_size, global_batch, seed
        self.steps_per_epoch = -(-dataset_size // global_batch)
        self._orders: dict[int, np.ndarray] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def epoch(self) -> int:
        """The epoch of the next step (from the committed steps)."""
        return self.manager.step // self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order, the same on every replica."""
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
                self.dataset_size)}
        return self._orders[epoch]

    def global_indices(self) -> np.ndarray:
        """The samples of this step's global batch."""
        k = self.manager.step % self.steps_per_epoch
        return self.order(self.epoch)[k * self.global_batch:(k + 1) * self.global_batch]

    def local_indices(self) -> np.ndarray:
        """This replica's part of this step's global batch."""
        return split_batch(self.global_indices(), self.manager.rank, self.manager.size)

    def loss_scale(self) -> float:
        """Multiply the sum of this replica's per-sample losses by this, so that the
        summed gradients are the mean over the global batch."""
        return 1.0 / len(self.global_indices())

    def sync_gradients(self) -> bool:
        """Sum every parameter's gradient over the step's participants (one flat
        all_reduce); a no-op once the step failed. Returns whether it succeeded."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        if not self.manager.all_reduce(flat):
            return False
        offset = 0
        for p in params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        return True
