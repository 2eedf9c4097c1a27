"""Which samples each data-parallel rank sees."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch.utils.data

__all__ = ["ShardSampler"]


class ShardSampler(torch.utils.data.Sampler[int]):
    """Deal a dataset's indices out to ``world_size`` ranks, a different order each epoch.

    Every rank draws the same permutation (from ``seed`` and the epoch, no communication)
    and keeps every ``world_size``-th index starting at ``rank``: the shards are disjoint
    and together hold the dataset. All shards have the same length, because DDP needs the
    ranks to take equally many steps:

    - ``drop_last=False`` (default): the permutation is padded by wrapping around to a
      multiple of ``world_size``, so up to ``world_size - 1`` samples appear twice in an
      epoch (as with ``torch.utils.data.DistributedSampler``);
    - ``drop_last=True``: the permutation's tail is cut instead, so up to
      ``world_size - 1`` samples are left out of the epoch (different ones each epoch).

    Call :meth:`set_epoch` at the start of every epoch, or every epoch repeats the first
    one's order. The permutation comes from ``numpy.random.default_rng([seed, epoch])``:
    the pair feeds a ``SeedSequence``, so ``(seed=0, epoch=1)`` and ``(seed=1, epoch=0)``
    give unrelated orders (``seed + epoch`` would make them equal).

    >>> [list(ShardSampler(5, r, 2, shuffle=False)) for r in range(2)]
    [[0, 2, 4], [1, 3, 0]]

    It is a ``torch.utils.data.Sampler``: give it to a ``DataLoader(sampler=...)`` or a
    ``BatchSampler``.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        for name, value, low in (("dataset_len", dataset_len, 0), ("world_size", world_size, 1),
                                 ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"ShardSampler: argument `{name}` must be an int >= {low}, "
                                 f"got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                or not 0 <= rank < world_size:
            raise ValueError(f"ShardSampler: argument `rank`={rank!r} is not a rank of a "
                             f"world of {world_size} (0..{world_size - 1})")
        self.dataset_len = int(dataset_len)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last:
            self.num_samples = self.dataset_len // self.world_size
        else:
            self.num_samples = -(-self.dataset_len // self.world_size)  # ceil
        #: Indices dealt out per epoch over all ranks: ``num_samples * world_size``.
        self.total_size = self.num_samples * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order :meth:`__iter__` yields (the same on every rank)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"ShardSampler.set_epoch: `epoch` must be an int >= 0, got "
                             f"{epoch!r}")
        self.epoch = int(epoch)

    def epoch_order(self) -> np.ndarray:
        """The whole epoch's order over all ranks (before dealing), padded or cut to
        ``total_size``; rank ``r`` gets ``epoch_order()[r::world_size]``."""
        n = self.dataset_len
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        if self.total_size <= n:
            return order[:self.total_size]
        return np.resize(order, self.total_size)  # repeats `order` from its start

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order()[self.rank::self.world_size].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"ShardSampler(dataset_len={self.dataset_len}, rank={self.rank}, "
                f"world_size={self.world_size}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")
