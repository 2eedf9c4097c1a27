"""Typed errors of the collectives library.

Every error says what happened and where: the rank and world size of the caller, the
operation, and (for waits) which peers did not arrive. Argument errors are plain
``TypeError``/``ValueError`` so that user code can catch them the usual way.
"""

from __future__ import annotations

from typing import Iterable


class CollectiveError(RuntimeError):
    """Base class of every communication failure raised by this library."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A blocking wait passed the group's timeout.

    Carries the operation, its sequence number on the group, and the ranks that had not
    arrived, so that a hang is diagnosed instead of silent.
    """

    def __init__(self, message: str, *, op: str = "", seq: int = -1,
                 missing: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = tuple(missing)


class PeerError(CollectiveError):
    """A peer rank died, hung up or reported a failure. ``peer``: that rank (-1:
    unknown), numbered as in the group whose transport raised the error (the call's own
    group on shm, zmq and hier, its point to point included, and in the sub-groups of
    :mod:`collectives.subgroup`)."""

    def __init__(self, message: str, *, peer: int = -1) -> None:
        super().__init__(message)
        self.peer = peer


class GroupAborted(CollectiveError):
    """The group was aborted (``pg.abort()``, from any thread): every call that was
    pending on it, or comes after, raises this, naming the op and the rank."""

    def __init__(self, message: str, *, op: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.reason = reason


class CollectiveMismatch(CollectiveError):
    """Ranks called different collectives, or the same one with different shapes,
    dtypes or roots."""


def where(rank: int, size: int, op: str) -> str:
    """The standard prefix of every message: ``[rank 1/4] all_gather``."""
    return f"[rank {rank}/{size}] {op}"


#: Whether tracebacks print an exception's notes (Python 3.11+, PEP 678).
NATIVE_NOTES: bool = hasattr(BaseException, "add_note")


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` on Python 3.11+. On 3.10, whose tracebacks do not print
    notes, the note is also appended to the message (``str(exc)`` and the traceback's
    last line show it), and kept in ``__notes__`` for code that reads them.

    >>> e = ValueError("x"); add_note(e, "more"); e.__notes__
    ['more']
    """
    if NATIVE_NOTES:
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes
    notes.append(note)
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",) + tuple(exc.args[1:])
    else:
        exc.args = tuple(exc.args) + (note,)
