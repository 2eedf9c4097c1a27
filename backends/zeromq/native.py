"""The zmq backend's collectives: one algorithm per (op, size, world size).

Over TCP or ipc a message costs tens of microseconds however small it is, while every
peer can be sent to at once (each pair has its own connection). So:

- all_reduce between two ranks, up to :data:`PAIR_ONE_ROUND_BYTES`: one round, each rank
  sends its whole vector and folds the other's in straight from libzmq's buffers
  (:func:`pair_all_reduce`);
- small messages, up to :data:`DIRECT_MAX_RANKS` ranks: *direct* algorithms, one round in
  which every rank posts all its receives and sends at once (all_reduce: every rank sends
  its vector to every other and all reduce the same ``n`` vectors in rank order, so all
  hold identical bits; barrier: every rank signals every other);
- large messages: bandwidth-optimal *reduce-scatter + all-gather* (all_reduce), *scatter
  + all-gather* (broadcast) or *reduce-scatter + gather* (reduce): each rank moves
  ``2(n-1)/n`` of the message. Up to :data:`DIRECT_MAX_RANKS` the phases are direct
  (2 rounds); beyond, the ring and tree algorithms of :mod:`collectives.algorithms`
  (``2(n-1)`` rounds, but each rank talks to its neighbours only);
- all_gather, reduce_scatter, gather, scatter and all_to_all are direct at every size up
  to :data:`DIRECT_MAX_RANKS` ranks (each rank already moves the least data possible);
- beyond :data:`DIRECT_MAX_RANKS` ranks, small messages use the latency-optimal
  logarithmic algorithms of :mod:`collectives.algorithms` (recursive doubling, binomial
  trees, dissemination).

Every choice depends only on values all ranks share (world size, the call's byte count),
so all ranks pick the same algorithm. Bitwise identity of all_reduce: either every rank
folds the same ``n`` vectors in rank order ``0, 1, ..., n-1`` (direct, pair), or each element is
reduced by exactly one rank (its chunk's owner: its own part first, then the others in
rank order; or the ring's order) and the others copy its bits.

The reduce-scatter of a large all_reduce between two ranks reads every received part
straight from the buffer libzmq received it into (``irecv_parts``), folding it in as soon
as it arrived: no receive buffer, no copy of the received bytes, and the addition overlaps
the transfer. With more ranks the parts are folded in rank order, so those of later peers
would wait, each holding a fresh libzmq buffer (page faults on every call); there they
are copied into a :class:`Scratch` the group keeps between calls instead.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from collectives import settings
from collectives.algorithms import dispatch, pairwise, recursive_doubling, ring, tree, \
    two_phase, dissemination
from collectives.algorithms.links import Links, wait_all
from collectives.errors import CollectiveMismatch, where
from collectives.paths import Path, PathTable
from collectives.reduce_op import ReduceOp, combine_into, finish, kernel
from collectives.thresholds import SizeThreshold


#: Direct (one-round, all-peers-at-once) algorithms up to this many ranks
#: (``COLLECTIVES_ZMQ_DIRECT_MAX_RANKS``; every rank must see the same value).
DIRECT_MAX_RANKS: int = settings.ZMQ_DIRECT_MAX_RANKS.get()
#: all_reduce of 3 ranks and more: one round of direct exchange up to this many bytes;
#: above, reduce-scatter + all-gather (``COLLECTIVES_ZMQ_ALL_REDUCE_DIRECT_BYTES``).
ALL_REDUCE_DIRECT_BYTES: int = settings.ZMQ_ALL_REDUCE_DIRECT_BYTES.get()
#: all_reduce of two ranks: one round (:func:`pair_all_reduce`) up to this many bytes; above,
#: reduce-scatter + all-gather, which has half as much in libzmq's buffers at a time
#: (``COLLECTIVES_ZMQ_PAIR_ONE_ROUND_BYTES``).
PAIR_ONE_ROUND_BYTES: int = settings.ZMQ_PAIR_ONE_ROUND_BYTES.get()
#: broadcast/reduce: whole message from/to the root up to this many bytes; above (and
#: n > 2), split so that every rank carries 1/n of it.
ROOTED_SPLIT_BYTES: int = settings.ZMQ_ROOTED_SPLIT_BYTES.get()


#: Scratch kept between calls up to this many bytes (larger needs are allocated fresh).
SCRATCH_KEEP_BYTES: int = settings.ZMQ_SCRATCH_KEEP_BYTES.get()


class Scratch:
    """Reusable receive buffers of one group (whose collectives run one at a time)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def arrays(self, k: int, count: int, dtype: np.dtype) -> list:
        """``k`` disjoint arrays of ``count`` elements of ``dtype``."""
        dtype = np.dtype(dtype)
        need = k * count * dtype.itemsize
        if need > self._buf.size:
            buf = np.empty(need, np.uint8)
            if need <= SCRATCH_KEEP_BYTES:
                self._buf = buf
        else:
            buf = self._buf
        flat = buf[:need].view(dtype)
        return [flat[i * count:(i + 1) * count] for i in range(k)]

    def release(self) -> None:
        self._buf = np.empty(0, np.uint8)


def _scratch(links: Links) -> Scratch:
    s = getattr(links.p2p, "scratch", None)  # the group's, when it offers one
    return s if s is not None else Scratch()


def _peers(links: Links):
    return [p for p in range(links.size) if p != links.rank]


def _fold_in_rank_order(op: ReduceOp, parts: list, n: int) -> np.ndarray:
    """``((p0 op p1) op p2) ...`` finished (AVG divides), into a fresh array."""
    acc = parts[0].copy()
    for p in parts[1:]:
        combine_into(op, acc, p)
    finish(op, acc, n)
    return acc


# ------------------------------------------------------------------------ all_reduce
def all_reduce(links: Links, a: np.ndarray, op: ReduceOp) -> None:
    n = links.size
    if n == 1:
        finish(op, a, 1)
        return
    if a.size == 0:
        return
    if n <= DIRECT_MAX_RANKS:
        if n == 2 and a.nbytes <= PAIR_ONE_ROUND_BYTES:
            pair_all_reduce(links, a, op)
        elif a.nbytes <= ALL_REDUCE_DIRECT_BYTES or a.size < n:
            direct_all_reduce(links, a, op)
        else:
            direct_rsag_all_reduce(links, a, op)
    elif a.nbytes >= dispatch.ALL_REDUCE_RING_BYTES and a.size >= n:
        ring.all_reduce(links, a, op)
    else:
        recursive_doubling.all_reduce(links, a, op)


def pair_all_reduce(links: Links, a: np.ndarray, op: ReduceOp) -> None:
    """Two ranks, one round: each sends its whole ``a`` to the other and folds the other's
    in straight from the buffers libzmq received it into, as ``a0 op a1`` on both ranks
    (rank 1 puts the received operand first), so both hold identical bits.

    The same bytes cross the socket as in reduce-scatter + all-gather, in one round instead
    of two and with no copy out of libzmq's buffers (the all-gather's; docs/performance.md
    times both). ``a`` is sent from in place, so the fold starts once libzmq has let go of
    it."""
    if links.size != 2:
        raise ValueError(f"{where(links.rank, links.size, 'all_reduce')}: pair_all_reduce "
                         f"needs a group of two ranks, not {links.size}")
    peer = 1 - links.rank
    recv = _irecv_parts(links, a, peer, 0, zero_copy=True)
    links.isend(a, peer, 0).wait()
    _fold_parts(op, a, recv, received_first=peer == 0)
    finish(op, a, 2)


def direct_all_reduce(links: Links, a: np.ndarray, op: ReduceOp) -> None:
    """Every rank sends ``a`` to every other, then all fold the ``n`` vectors in rank
    order. One round; ``(n-1) m`` bytes in and out per rank."""
    n, r = links.size, links.rank
    parts: list = [None] * n
    works = []
    for p in _peers(links):
        parts[p] = np.empty_like(a)
        works.append(links.irecv(parts[p], p))
    works += [links.isend(a, p) for p in _peers(links)]
    wait_all(works)
    parts[r] = a
    a[...] = _fold_in_rank_order(op, parts, n)


def direct_rsag_all_reduce(links: Links, a: np.ndarray, op: ReduceOp) -> None:
    """Reduce-scatter (rank ``j`` reduces chunk ``j`` of everyone's ``a``, in rank order)
    then all-gather of the reduced chunks; both phases direct. ``2(n-1)/n m`` bytes in and
    out per rank, two rounds.

    The reduce-scatter reads each received part straight from the buffer it arrived in
    (no copy into a receive buffer first: on a machine whose cores share one memory bus
    that copy costs as much as the addition) and folds it in as soon as it is there, so
    the addition of one 4 MiB part overlaps the arrival of the next."""
    n, r = links.size, links.rank
    bounds = ring.chunk_bounds(a.size, n)
    lo, hi = bounds[r], bounds[r + 1]
    mine = a[lo:hi]                # this rank alone reduces chunk r: own part, then rank order
    peers = _peers(links)
    zero_copy = n == 2  # see the module docstring
    recvs = {p: _irecv_parts(links, mine, p, 0, zero_copy) for p in peers} if hi > lo else {}
    sends = [links.isend(a[bounds[p]:bounds[p + 1]], p, 0) for p in peers
             if bounds[p + 1] > bounds[p]]
    error = None
    try:
        for p in peers:            # rank order, whatever order the data arrives in
            work = recvs.get(p)
            if work is None:
                continue
            _fold_parts(op, mine, work, received_first=False)
        if hi > lo:
            finish(op, mine, n)
    except BaseException as exc:  # noqa: BLE001 - re-raised once the sends are done
        error = exc
    try:
        wait_all(sends)            # ``a`` is sent from in place (zero-copy)
    except BaseException as exc:  # noqa: BLE001
        error = error or exc
    if error is not None:
        raise error
    direct_all_gather_chunks(links, a, bounds, step=1)


def _fold_parts(op: ReduceOp, acc: np.ndarray, recv, received_first: bool) -> None:
    """Fold every part of ``recv`` (a receive shaped like ``acc`` whose ``parts()`` yields
    ``(byte offset, buffer)``) into ``acc`` as it arrives: ``acc op part``, or ``part op
    acc`` with ``received_first`` (the sender's rank comes first in the fold's order)."""
    fold = kernel(op)
    for offset, buf in recv.parts():
        part = np.frombuffer(buf, acc.dtype)
        at = offset // acc.itemsize
        mine = acc[at:at + part.size]
        if received_first:
            fold(part, mine, out=mine)
        else:
            fold(mine, part, out=mine)
        del part, buf, mine  # libzmq's buffer is freed when the next part is asked for


class _CopiedParts:
    """``parts()`` of a plain receive (a group without zero-copy receives): the whole
    message, once it is in."""

    def __init__(self, work, array: np.ndarray) -> None:
        self._work, self._array = work, array

    def parts(self):
        self._work.wait()
        yield 0, self._array.reshape(-1).view(np.uint8)


def _irecv_parts(links: Links, like: np.ndarray, src: int, step: int, zero_copy: bool):
    """A receive from ``src`` whose ``parts()`` yields ``(byte offset, buffer)`` pairs:
    with ``zero_copy`` on a zmq group, each part as it arrives, in libzmq's buffer; else
    the whole message once received into this peer's slot of the group's scratch."""
    fast = getattr(links.p2p, "irecv_parts", None)
    if zero_copy and fast is not None:
        return fast(like, src, links.tag(step))
    slot = src if src < links.rank else src - 1  # one slot per peer
    buf = _scratch(links).arrays(links.size - 1, like.size, like.dtype)[slot]
    return _CopiedParts(links.irecv(buf, src, step), buf)


def direct_all_gather_chunks(links: Links, a: np.ndarray, bounds: list, *, step: int,
                             root_has_all: Optional[int] = None) -> None:
    """Rank ``j`` holds chunk ``j`` of ``a``; afterwards every rank holds all chunks.
    With ``root_has_all`` that rank already holds everything and receives nothing."""
    r = links.rank
    works = []
    for p in _peers(links):
        if r != root_has_all and bounds[p + 1] > bounds[p]:
            works.append(links.irecv(a[bounds[p]:bounds[p + 1]], p, step))
        if p != root_has_all and bounds[r + 1] > bounds[r]:
            works.append(links.isend(a[bounds[r]:bounds[r + 1]], p, step))
    wait_all(works)


# ------------------------------------------------------------------ broadcast, reduce
def broadcast(links: Links, a: np.ndarray, src: int) -> None:
    n = links.size
    if n == 1 or a.size == 0:
        return
    split = n > 2 and a.nbytes > ROOTED_SPLIT_BYTES and a.size >= n
    if n <= DIRECT_MAX_RANKS:
        if split:
            direct_scatter_all_gather(links, a, src)
        elif links.rank == src:
            wait_all([links.isend(a, p) for p in _peers(links)])
        else:
            links.recv(a, src)
    elif split:
        two_phase.broadcast(links, a, src)
    else:
        tree.broadcast(links, a, src)


def direct_scatter_all_gather(links: Links, a: np.ndarray, src: int) -> None:
    """The root sends chunk ``j`` to rank ``j``; then every rank sends its chunk to all
    others except the root (which has everything)."""
    r = links.rank
    bounds = ring.chunk_bounds(a.size, links.size)
    if r == src:
        wait_all([links.isend(a[bounds[p]:bounds[p + 1]], p, 0) for p in _peers(links)
                  if bounds[p + 1] > bounds[p]])
    elif bounds[r + 1] > bounds[r]:
        links.recv(a[bounds[r]:bounds[r + 1]], src, 0)
    direct_all_gather_chunks(links, a, bounds, step=1, root_has_all=src)


def reduce(links: Links, a: np.ndarray, dst: int, op: ReduceOp) -> None:
    n, r = links.size, links.rank
    if n == 1:
        finish(op, a, 1)
        return
    if a.size == 0:
        return
    split = n > 2 and a.nbytes > ROOTED_SPLIT_BYTES and a.size >= n
    if n <= DIRECT_MAX_RANKS and not split:
        if r != dst:
            links.send(a, dst)
            return
        parts: list = [None] * n
        works = []
        for p in _peers(links):
            parts[p] = np.empty_like(a)
            works.append(links.irecv(parts[p], p))
        wait_all(works)
        parts[r] = a
        a[...] = _fold_in_rank_order(op, parts, n)
    elif split:
        two_phase.reduce(links, a, dst, op)
    else:
        tree.reduce(links, a, dst, op)


# ------------------------------------------------------------- gathers and scatters
def all_gather(links: Links, out: np.ndarray, inp: np.ndarray) -> None:
    n, r, k = links.size, links.rank, inp.size
    out[r * k:(r + 1) * k] = inp
    if n == 1 or k == 0:
        return
    if n <= DIRECT_MAX_RANKS:
        direct_all_gather_chunks(links, out, [p * k for p in range(n + 1)], step=0)
    else:
        ring.all_gather_chunks(links, out, [p * k for p in range(n + 1)])


def reduce_scatter(links: Links, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> None:
    n, r, k = links.size, links.rank, out.size
    if n == 1:
        out[...] = inp
        finish(op, out, 1)
        return
    if k == 0:
        return
    if n > DIRECT_MAX_RANKS:
        ring.reduce_scatter(links, out, inp, op)
        return
    parts: list = [None] * n
    works = []
    for p in _peers(links):
        parts[p] = np.empty(k, inp.dtype)
        works.append(links.irecv(parts[p], p))
        works.append(links.isend(inp[p * k:(p + 1) * k], p))
    wait_all(works)
    parts[r] = inp[r * k:(r + 1) * k]
    out[...] = _fold_in_rank_order(op, parts, n)


def gather(links: Links, inp: np.ndarray, out: Optional[np.ndarray], dst: int) -> None:
    n, r, k = links.size, links.rank, inp.size
    if r == dst:
        out[r * k:(r + 1) * k] = inp
    if n == 1 or k == 0:
        return
    if n > DIRECT_MAX_RANKS:
        tree.gather(links, inp, out, dst)
    elif r == dst:
        wait_all([links.irecv(out[p * k:(p + 1) * k], p) for p in _peers(links)])
    else:
        links.send(inp, dst)


def scatter(links: Links, out: np.ndarray, inp: Optional[np.ndarray], src: int) -> None:
    n, r, k = links.size, links.rank, out.size
    if r == src:
        out[...] = inp[r * k:(r + 1) * k]
    if n == 1 or k == 0:
        return
    if n > DIRECT_MAX_RANKS:
        tree.scatter(links, out, inp, src)
    elif r == src:
        wait_all([links.isend(inp[p * k:(p + 1) * k], p) for p in _peers(links)])
    else:
        links.recv(out, src)


def all_to_all(links: Links, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
               in_counts: Sequence[int]) -> None:
    n, r = links.size, links.rank
    if n > DIRECT_MAX_RANKS:
        pairwise.all_to_all(links, out, inp, out_counts, in_counts)
        return
    if out_counts[r] != in_counts[r]:
        raise CollectiveMismatch(
            f"{where(r, n, 'all_to_all')}: this rank sends itself {in_counts[r]} elements "
            f"but expects {out_counts[r]} from itself (split sizes disagree)")
    out_at, in_at = [0], [0]
    for c in out_counts:
        out_at.append(out_at[-1] + c)
    for c in in_counts:
        in_at.append(in_at[-1] + c)
    out[out_at[r]:out_at[r + 1]] = inp[in_at[r]:in_at[r + 1]]
    works = []
    for p in _peers(links):
        if out_counts[p]:
            works.append(links.irecv(out[out_at[p]:out_at[p + 1]], p))
        if in_counts[p]:
            works.append(links.isend(inp[in_at[p]:in_at[p + 1]], p))
    wait_all(works)


def barrier(links: Links) -> None:
    if links.size == 1:
        return
    if links.size > DIRECT_MAX_RANKS:
        dissemination.barrier(links)
        return
    token = np.empty(0, np.uint8)
    works = [links.irecv(np.empty(0, np.uint8), p) for p in _peers(links)]
    works += [links.isend(token, p) for p in _peers(links)]
    wait_all(works)


def paths(framing: Sequence[SizeThreshold]) -> PathTable:
    """The choices above as a table (``pg.describe()``, and the lines the conformance
    suite crosses), with the wire's ``framing`` lines (every message's, whatever the
    algorithm)."""
    direct, beyond = DIRECT_MAX_RANKS, DIRECT_MAX_RANKS + 1
    pair_max = min(2, direct)
    return PathTable({
        "all_reduce": [
            Path("pair: one round, each folds the other's vector from libzmq's buffers",
                 PAIR_ONE_ROUND_BYTES, "zmq.native.PAIR_ONE_ROUND_BYTES",
                 max_ranks=pair_max, inclusive=True),
            Path("direct: whole vectors to every peer, folded in rank order",
                 ALL_REDUCE_DIRECT_BYTES, "zmq.native.ALL_REDUCE_DIRECT_BYTES", min_ranks=3,
                 max_ranks=direct, inclusive=True),
            Path("direct reduce-scatter + all-gather", max_ranks=direct),
            Path("recursive doubling", dispatch.ALL_REDUCE_RING_BYTES,
                 "algorithms.ALL_REDUCE_RING_BYTES", min_ranks=beyond),
            Path("ring reduce-scatter + all-gather", min_ranks=beyond)],
        "broadcast": [
            Path("the root sends to every peer", ROOTED_SPLIT_BYTES,
                 "zmq.native.ROOTED_SPLIT_BYTES", min_ranks=3, max_ranks=direct,
                 inclusive=True),
            Path("direct scatter + all-gather", min_ranks=3, max_ranks=direct),
            Path("the root sends to its peer", max_ranks=2),
            Path("binomial tree", ROOTED_SPLIT_BYTES, "zmq.native.ROOTED_SPLIT_BYTES",
                 min_ranks=beyond, inclusive=True),
            Path("scatter + ring all-gather", min_ranks=beyond)],
        "reduce": [
            Path("every rank sends to the root, which folds in rank order",
                 ROOTED_SPLIT_BYTES, "zmq.native.ROOTED_SPLIT_BYTES", min_ranks=3,
                 max_ranks=direct, inclusive=True),
            Path("binomial tree", ROOTED_SPLIT_BYTES, "zmq.native.ROOTED_SPLIT_BYTES",
                 min_ranks=beyond, inclusive=True),
            Path("ring reduce-scatter + gather", min_ranks=3),
            Path("the peer sends to the root", max_ranks=2)],
        "all_gather": [Path("direct", max_ranks=direct), Path("ring", min_ranks=beyond)],
        "reduce_scatter": [Path("direct, folded in rank order", max_ranks=direct),
                           Path("ring", min_ranks=beyond)],
        "gather": [Path("direct", max_ranks=direct), Path("binomial tree", min_ranks=beyond)],
        "scatter": [Path("direct", max_ranks=direct), Path("binomial tree", min_ranks=beyond)],
        "all_to_all": [Path("direct", max_ranks=direct),
                       Path("pairwise exchange", min_ranks=beyond)],
        "barrier": [Path("direct", max_ranks=direct), Path("dissemination", min_ranks=beyond)],
    }, framing)
