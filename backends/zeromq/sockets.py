"""The socket calls of the zmq transport: the options of its sockets, a tensor's frames
out through a DEALER, a part's payload read from the ROUTER into place, and the rest of a
message nobody wants. Pure functions of the socket they are given: which socket, and
under which lock, is decided by :mod:`backends.zeromq.connections` (sending) and
:mod:`backends.zeromq.matching` (receiving). The framing itself is :mod:`backends.zeromq.wire`.
"""

from __future__ import annotations

import secrets
from typing import Optional

import numpy as np
import zmq

from . import wire

#: Frames of at least this many bytes are sent zero-copy (pyzmq copies smaller ones anyway).
ZERO_COPY_MIN = 64 * 1024
#: First retry of a refused connection (the rendezvous, before rank 0 listens), doubled
#: up to the second value while rank 0 is late (a late rank 0 costs at most that much
#: more): with libzmq's default of 100 ms, a rank that came a moment before rank 0
#: waited that long for nothing.
RECONNECT_IVL_MS = 2
RECONNECT_IVL_MAX_MS = 50
# pyzmq's constants are enum members; plain ints keep the hot paths cheap.
EVENTS, POLLIN, RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)

_HAS_RECV_INTO = hasattr(zmq.Socket, "recv_into")


# ------------------------------------------------------------------------- options
def _options(sock: zmq.Socket, heartbeat_s: float, ipv6: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, int(heartbeat_s * 200)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(500, int(heartbeat_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, max(500, int(heartbeat_s * 1000)))
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)


def new_router(ctx: zmq.Context, heartbeat_s: float, ipv6: bool) -> zmq.Socket:
    """A ROUTER that receives from every peer (and refuses frames above a part's size)."""
    sock = ctx.socket(zmq.ROUTER)
    _options(sock, heartbeat_s, ipv6)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.FRAME_MAX + 4096)
    return sock


def new_dealer(ctx: zmq.Context, heartbeat_s: float, ipv6: bool, reconnect: bool) -> zmq.Socket:
    """A DEALER to one peer's ROUTER; only the rendezvous's ``reconnect``s (a data
    connection is made once its peer listens, and one that closed means the peer is gone)."""
    sock = ctx.socket(zmq.DEALER)
    _options(sock, heartbeat_s, ipv6)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.ROUTING_ID, bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(15))
    if not reconnect:
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
    else:
        # A rank often connects to the rendezvous before rank 0 listens there: retry
        # soon (see RECONNECT_IVL_MS), backing off while rank 0 is late.
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    return sock


# ------------------------------------------------------------------------- sending
def write_tensor(sock: zmq.Socket, header: bytes, flat: Optional[np.ndarray]) -> list:
    """Queue the message(s) of one tensor (``flat``: its bytes, None when empty) on
    ``sock``: one INLINE frame when small, else a header and a frame per part, the large
    ones zero-copy. Returns the zero-copy frames (the tensor must not change until
    libzmq released them); raises ``zmq.Again`` when the peer's connection is closed."""
    frames = []
    if flat is None:
        sock.send(header, NOBLOCK)
    elif flat.size <= wire.INLINE_MAX:
        sock.send(wire.pack_inline(header, flat.data), NOBLOCK)
    else:
        for off in range(0, flat.size, wire.FRAME_MAX):
            chunk = flat[off:off + wire.FRAME_MAX]
            sock.send(wire.with_offset(header, off) if off else header, NOBLOCK | SNDMORE)
            if chunk.size >= ZERO_COPY_MIN:
                f = zmq.Frame(chunk, track=True, copy=False)
                sock.send(f, 0, copy=False)
                frames.append(f)
            else:
                sock.send(chunk, 0, copy=True)
    return frames


# ----------------------------------------------------------------------- receiving
def discard_rest(sock: zmq.Socket) -> None:
    """Read and drop the frames left of the message being received."""
    try:
        while sock.get(RCVMORE):
            sock.recv(NOBLOCK, copy=False)
    except zmq.Again:
        pass


def recv_part(sock: zmq.Socket, h: wire.Header, view: np.ndarray,
              data: Optional[bytes] = None, frames: Optional[list] = None) -> bool:
    """Read the payload of part ``h.offset`` into ``view`` (bytes of the tensor): from
    ``data`` (an INLINE frame), or the next frame of ``sock``; with ``frames``, append that
    frame itself (zero-copy) as ``(offset, buffer)`` instead. False (the rest of the
    message dropped) when the payload is not what the header announced."""
    size = wire.part_size(h.nbytes, h.offset) if h.nbytes else 0
    try:
        if data is not None:  # parse() checked len(data) == header + nbytes
            if frames is not None:
                frames.append((0, memoryview(data)[wire.HEADER.size:]))
            else:
                view[:size] = np.frombuffer(data, np.uint8, size, wire.HEADER.size)
        elif size and frames is not None:
            if not sock.get(RCVMORE):
                return False
            frame = sock.recv(NOBLOCK, copy=False)
            if len(frame) != size:
                discard_rest(sock)
                return False
            frames.append((h.offset, frame.buffer))
        elif size:
            if not sock.get(RCVMORE):
                return False
            if _HAS_RECV_INTO:
                got = sock.recv_into(view[h.offset:h.offset + size], flags=NOBLOCK)
            else:  # pyzmq < 26.4: one more copy, out of libzmq's buffer
                frame = sock.recv(NOBLOCK, copy=False)
                got = len(frame.buffer)
                if got == size:
                    view[h.offset:h.offset + size] = np.frombuffer(frame.buffer, np.uint8)
            if got != size:
                discard_rest(sock)
                return False
    except zmq.Again:
        return False
    if sock.get(RCVMORE):
        discard_rest(sock)
        return False
    return True
