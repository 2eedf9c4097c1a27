"""Which path each collective takes, by op, message size and group size: data, chosen
once when a backend is made, printable, and crossed from both sides by the tests.

Every implementation switches algorithm somewhere (the send/recv defaults from recursive
doubling to the ring at 64 KiB, shm from its one-phase reduce to the pipelined one, zmq
from inline frames to zero-copy ones). A backend states its choices as a
:class:`PathTable` (``Backend.paths()``): per op, the paths in the order they are tried,
each taken for a rank's contribution below some size. ``pg.describe()`` prints it;
:meth:`PathTable.thresholds` turns every size line into a
:class:`~collectives.thresholds.SizeThreshold`, which the conformance suite crosses
from both sides (a bug on one side of a line is invisible to tests that stay on the
other). Lines that are not a choice of algorithm (how a message is framed on the wire,
where a ring wraps) are listed too, as ``lines``.

The size is that of one rank's contribution (see :mod:`collectives.thresholds`): the
tensor of broadcast, all_reduce and reduce; the input of all_gather and gather; the
output of scatter and reduce_scatter; one peer's part of all_to_all.

Two ranks of the send/recv defaults (``p2p:shm``), the path an all_reduce of 1 KiB and
one of 1 MiB take:

>>> import collectives
>>> def all_reduce_paths():
...     pg = collectives.init_process_group("p2p:shm")
...     table = pg.transport.paths()          # pg.describe() prints it
...     taken = [table.select("all_reduce", n, pg.size).name for n in (1024, 1 << 20)]
...     pg.close()
...     return taken
>>> collectives.spawn(all_reduce_paths, 2)[0]
['recursive doubling', 'ring reduce-scatter + all-gather']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .thresholds import SizeThreshold

__all__ = ["Path", "PathTable", "format_bytes"]


@dataclass(frozen=True)
class Path:
    """One way an op runs: taken for a contribution of fewer than ``limit`` bytes (up to
    ``limit`` with ``inclusive``; None: any size the earlier paths left), in groups of
    ``min_ranks`` to ``max_ranks`` ranks. ``setting`` names what fixes ``limit`` (a
    constant, or a ``COLLECTIVES_*`` variable)."""

    name: str
    limit: Optional[int] = None
    setting: str = ""
    min_ranks: int = 2
    max_ranks: Optional[int] = None
    inclusive: bool = False

    def applies(self, size: int) -> bool:
        return size >= self.min_ranks and (self.max_ranks is None or size <= self.max_ranks)

    def takes(self, nbytes: int) -> bool:
        """Whether a contribution of ``nbytes`` is within this path's limit."""
        if self.limit is None:
            return True
        return nbytes <= self.limit if self.inclusive else nbytes < self.limit


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact multiples print without a fraction.

    >>> format_bytes(65536), format_bytes(3 << 19), format_bytes(100)
    ('64 KiB', '1.5 MiB', '100 B')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:g} {unit}"
    return f"{n} B"


class PathTable:
    """Per op, the paths in the order they are tried, and the other size ``lines``.

    >>> t = PathTable({"all_reduce": [Path("one phase", 1024, "X"), Path("pipelined")]})
    >>> t.select("all_reduce", 100, 2).name, t.select("all_reduce", 4096, 2).name
    ('one phase', 'pipelined')
    >>> [(s.name, s.nbytes) for s in t.thresholds()]
    [('X', 1024)]
    """

    def __init__(self, paths: Mapping[str, Sequence[Path]],
                 lines: Sequence[SizeThreshold] = (), notes: Sequence[str] = ()) -> None:
        self.paths = {op: tuple(rows) for op, rows in paths.items()}
        self.lines = tuple(lines)
        self.notes = tuple(notes)

    def for_op(self, op: str) -> tuple[Path, ...]:
        return self.paths.get(op, ())

    def select(self, op: str, nbytes: int, size: int) -> Optional[Path]:
        """The path ``op`` takes for a contribution of ``nbytes`` in a group of ``size``
        (None where the table has none for it: a world of one, or an op it leaves to a
        library)."""
        for path in self.for_op(op):
            if path.applies(size) and path.takes(nbytes):
                return path
        return None

    def thresholds(self) -> tuple[SizeThreshold, ...]:
        """Every size line: the paths' (one per path with a bound) and ``lines``."""
        found = []
        for op, rows in self.paths.items():
            for path in rows:
                if path.limit is not None:
                    found.append(SizeThreshold(path.setting or f"{op}: {path.name}",
                                               path.limit, (op,), path.min_ranks,
                                               path.max_ranks))
        return tuple(found) + self.lines

    def describe(self, size: int) -> str:
        """The table as text for a group of ``size`` ranks."""
        out = []
        for op, rows in self.paths.items():
            shown = [p for p in rows if p.applies(size)]
            for i, path in enumerate(shown):
                when = ("any size" if i == 0 else "larger") if path.limit is None else \
                    f"{'up to' if path.inclusive else 'below'} {format_bytes(path.limit)}"
                source = f"  [{path.setting}]" if path.setting else ""
                out.append(f"  {op if i == 0 else '':<15} {when:<18} {path.name}{source}")
        for line in self.lines:
            if size >= line.min_ranks and (line.max_ranks is None or size <= line.max_ranks):
                out.append(f"  {'/'.join(line.ops)}: from {format_bytes(line.nbytes)}: "
                           f"{line.name}")
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"<PathTable ops={list(self.paths)}>"
