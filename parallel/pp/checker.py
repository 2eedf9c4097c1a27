"""Prove a schedule valid without a model, or show where it goes wrong.

:func:`check_schedule` takes per-rank compute lists (a generator's output, or your own)
and checks, in order:

1. every entry is an :class:`Action` or ``None``, of a stage in ``[0, num_stages)`` and a
   micro-batch in ``[0, n_microbatches)``, on the rank that holds its stage (``s % P``);
2. one F and one B per (stage, micro-batch), and one W each too in a schedule whose
   backward is split (``split_backward``, by default: if any W appears);
3. on its rank, F before B before W of the same (stage, micro-batch);
4. (``timed=True``, the default) the grid's timing: each action starts in a later step
   than what it consumes (the previous stage's F, the next stage's B), so the bubbles
   drawn are the ones a unit-cost run would have;
5. the lowered program (:func:`parallel.pp.lowering.lower`): every send matched by the
   receive of the same micro-batch on its channel, every receive posted before its
   consumer, and :func:`simulate` running all ranks to the end without deadlock.

A failure raises :class:`ScheduleError` (a ``ValueError``) whose message holds the
rank-by-step grid with the offending action marked ``[like this]``::

    >>> from parallel.pp import check_schedule, one_f_one_b
    >>> bad = one_f_one_b(2, 2); bad[1][1], bad[1][2] = bad[1][2], bad[1][1]
    >>> check_schedule(bad, 2, 2)
    Traceback (most recent call last):
    parallel.pp.checker.ScheduleError: pp.check_schedule: rank 1 step 1: 1B0 comes before
    1F0 on its rank
    rank 0 | 0F0  0F1   .   0B0   .   0B1
    rank 1 |  .  [1B0] 1F0  1F1  1B1   .
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

from .actions import B, COMM, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, stage_rank
from .lowering import channel, lower
from .picture import text_grid

__all__ = ["ScheduleError", "check_schedule", "simulate"]


class ScheduleError(ValueError):
    """An invalid schedule: ``rank``, ``step`` and ``action`` say where, ``grid`` shows it."""

    def __init__(self, problem: str, grid: str, rank: Optional[int] = None,
                 step: Optional[int] = None, action: Optional[Action] = None) -> None:
        where = f"rank {rank} step {step}: " if rank is not None else ""
        super().__init__(f"pp.check_schedule: {where}{problem}\n{grid}")
        self.problem, self.grid, self.rank, self.step, self.action = (
            problem, grid, rank, step, action)


def _fail(schedule, problem: str, rank=None, step=None, action=None, also=()) -> None:
    mark = ([(rank, step)] if rank is not None else []) + list(also)
    raise ScheduleError(problem, text_grid(schedule, mark), rank, step, action)


def _check_entries(schedule, num_stages: int, n_microbatches: int) -> None:
    num_ranks = len(schedule)
    for r, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a is None:
                continue
            if not isinstance(a, Action):
                raise ScheduleError(f"entry {a!r} is neither an Action nor None",
                                    f"(rank {r}, step {i})", r, i)
            if a.kind in COMM:
                _fail(schedule, f"{a} is a communication action; pass the compute "
                                f"schedule (lowering adds the messages)", r, i, a)
            if a.stage >= num_stages or a.microbatch >= n_microbatches:
                _fail(schedule, f"{a} is outside {num_stages} stages x {n_microbatches} "
                                f"micro-batches", r, i, a)
            if stage_rank(a.stage, num_ranks) != r:
                _fail(schedule, f"{a} is on rank {r}, but stage {a.stage} lives on rank "
                                f"{stage_rank(a.stage, num_ranks)}", r, i, a)


def _check_once(schedule, num_stages: int, n_microbatches: int,
                split_backward: Optional[bool]) -> None:
    where: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a is None:
                continue
            if a in where:
                _fail(schedule, f"{a} appears twice (first at rank {where[a][0]} step "
                                f"{where[a][1]})", r, i, a, also=[where[a]])
            where[a] = (r, i)
    if split_backward is None:
        split_backward = any(a.kind == W for a in where)
    kinds = (F, B, W) if split_backward else (F, B)
    if not split_backward:
        extra = next((a for a in where if a.kind == W), None)
        if extra is not None:
            _fail(schedule, f"{extra}: a W in a schedule whose backward is not split",
                  *where[extra], extra)
    for s in range(num_stages):
        for m in range(n_microbatches):
            for kind in kinds:
                if Action(s, kind, m) not in where:
                    _fail(schedule, f"{Action(s, kind, m)} is missing (every (stage, "
                                    f"micro-batch) needs one of each of {', '.join(kinds)})")


def _check_order(schedule) -> None:
    for r, row in enumerate(schedule):
        seen: set[Action] = set()
        for i, a in enumerate(row):
            if a is None:
                continue
            before = {B: F, W: B}.get(a.kind)
            if before and Action(a.stage, before, a.microbatch) not in seen:
                _fail(schedule, f"{a} comes before {Action(a.stage, before, a.microbatch)} "
                                f"on its rank", r, i, a)
            seen.add(a)


def _check_timing(schedule, num_stages: int) -> None:
    step_of = {a: i for row in schedule for i, a in enumerate(row) if a is not None}
    for r, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a is None:
                continue
            needs = []
            if a.kind == F and a.stage > 0:
                needs.append(Action(a.stage - 1, F, a.microbatch))
            if a.kind == B and a.stage < num_stages - 1:
                needs.append(Action(a.stage + 1, B, a.microbatch))
            for need in needs:
                if step_of[need] >= i:
                    _fail(schedule, f"{a} starts at step {i}, but it needs {need}, which "
                                    f"runs at step {step_of[need]}", r, i, a)


def simulate(programs: Sequence[Sequence[Action]], num_stages: int) -> int:
    """Run lowered ``programs`` (one per rank) with the runtime's semantics and return the
    number of rounds it took: a send never blocks; a receive is posted, and the compute
    action that consumes it waits until the matching send was issued. Raises
    :class:`ScheduleError` on a receive whose send carries another micro-batch, a compute
    before its receive, or a deadlock (the grid shows where every rank is stuck).
    """
    num_ranks = len(programs)
    sent: dict[tuple, list[Action]] = defaultdict(list)       # channel -> sends so far
    posted: dict[tuple, int] = defaultdict(int)                # channel -> receives posted
    pending: list[dict[tuple[int, int, str], tuple]] = [{} for _ in programs]
    pc = [0] * num_ranks
    rounds = 0

    def expected_send(recv: Action) -> Action:
        kind = SEND_F if recv.kind == RECV_F else SEND_B
        return Action(recv.stage - 1 if kind == SEND_F else recv.stage + 1, kind,
                      recv.microbatch)

    while any(p < len(prog) for p, prog in zip(pc, programs)):
        progressed = False
        for r, prog in enumerate(programs):
            while pc[r] < len(prog):
                a = prog[pc[r]]
                if a.kind in (SEND_F, SEND_B):
                    sent[channel(a, num_ranks)].append(a)
                elif a.kind in (RECV_F, RECV_B):
                    ch = channel(a, num_ranks)
                    pending[r][(a.stage, a.microbatch, a.kind)] = (ch, posted[ch])
                    posted[ch] += 1
                else:
                    need = {F: RECV_F, B: RECV_B}.get(a.kind)
                    key = (a.stage, a.microbatch, need)
                    remote = need is not None and (
                        (a.kind == F and a.stage > 0 and stage_rank(a.stage - 1, num_ranks) != r)
                        or (a.kind == B and a.stage < num_stages - 1
                            and stage_rank(a.stage + 1, num_ranks) != r))
                    if remote:
                        if key not in pending[r]:
                            _stuck(programs, f"{a} runs before its {need} was posted",
                                   r, pc[r], a)
                        ch, ticket = pending[r][key]
                        if ticket >= len(sent[ch]):
                            break  # blocked: the message was not sent yet
                        match = sent[ch][ticket]
                        want = expected_send(Action(a.stage, need, a.microbatch))
                        if match != want:
                            _stuck(programs, f"{a}'s receive is matched by {match} (the "
                                             f"sends on channel {ch[:2]} come in another "
                                             f"order than the receives)", r, pc[r], a)
                        del pending[r][key]
                pc[r] += 1
                progressed = True
        rounds += 1
        if not progressed:
            stuck = [(r, p) for r, (p, prog) in enumerate(zip(pc, programs)) if p < len(prog)]
            names = ", ".join(f"rank {r} at {programs[r][p]}" for r, p in stuck)
            _stuck(programs, f"deadlock: every unfinished rank waits for a message never "
                             f"sent ({names})", *stuck[0], programs[stuck[0][0]][stuck[0][1]],
                   also=stuck)
    unmatched = {ch: len(s) - posted[ch] for ch, s in sent.items() if len(s) != posted[ch]}
    if unmatched:
        _stuck(programs, f"sends without their receive on channels (src, dst, tag) "
                         f"{sorted(unmatched)}")
    return rounds


def _stuck(programs, problem: str, rank=None, index=None, action=None, also=()) -> None:
    mark = ([(rank, index)] if rank is not None else []) + list(also)
    raise ScheduleError(problem, text_grid(programs, mark), rank, index, action)


def check_schedule(schedule: Sequence[Sequence[Optional[Action]]], num_stages: int,
                   n_microbatches: int, *, timed: bool = True,
                   split_backward: Optional[bool] = None) -> list[list[Action]]:
    """Validate ``schedule`` (see the module docstring) and return its lowered programs.
    ``split_backward``: whether every (stage, micro-batch) needs a W; by default, whether
    any W appears.

    Two ranks: ``check_schedule(one_f_one_b(2, 4), 2, 4)`` passes; drop an action, swap
    a B before its F, or duplicate one, and it raises :class:`ScheduleError`.
    """
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise TypeError(f"pp.check_schedule: schedule must be a non-empty list of per-rank "
                        f"lists, got {type(schedule).__name__}")
    for name, value in (("num_stages", num_stages), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pp.check_schedule: {name} must be an int >= 1, got {value!r}")
    if num_stages % len(schedule):
        raise ValueError(f"pp.check_schedule: num_stages={num_stages} is not a multiple of "
                         f"the {len(schedule)} ranks")
    _check_entries(schedule, num_stages, n_microbatches)
    _check_once(schedule, num_stages, n_microbatches, split_backward)
    _check_order(schedule)
    if timed:
        _check_timing(schedule, num_stages)
    programs = lower(schedule, num_stages)
    simulate(programs, num_stages)
    return programs
