"""Message sizes at which an implementation changes its path, made visible to tests.

Every collective implementation switches algorithm somewhere: the send/recv defaults
from recursive doubling to the ring at 64 KiB, shm from its one-phase reduce to the
pipelined one, zmq from inline frames to zero-copy ones and from one frame to several.
A bug on one side of such a line is invisible to tests that stay on the other. So each
implementation lists its lines as :class:`SizeThreshold` values
(:meth:`collectives.ProcessGroup.size_thresholds`), and the conformance suite draws
examples on both sides of every one (:func:`boundary_sizes`), and fails when one is
never crossed.

A threshold is measured in the bytes of one rank's contribution: the tensor of
broadcast, all_reduce and reduce; the input of all_gather and gather; the output of
scatter and reduce_scatter; one peer's part of all_to_all; the message of a send (op
``"send"``). Those are the sizes every implementation's dispatch looks at (a part of a
chunked message is a fixed fraction of it).

Two ranks of the send/recv defaults (``p2p:shm``): where their all_reduce changes path,
and the float32 element counts the conformance suite draws around that line:

>>> import collectives
>>> def all_reduce_lines():
...     pg = collectives.init_process_group("p2p:shm")
...     lines = [t for t in pg.size_thresholds() if "all_reduce" in t.ops]
...     pg.close()
...     return [(t.name, t.nbytes) for t in lines]
>>> collectives.spawn(all_reduce_lines, 2)[0]
[('algorithms.ALL_REDUCE_RING_BYTES', 65536)]
>>> from collectives.thresholds import SizeThreshold, boundary_sizes
>>> boundary_sizes(SizeThreshold("algorithms.ALL_REDUCE_RING_BYTES", 65536,
...                               ("all_reduce",)), itemsize=4)
[16382, 16384, 16386]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: Bytes either side of a threshold that its boundary examples use: below by this many,
#: exactly at it, above by this many (so ``<`` and ``<=`` tests are both crossed).
MARGIN = 8


@dataclass(frozen=True)
class SizeThreshold:
    """``ops`` take another path from ``nbytes`` bytes of a rank's contribution on
    (in groups of ``min_ranks`` to ``max_ranks`` ranks; None: no upper bound)."""

    name: str
    nbytes: int
    ops: tuple[str, ...]
    min_ranks: int = 2
    max_ranks: Optional[int] = None

    def applies(self, op: str, world_size: int) -> bool:
        """Whether ``op`` in a world of ``world_size`` has a path change here."""
        return (op in self.ops and world_size >= self.min_ranks
                and (self.max_ranks is None or world_size <= self.max_ranks))

    def side(self, nbytes: int) -> Optional[str]:
        """``"below"`` or ``"above"`` for a contribution of ``nbytes`` bytes, None when it
        is within :data:`MARGIN` of the line (it proves neither side)."""
        if nbytes <= self.nbytes - MARGIN:
            return "below"
        if nbytes >= self.nbytes + MARGIN:
            return "above"
        return None


def boundary_sizes(threshold: SizeThreshold, itemsize: int) -> list[int]:
    """Element counts of ``itemsize``-byte elements just below, at and just above
    ``threshold``: ``[below, at, above]`` (at least one element each)."""
    t = threshold.nbytes
    return [max(1, (t - MARGIN) // itemsize), max(1, t // itemsize),
            max(1, -(-(t + MARGIN) // itemsize))]
