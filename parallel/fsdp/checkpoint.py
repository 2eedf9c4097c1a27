"""Sharded checkpoints: one file per rank, read back at any world size.

Each rank writes ``shard-RRRRR-of-NNNNN.pt`` into the folder: per unit its layout (the
parameters' keys, shapes, offsets, the unpadded length), its parameter shard, and the
optimizer's state for that shard. Optimizer tensors shaped like the shard (momentum,
Adam's moments) are sharded like it; the others (Adam's step count) are the same on every
rank and kept as they are. Rank 0 also writes the buffers and the optimizer's
hyperparameters.

Loading at M ranks: a unit's flat vector is the saving ranks' shards back to back; new
rank ``r`` needs ``[r * S', (r + 1) * S')`` of it (``S'`` the new shard size), which it
copies out of the old files that overlap that range; past the end, padding zeros. Files
are read with ``torch.load(weights_only=True)``: tensors and plain containers only.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

__all__ = ["load_sharded", "save_sharded"]

FORMAT = "parallel.fsdp.sharded/1"
_NAME = "shard-{rank:05d}-of-{world:05d}.pt"
_PATTERN = re.compile(r"shard-(\d{5})-of-(\d{5})\.pt$")


def _optimizer_index(fsdp: Any, optimizer: Any) -> dict[int, int]:
    """unit index -> the optimizer's index of that unit's shard."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = {id(p): i for i, p in enumerate(params)}
    out = {}
    for unit in fsdp.units:
        if id(unit.flat.shard) not in ids:
            raise ValueError(f"{fsdp._where}: the optimizer does not hold the shard of "
                             f"{unit.label}; build it on model.parameters()")
        out[unit.index] = ids[id(unit.flat.shard)]
    return out


def save_sharded(fsdp: Any, path: str, optimizer: Optional[Any] = None) -> None:
    """Two ranks: ``model.save_sharded("ckpt", opt)`` on both writes ``ckpt/shard-00000-of-
    00002.pt`` and ``ckpt/shard-00001-of-00002.pt``; all ranks return once both exist."""
    group, rank = fsdp.group, fsdp.group.rank
    index = _optimizer_index(fsdp, optimizer) if optimizer is not None else {}
    opt_state = optimizer.state_dict()["state"] if optimizer is not None else {}
    units = []
    for unit in fsdp.units:
        flat = unit.flat
        state = opt_state.get(index.get(unit.index), {})
        sharded = {k: v.detach().clone() for k, v in state.items()
                   if isinstance(v, torch.Tensor) and v.shape == flat.shard.shape}
        replicated = {k: v for k, v in state.items() if k not in sharded}
        units.append({
            "name": unit.name, "total": flat.total, "shard_numel": flat.shard_numel,
            "slots": [(s.name, list(s.shape), s.offset, s.numel) for s in flat.slots],
            "param": flat.shard.detach().clone(),
            "optim_sharded": sharded, "optim_replicated": replicated,
        })
    payload = {"format": FORMAT, "world_size": group.size, "rank": rank, "units": units}
    if rank == 0:
        payload["module_state"] = {k: v.detach().clone()
                                   for k, v in fsdp.module.state_dict().items()}
        if optimizer is not None:
            payload["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                       for g in optimizer.state_dict()["param_groups"]]
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, _NAME.format(rank=rank, world=group.size) + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, tmp[:-4])        # a reader never sees half a file
    group.barrier()


def _saved_world(fsdp: Any, path: str) -> int:
    if not os.path.isdir(path):
        raise ValueError(f"{fsdp._where}.load_sharded: {path!r} is not a folder")
    worlds = {int(m.group(2)) for f in os.listdir(path) if (m := _PATTERN.match(f))}
    if len(worlds) != 1:
        raise ValueError(f"{fsdp._where}.load_sharded: {path!r} holds "
                         f"{'no' if not worlds else 'mixed'} shard files (world sizes "
                         f"{sorted(worlds)})")
    return worlds.pop()


def _read(path: str, rank: int, world: int, cache: dict) -> dict:
    if rank not in cache:
        name = os.path.join(path, _NAME.format(rank=rank, world=world))
        if not os.path.exists(name):
            raise ValueError(f"load_sharded: {name!r} is missing (saved at {world} ranks)")
        cache[rank] = torch.load(name, weights_only=True)
    return cache[rank]


def _reshard(pieces: list[tuple[int, torch.Tensor]], old_shard: int, total: int,
             start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """``[start, stop)`` of the flat vector made of old shards ``(old rank, tensor)``."""
    out = torch.zeros(stop - start, dtype=like.dtype)
    for old_rank, t in pieces:
        lo, hi = max(start, old_rank * old_shard), min(stop, (old_rank + 1) * old_shard, total)
        if lo < hi:
            out[lo - start:hi - start] = t[lo - old_rank * old_shard:hi - old_rank * old_shard]
    return out


@torch.no_grad()
def load_sharded(fsdp: Any, path: str, optimizer: Optional[Any] = None) -> None:
    """Two ranks reading what four saved: each reads the two files that overlap its
    shards; ``opt`` gets the resharded momentum / moments and the saved hyperparameters."""
    world = _saved_world(fsdp, path)
    cache: dict = {}
    head = _read(path, 0, world, cache)
    if head.get("format") != FORMAT or len(head["units"]) != len(fsdp.units):
        raise ValueError(f"{fsdp._where}.load_sharded: {path!r} holds "
                         f"{len(head.get('units', []))} units in format "
                         f"{head.get('format')!r}; this model has {len(fsdp.units)} units")
    rank = fsdp.group.rank
    index = _optimizer_index(fsdp, optimizer) if optimizer is not None else {}
    new_state: dict = {}
    for unit, saved in zip(fsdp.units, head["units"]):
        flat = unit.flat
        layout = [(s.name, list(s.shape), s.offset, s.numel) for s in flat.slots]
        if [tuple(x) for x in saved["slots"]] != [tuple(x) for x in layout]:
            raise ValueError(f"{fsdp._where}.load_sharded: {unit.label} holds "
                             f"{flat.names()} in the model but {[s[0] for s in saved['slots']]} "
                             f"in {path!r}")
        old_shard = saved["shard_numel"]
        start, stop = flat.shard_range(rank)
        first, last = start // old_shard, min((stop - 1) // old_shard, world - 1)
        files = [(q, _read(path, q, world, cache)["units"][unit.index])
                 for q in range(first, last + 1)]
        flat.shard.copy_(_reshard([(q, u["param"]) for q, u in files], old_shard,
                                  flat.total, start, stop, flat.shard))
        if optimizer is None or not (saved["optim_sharded"] or saved["optim_replicated"]):
            continue
        state = dict(saved["optim_replicated"])
        for key, like in saved["optim_sharded"].items():
            state[key] = _reshard([(q, u["optim_sharded"][key]) for q, u in files],
                                  old_shard, flat.total, start, stop, like)
        new_state[index[unit.index]] = state
    fsdp.module.load_state_dict(head["module_state"])
    if optimizer is not None:
        sd = optimizer.state_dict()
        sd["state"] = new_state
        for group, saved in zip(sd["param_groups"], head.get("param_groups", [])):
            group.update(saved)
        optimizer.load_state_dict(sd)
