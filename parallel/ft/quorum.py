"""Deciding a quorum, as pure functions (no sockets, no clocks): who takes part in the
next step, in which order, whether the group must be re-formed, and who heals from whom.
:mod:`parallel.ft.coordinator` calls them with the requests of one round.

Two replicas, one of them new (``fresh``) and behind::

    plan = plan_quorum({"a": Ask(step=7, quorum_id=3), "b": Ask(step=0, fresh=True)},
                       previous=("a",), quorum_id=3)
    plan.members == ("a", "b"); plan.quorum_id == 4; plan.source == 0; plan.healers == (1,)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["Ask", "Plan", "plan_quorum"]


@dataclass(frozen=True)
class Ask:
    """One replica's request for the next step's quorum: its committed ``step``, the
    quorum its group was formed for (``quorum_id``; 0: none), whether its last step
    failed (``broken``: its group is suspect) and whether it never held the training
    state (``fresh``: a new process)."""

    step: int
    quorum_id: int = 0
    broken: bool = False
    fresh: bool = False


@dataclass(frozen=True)
class Plan:
    """The decided quorum: ``members`` (replica ids, rank order), ``quorum_id`` (the
    generation the group meets under), ``step`` (the step every member is at once
    healed), ``source`` (rank that sends its state; None when nobody heals) and
    ``healers`` (ranks that receive it)."""

    members: tuple[str, ...]
    quorum_id: int
    step: int
    source: Optional[int]
    healers: tuple[int, ...]


def member_order(asks: Mapping[str, Ask], previous: Sequence[str]) -> tuple[str, ...]:
    """Members of the last quorum first, in their order (ranks move as little as they
    can), then the others sorted by id (not by arrival: the same replicas get the same
    ranks whatever the timing)."""
    kept = [m for m in previous if m in asks]
    return tuple(kept + sorted(m for m in asks if m not in kept))


def plan_quorum(asks: Mapping[str, Ask], previous: Sequence[str], quorum_id: int) -> Plan:
    """The quorum of the replicas in ``asks``, given the last
    quorum's members ``previous`` and id ``quorum_id``.

    The id (and so the group) changes when the members changed, or any member's group
    was not formed for the current id, or any member's last step failed: a failed step
    usually means a dead or stopped peer, and a group with one is unusable. The source of
    healing is the first member at the highest step that holds state; every member
    behind it, or fresh, heals. With no member holding state (the first quorum), nobody
    heals: the replicas start from the same initialisation.
    """
    if not asks:
        raise ValueError("plan_quorum: no replica asked")
    members = member_order(asks, previous)
    same = (members == tuple(previous)
            and all(a.quorum_id == quorum_id and not a.broken for a in asks.values()))
    new_id = quorum_id if same and quorum_id > 0 else quorum_id + 1
    holders = [i for i, m in enumerate(members) if not asks[m].fresh]
    if not holders:
        return Plan(members, new_id, max(a.step for a in asks.values()), None, ())
    step = max(asks[members[i]].step for i in holders)
    source = next(i for i in holders if asks[members[i]].step == step)
    healers = tuple(i for i, m in enumerate(members)
                    if asks[m].fresh or asks[m].step < step)
    return Plan(members, new_id, step, source if healers else None, healers)
