"""Typed errors of the collectives library.

Every error says what happened and where: the rank and world size of the caller, the
operation, and (for waits) which peers did not arrive. Argument errors are plain
``TypeError``/``ValueError`` so that user code can catch them the usual way.
"""

from __future__ import annotations

from typing import Callable, Iterable, NoReturn, Optional


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


def renumbered(exc: CollectiveError, head: str, rank_of: Callable[[int], int], *,
               op: Optional[str] = None, seq: Optional[int] = None) -> CollectiveError:
    """``exc``, raised by a part of a group made of other groups (hier's host group, a
    sub-group's parent), as the same type of error of the call ``head`` names (its
    ``op`` and ``seq``; None keeps the part's), the ranks it names (``PeerError.peer``,
    ``CollectiveTimeout.missing``) mapped by ``rank_of`` to the group's numbering (-1
    where the part's rank is not one of the group's: then ``peer`` is -1, and
    ``missing`` leaves it out). An error type that cannot be built from a message alone
    becomes a :class:`CollectiveError`.

    >>> e = renumbered(PeerError("[rank 0/2] recv from rank 1: it died", peer=1),
    ...                "[rank 2/4] recv: in the host (ranks 2, 3)", lambda i: (2, 3)[i])
    >>> e.peer, str(e)
    (3, '[rank 2/4] recv: in the host (ranks 2, 3): rank 3: [rank 0/2] recv from rank 1: it died')
    """
    if isinstance(exc, PeerError):
        peer = rank_of(exc.peer) if exc.peer >= 0 else -1
        named = f": rank {peer}" if peer >= 0 else ""
        return PeerError(f"{head}{named}: {exc}", peer=peer)
    if isinstance(exc, CollectiveTimeout):
        missing = [mine for mine in map(rank_of, exc.missing) if mine >= 0]
        return CollectiveTimeout(f"{head}: {exc}", op=exc.op if op is None else op,
                                 seq=exc.seq if seq is None else seq, missing=missing)
    if isinstance(exc, GroupAborted):
        return GroupAborted(f"{head}: {exc}", op=exc.op if op is None else op,
                            reason=exc.reason)
    try:
        return type(exc)(f"{head}: {exc}")
    except TypeError:
        return CollectiveError(f"{head}: {exc}")


def raise_lifted(exc: CollectiveError, lifted: CollectiveError) -> NoReturn:
    """Raise ``lifted`` (``exc`` as a wrapping group tells it, e.g. :func:`renumbered`)
    from ``exc``; or ``exc`` itself where the lift left it as it was."""
    if lifted is exc:
        raise exc
    raise lifted from exc


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
