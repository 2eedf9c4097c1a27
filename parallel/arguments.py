"""The argument checks every strategy makes first: a module, a group that has what
the strategy calls (any object with those methods will do: a ProcessGroup, a mesh's
sub-group, a user's wrapper around one), and replicas alike on every rank.

    check_module(module, "DDP")
    check_group(group, "DDP", ("rank", "size", "all_reduce"))
    check_same_replicas(group, module.named_parameters(), "[rank 0/2] DDP")
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from torch import nn


def check_module(module: Any, where: str) -> None:
    """``TypeError`` naming ``where`` unless ``module`` is a ``torch.nn.Module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: argument `module` must be a torch.nn.Module, got "
                        f"{type(module).__name__}")


def check_group(group: Any, where: str, needs: Sequence[str]) -> None:
    """``TypeError`` naming ``where`` and the first missing attribute unless ``group``
    has every one of ``needs``."""
    for attr in needs:
        if not hasattr(group, attr):
            raise TypeError(f"{where}: argument `group` must be a collectives.ProcessGroup "
                            f"(it has no `{attr}`), got {type(group).__name__}")


def check_same_replicas(group: Any, named_parameters: Iterable, where: str) -> None:
    """``ValueError`` on every rank unless every rank of ``group`` holds the same
    parameters (names, shapes, dtypes, ``requires_grad``): otherwise a broadcast or a
    bucket would silently pair different tensors. A collective (``all_gather_object``):
    everyone sees every signature, so everyone raises."""
    if group.size == 1:
        return
    mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named_parameters]
    everyone = group.all_gather_object(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next((f"{a} vs {b}" for a, b in zip(everyone[0], theirs) if a != b),
                        f"{len(everyone[0])} vs {len(theirs)} parameters")
            raise ValueError(f"{where}: the replicas differ: rank 0 and rank {rank} hold "
                             f"different parameters (first difference: {diff})")
