"""The library's logging: one tree of loggers under ``collectives``, silent unless asked.

Every module logs through a child of ``logging.getLogger("collectives")``:
``collectives.rendezvous`` (how the ranks meet, who is awaited), ``collectives.group``
(the path a new group chose, failures, aborts), ``collectives.backend.shm``, ``.zmq``,
``.mpi``, ``.torch`` (each transport's own start-up and recoveries) and
``collectives.testing`` (what the testing kit checks). The library never prints.

With no configuration nothing new appears on the terminal: the tree's root has a
``NullHandler``, so Python's last-resort handler stays out of it and an application's
own logging set-up decides (``logging.getLogger("collectives").setLevel("DEBUG")``
with a handler of its own, or ``logging.basicConfig(level="DEBUG")``). Setting
``COLLECTIVES_LOG_LEVEL`` (debug, info, warning, error) sets the tree's level and adds
one handler on standard error whose lines name the rank and the logger::

    COLLECTIVES_LOG_LEVEL=debug python examples/ddp.py --nproc 2
    12:00:01.234 [rank 1/2] DEBUG collectives.backend.shm: waiting for ranks [0] to attach ...

Levels: ``debug`` for each step of a rendezvous and the path table of each new group,
``info`` for a wait that lasts (every few seconds, naming the ranks still awaited), a
world that is ready and what the testing kit checked, ``warning`` for timeouts, failed
operations, aborts and recoveries (a stale segment replaced, a handshake retried).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Mapping, Optional, Sequence

from . import settings

__all__ = ["ROOT", "Awaiting", "configure", "get_logger", "note_rank"]

#: The name of the tree's root logger.
ROOT = "collectives"

#: The variables of the launchers that name this process's rank before any group exists.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

_rank_text: Optional[str] = None
_handler: Optional[logging.Handler] = None


def get_logger(name: str) -> logging.Logger:
    """The logger ``collectives.<name>`` (a child of the tree's root).

    >>> get_logger("backend.shm").name
    'collectives.backend.shm'
    """
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def note_rank(rank: int, size: int) -> None:
    """Name this process ``rank/size`` in the lines of the stderr handler (called when the
    world group is made; before that the launcher's variables name it)."""
    global _rank_text
    _rank_text = f"{rank}/{size}"


def _launcher_rank(env: Mapping[str, str]) -> str:
    rank = next((env[v] for v in _RANK_VARIABLES if env.get(v)), None)
    size = next((env[v] for v in _SIZE_VARIABLES if env.get(v)), None)
    if rank is None:
        return f"pid {os.getpid()}"
    return f"{rank}/{size}" if size else rank


class _RankField(logging.Filter):
    """Adds ``record.rank``: this process's rank once known, else the launcher's."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank_text or _launcher_rank(os.environ)
        return True


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged: the ranks of
    ``collectives.spawn`` get the caller's streams after this handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # (StreamHandler.__init__ assigns it)
        pass


FORMAT = "%(asctime)s.%(msecs)03d [rank %(rank)s] %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def configure(env: Optional[Mapping[str, str]] = None) -> Optional[logging.Handler]:
    """Give the tree its ``NullHandler`` and, where ``COLLECTIVES_LOG_LEVEL`` is set, its
    level and a stderr handler; returns that handler (None when the variable is unset).
    Idempotent: run at ``import collectives`` and again by ``init_process_group`` (a
    variable set in between is honoured). A bad value is a ``RuntimeWarning``, not an
    error: logging must never stop a job.

    >>> configure({}) is None
    True
    """
    global _handler
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())
    try:
        level = settings.LOG_LEVEL.get(env)
    except ValueError as exc:
        warnings.warn(f"{exc}; logging stays off", RuntimeWarning, stacklevel=2)
        level = None
    if level is None:
        return None
    root.setLevel(level.upper())
    if _handler is None or _handler not in root.handlers:
        _handler = _CurrentStderr()
        _handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        _handler.addFilter(_RankField())
        root.addHandler(_handler)
    return _handler


class Awaiting:
    """A wait for peers, told to the log: its start at debug, then every ``every``
    seconds at info while it lasts, naming who is still awaited, and its end at debug.
    Cheap enough for a polling loop (one clock read per :meth:`still`).

    >>> wait = Awaiting(get_logger("rendezvous"), "ranks to attach")
    >>> wait.still([1, 2])      # logged at info once the wait passed 5 s, every 5 s
    >>> seconds = wait.done()
    """

    def __init__(self, logger: logging.Logger, what: str, every: float = 5.0) -> None:
        self.logger, self.what, self.every = logger, what, every
        self.start = time.monotonic()
        self._next = self.start + every
        logger.debug("waiting for %s", what)

    def due(self, now: Optional[float] = None) -> bool:
        """Whether :meth:`still` would log now (for a caller whose list of who is
        awaited costs something to make)."""
        return (time.monotonic() if now is None else now) >= self._next

    def still(self, awaited: "Sequence[int] | str") -> None:
        """Called in the loop: ``awaited`` is the ranks (or a text saying who) still
        awaited; logged at info once every ``every`` seconds."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every
        who = awaited if isinstance(awaited, str) else f"ranks {list(awaited)}"
        self.logger.info("still waiting for %s after %.0f s: %s", self.what,
                         now - self.start, who)

    def done(self) -> float:
        """The wait is over: log how long it took; returns the seconds."""
        seconds = time.monotonic() - self.start
        self.logger.debug("done waiting for %s after %.3f s", self.what, seconds)
        return seconds
