"""The argument checks every strategy makes first: a module, and a group that has what
the strategy calls (any object with those methods will do: a ProcessGroup, a mesh's
sub-group, a user's wrapper around one).

    check_module(module, "DDP")
    check_group(group, "DDP", ("rank", "size", "all_reduce"))
"""

from __future__ import annotations

from typing import Any, Sequence

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
