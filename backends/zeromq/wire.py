"""The wire format of the zmq backend.

Every message is a ZeroMQ multipart message: one fixed-size binary header frame
(:data:`HEADER`, 132 bytes, little endian) followed by its body frames. A tensor travels
as one or more DATA messages, each a header plus one raw frame of at most
:data:`FRAME_MAX` bytes starting at byte ``offset`` of the tensor (the receiver writes
each straight into the destination array with ``recv_into``, or reduces straight out of
the received frame, while the next is on the wire); nothing on the data path is ever
pickled. A tensor of at most :data:`INLINE_MAX` bytes travels as one INLINE message
instead: a single frame holding the header immediately followed by the tensor's bytes
(one send and one receive call fewer per message on the latency-bound path). Control messages (the authentication
handshake, the rendezvous table, abort and goodbye notices) carry small fixed binary
bodies or JSON.

Header fields, in order::

    magic      4s  b"CZMQ"
    version    B   PROTOCOL_VERSION
    kind       B   Kind (DATA, HELLO, CHALLENGE, PROOF, TABLE, ABORT, BYE, REFUSED, INLINE)
    op         B   the collective (OP_CODES) this message belongs to; "send" for p2p
    dtype      B   DTYPE_CODES of the payload
    redop      B   the ReduceOp of the call (0: none)
    ndim       B   number of dimensions of the sent array (shape: first 6 below)
    reserved   H
    src, dst   I I world ranks of sender and receiver
    gid        Q   group id (0: the world; sub-groups: a hash of members and instance)
    seq        Q   the collective's sequence number on its group (2**64-1 for p2p)
    tag        Q   the matching tag (user tag, or collectives.algorithms.Links' tag);
                   an ABORT's: ABORT_LEFT when its sender left the group's call
    count      Q   elements of the whole tensor
    nbytes     Q   bytes of the whole tensor (== count * itemsize)
    offset     Q   where this message's frame starts (0 for the first part)
    sig_count  Q   the call's signature: elements of the call (2**64-1: not compared)
    root       q   the call's root rank (-1: none)
    shape      6Q  the sent array's shape (diagnostics only)
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Optional

import numpy as np

from collectives import dtypes
from collectives.reduce_op import ReduceOp

MAGIC = b"CZMQ"
PROTOCOL_VERSION = 1
#: Largest payload frame: larger tensors travel as several messages (pipelined: the
#: receiver copies one part while the next is in flight, and libzmq's buffers stay small
#: enough to be reused). The receiving socket refuses larger frames (``ZMQ_MAXMSGSIZE``),
#: which bounds what one unauthenticated frame can make libzmq allocate.
FRAME_MAX = 4 << 20
#: Tensors of 1 to this many bytes travel as one INLINE frame (header + payload): below
#: a few KiB a message's cost is per call, not per byte, so the extra copy is free.
INLINE_MAX = 8 << 10
#: ``seq`` of point-to-point messages, and ``sig_count`` when a call has no common size.
NO_SEQ = (1 << 64) - 1
ANY_COUNT = (1 << 64) - 1
MAX_DIMS = 6

HEADER = struct.Struct("<4sBBBBBBHIIQQQQQQQq6Q")
assert HEADER.size == 132
_OFFSET_AT = struct.calcsize("<4sBBBBBBHIIQQQQQ")
_KIND_AT = struct.calcsize("<4sB")  # magic, version: then kind


class Kind:
    DATA = 1
    HELLO = 2
    CHALLENGE = 3
    PROOF = 4
    TABLE = 5
    ABORT = 6
    BYE = 7
    REFUSED = 8
    INLINE = 9


#: An ABORT's tag when its sender left the group's call (it aborted the group, because
#: of a failure of its own) rather than saw the group's calls disagree (tag 0).
ABORT_LEFT = 1

_INLINE_KIND = bytes([Kind.INLINE])

OPS = ("none", "send", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
       "reduce_scatter", "all_to_all", "barrier")
OP_CODES = {name: i for i, name in enumerate(OPS)}

REDOP_CODES = {None: 0, ReduceOp.SUM: 1, ReduceOp.AVG: 2, ReduceOp.PRODUCT: 3,
               ReduceOp.MIN: 4, ReduceOp.MAX: 5}
REDOP_NAMES = {code: (op.name if op is not None else "-") for op, code in REDOP_CODES.items()}

#: Stable codes of the dtypes: collectives.dtypes.NAMES's (bfloat16 joins when first met).
DTYPE_CODES = {np.dtype(name): i + 1 for i, name in enumerate(dtypes.NAMES)
               if name != "bfloat16"}
dtypes.when_bfloat16(lambda dt: DTYPE_CODES.__setitem__(dt, dtypes.BFLOAT16_CODE))


def dtype_code(dtype: np.dtype) -> int:
    return DTYPE_CODES.get(np.dtype(dtype), 0)


def dtype_name(code: int) -> str:
    return dtypes.NAMES[code - 1] if 0 < code <= len(dtypes.NAMES) else f"dtype#{code}"


class Header(NamedTuple):
    magic: bytes
    version: int
    kind: int
    op: int
    dtype: int
    redop: int
    ndim: int
    reserved: int
    src: int
    dst: int
    gid: int
    seq: int
    tag: int
    count: int
    nbytes: int
    offset: int
    sig_count: int
    root: int
    s0: int
    s1: int
    s2: int
    s3: int
    s4: int
    s5: int

    @property
    def shape(self) -> tuple[int, ...]:
        dims = (self.s0, self.s1, self.s2, self.s3, self.s4, self.s5)
        return dims[:min(self.ndim, MAX_DIMS)]

    @property
    def op_name(self) -> str:
        return OPS[self.op] if self.op < len(OPS) else f"op#{self.op}"


class Meta(NamedTuple):
    """What a call stamps on each of its messages (and what a receiver expects). A named
    tuple: one is made per call, and this is the cheapest immutable record."""

    op: int
    seq: int
    sig_count: int = ANY_COUNT
    root: int = -1
    redop: int = 0


def pack(kind: int, src: int, dst: int, *, meta: Optional[Meta] = None, gid: int = 0,
         tag: int = 0, array: Optional[np.ndarray] = None, offset: int = 0) -> bytes:
    """A header frame (``array`` gives dtype, count, bytes and shape of a DATA message)."""
    if meta is None:
        meta = Meta(0, NO_SEQ)
    if array is not None:
        shape = tuple(array.shape)[:MAX_DIMS]
        dims = shape + (0,) * (MAX_DIMS - len(shape))
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, meta.op, dtype_code(array.dtype),
                           meta.redop, array.ndim, 0, src, dst, gid, meta.seq, tag,
                           array.size, array.nbytes, offset, meta.sig_count, meta.root, *dims)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, meta.op, 0, meta.redop, 0, 0, src, dst,
                       gid, meta.seq, tag, 0, 0, 0, meta.sig_count, meta.root, 0, 0, 0, 0, 0, 0)


def with_offset(header: bytes, offset: int) -> bytes:
    """``header`` of part 0 re-stamped for the part starting at ``offset``."""
    return header[:_OFFSET_AT] + struct.pack("<Q", offset) + header[_OFFSET_AT + 8:]


def parse(frame: bytes) -> Optional[Header]:
    """The header in ``frame``, or None when it is not one of ours (wrong size, magic or
    version, or an INLINE frame whose length is not header + ``nbytes``): such a message
    is dropped."""
    size = len(frame)
    if size < HEADER.size:
        return None
    h = Header._make(HEADER.unpack_from(frame))
    if h.magic != MAGIC or h.version != PROTOCOL_VERSION:
        return None
    if size != HEADER.size and not (h.kind == Kind.INLINE and h.offset == 0 and
                                    0 < h.nbytes <= INLINE_MAX and size == HEADER.size + h.nbytes):
        return None
    return h


def pack_inline(header: bytes, payload: memoryview) -> bytes:
    """One INLINE frame: ``header`` (of a DATA message, re-stamped INLINE) then the
    tensor's ``payload`` bytes (at most :data:`INLINE_MAX`)."""
    return b"".join((header[:_KIND_AT], _INLINE_KIND, header[_KIND_AT + 1:], payload))


def part_size(nbytes: int, offset: int) -> int:
    """Bytes in the frame of the part at ``offset`` of a tensor of ``nbytes`` bytes."""
    return min(FRAME_MAX, nbytes - offset)


def describe(op: int, seq: int, dtype: int, count: int, shape: tuple, sig_count: int,
             root: int, redop: int) -> str:
    """A message (or an expected message) in words, for CollectiveMismatch."""
    name = OPS[op] if op < len(OPS) else f"op#{op}"
    text = name if seq == NO_SEQ else f"{name} (seq {seq})"
    text += f" of {dtype_name(dtype)}[{count}]"
    if shape and shape != (count,):
        text += f" shape {tuple(shape)}"
    extras = []
    if sig_count != ANY_COUNT and op != OP_CODES["send"]:
        extras.append(f"{sig_count} elements per rank")
    if root >= 0:
        extras.append(f"root {root}")
    if redop:
        extras.append(f"op {REDOP_NAMES.get(redop, redop)}")
    if extras:
        text += " (" + ", ".join(extras) + ")"
    return text
