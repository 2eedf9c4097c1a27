"""A unit's flat parameter: its parameters back to back, padded, cut into equal shards.

Two pieces, kept apart as in ``parallel/bucket.py``:

- :func:`shard_layout`, a pure function: how ``total`` elements split over ``world``
  ranks (shard size, padding, each rank's range). A property test hits it directly.
- :class:`FlatParam`: one unit's parameters. It records where each original parameter
  lives (module, attribute, shape, offset into the flat vector), holds this rank's shard as
  an ``nn.Parameter`` (the float32 master copy the optimizer steps) and the full, gathered
  flat vector while a unit computes.

The full flat vector is an autograd leaf whose slices become the module's attributes
(``linear.weight`` is a view into it). Autograd then sums every view's gradient into the
leaf's ``.grad``: one flat gradient per unit, ready to reduce-scatter. Freeing the full
parameters after a forward shrinks the leaf's storage to 0 bytes; gathering again in
backward re-grows the same storage, so the views autograd saved for backward see the
gathered values again (what FSDP2 does with ``untyped_storage().resize_``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["FlatParam", "ParamSlot", "host_alias", "shard_layout"]


def shard_layout(total: int, world: int) -> tuple[int, int]:
    """Split ``total`` elements into ``world`` equal shards: returns ``(shard_numel,
    padding)``; rank ``r`` owns the flat range ``[r * shard_numel, (r + 1) * shard_numel)``
    of the vector padded with ``padding`` zeros at its end (``padding < world``).

    >>> shard_layout(10, 4)     # 4 shards of 3, the last holds 1 element and 2 of padding
    (3, 2)
    >>> shard_layout(8, 2)
    (4, 0)
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"shard_layout: argument `total` must be a non-negative int, got "
                         f"{total!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"shard_layout: argument `world` must be a positive int, got "
                         f"{world!r}")
    shard = -(-total // world)
    return shard, shard * world - total


def host_alias(t: torch.Tensor) -> np.ndarray:
    """A numpy array over ``t``'s memory, as integers of ``t``'s element size.

    ``Tensor.numpy()`` would mark the storage as not resizable, and the full parameters
    are freed by resizing their storage (see the module docstring). An all-gather only
    moves bytes, so integers of the right width carry any dtype (bfloat16 included). The
    caller keeps ``t`` alive and does not resize it while the array is in use.
    """
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("host_alias: needs a contiguous CPU tensor")
    width = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[t.element_size()]
    if t.numel() == 0:
        return np.empty(0, dtype=width)
    buf = (ctypes.c_uint8 * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return np.frombuffer(buf, dtype=width)


@dataclass
class ParamSlot:
    """Where one original parameter lives: ``getattr(owners[0][0], owners[0][1])``, and its
    slice ``[offset, offset + numel)`` of the flat vector. A parameter shared by several
    modules of one unit has several owners."""

    name: str                                  # the state-dict key, e.g. "0.weight"
    owners: list                               # [(module, attribute name), ...]
    shape: torch.Size
    offset: int
    numel: int
    aliases: list                              # the other owners' state-dict keys


class FlatParam:
    """One unit's parameters, flattened and sharded over ``world`` ranks.

    Two ranks, a unit holding ``nn.Linear(3, 2)`` (8 elements)::

        flat = FlatParam([("weight", lin, "weight", lin.weight), ("bias", ...)], rank, 2)
        flat.shard          # nn.Parameter of 4 elements: rank 0 [w00..w03], rank 1 [w10..b1]
        flat.full           # the gathered 8 elements (a leaf; 0 bytes while freed)
    """

    def __init__(self, entries: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
                 rank: int, world: int, *, compute_dtype: torch.dtype, where: str) -> None:
        if not entries:
            raise ValueError(f"{where}: a unit needs at least one parameter")
        devices = {p.device.type for *_, p in entries}
        if devices != {"cpu"}:
            raise ValueError(f"{where}: parameters must be on the CPU (the gathered copies "
                             f"are freed by resizing host storage); got {sorted(devices)}")
        dtypes = {p.dtype for *_, p in entries}
        if len(dtypes) != 1 or torch.float32 not in dtypes:
            raise TypeError(f"{where}: every parameter of a unit must be float32 (the "
                            f"sharded master copy); got {sorted(str(d) for d in dtypes)}")
        self.where, self.rank, self.world = where, rank, world
        self.slots: list[ParamSlot] = []
        by_id: dict[int, ParamSlot] = {}
        offset = 0
        for name, module, attr, p in entries:
            slot = by_id.get(id(p))
            if slot is not None:           # one parameter under two names (weight tying)
                slot.owners.append((module, attr))
                slot.aliases.append(name)
                continue
            slot = ParamSlot(name, [(module, attr)], p.shape, offset, p.numel(), [])
            by_id[id(p)] = slot
            self.slots.append(slot)
            offset += p.numel()
        self.total = offset
        self.shard_numel, self.padding = shard_layout(self.total, world)
        self.padded = self.shard_numel * world
        start = rank * self.shard_numel
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self._originals(entries)]
                             + [torch.zeros(self.padding)])
            self.shard = nn.Parameter(flat[start:start + self.shard_numel].clone())
        self.compute_dtype = compute_dtype
        # The full vector: an autograd leaf, allocated only while gathered.
        self.full = torch.empty(self.padded, dtype=compute_dtype, requires_grad=True)
        self.full_bytes = self.padded * self.full.element_size()
        self.full.untyped_storage().resize_(0)

    @staticmethod
    def _originals(entries: Sequence[tuple]) -> list:
        seen, out = set(), []
        for *_, p in entries:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    # ---------------------------------------------------------------- the full copy
    @property
    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        if not self.allocated:
            self.full.untyped_storage().resize_(self.full_bytes)

    def free(self) -> None:
        """Drop the full copy's memory, and point the modules at empty placeholders (a
        view of freed storage would crash whoever reads it)."""
        if self.allocated:
            self.full.untyped_storage().resize_(0)
        self.install_placeholders()

    def install_placeholders(self) -> None:
        empty = torch.empty(0, dtype=self.compute_dtype)
        for slot in self.slots:
            for module, attr in slot.owners:
                setattr(module, attr, empty)

    def install_views(self) -> None:
        """Make every original parameter a view into the full copy. In grad mode the
        views are differentiable: their gradients land, summed, in ``full.grad``."""
        for slot in self.slots:
            view = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
            for module, attr in slot.owners:
                setattr(module, attr, view)

    def gather_input(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, as the all_gather's input."""
        shard = self.shard.detach()
        return shard if shard.dtype == self.compute_dtype else shard.to(self.compute_dtype)

    # ---------------------------------------------------------------- full values
    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter's values (state-dict key -> tensor, tied names included) from
        a full flat vector."""
        out = {}
        for s in self.slots:
            for name in [s.name] + s.aliases:
                out[name] = flat[s.offset:s.offset + s.numel].view(s.shape)
        return out

    def flatten(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The padded flat vector (float32) from state-dict values keyed like ``slots``."""
        parts = [values[s.name].detach().reshape(-1).to(torch.float32) for s in self.slots]
        return torch.cat(parts + [torch.zeros(self.padding)])

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s range of the padded flat vector."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def names(self) -> list[str]:
        """Every state-dict key this flat parameter stands for."""
        return [name for s in self.slots for name in [s.name] + s.aliases]


def detach_parameters(entries: Sequence[tuple[str, nn.Module, str, Any]]) -> None:
    """Remove the original parameters from their modules (the views replace them)."""
    for _, module, attr, _ in entries:
        if attr in module._parameters:
            del module._parameters[attr]
