"""Which unit to gather next, and the order every rank issues its collectives in.

All of a group's asynchronous operations run one after the other on the group's single
thread, in the order they were issued (``collectives/group.py``, ``_run``), and a
synchronous call issued while some are queued waits its turn. So a prefetch is simply an
``all_gather(..., async_op=True)`` issued before the current unit computes: it runs on the
group's thread while this thread computes. The price of that simplicity: every rank must
issue the same collectives in the same order, or the ranks pair different operations.
Hence the rules below, which depend only on what every rank sees alike (the units'
forward order, the same on every rank for the same model code):

Forward
    the order of the units' forward pre-hooks is recorded each step. Before unit ``k``
    computes, the unit after it in the *previous* step's order is gathered asynchronously
    (first step: the order of registration, a guess; a wrong guess only costs memory for
    a while). PyTorch's FSDP1 does the same ("forward_prefetch").
Backward
    the schedule is the reverse of this step's forward order. When unit ``k``'s backward
    is about to start (its outputs' gradients arrived), every unit up to ``k`` in the
    schedule is gathered if it has not been (one that some rank skips, because its
    outputs got no gradient there, is still gathered, so the ranks stay in step), then
    the next one is prefetched. At the end of backward the rest of the schedule is
    gathered too, for the same reason.
Gradients
    units reduce in schedule order, strictly (a ready unit waits for the ones before it),
    as DDP's buckets launch in bucket order, and the root's leftover parameters last.
    Where a reduction falls between the gathers follows autograd's execution order, the
    same on every rank for the same graph: so the ranks must also run the same backward
    structure (as with PyTorch's FSDP).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .unit import Unit

__all__ = ["BackwardPlan", "ForwardOrder"]


class ForwardOrder:
    """The units' forward order: this step's (being recorded) and the previous step's."""

    def __init__(self, registration: Sequence[Unit]) -> None:
        self.registration = list(registration)
        self.previous: Optional[list[Unit]] = None
        self.current: list[Unit] = []
        self._seen: set[int] = set()
        self._next = self._successors(self.registration)

    @staticmethod
    def _successors(order: list[Unit]) -> dict[int, Optional[Unit]]:
        return {u.index: (order[i + 1] if i + 1 < len(order) else None)
                for i, u in enumerate(order)}

    def record(self, unit: Unit) -> None:
        if unit.index not in self._seen:
            self._seen.add(unit.index)
            self.current.append(unit)

    def guess(self) -> list[Unit]:
        """The order this step is expected to follow."""
        return self.previous if self.previous is not None else self.registration

    def first(self) -> Optional[Unit]:
        order = self.guess()
        return order[0] if order else None

    def after(self, unit: Unit) -> Optional[Unit]:
        """The unit expected to run after ``unit`` (None: the last, or unknown)."""
        return self._next.get(unit.index)

    def end_step(self) -> None:
        """The backward pass ended: this step's order is the guess for the next one."""
        if self.current:
            self.previous = self.current
            self._next = self._successors(self.previous)
        self.current, self._seen = [], set()


class BackwardPlan:
    """One backward pass: the gather schedule with its cursor, and the reduce order."""

    def __init__(self, schedule: Sequence[Unit], reduce_order: Sequence[Unit], *,
                 prefetch: bool) -> None:
        self.schedule = list(schedule)
        self.position = {u.index: i for i, u in enumerate(self.schedule)}
        self.reduce_order = list(reduce_order)
        self.prefetch = prefetch
        self._gathered = 0          # schedule[:_gathered] have had their gather issued
        self._reduced = 0           # reduce_order[:_reduced] have been launched

    def _gather_through(self, stop: int) -> None:
        while self._gathered < min(stop, len(self.schedule)):
            unit = self.schedule[self._gathered]
            unit.unshard(async_op=True)
            unit.gathered_in_backward = True
            self._gathered += 1

    def start(self) -> None:
        """The pass begins (gradients reached the root's outputs): prefetch the first."""
        if self.prefetch:
            self._gather_through(1)

    def before_unit(self, unit: Unit) -> None:
        """Unit ``unit``'s backward is next: have it (and all before it) gathered, prefetch
        the one after, wait for it."""
        p = self.position.get(unit.index)
        if p is not None:
            self._gather_through(p + 1 + (1 if self.prefetch else 0))
        unit.wait_unshard(install=False)

    def finish_gathers(self) -> None:
        """End of the pass: the gathers the schedule still owes (see the module docstring)."""
        self._gather_through(len(self.schedule))

    def launch_ready(self) -> list[Unit]:
        """Launch the reductions whose units are ready, in order; returns those launched."""
        launched = []
        while (self._reduced < len(self.reduce_order)
               and self.reduce_order[self._reduced].grad_ready):
            unit = self.reduce_order[self._reduced]
            unit.launch_reduce()
            launched.append(unit)
            self._reduced += 1
        return launched

    def launch_rest(self) -> list[Unit]:
        """End of the pass: launch every reduction not launched yet (zeros where a unit got
        no gradient on this rank)."""
        rest = self.reduce_order[self._reduced:]
        for unit in rest:
            unit.launch_reduce()
        self._reduced = len(self.reduce_order)
        return rest
