"""Finding the units: which submodules ``wrap`` matches, and which parameters each owns.

A parameter belongs to the innermost matched module above it; what no matched module
claims belongs to the root unit. Parameters that do not train (``requires_grad=False``)
are not sharded: they stay in their modules, replicated, like buffers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["as_predicate", "assign_parameters", "broadcast_tensors"]

Entry = tuple  # (state-dict key, owning module, attribute, parameter)


def as_predicate(wrap: Any) -> Optional[Callable[[nn.Module], bool]]:
    """``wrap`` (None, a module class, a tuple of classes, or ``module -> bool``) as a
    predicate, or a TypeError naming the argument."""
    if wrap is None:
        return None
    if isinstance(wrap, type) and issubclass(wrap, nn.Module):
        return lambda m: isinstance(m, wrap)
    if isinstance(wrap, tuple) and wrap and all(isinstance(c, type) and issubclass(c, nn.Module)
                                                 for c in wrap):
        return lambda m: isinstance(m, wrap)
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    raise TypeError(f"FSDP: argument `wrap` must be None, an nn.Module class, a tuple of "
                    f"them, or a predicate module -> bool; got {wrap!r}")


def assign_parameters(root: nn.Module, predicate: Optional[Callable[[nn.Module], bool]],
                      where: str) -> tuple[list[tuple[str, nn.Module, list[Entry]]], list]:
    """The units, in order of registration: ``[(qualified name, module, entries), ...]``,
    the root's own first (name ``""``; dropped later if it owns nothing); and the frozen
    parameters' keys. Each entry is ``(state-dict key, module, attribute, parameter)``."""
    units: dict[int, tuple[str, nn.Module, list[Entry]]] = {id(root): ("", root, [])}
    order = [id(root)]
    owner_of: dict[int, str] = {}          # parameter id -> unit name (sharing check)
    frozen: list[str] = []
    visited: set[int] = set()

    def visit(module: nn.Module, prefix: str, owner: int) -> None:
        if id(module) in visited:
            return  # a module used twice: its parameters were assigned the first time
        visited.add(id(module))
        if module is not root and predicate is not None and predicate(module):
            owner = id(module)
            units[owner] = (prefix.rstrip("."), module, [])
            order.append(owner)
        for attr, p in module._parameters.items():
            if p is None:
                continue
            key = prefix + attr
            if not p.requires_grad:
                frozen.append(key)
                continue
            unit_name = units[owner][0]
            seen = owner_of.get(id(p))
            if seen is not None and seen != unit_name:
                raise ValueError(f"{where}: parameter {key!r} is shared between unit "
                                 f"{seen or '(root)'!r} and unit {unit_name or '(root)'!r}; "
                                 f"a shared parameter must belong to one unit (wrap a module "
                                 f"above both)")
            owner_of[id(p)] = unit_name
            units[owner][2].append((key, module, attr, p))
        for name, child in module._modules.items():
            if child is not None:
                visit(child, prefix + name + ".", owner)

    visit(root, "", id(root))
    return [units[i] for i in order], frozen


@torch.no_grad()
def broadcast_tensors(group: Any, tensors: list) -> None:
    """Copy rank 0's values into ``tensors`` on every rank, one flat message per dtype."""
    if group.size == 1 or not tensors:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):       # the same order on every rank
        chunk = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        group.broadcast(flat, src=0)
        if group.rank != 0:
            offset = 0
            for t in chunk:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
