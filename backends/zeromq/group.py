"""``ZmqBackend``: the :class:`~collectives.backend.Backend` of the zmq transport (the
world and its sub-groups, which share the world's sockets)."""

from __future__ import annotations

import hashlib
import pickle
import struct
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from collectives import settings
from collectives.algorithms.links import Links
from collectives.backend import Backend, Capabilities
from collectives.paths import PathTable
from collectives.reduce_op import ReduceOp
from collectives.thresholds import SizeThreshold
from collectives.work import Work

from . import auth, native, wire
from .sockets import ZERO_COPY_MIN
from .calls import Call
from .engine import Engine


def _gid(parent: int, members: tuple, instance: int) -> int:
    """A sub-group's id: equal on every member (members and instance are), distinct from
    the world's 0 and, in practice, from every other group's."""
    digest = hashlib.blake2b(struct.pack(f"<QQ{len(members)}I", parent, instance, *members),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class _CallLinks:
    """Point to point inside one call, in the shape ``collectives.algorithms`` expect
    (``rank``, ``size``, ``isend``, ``irecv``); group ranks in, world ranks out."""

    __slots__ = ("rank", "size", "scratch", "_engine", "_call", "_members")

    def __init__(self, group: "ZmqBackend", call: Call) -> None:
        self.rank, self.size = group.rank, group.size
        self.scratch = group._scratch
        self._engine, self._call, self._members = group._engine, call, group._members

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        return self._engine.isend(self._call, self._members[dst], tag, array)

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        return self._engine.irecv(self._call, self._members[src], tag, array)

    def irecv_parts(self, like: np.ndarray, src: int, tag: int) -> Work:
        """Receive a message shaped like ``like`` into the buffers it arrives in; read
        it with ``work.parts()`` (see :meth:`Engine.irecv_parts`)."""
        return self._engine.irecv_parts(self._call, self._members[src], tag, like)


_P2P_META = wire.Meta(wire.OP_CODES["send"], wire.NO_SEQ)


class ZmqBackend(Backend):
    """Ranks connected by ZeroMQ sockets. A sub-group shares its world's sockets; its
    messages carry its own group id.

    Rank 0 of two (``collectives.spawn(fn, 2, backend="zmq")``)::

        pg = collectives.init_process_group()        # backend from COLLECTIVES_BACKEND
        pg.all_reduce(t); pg.close()
        pg.transport.auth_mode                       # 'secret' (spawn makes one)
    """

    name = "zmq"
    # regroups: a re-formed group is a new Engine, meeting at its generation's port.
    capabilities = Capabilities(regroups=True)

    def __init__(self, engine: Engine, members: tuple, gid: int, timeout: float) -> None:
        super().__init__(members.index(engine.rank), len(members), timeout)
        self._engine, self._members, self._gid = engine, members, gid
        self._subgroups: "weakref.WeakSet[ZmqBackend]" = weakref.WeakSet()
        self._scratch = native.Scratch()
        engine.register_group(gid, members)

    # ---------------------------------------------------------------- introspection
    @property
    def auth_mode(self) -> str:
        """``secret``, ``file``, ``open`` (see the package docstring) or ``local``."""
        return self._engine.mode

    @property
    def endpoints(self) -> dict:
        """This rank's data endpoints (``tcp``, and ``ipc`` when bound)."""
        return dict(self._engine.endpoints)

    @property
    def connections(self) -> dict:
        """Group rank -> the endpoint this rank sends to it through (``ipc://`` or
        ``tcp://``)."""
        return {self._members.index(w): e for w, e in self._engine.sends_to.items()
                if w in self._members}

    @property
    def malloc(self) -> str:
        """What this process's zmq backend did to glibc's malloc thresholds so that
        libzmq's receive buffers are reused instead of faulted in afresh: ``"kept"``,
        ``"system"``, ``"user"``, ``"partial"`` or ``"unsupported"`` (see
        :mod:`backends.zeromq.heap`), or ``"unused"`` in a world of one (nothing is received)."""
        return self._engine.malloc

    @property
    def stats(self) -> dict:
        """Counters: messages rejected before authentication, failed proofs, refusals,
        messages that arrived before their receive was posted."""
        return dict(self._engine.stats)

    # ----------------------------------------------------------------- point to point
    def _p2p_call(self, what: str) -> Call:
        return Call(self._gid, self._members, self.rank, what, -1, _P2P_META, 0, self.timeout,
                    self.where(what), collective=False)

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        return self._engine.isend(self._p2p_call("send"), self._members[dst], tag, array)

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        return self._engine.irecv(self._p2p_call("recv"), self._members[src], tag, array)

    # -------------------------------------------------------------------- collectives
    def _collective(self, op: str, seq: int, fn, *, dtype: np.dtype, count: int,
                    root: int = -1, redop: Optional[ReduceOp] = None) -> None:
        meta = wire.Meta(wire.OP_CODES[op], seq, count, root, wire.REDOP_CODES[redop])
        code = wire.dtype_code(dtype)
        call = Call(self._gid, self._members, self.rank, op, seq, meta, code, self.timeout,
                    self.where(op), collective=True)  # Call.where adds "(seq N)"
        if self.size == 1:
            fn(Links(_CallLinks(self, call), seq))
            return
        self._engine.begin(call, (meta.op, code, meta.sig_count, meta.root, meta.redop))
        ok = False
        try:
            fn(Links(_CallLinks(self, call), seq))
            ok = True
        finally:
            self._engine.end(call, ok)

    def paths(self) -> PathTable:
        """zmq's own choices (``backends.zeromq.native``), and the framing of every message
        (inline up to ``INLINE_MAX``, zero-copy frames from ``ZERO_COPY_MIN``, several
        frames beyond ``FRAME_MAX``)."""
        moving = ("send", "broadcast", "all_gather", "gather", "scatter", "all_to_all")
        return native.paths((
            SizeThreshold("zmq.wire.INLINE_MAX (one frame: header and bytes)",
                          wire.INLINE_MAX, moving),
            SizeThreshold("zmq.sockets.ZERO_COPY_MIN (frames sent zero-copy)",
                          ZERO_COPY_MIN, moving),
            SizeThreshold("zmq.wire.FRAME_MAX (several messages)", wire.FRAME_MAX, moving)))

    def describe(self) -> list[str]:
        return [f"authentication: {self.auth_mode}; malloc: {self.malloc}",
                "sends to: " + ", ".join(f"rank {r} {e}" for r, e in
                                         sorted(self.connections.items()))]

    def barrier(self, seq: int) -> None:
        self._collective("barrier", seq, native.barrier, dtype=np.dtype(np.uint8), count=0)

    def broadcast(self, a: np.ndarray, root: int, seq: int) -> None:
        flat = a.reshape(-1)
        self._collective("broadcast", seq, lambda links: native.broadcast(links, flat, root),
                         dtype=a.dtype, count=a.size, root=root)

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        flat = a.reshape(-1)
        self._collective("all_reduce", seq, lambda links: native.all_reduce(links, flat, op),
                         dtype=a.dtype, count=a.size, redop=op)

    def reduce(self, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> None:
        flat = a.reshape(-1)
        self._collective("reduce", seq, lambda links: native.reduce(links, flat, root, op),
                         dtype=a.dtype, count=a.size, root=root, redop=op)

    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> None:
        self._collective("all_gather", seq, lambda links: native.all_gather(links, out, inp),
                         dtype=inp.dtype, count=inp.size)

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], root: int, seq: int) -> None:
        self._collective("gather", seq, lambda links: native.gather(links, inp, out, root),
                         dtype=inp.dtype, count=inp.size, root=root)

    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], root: int, seq: int) -> None:
        self._collective("scatter", seq, lambda links: native.scatter(links, out, inp, root),
                         dtype=out.dtype, count=out.size, root=root)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, seq: int) -> None:
        self._collective("reduce_scatter", seq,
                         lambda links: native.reduce_scatter(links, out, inp, op),
                         dtype=inp.dtype, count=out.size, redop=op)

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                    in_counts: Sequence[int], seq: int) -> None:
        self._collective("all_to_all", seq,
                         lambda links: native.all_to_all(links, out, inp, out_counts, in_counts),
                         dtype=inp.dtype, count=wire.ANY_COUNT)

    # ------------------------------------------------------------------------ objects
    def decode_object(self, data: np.ndarray, src: int) -> Any:
        """Every message was accepted from an authenticated connection: unpickle, except in
        ``open`` mode (trust on first use), where only plain data is decoded."""
        raw = data.tobytes()
        if self._engine.mode != "open":
            return pickle.loads(raw)
        try:
            return auth.plain_loads(raw)
        except pickle.UnpicklingError as exc:
            raise TypeError(
                f"{self.where('object collective')}: refusing to unpickle {exc} from rank "
                f"{src}: without {settings.SECRET.name} (trust-on-first-use mode) object "
                f"collectives carry plain data only (None, bool, int, float, str, bytes, "
                f"tuple, list, dict, set)") from None

    # --------------------------------------------------------------------- sub-groups
    def new_group(self, ranks: tuple, instance: int) -> "ZmqBackend":
        members = tuple(self._members[r] for r in ranks)
        sub = ZmqBackend(self._engine, members, _gid(self._gid, members, instance),
                         self.timeout)
        self._subgroups.add(sub)
        return sub

    # ------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        for sub in list(self._subgroups):
            sub.close()
        self._scratch.release()
        if self._gid == 0:
            self._engine.close()
        else:
            self._engine.unregister_group(self._gid)

    def abort(self) -> None:
        """The world: every socket closed without a goodbye (the peers see this rank
        gone); a sub-group: its calls fail, the world's other groups go on."""
        if self._gid == 0:
            self._engine.abort()
        else:
            self._engine.abort_group(self._gid)
