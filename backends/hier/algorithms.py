"""The two-level collectives: a step inside each host (shm), a step between hosts (the
network, over *columns*: the ranks with the same local index on every host), a step
inside each host again.

Each function takes the :class:`~backends.hier.backend.HierBackend` ``b`` (what it uses
of it is :class:`TwoLevel`: its ``topo``, and ``b.on_host``/``b.on_column``, which run a
collective of the host's group or of this rank's column and say which part failed) and
the flat buffers of the call.

Reduction order, so that every rank holds the same bits: an element is reduced exactly
once, by one column (every rank of the host first combines in the host, in rank order;
the column then combines the hosts' partial results, in host order on each of its
members: between two hosts each folds the other's shard in itself, with more hosts the
column's all_reduce does), and then only copied. AVG runs as SUM and divides once,
at the end (:func:`collectives.reduce_op.finish`), by the whole group's size.

all_reduce of ``n`` elements, ``H`` hosts of ``L`` ranks (even hosts, from
``COLLECTIVES_HIER_SPLIT_BYTES`` on)::

    host 0: r0 r1          host 1: r2 r3
    1. reduce-scatter in each host:       r0,r2 hold shard 0 of their host's sum;
                                          r1,r3 hold shard 1 (n/L elements each)
    2. each shard summed across hosts, column by column, all at once (two hosts: the
       pair swap their shards and each adds; more: the column's all_reduce):
          column 0: r0 <-> r2 (shard 0)     column 1: r1 <-> r3 (shard 1)
    3. all-gather in each host:           every rank holds the whole sum

    Each host sends 2 (H-1)/H x n elements over the network (the minimum), spread over
    its L ranks' connections; a flat ring of H x L ranks sends (H L - 1)/(H L) x 2n per
    host-crossing edge.

    Pipelined in pieces (``COLLECTIVES_HIER_PIECE_BYTES``): step 2 of one piece runs while
    the host does steps 1 and 3 of its neighbours. Between two hosts, step 2 is a stream:
    each rank sends its shard of every piece to its column's other rank as soon as the
    host has reduced it, so the link carries one piece after another with no handshake
    between them; with more hosts, each piece is a column all_reduce.

Below the split size, and on uneven hosts (3 ranks on one, 1 on another), one rank per
host (its lowest: the *leader*) carries the host: reduce to it in the host, all_reduce
among the leaders, broadcast in the host.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import numpy as np

from collectives.algorithms import Links
from collectives.reduce_op import ReduceOp, combine_into, finish
from collectives.work import Work

from .topology import Topology

__all__ = ["TwoLevel", "all_reduce", "barrier", "broadcast", "reduce", "all_gather",
           "reduce_scatter"]


class TwoLevel(Protocol):
    """What these algorithms use of :class:`~backends.hier.backend.HierBackend`."""

    topo: Topology
    column_index: int
    split_bytes: int
    piece_bytes: int

    def on_host(self, name: str, *args: Any) -> None: ...

    def on_column(self, name: str, *args: Any) -> None: ...

    def column_start(self, name: str, *args: Any) -> Work: ...

    def column_wait(self, work: Work) -> None: ...

    def column_exchange(self, send: np.ndarray, recv: np.ndarray,
                        tag: int) -> tuple[Work, Work]: ...

    def scratch(self, role: str, count: int, dtype: np.dtype) -> np.ndarray: ...

    def links(self, seq: int) -> Links: ...


def _inner(op: ReduceOp) -> ReduceOp:
    """The reduction the parts run: AVG as SUM (divided once at the end)."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def splits(b: TwoLevel, a: np.ndarray) -> bool:
    """Whether all_reduce of ``a`` takes the split path (every rank drives a shard)."""
    return b.topo.splittable and a.nbytes >= b.split_bytes


def all_reduce(b: TwoLevel, a: np.ndarray, op: ReduceOp) -> None:
    """``a`` = the reduction over every rank (see the module docstring)."""
    inner = _inner(op)
    if splits(b, a):
        _split_all_reduce(b, a, inner)
    else:
        _leader_all_reduce(b, a, inner)
    finish(op, a, b.topo.size)


def _leader_all_reduce(b: TwoLevel, a: np.ndarray, op: ReduceOp) -> None:
    t = b.topo
    alone = len(t.local_ranks) == 1
    if not alone:
        b.on_host("reduce", a, 0, op)        # the host's sum on its leader; others unchanged
    if t.local_index == 0:
        b.on_column("all_reduce", a, op)
    if not alone:
        b.on_host("broadcast", a, 0)


#: A split all_reduce runs in at most this many pieces.
MAX_PIECES = 256
#: ... and keeps this many more pieces on their way while it waits for one: a pause of
#: this rank (the host's steps, a busy core) is covered by the pieces queued behind the
#: one on the wire, where one piece queued would drain in a few ms.
AHEAD = 4


def pieces(b: TwoLevel, nbytes: int) -> int:
    """How many pieces a split all_reduce of ``nbytes`` runs in: one per
    ``COLLECTIVES_HIER_PIECE_BYTES``, 1 to :data:`MAX_PIECES`."""
    return max(1, min(MAX_PIECES, nbytes // b.piece_bytes))


def _split_all_reduce(b: TwoLevel, a: np.ndarray, op: ReduceOp) -> None:
    """Pipelined: pieces q to q+AHEAD are on their way between hosts while this thread
    waits for piece q, all-gathers it in the host and reduce-scatters the next, so the
    network is never idle for the host's steps (the same order of calls on every rank). Two hosts stream the
    shards (:func:`_exchange_pieces`); more run a column all_reduce per piece."""
    L = len(b.topo.local_ranks)
    n = a.size
    count = pieces(b, a.nbytes)
    s = -(-n // (count * L))                  # one rank's shard of one piece
    span = s * L                              # one piece, padded to a multiple of L
    whole = a
    if span * count != n:                     # (then the last piece is padded)
        whole = b.scratch("whole", span * count, a.dtype)
        whole[:n] = a
        whole[n:] = 0
    shards = b.scratch("shard", s * count, a.dtype)
    between = _exchange_pieces if b.topo.two_hosts else _column_pieces
    for q, done in between(b, shards, s, count, op,
                           lambda p: b.on_host("reduce_scatter", shards[p * s:(p + 1) * s],
                                               whole[p * span:(p + 1) * span], op)):
        b.on_host("all_gather", whole[q * span:(q + 1) * span], done)
    if whole is not a:
        a[...] = whole[:n]


def _column_pieces(b: TwoLevel, shards: np.ndarray, s: int, count: int, op: ReduceOp,
                   reduce_in_host: Callable[[int], None]
                   ) -> Iterator[tuple[int, np.ndarray]]:
    """Any number of hosts: each piece's shard is all_reduced by the column (on the
    column group's thread) while the host reduce-scatters the next; yields ``(q, the
    summed shard of piece q)`` in order."""
    works = []
    for p in range(count + AHEAD):
        if p < count:
            reduce_in_host(p)
            works.append(b.column_start("all_reduce", shards[p * s:(p + 1) * s], op))
        q = p - AHEAD
        if q >= 0:
            b.column_wait(works[q])
            yield q, shards[q * s:(q + 1) * s]


def _exchange_pieces(b: TwoLevel, shards: np.ndarray, s: int, count: int, op: ReduceOp,
                     reduce_in_host: Callable[[int], None]
                     ) -> Iterator[tuple[int, np.ndarray]]:
    """Two hosts: each rank sends its shard of every piece to its column's other rank as
    soon as the host has reduced it, so the sends queue back to back and the link never
    waits for a piece's fold or for a handshake between pieces (a column all_reduce per
    piece would); the fold is ``host 0's op host 1's`` on both, so both hold the same
    bits. Yields ``(q, the summed shard of piece q)`` in order.

    A failure (here or in the caller's step between two yields) leaves pieces posted;
    the backend then aborts the column (``HierBackend._break``), which fails them, and
    the group is unusable after it, so no later call meets their messages."""
    first = b.column_index == 0
    theirs = b.scratch("theirs", s * count, shards.dtype)
    posted = []
    for p in range(count + AHEAD):
        if p < count:
            reduce_in_host(p)
            piece = slice(p * s, (p + 1) * s)
            posted.append(b.column_exchange(shards[piece], theirs[piece], tag=p))
        q = p - AHEAD
        if q >= 0:
            piece = slice(q * s, (q + 1) * s)
            received, sent = posted[q]
            b.column_wait(received)
            b.column_wait(sent)            # (the shard is sent from in place)
            if first:
                combine_into(op, shards[piece], theirs[piece])
                yield q, shards[piece]
            else:
                combine_into(op, theirs[piece], shards[piece])
                yield q, theirs[piece]


def barrier(b: TwoLevel) -> None:
    """In the host, among the leaders, in the host: nobody leaves before all arrived."""
    alone = len(b.topo.local_ranks) == 1
    if not alone:
        b.on_host("barrier")
    if b.topo.local_index == 0:
        b.on_column("barrier")
    if not alone:
        b.on_host("barrier")


def broadcast(b: TwoLevel, a: np.ndarray, root: int) -> None:
    """Across hosts in the root's column (even hosts: the ranks with the root's local
    index; uneven: the leaders, after a broadcast in the root's host), then in each
    host."""
    t = b.topo
    root_host, root_local = t.host_of(root), t.local_of(root)
    c = root_local if t.even else 0
    # Uneven hosts, a root that is not its host's leader: its host first (all of it).
    first_here = not t.even and root_local != 0 and t.host_index == root_host
    if first_here:
        b.on_host("broadcast", a, root_local)
    if t.local_index == c:
        source = t.hosts[root_host][c]
        b.on_column("broadcast", a, t.column(c).index(source))
    if len(t.local_ranks) > 1 and not first_here:
        b.on_host("broadcast", a, c)


def reduce(b: TwoLevel, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> None:
    """Reduce to each host's leader, among the leaders to the root's host's leader, then
    to the root (if it is not that leader). Every other rank's ``a`` is unchanged."""
    t = b.topo
    inner = _inner(op)
    root_host = t.host_of(root)
    leader_of_root = t.hosts[root_host][0]
    lead = t.local_index == 0
    buf = a
    if lead and t.rank != root:
        buf = b.scratch("reduce", a.size, a.dtype)
        buf[...] = a
    if len(t.local_ranks) > 1:
        b.on_host("reduce", buf, 0, inner)
    if lead:
        b.on_column("reduce", buf, t.column(0).index(leader_of_root), inner)
    if root != leader_of_root and t.host_index == root_host:
        links = b.links(seq)
        if t.rank == leader_of_root:
            links.send(buf, root)
        elif t.rank == root:
            links.recv(a, leader_of_root)
    if t.rank == root:
        finish(op, a, t.size)


def all_gather(b: TwoLevel, out: np.ndarray, inp: np.ndarray) -> None:
    """Even hosts: each rank gathers its column's inputs across hosts, the host gathers
    those, and one copy puts the blocks in rank order."""
    t = b.topo
    m = inp.size
    col = b.scratch("column", len(t.hosts) * m, inp.dtype)
    b.on_column("all_gather", col, inp)
    staged = b.scratch("gathered", t.size * m, inp.dtype)
    b.on_host("all_gather", staged, col)
    out.reshape(t.size, m)[t.column_major] = staged.reshape(t.size, m)


def reduce_scatter(b: TwoLevel, out: np.ndarray, inp: np.ndarray,
                   op: ReduceOp) -> None:
    """Even hosts: reorder the blocks so that each local index gets its column's blocks,
    reduce-scatter in the host (the host's sums of those blocks), then across hosts in
    the column (each rank's block, summed over hosts)."""
    t = b.topo
    inner = _inner(op)
    m = out.size
    staged = b.scratch("staged", t.size * m, inp.dtype)
    staged.reshape(t.size, m)[...] = inp.reshape(t.size, m)[t.column_major]
    col = b.scratch("column", len(t.hosts) * m, inp.dtype)
    b.on_host("reduce_scatter", col, staged, inner)
    b.on_column("reduce_scatter", out, col, inner)
    finish(op, out, t.size)
