"""Timelines: what a schedule would take with given costs, and how idle a run was.

A timeline is, per rank, a list of ``(action, start, end)``: measured
(:attr:`parallel.pp.PipelineSchedule.timeline`, seconds of ``time.time()``) or replayed
from a schedule with a cost per action (:func:`replay`). Two measures of waste:

- :func:`idle_fraction`: the share of all ranks' time spent idle;
- :func:`pipeline_bubble`: the share of the step the *busiest* rank spends idle, i.e.
  1 - (its compute) / (the step's span). This is the bubble of the papers: for GPipe
  and 1F1B with equal stages both are (P-1)/(M+P-1); they differ where ranks have
  unequal work (in ZB-H1 the first stage has no input gradient to compute, so its B is
  cheap and it idles more without slowing the step).

Two ranks, one micro-batch, backward twice the forward::

    >>> from parallel.pp import gpipe, pipeline_bubble, replay
    >>> replay(gpipe(2, 1), 2, lambda a: 1 + (a.kind == "B"))
    [[(Action('0F0'), 0.0, 1.0), (Action('0B0'), 4.0, 6.0)],
     [(Action('1F0'), 1.0, 2.0), (Action('1B0'), 2.0, 4.0)]]
    >>> pipeline_bubble(_)        # 1 - 3 / 6
    0.5
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from .actions import B, F, W, Action

__all__ = ["idle_fraction", "pipeline_bubble", "replay"]

Timelines = Sequence[Sequence[tuple]]


def replay(schedule: Sequence[Sequence[Optional[Action]]], num_stages: int,
           cost: Callable[[Action], float] = lambda a: 1.0) -> list[list[tuple]]:
    """The timeline a schedule's orders would have if each action took ``cost(action)``:
    per rank ``(action, start, end)``, each action starting as soon as the rank is free
    and its inputs exist. With unit costs it reproduces the grid. Compare it with a
    measured :attr:`parallel.pp.PipelineSchedule.timeline` (same form).
    """
    orders = [[a for a in row if a is not None] for row in schedule]
    end: dict[Action, float] = {}
    free = [0.0] * len(orders)
    out: list[list[tuple]] = [[] for _ in orders]
    position = [0] * len(orders)
    last = num_stages - 1
    while any(p < len(o) for p, o in zip(position, orders)):
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                s, m = a.stage, a.microbatch
                needs = [Action(s, F, m)] if a.kind == B else []
                if a.kind == F and s > 0:
                    needs.append(Action(s - 1, F, m))
                if a.kind == B and s < last:
                    needs.append(Action(s + 1, B, m))
                if a.kind == W:
                    needs.append(Action(s, B, m))
                if any(n not in end for n in needs):
                    break
                start = max([free[r]] + [end[n] for n in needs])
                end[a] = free[r] = start + cost(a)
                out[r].append((a, start, end[a]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("pp.replay: the orders deadlock")
    return out


def _span(timelines: Timelines) -> float:
    bars = [bar for line in timelines for bar in line]
    if not bars:
        return 0.0
    return max(e for _, _, e in bars) - min(s for _, s, _ in bars)


def idle_fraction(timelines: Timelines) -> float:
    """1 - (every rank's compute) / (ranks x the step's span); 0 for an empty step.

    ``idle_fraction(replay(gpipe(4, 8), 4)) == 3 / 11``.
    """
    span = _span(timelines)
    busy = sum(e - s for line in timelines for _, s, e in line)
    return 1.0 - busy / (span * len(timelines)) if span > 0 else 0.0


def pipeline_bubble(timelines: Timelines) -> float:
    """1 - (the busiest rank's compute) / (the step's span); 0 for an empty step.

    ``pipeline_bubble(replay(one_f_one_b(4, 8), 4)) == 3 / 11``.
    """
    span = _span(timelines)
    busiest = max((sum(e - s for _, s, e in line) for line in timelines), default=0.0)
    return 1.0 - busiest / span if span > 0 else 0.0
