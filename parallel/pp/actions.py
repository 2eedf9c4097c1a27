"""The vocabulary of pipeline schedules: one :class:`Action` per thing a rank does.

A schedule is data: for each rank, the ordered list of its actions, ``None`` where the
rank idles (a bubble). Written the way torch.distributed.pipelining prints them::

    2F0      stage 2, forward of micro-batch 0
    1B3      stage 1, backward of micro-batch 3 (input and weight gradients, or, in a
             zero-bubble schedule, the input gradient only)
    1W3      stage 1, weight gradient of micro-batch 3 (zero-bubble schedules)
    1SEND_F3 stage 1 sends micro-batch 3's activation to stage 2's rank
    2RECV_F3 stage 2 receives it;  2SEND_B3 / 1RECV_B3: the gradient coming back

The compute kinds are what the schedule generators emit; the communication kinds are
added by :func:`parallel.pp.lowering.lower`. Stage ``s`` of ``P * V`` lives on rank
``s % P`` (:func:`stage_rank`): rank ``r`` holds stages ``r, r + P, ...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Action", "COMPUTE", "COMM", "Schedule", "F", "B", "W", "SEND_F", "RECV_F",
           "SEND_B", "RECV_B", "parse_action", "stage_rank"]

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)

#: A schedule: for each rank, its actions in order, ``None`` for an idle step.
Schedule = Sequence[Sequence[Optional["Action"]]]

_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``kind`` (F, B, W or a send/receive) of ``microbatch`` on
    ``stage``. ``str(Action(2, "F", 0)) == "2F0"``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + COMM:
            raise ValueError(f"pp.Action: kind must be one of {COMPUTE + COMM}, got "
                             f"{self.kind!r}")
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"pp.Action: {name} must be an int >= 0, got {value!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"


def parse_action(text: str) -> Optional[Action]:
    """``"2F0"`` -> ``Action(2, "F", 0)``; ``""``, ``"-"`` or ``"None"`` -> ``None``."""
    text = text.strip()
    if text in ("", "-", ".", "None"):
        return None
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(f"pp.parse_action: {text!r} is not an action like '2F0' or "
                         f"'1SEND_B3'")
    return Action(int(match.group(1)), match.group(2), int(match.group(3)))


def stage_rank(stage: int, num_ranks: int) -> int:
    """The rank holding ``stage`` when stages are dealt round-robin: ``stage % num_ranks``.

    With 2 ranks and 4 stages (interleaved, 2 per rank): stages 0, 2 on rank 0; 1, 3 on 1.
    """
    return stage % num_ranks
