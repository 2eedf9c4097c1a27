"""The public point-to-point calls (mixed into :class:`~collectives.group.ProcessGroup`):
``send``, ``recv``, ``isend``, ``irecv`` over the backend's ``_isend``/``_irecv`` hooks.

Point to point is not numbered (it is matched by peer and tag, not by order across the
group); each call still goes into the flight record.
"""

from __future__ import annotations

from typing import Any, Callable

from .buffers import HostBuffer
from .running import _CommitOnWait, _RecordedWork
from .work import Work

Tensor = Any  # torch.Tensor or numpy.ndarray


class PointToPointCalls:
    """``isend``/``irecv``/``send``/``recv``; the checks and hooks come from the group."""

    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst``; the returned Work completes when the
        buffer may be reused.

        Rank 0: ``pg.isend(t, dst=1).wait()``; rank 1: ``pg.recv(t, src=0)``.
        """
        return self._start_p2p("isend", tensor, dst, tag, send=True)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from ``src``; wait on the Work before use.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``w = pg.irecv(t, src=0); w.wait()``.
        """
        return self._start_p2p("irecv", tensor, src, tag, send=False)

    def _start_p2p(self, op: str, tensor: Tensor, peer: Any, tag: Any, *,
                   send: bool) -> Work:
        """Check a send's (``dst``) or receive's (``src``) arguments and post it."""
        w = self._where(op)
        self._check_tensor(tensor, "tensor", w)
        peer = self._check_rank(peer, "dst" if send else "src", w, allow_self=False)
        tag = self._check_tag(tag, w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=not send)
        hook = self._isend if send else self._irecv
        return self._post_p2p(op, lambda: hook(buf.array, peer, tag), buf, peer)

    def _post_p2p(self, op: str, post: Callable[[], Work], buf: HostBuffer, peer: int) -> Work:
        """Post a send or receive; the Work writes a staged receive back and keeps the
        flight record."""
        rec = None if self._recorder is None else self._recorder.start(
            -1, op, buf.array.shape, buf.array.dtype, -1, None, peer)
        try:
            work = post()
        except BaseException as exc:
            self._record_failure(rec, exc)
            raise
        if buf.writeback is not None:
            work = _CommitOnWait(work, buf)
        return work if rec is None else _RecordedWork(work, self, rec)

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst`` and return when its buffer may be reused.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``pg.recv(t, src=0)``.
        """
        if not self._fast_p2p("send", self._send_now, tensor, dst, tag):
            self._start_p2p("send", tensor, dst, tag, send=True).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        if not self._fast_p2p("recv", self._recv_now, tensor, src, tag):
            self._start_p2p("recv", tensor, src, tag, send=False).wait()
