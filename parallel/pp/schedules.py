"""Pipeline schedules as values: per-rank lists of actions, bubbles explicit.

Every generator returns ``schedule[rank][step]``: an :class:`~parallel.pp.actions.Action`
or ``None`` (idle), all ranks' lists equally long, laid out in unit time steps (each
action takes one step; an action starts only after what it depends on finished in an
earlier step, possibly on another rank). Two ranks, two micro-batches of GPipe::

    >>> from parallel.pp.picture import text_grid
    >>> print(text_grid(gpipe(2, 2)))
    rank 0 | 0F0  0F1   .    .   0B0  0B1
    rank 1 |  .   1F0  1F1  1B0  1B1   .

The generators fix the *order* of each rank's compute; :func:`timed` places that order
on the time grid, which is where the bubbles come from. With equal costs per action the
idle fraction of GPipe and 1F1B is (P-1)/(M+P-1) (Huang et al. 2019; Narayanan et al.
2021); interleaving V stages per rank divides the bubble by about V (Narayanan et al.,
arXiv 2104.04473); ZB-H1 splits the backward into the input gradient B, which the
previous stage waits for, and the weight gradient W, which nobody waits for, and fills
the bubbles with W (Qi et al., arXiv 2401.10241).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .actions import B, F, W, Action

__all__ = ["SCHEDULES", "bubble_fraction", "gpipe", "interleaved_1f1b", "one_f_one_b",
           "timed", "zb_h1"]


def _check_counts(name: str, num_ranks: int, n_microbatches: int) -> None:
    for arg, value in (("num_ranks", num_ranks), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pp.{name}: {arg} must be an int >= 1, got {value!r} (allowed: "
                             f"any num_ranks >= 1 and n_microbatches >= 1)")


def _ready(action: Action, done: dict, step: int, last: int) -> bool:
    """Has everything ``action`` needs finished before ``step``?"""
    def before(a: Action) -> bool:
        return done.get(a, step) < step

    s, m = action.stage, action.microbatch
    if action.kind == F:
        return s == 0 or before(Action(s - 1, F, m))
    if action.kind == B:
        return before(Action(s, F, m)) and (s == last or before(Action(s + 1, B, m)))
    return before(Action(s, B, m))  # W


def timed(orders: Sequence[Sequence[Action]], num_stages: int) -> list[list[Optional[Action]]]:
    """Place each rank's compute ``orders`` on the unit-step grid: at every step each rank
    runs its next action if its inputs were produced in an earlier step, else idles.

    Raises ``ValueError`` if the orders deadlock (every rank waits on another).
    """
    grid: list[list[Optional[Action]]] = [[] for _ in orders]
    position = [0] * len(orders)
    done: dict[Action, int] = {}
    step = 0
    while any(p < len(o) for p, o in zip(position, orders)):
        progressed = False
        for r, order in enumerate(orders):
            if position[r] < len(order) and _ready(order[position[r]], done, step,
                                                   num_stages - 1):
                done[order[position[r]]] = step
                grid[r].append(order[position[r]])
                position[r] += 1
                progressed = True
            else:
                grid[r].append(None)
        if not progressed:
            stuck = {r: str(o[p]) for r, (p, o) in enumerate(zip(position, orders))
                     if p < len(o)}
            raise ValueError(f"pp.timed: the orders deadlock at step {step}: every rank "
                             f"waits (next actions {stuck})")
        step += 1
    return grid


def gpipe(num_ranks: int, n_microbatches: int) -> list[list[Optional[Action]]]:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Holds all M micro-batches' activations at once. Any P >= 1, M >= 1.
    """
    _check_counts("gpipe", num_ranks, n_microbatches)
    ms = range(n_microbatches)
    return timed([[Action(r, F, m) for m in ms] + [Action(r, B, m) for m in ms]
                  for r in range(num_ranks)], num_ranks)


def one_f_one_b(num_ranks: int, n_microbatches: int) -> list[list[Optional[Action]]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r runs P-1-r warm-up forwards,
    then alternates one forward and one backward, then drains the backwards.

    Same bubble as GPipe, but rank r holds at most P-r micro-batches' activations instead
    of M. Any P >= 1, M >= 1.
    """
    _check_counts("one_f_one_b", num_ranks, n_microbatches)
    orders = []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, n_microbatches)
        order = [Action(r, F, m) for m in range(warmup)]
        for i in range(n_microbatches - warmup):
            order += [Action(r, F, warmup + i), Action(r, B, i)]
        order += [Action(r, B, m) for m in range(n_microbatches - warmup, n_microbatches)]
        orders.append(order)
    return timed(orders, num_ranks)


def _interleaved_sequence(num_ranks: int, n_microbatches: int, virtual: int,
                          rank: int, backward: bool) -> list[Action]:
    """Megatron's order of (stage, micro-batch) on ``rank``: micro-batches in groups of P;
    within a group, every micro-batch through the rank's first stage, then its second...
    (backwards: the last stage first)."""
    out = []
    for start in range(0, n_microbatches, num_ranks):
        group = range(start, min(start + num_ranks, n_microbatches))
        for v in range(virtual):
            chunk = virtual - 1 - v if backward else v
            out += [Action(chunk * num_ranks + rank, B if backward else F, m) for m in group]
    return out


def interleaved_1f1b(num_ranks: int, n_microbatches: int,
                     virtual_stages: int = 2) -> list[list[Optional[Action]]]:
    """Interleaved 1F1B (Narayanan et al. 2021, arXiv 2104.04473): ``virtual_stages`` V
    stages per rank, rank r holding stages r, r+P, ..., r+(V-1)P. Each stage is 1/V of
    the work, so the bubble shrinks by about V at the price of V times more messages.

    Rank r warms up with (P-1-r)*2 + (V-1)*P forwards (capped at M*V), then alternates.
    Allowed: M a multiple of P (Megatron's rule; other M leave a stage waiting on a
    micro-batch its neighbour holds back), any V >= 1.
    """
    _check_counts("interleaved_1f1b", num_ranks, n_microbatches)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) \
            or virtual_stages < 1:
        raise ValueError(f"pp.interleaved_1f1b: virtual_stages must be an int >= 1, got "
                         f"{virtual_stages!r}")
    if n_microbatches % num_ranks:
        raise ValueError(f"pp.interleaved_1f1b: n_microbatches={n_microbatches} is not a "
                         f"multiple of num_ranks={num_ranks}; allowed: n_microbatches in "
                         f"{num_ranks}, {2 * num_ranks}, {3 * num_ranks}, ...")
    total = n_microbatches * virtual_stages
    orders = []
    for r in range(num_ranks):
        fwd = _interleaved_sequence(num_ranks, n_microbatches, virtual_stages, r, False)
        bwd = _interleaved_sequence(num_ranks, n_microbatches, virtual_stages, r, True)
        warmup = min((num_ranks - 1 - r) * 2 + (virtual_stages - 1) * num_ranks, total)
        order = fwd[:warmup]
        for i in range(total - warmup):
            order += [fwd[warmup + i], bwd[i]]
        order += bwd[total - warmup:]
        orders.append(order)
    return timed(orders, num_ranks * virtual_stages)


def zb_h1(num_ranks: int, n_microbatches: int) -> list[list[Optional[Action]]]:
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): 1F1B with the backward split into B (the
    input gradient, on the critical path) and W (the weight gradient, wanted by nobody but
    the optimizer). Rank r keeps at most P-r micro-batches awaiting B, as 1F1B does, and
    at most P+2 awaiting W; at every step it runs a ready B first, else a forward if it
    may, else a deferred W. The W passes fill what were 1F1B's bubbles: with equal costs
    the idle share falls to about (P-1)/(3M+P-1). Any P >= 1, M >= 1.
    """
    _check_counts("zb_h1", num_ranks, n_microbatches)
    P, M = num_ranks, n_microbatches
    last = P - 1
    done: dict[Action, int] = {}
    grid: list[list[Optional[Action]]] = [[] for _ in range(P)]
    next_f, next_b, next_w = [0] * P, [0] * P, [0] * P
    step = 0
    while any(w < M for w in next_w):
        for r in range(P):
            candidates = []
            if next_b[r] < M:
                candidates.append(Action(r, B, next_b[r]))
            # 1F1B's bound on activations awaiting B, and two more micro-batches than P
            # awaiting W (what lets W fill the tail instead of the critical path).
            if next_f[r] < M and next_f[r] - next_b[r] < P - r \
                    and next_f[r] - next_w[r] < P + 2:
                candidates.append(Action(r, F, next_f[r]))
            if next_w[r] < next_b[r]:
                candidates.append(Action(r, W, next_w[r]))
            chosen = next((a for a in candidates if _ready(a, done, step, last)), None)
            grid[r].append(chosen)
            if chosen is not None:
                done[chosen] = step
                counter = {F: next_f, B: next_b, W: next_w}[chosen.kind]
                counter[r] += 1
        step += 1
    return grid


def bubble_fraction(schedule: Sequence[Sequence[Optional[Action]]]) -> float:
    """The idle share of the grid: idle steps over ranks x steps (unit costs).

    ``bubble_fraction(gpipe(4, 8)) == 3 / 11``, i.e. (P-1)/(M+P-1).
    """
    steps = max((len(row) for row in schedule), default=0)
    if steps == 0:
        return 0.0
    busy = sum(a is not None for row in schedule for a in row)
    return 1.0 - busy / (steps * len(schedule))


#: The generators by the names the example's ``--schedule`` uses.
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b,
             "zb": zb_h1}
