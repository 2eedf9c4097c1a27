"""``HierBackend``: two groups composed, the shm group of this rank's host and a network
group over every rank, with the *column* groups cut from the network one (the ranks with
the same local index on every host: the links between hosts).

Point to point takes the direct route: a peer on this host through shm, any other
through the network. The collectives are :mod:`backends.hier.algorithms` (all_reduce,
broadcast, barrier, reduce everywhere; all_gather and reduce_scatter on even hosts);
gather, scatter, all_to_all (and all_gather, reduce_scatter on uneven hosts) run the
library's send/recv algorithms over that point to point, which is correct on any layout.

The parts are :class:`~collectives.ProcessGroup` objects (so each transport gets the
memory it takes: gloo's tensors, shm's arrays), private to this backend. A failure in a
part is raised as the same error type, naming this group's op, sequence number and
ranks (a peer's rank mapped to this group's numbering), and breaks the whole group: both
parts are aborted, so that no rank waits for a peer that already left the call (its
peers then fail at once with ``PeerError`` instead of at their timeout).

Two ranks on each of two hosts::

    pg = collectives.init_process_group("hier")   # or "shm": chosen for several hosts
    pg.transport.topo.describe()                  # '2 hosts: a [0, 1], b [2, 3]'
    pg.all_reduce(t)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives import settings
from collectives.backend import Backend, Capabilities
from collectives.errors import CollectiveError, renumbered
from collectives.group import ProcessGroup
from collectives.paths import Path, PathTable
from collectives.reduce_op import ReduceOp
from collectives.work import LiftedWork, Work

from . import algorithms
from .topology import Topology

__all__ = ["HierBackend"]

#: Scratch buffers larger than this are not kept between calls.
_KEEP_SCRATCH = 256 << 20


class HierBackend(Backend):
    """shm inside each host, a network transport between hosts (see the module
    docstring). ``local``: the host's group (shm); ``net``: every rank over the network
    (None on one host)."""

    name = "hier"
    capabilities = Capabilities(regroups=True)

    def __init__(self, topo: Topology, local: ProcessGroup, net: Optional[ProcessGroup],
                 timeout: float, net_name: str) -> None:
        self._parts = [p for p in (local, net) if p is not None]
        super().__init__(topo.rank, topo.size, timeout)   # (its timeout reaches the parts)
        self.topo = topo
        self.local = local
        self.net = net
        self.net_name = net_name
        self.split_bytes: int = settings.HIER_SPLIT_BYTES.get()
        self.piece_bytes: int = settings.HIER_PIECE_BYTES.get()
        #: This rank's column (even hosts: the ranks with its local index; uneven: the
        #: leaders, for the leaders only), or None.
        self.column: Optional[ProcessGroup] = None
        #: This rank's index in its column (its host's, among the hosts in the column).
        self.column_index = -1
        if net is not None and (topo.even or topo.local_index == 0):
            self.column_ranks = topo.column(topo.local_index if topo.even else 0)
            self.column = net.new_group(self.column_ranks)
            self.column_index = self.column_ranks.index(topo.rank)
        here = topo.host_index
        self._routes = [(local.transport, topo.local_of(r)) if topo.host_of(r) == here
                        else (net.transport, r) for r in range(topo.size)]
        self._scratch: dict[str, np.ndarray] = {}
        self._call = threading.local()

    # ----------------------------------------------------------------- the parts
    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        for part in self._parts:
            part.timeout = seconds

    def on_host(self, name: str, *args: Any) -> None:
        """Collective ``name`` of this host's group (shm), its failure lifted."""
        try:
            getattr(self.local, name)(*args)
        except CollectiveError as exc:
            raise self._lift(exc, "in the host", self.topo.local_ranks) from exc

    def on_column(self, name: str, *args: Any) -> None:
        """Collective ``name`` of this rank's column (between hosts), its failure lifted."""
        try:
            getattr(self.column, name)(*args)
        except CollectiveError as exc:
            raise self._lift_column(exc) from exc

    def column_start(self, name: str, *args: Any) -> Work:
        """Start collective ``name`` of this rank's column on its own thread; wait with
        :meth:`column_wait`."""
        try:
            return getattr(self.column, name)(*args, async_op=True)
        except CollectiveError as exc:
            raise self._lift_column(exc) from exc

    def column_exchange(self, send: np.ndarray, recv: np.ndarray,
                        tag: int) -> tuple[Work, Work]:
        """Two hosts: start receiving ``recv`` from this column's other rank and sending
        it ``send``, both with ``tag`` (the column group's point to point, so the column's
        flight record shows each piece, and an abort of the column fails them as it fails
        its collectives); wait with :meth:`column_wait`. Returns (the receive, the send).

        The column group is this backend's own, so its whole tag space is; a pair's
        messages with one tag arrive in order, call after call, so a small tag (the
        piece) tells them apart and fits every MPI's ``TAG_UB`` (at least 32767)."""
        peer = 1 - self.column_index
        try:
            return self.column.irecv(recv, peer, tag), self.column.isend(send, peer, tag)
        except CollectiveError as exc:
            raise self._lift_column(exc) from exc

    def column_wait(self, work: Work) -> None:
        """Wait for a Work of :meth:`column_start`, its failure lifted. The wait allows
        the column's call its own timeout and a grace on top: that call started later
        than this wait's clock would count, and its own error names whom it waited for."""
        try:
            work.wait(self.timeout + max(1.0, 0.1 * self.timeout))
        except CollectiveError as exc:
            raise self._lift_column(exc) from exc

    def _lift_column(self, exc: CollectiveError) -> CollectiveError:
        """A column's error lifted. A peer that left the column's call because of a
        failure elsewhere (``_break``) aborted the column: zmq tells its members with a
        ``PeerError`` naming it."""
        return self._lift(exc, "between hosts", self.column_ranks)

    def _lift(self, exc: CollectiveError, part: str, ranks: Sequence[int],
              p2p: Optional[str] = None) -> CollectiveError:
        """``exc`` from a part (whose rank ``i`` is this group's ``ranks[i]``), as the
        same type of error naming this group's call: the collective running, or the
        point to point ``p2p`` (``"send"``/``"recv"``)."""
        if p2p is not None:
            op, seq = p2p, -1
        else:
            op, seq = getattr(self._call, "op", "collective"), getattr(self._call, "seq", -1)
        head = f"{self.describe_call(op, seq)}: {part} (ranks {', '.join(map(str, ranks))})"
        return renumbered(exc, head, lambda i: ranks[i] if 0 <= i < len(ranks) else -1,
                          op=op, seq=seq)

    def scratch(self, role: str, count: int, dtype: np.dtype) -> np.ndarray:
        """A flat buffer of ``count`` elements for ``role`` in one call, kept for the
        next call (up to a size)."""
        nbytes = count * np.dtype(dtype).itemsize
        have = self._scratch.get(role)
        if have is None or have.nbytes < nbytes:
            have = np.empty(max(nbytes, 64), np.uint8)
            if nbytes <= _KEEP_SCRATCH:
                self._scratch[role] = have
        return have[:nbytes].view(dtype)

    def _run(self, op: str, seq: int, algorithm: Any, *args: Any) -> None:
        """Run ``algorithm(self, *args)`` as call ``op``/``seq``; any failure breaks the
        group (see the module docstring) and propagates."""
        self._call.op, self._call.seq = op, seq
        try:
            algorithm(self, *args)
        except BaseException:
            self._break()
            raise

    def _break(self) -> None:
        """A collective failed here: abort this host's group (its ranks' waits for this
        one fail at once, naming it) and this rank's column (zmq tells its members); the
        network group itself stays, so that a peer that died is told from one that left
        (a rank that aborts looks dead to its peers)."""
        reason = f"a collective of the hier group failed on rank {self.rank}"
        for part in (self.local, self.column):
            if part is not None:
                try:
                    part.abort(reason)
                except Exception:  # noqa: BLE001 - the error being raised matters more
                    pass

    @property
    def one_host(self) -> bool:
        return self.net is None

    # ------------------------------------------------------------- point to point
    def route(self, peer: int) -> str:
        """The transport a message to or from ``peer`` takes: ``"shm"`` on this host,
        the network's name (``"zmq"``) across hosts."""
        transport = self._routes[peer][0]
        return "shm" if transport is self.local.transport else self.net_name

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        transport, peer = self._routes[dst]
        return self._point_to_point("send", transport, lambda: transport.isend(array, peer, tag))

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        transport, peer = self._routes[src]
        return self._point_to_point("recv", transport, lambda: transport.irecv(array, peer, tag))

    def send_now(self, array: np.ndarray, dst: int, tag: int) -> None:
        transport, peer = self._routes[dst]
        self._point_to_point("send", transport, lambda: transport.send_now(array, peer, tag))

    def recv_now(self, array: np.ndarray, src: int, tag: int) -> None:
        transport, peer = self._routes[src]
        self._point_to_point("recv", transport, lambda: transport.recv_now(array, peer, tag))

    def _point_to_point(self, op: str, transport: Backend, start: Callable[[], Any]) -> Any:
        """``start()`` on the route's transport. The network's ranks are this group's;
        shm's are the host's indices, so its errors (raised now, or by the Work) are
        lifted to this group's numbering, as the collectives' are."""
        if transport is not self.local.transport:
            return start()

        def lift(exc: CollectiveError) -> CollectiveError:
            return self._lift(exc, "in the host", self.topo.local_ranks, p2p=op)

        try:
            work = start()
        except CollectiveError as exc:
            raise lift(exc) from exc
        return work if work is None else LiftedWork(work, lift)

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        if self.one_host:
            self.local.transport.all_reduce(a, op, seq)
        else:
            self._run("all_reduce", seq, algorithms.all_reduce, a, op)

    def broadcast(self, a: np.ndarray, root: int, seq: int) -> None:
        if self.one_host:
            self.local.transport.broadcast(a, root, seq)
        else:
            self._run("broadcast", seq, algorithms.broadcast, a, root)

    def barrier(self, seq: int) -> None:
        if self.one_host:
            self.local.transport.barrier(seq)
        else:
            self._run("barrier", seq, algorithms.barrier)

    def reduce(self, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> None:
        if self.one_host:
            self.local.transport.reduce(a, root, op, seq)
        else:
            self._run("reduce", seq, algorithms.reduce, a, root, op, seq)

    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> None:
        if self.one_host:
            self.local.transport.all_gather(out, inp, seq)
        elif self.topo.even:
            self._run("all_gather", seq, algorithms.all_gather, out, inp)
        else:
            super().all_gather(out, inp, seq)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp,
                       seq: int) -> None:
        if self.one_host:
            self.local.transport.reduce_scatter(out, inp, op, seq)
        elif self.topo.even:
            self._run("reduce_scatter", seq, algorithms.reduce_scatter, out, inp, op)
        else:
            super().reduce_scatter(out, inp, op, seq)

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], root: int,
               seq: int) -> None:
        if self.one_host:
            self.local.transport.gather(inp, out, root, seq)
        else:
            super().gather(inp, out, root, seq)

    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], root: int,
                seq: int) -> None:
        if self.one_host:
            self.local.transport.scatter(out, inp, root, seq)
        else:
            super().scatter(out, inp, root, seq)

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                   in_counts: Sequence[int], seq: int) -> None:
        if self.one_host:
            self.local.transport.all_to_all(out, inp, out_counts, in_counts, seq)
        else:
            super().all_to_all(out, inp, out_counts, in_counts, seq)

    # ------------------------------------------------------------------ groups
    def new_group(self, ranks: tuple[int, ...], instance: int) -> "HierBackend":
        """The hier group of ``ranks``: the host's part cut from this one's (by the
        members on this host), the network part likewise (by every member)."""
        topo = self.topo.restrict(ranks)
        local = self.local.new_group([self.topo.local_of(r) for r in ranks
                                      if self.topo.host_of(r) == self.topo.host_index])
        net = None
        if len(topo.hosts) > 1:
            net = self.net.new_group(list(ranks))
        return HierBackend(topo, local, net, self.timeout, self.net_name)

    def regroup_refusal(self) -> Optional[str]:
        if self.net is None:
            return None
        return self.net.transport.regroup_refusal()

    # ------------------------------------------------------------- description
    def paths(self) -> PathTable:
        if self.one_host:
            return self.local.transport.paths()
        leader = ("one rank per host: reduce in the host (shm), all_reduce among the "
                  "hosts' leaders, broadcast in the host")
        even, split = self.topo.even, self.topo.splittable
        across = ("each shard streamed to the other host by its column and folded"
                  if self.topo.two_hosts else "each shard all-reduced across hosts "
                  "by its column")
        split_text = f"reduce-scatter in the host, {across}, all-gather in the host"
        default = "send/recv algorithms over the direct routes (shm in a host, else the network)"
        return PathTable({
            "all_reduce": ([Path(leader, self.split_bytes, settings.HIER_SPLIT_BYTES.name),
                            Path(f"{split_text}, in one piece", 2 * self.piece_bytes,
                                 f"2 x {settings.HIER_PIECE_BYTES.name}"),
                            Path(f"{split_text}, pipelined in 2 to {algorithms.MAX_PIECES} "
                                 f"pieces")]
                           if split else [Path(leader)]),
            "broadcast": [Path("across hosts in the root's column, then in each host" if even
                               else "in the root's host, among the leaders, in each host")],
            "reduce": [Path("to each host's leader, among the leaders, to the root")],
            "all_gather": [Path("across hosts by column, in the host, one copy into rank "
                                "order" if even else default)],
            "reduce_scatter": [Path("reordered, in the host, across hosts by column" if even
                                    else default)],
            "gather": [Path(default)], "scatter": [Path(default)],
            "all_to_all": [Path(default)],
            "barrier": [Path("in the host, among the leaders, in the host")],
        })

    def describe(self) -> list[str]:
        lines = [f"{self.topo.describe()}; this rank: host {self.topo.host_index}, local "
                 f"index {self.topo.local_index}; between hosts: "
                 + (self.net_name if self.net is not None else "nothing (one host)")]
        lines += [f"in the host: {line}" for line in self.local.transport.describe()]
        if self.net is not None:
            lines += [f"between hosts: {line}" for line in self.net.transport.describe()]
        return lines

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        for part in self._parts:
            part.close()
        self._scratch.clear()

    def abort(self) -> None:
        for part in self._parts:
            part.abort("the hier group was aborted")
