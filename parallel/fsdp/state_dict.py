"""Full state dicts: the original module's keys, shapes and current values, on every rank.

``full_state_dict`` gathers each unit's float32 shards (one all_gather per unit) and cuts
the flat vector back into the original parameters; buffers and frozen parameters (which
are replicated) come from rank 0, broadcast, so every rank returns the same dict.
``load_full_state_dict`` needs no communication: every rank takes its own shard of the
flat vector built from the dict.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .wrap import broadcast_tensors

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(fsdp: Any) -> "OrderedDict[str, torch.Tensor]":
    """Two ranks: ``sd = model.full_state_dict()`` on both; ``sd["0.weight"]`` is the whole
    first weight, equal on both ranks, and ``nn.Linear(...).load_state_dict(sd)`` works."""
    group = fsdp.group
    values: dict[str, torch.Tensor] = {}
    for unit in fsdp.units:
        flat = unit.flat
        full = torch.empty(flat.padded, dtype=torch.float32)
        group.all_gather(full, flat.shard.detach())
        values.update(flat.unflatten(full))
    rest = {k: v.detach().clone() for k, v in fsdp.module.state_dict().items()}
    broadcast_tensors(group, [rest[k] for k in sorted(rest)])
    values.update(rest)
    missing = [k for k in fsdp._state_dict_keys if k not in values]
    if missing:
        raise RuntimeError(f"{fsdp._where}: full_state_dict lost the keys {missing}")
    return OrderedDict((k, values[k]) for k in fsdp._state_dict_keys)


@torch.no_grad()
def load_full_state_dict(fsdp: Any, sd: dict) -> None:
    """Load ``sd`` (the original module's keys; values may be any float dtype) into this
    rank's shards and the replicated buffers. Every rank passes the same dict."""
    if not isinstance(sd, dict):
        raise TypeError(f"{fsdp._where}.load_full_state_dict: argument `sd` must be a dict, "
                        f"got {type(sd).__name__}")
    expected = set(fsdp._state_dict_keys)
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"{fsdp._where}.load_full_state_dict: keys do not match the "
                         f"module's: missing {missing}, unexpected {unexpected}")
    rank = fsdp.group.rank
    for unit in fsdp.units:
        flat = unit.flat
        for slot in flat.slots:
            value = sd[slot.name]
            if not isinstance(value, torch.Tensor) or value.shape != slot.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(f"{fsdp._where}.load_full_state_dict: {slot.name!r} has "
                                 f"shape {got}, expected {tuple(slot.shape)}")
        start, stop = flat.shard_range(rank)
        flat.shard.copy_(flat.flatten(sd)[start:stop])  # bumps the version: regathered
    unit_keys = {k for unit in fsdp.units for k in unit.flat.names()}
    fsdp.module.load_state_dict({k: v for k, v in sd.items() if k not in unit_keys})
