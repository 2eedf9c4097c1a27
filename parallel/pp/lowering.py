"""Lowering: add to a compute schedule the messages between stages.

Where stage ``s`` and its neighbour live on different ranks (``s % P``), every forward
``sF m`` is followed by ``sSEND_F m`` (its output to stage s+1's rank) and every
backward ``sB m`` of a stage s > 0 by ``sSEND_B m`` (the gradient of its input to stage
s-1's rank). The receives go one compute action ahead of their consumer, so that a
runtime with non-blocking receives has the message in flight while it computes::

    >>> from parallel.pp.schedules import gpipe
    >>> [[str(a) for a in program] for program in lower(gpipe(2, 2), 2)]
    [['0F0', '0SEND_F0', '0RECV_B0', '0F1', '0SEND_F1', '0RECV_B1', '0B0', '0B1'],
     ['1RECV_F0', '1RECV_F1', '1F0', '1F1', '1B0', '1SEND_B0', '1B1', '1SEND_B1']]

Sends never wait for their
receiver (the runtime uses ``isend``), receives complete when the matching send was
issued: two neighbours that send to each other at once cannot deadlock. Idle steps
(``None``) are dropped: the lowered lists are programs, not time grids.

Messages between two ranks for one stage boundary and direction share a tag
(:func:`message_tag`) and match in order, as MPI and every backend here do; the checker
verifies that the n-th send on a channel carries the micro-batch of the n-th receive.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .actions import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, stage_rank

__all__ = ["TAG_BASE", "channel", "lower", "message_tag"]

#: Tags of the pipeline's messages start here (below MPI's smallest TAG_UB, 32767).
TAG_BASE = 1000


def message_tag(action: Action) -> int:
    """The tag of a send or receive: one per stage boundary and direction.

    ``message_tag(Action(0, "SEND_F", 5)) == message_tag(Action(1, "RECV_F", 5))``.
    """
    boundary = {SEND_F: action.stage, RECV_F: action.stage - 1,
                SEND_B: action.stage - 1, RECV_B: action.stage}[action.kind]
    return TAG_BASE + 2 * boundary + (action.kind in (SEND_B, RECV_B))


def channel(action: Action, num_ranks: int) -> tuple[int, int, int]:
    """``(source rank, destination rank, tag)`` of a send or receive."""
    peer_stage = {SEND_F: action.stage + 1, RECV_F: action.stage - 1,
                  SEND_B: action.stage - 1, RECV_B: action.stage + 1}[action.kind]
    me, peer = stage_rank(action.stage, num_ranks), stage_rank(peer_stage, num_ranks)
    src, dst = (me, peer) if action.kind in (SEND_F, SEND_B) else (peer, me)
    return src, dst, message_tag(action)


def _remote(stage: int, other: int, num_stages: int, num_ranks: int) -> bool:
    return 0 <= other < num_stages and stage_rank(stage, num_ranks) != stage_rank(
        other, num_ranks)


def lower(schedule: Sequence[Sequence[Optional[Action]]], num_stages: int) -> list[list[Action]]:
    """Each rank's program: its compute actions with the sends and receives added.

    Two ranks, one micro-batch: ``[0RECV_B0, 0F0, 0SEND_F0, 0B0]`` and
    ``[1RECV_F0, 1F0, 1B0, 1SEND_B0]``.
    """
    num_ranks = len(schedule)
    programs = []
    for row in schedule:
        compute = [a for a in row if a is not None and a.is_compute]
        program: list[Action] = []
        for i, action in enumerate(compute):
            s, m = action.stage, action.microbatch
            recv = None
            if action.kind == F and _remote(s, s - 1, num_stages, num_ranks):
                recv = Action(s, RECV_F, m)
            elif action.kind == B and _remote(s, s + 1, num_stages, num_ranks):
                recv = Action(s, RECV_B, m)
            if recv is not None:
                # Post it before the previous compute action (after that one's sends).
                at = len(program)
                if i > 0:
                    at = program.index(compute[i - 1])
                program.insert(at, recv)
            program.append(action)
            if action.kind == F and _remote(s, s + 1, num_stages, num_ranks):
                program.append(Action(s, SEND_F, m))
            elif action.kind == B and _remote(s, s - 1, num_stages, num_ranks):
                program.append(Action(s, SEND_B, m))
        programs.append(program)
    return programs
