"""What :func:`check_backend` and :func:`check_algorithm` say: progress on the
``collectives.testing`` logger, and a :class:`CheckReport` of what passed.

A check runs for a minute or more. Each world it checks is logged at info when it starts
and when it passed (how many cases, how long), so ``COLLECTIVES_LOG_LEVEL=info`` (or the
application's own logging at info) shows what the check is doing; the report the check
returns says, in one line, what passed::

    report = check_backend("shm", world_sizes=(1, 2), max_examples=20)
    print(report)   # backend 'shm': 40 cases passed on shm at 1, 2 ranks in 6.1 s
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from collectives import logs

__all__ = ["CheckReport", "Progress"]

_log = logs.get_logger("testing")


@dataclass(frozen=True)
class WorldResult:
    """One world of a check: the backend, its size, the cases that passed, the seconds."""

    backend: str
    world_size: int
    cases: int
    seconds: float


@dataclass(frozen=True)
class CheckReport:
    """What a check checked, all of it passed (a failure raises ``AssertionError``
    instead): ``subject`` (``"backend 'shm'"``, ``"my_all_reduce as all_reduce"``) and
    one :class:`WorldResult` per backend and world size. ``str(report)`` is one line.

    >>> r = CheckReport("backend 'shm'", (WorldResult("shm", 1, 5, 0.5),
    ...                                   WorldResult("shm", 2, 5, 1.0)))
    >>> print(r)
    backend 'shm': 10 cases passed on shm at 1, 2 ranks in 1.5 s
    """

    subject: str
    worlds: tuple[WorldResult, ...] = field(default_factory=tuple)

    @property
    def cases(self) -> int:
        """Cases that passed, over every world."""
        return sum(w.cases for w in self.worlds)

    @property
    def seconds(self) -> float:
        """Seconds the worlds took, start-up included."""
        return sum(w.seconds for w in self.worlds)

    def __str__(self) -> str:
        backends: dict[str, list[int]] = {}
        for w in self.worlds:
            backends.setdefault(w.backend, []).append(w.world_size)
        where = "; ".join(f"{b} at {', '.join(map(str, sizes))} ranks"
                          for b, sizes in backends.items())
        return f"{self.subject}: {self.cases} cases passed on {where} in {self.seconds:.1f} s"


class Progress:
    """The log of one check: :meth:`world` around each world, :meth:`report` at the end."""

    def __init__(self, subject: str, plan: str) -> None:
        self.subject = subject
        self.worlds: list[WorldResult] = []
        _log.info("checking %s: %s", subject, plan)

    def world(self, backend: str, world_size: int) -> "WorldProgress":
        """Context of one world; count its cases with :meth:`WorldProgress.case`."""
        return WorldProgress(self, backend, world_size)

    def report(self) -> CheckReport:
        """The report of everything that passed, also logged at info."""
        done = CheckReport(self.subject, tuple(self.worlds))
        _log.info("%s", done)
        return done


class WorldProgress:
    """One world of a check: logs its start and, when it passed, its cases and time."""

    def __init__(self, check: Progress, backend: str, world_size: int) -> None:
        self.check, self.backend, self.world_size = check, backend, world_size
        self.cases = 0
        self.start = 0.0

    def case(self) -> None:
        """One case ran (hypothesis calls the test once per case)."""
        self.cases += 1

    def __enter__(self) -> "WorldProgress":
        self.start = time.monotonic()
        _log.info("%s: starting %d ranks on %s", self.check.subject, self.world_size,
                  self.backend)
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        seconds = time.monotonic() - self.start
        if exc_type is None:
            self.check.worlds.append(WorldResult(self.backend, self.world_size, self.cases,
                                                 seconds))
            _log.info("%s: %d cases passed on %s at %d ranks in %.1f s", self.check.subject,
                      self.cases, self.backend, self.world_size, seconds)
        else:
            _log.info("%s: failed on %s at %d ranks (%d cases tried, shrinking included)",
                      self.check.subject,
                      self.backend, self.world_size, self.cases)
