"""Split an ``nn.Sequential`` into contiguous, balanced pipeline stages."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

__all__ = ["split_sequential"]


def _partition(costs: Sequence[float], parts: int) -> list[int]:
    """Boundaries of the split of ``costs`` into ``parts`` non-empty contiguous runs that
    minimises the largest run's sum (dynamic programme, O(parts * n^2): n is small)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum over splits of the first i into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def split_sequential(seq: nn.Sequential, num_stages: int,
                     costs: Optional[Sequence[float]] = None) -> list[nn.Sequential]:
    """Cut ``seq`` into ``num_stages`` contiguous ``nn.Sequential`` stages whose largest
    cost is as small as possible; the cost of a layer is its parameter count, or
    ``costs[i]`` if given. The stages share the layers (no copy).

    Two ranks: ``split_sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8,
    8), nn.ReLU()), 2)`` gives ``[Linear, ReLU]`` and ``[Linear, ReLU]``; rank r runs the
    r-th.
    """
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"pp.split_sequential: `seq` must be an nn.Sequential, got "
                        f"{type(seq).__name__}")
    layers = list(seq)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) \
            or not 1 <= num_stages <= len(layers):
        raise ValueError(f"pp.split_sequential: num_stages must be an int in [1, "
                         f"{len(layers)}] (the number of layers), got {num_stages!r}")
    if costs is None:
        costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    else:
        costs = list(costs)
        if len(costs) != len(layers) or any(
                isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 for c in costs):
            raise ValueError(f"pp.split_sequential: `costs` must hold {len(layers)} numbers "
                             f">= 0 (one per layer), got {costs!r}")
    bounds = _partition(costs, num_stages)
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
