"""What the ranks of a :class:`~faults.world.FaultWorld` run in the regroup tests
(``tests/test_regroup.py``): shrink or grow the world a rank was SIGKILLed from, then
check collectives on the new group. Each returns a summary; errors travel as
``RemoteError``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from collectives import CollectiveError, GroupAborted
from collectives.group import ProcessGroup

ELEMENTS = 1 << 12


def check_collectives(group: ProcessGroup) -> dict[str, Any]:
    """all_reduce, broadcast from the last rank, all_gather and barrier on ``group``:
    what each produced, to compare with the closed forms."""
    t = np.full(ELEMENTS, group.rank + 1.0)
    group.all_reduce(t)
    b = np.full(3, float(group.rank), np.float32)
    group.broadcast(b, src=group.size - 1)
    out = np.empty(group.size, np.int64)
    group.all_gather(out, np.array([group.rank * 10], np.int64))
    group.barrier()
    return {"rank": group.rank, "size": group.size, "generation": group.generation,
            "sum": float(t[0]), "sum_uniform": bool((t == t[0]).all()),
            "broadcast": b.tolist(), "gathered": out.tolist()}


def old_group_state(old: ProcessGroup) -> str:
    """The type of error a call on the replaced group raises (it must be aborted)."""
    try:
        old.barrier()
    except CollectiveError as exc:
        return type(exc).__name__
    return "no error"


def shrink_and_check(group: ProcessGroup, exclude: list) -> dict[str, Any]:
    """``group.shrink(exclude)`` on a survivor, then collectives on the new group."""
    start = time.monotonic()
    small = group.shrink(exclude)
    shrink_s = time.monotonic() - start
    try:
        out = check_collectives(small)
    finally:
        small.close()
    out.update(shrink_s=shrink_s, old=old_group_state(group))
    return out


#: Groups a task keeps for the next task of the same worker (the worker lives on).
_KEPT: dict[str, ProcessGroup] = {}


def shrink_and_keep(group: ProcessGroup, exclude: list) -> dict[str, Any]:
    """Shrink without ``exclude`` and check; keep the new group for :func:`grow_kept`.
    Two tasks, not one: the test's round trip between them is the agreement outside the
    group that every member has returned from its last collective, which re-forming
    needs (it aborts the group, failing a peer's call still in flight)."""
    small = _KEPT["small"] = group.shrink(exclude)
    return check_collectives(small)


def grow_kept(group: ProcessGroup, world_size: int) -> dict[str, Any]:
    """Grow the kept group to ``world_size`` (new processes join with
    ``collectives.join_group(..., generation=2)``) and check."""
    small = _KEPT.pop("small")
    big = small.grow(world_size)
    try:
        out = check_collectives(big)
    finally:
        big.close()
    out["old"] = old_group_state(small)
    return out


def refused(group: ProcessGroup) -> dict[str, str]:
    """What ``shrink`` raises where the backend cannot re-form."""
    try:
        group.shrink([])
    except NotImplementedError as exc:
        return {"type": "NotImplementedError", "message": str(exc)}
    except GroupAborted as exc:
        return {"type": "GroupAborted", "message": str(exc)}
    return {"type": "none", "message": ""}
