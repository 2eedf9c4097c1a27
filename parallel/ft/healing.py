"""Healing: a replica that is new or behind receives the training state (model,
optimizer, step) from a healthy participant over the group, before it contributes.

The state travels as one pickled byte string, cut into chunks of ``chunk_bytes``; the
sender first sends the total length and a CRC-32 of every chunk, then the chunks, all by
point-to-point ``send``/``recv`` on a tag of its own, so that the other members need not
take part. The receiver checks every chunk against its CRC (a torn or misrouted transfer
is a :class:`HealingCorrupted` naming the chunk, never a silently wrong model) and
decodes the bytes with the transport's ``decode_object`` (a network backend refuses what
an unauthenticated peer could have sent). Pickling tensors copies their bytes exactly,
so the healed state is bitwise equal to the sender's.

Two ranks, rank 0 healthy, rank 1 new::

    if pg.rank == 0:
        send_state(pg, 1, {"model": model.state_dict(), "step": 7})
    else:
        state = receive_state(pg, 0)          # bitwise the same tensors
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import numpy as np

from collectives import CollectiveError, ProcessGroup

__all__ = ["HEAL_TAG", "HealingCorrupted", "receive_state", "send_state"]

#: The user tag healing messages travel on (below 2**31, as user tags must be).
HEAL_TAG = 0x4845414C   # "HEAL"
#: Bytes per chunk: small enough to bound a retry's waste, large enough to be fast.
CHUNK_BYTES = 4 << 20


class HealingCorrupted(CollectiveError):
    """A chunk of healing state arrived with a checksum that does not match."""


def _crc(chunk: np.ndarray) -> int:
    return zlib.crc32(memoryview(chunk)) & 0xFFFFFFFF


def send_state(group: ProcessGroup, dst: int, state: Any, *,
               chunk_bytes: int = CHUNK_BYTES) -> int:
    """Send ``state`` (any picklable value; tensors travel bit for bit) to rank ``dst``;
    returns the bytes sent. Errors are the group's (a dead receiver: ``PeerError``)."""
    payload = np.frombuffer(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    starts = range(0, len(payload), chunk_bytes)
    sums = np.array([_crc(payload[s:s + chunk_bytes]) for s in starts], np.int64)
    group.send(np.array([len(payload), chunk_bytes, len(sums)], np.int64), dst, HEAL_TAG)
    group.send(sums, dst, HEAL_TAG)
    for s in starts:
        group.send(payload[s:s + chunk_bytes], dst, HEAL_TAG)
    return len(payload)


def receive_state(group: ProcessGroup, src: int) -> Any:
    """The state rank ``src`` sent with :func:`send_state`, checked chunk by chunk."""
    where = f"[rank {group.rank}/{group.size}] receive_state from rank {src}"
    header = np.empty(3, np.int64)
    group.recv(header, src, HEAL_TAG)
    total, chunk_bytes, count = (int(v) for v in header)
    if total < 0 or chunk_bytes < 1 or count != -(-total // chunk_bytes):
        raise HealingCorrupted(f"{where}: a header that does not add up: {total} bytes in "
                               f"{count} chunks of {chunk_bytes}")
    sums = np.empty(count, np.int64)
    group.recv(sums, src, HEAL_TAG)
    payload = np.empty(total, np.uint8)
    for i, s in enumerate(range(0, total, chunk_bytes)):
        chunk = payload[s:s + chunk_bytes]
        group.recv(chunk, src, HEAL_TAG)
        if _crc(chunk) != int(sums[i]):
            raise HealingCorrupted(f"{where}: chunk {i} of {count} ({len(chunk)} bytes) "
                                   f"does not match its CRC-32")
    return group.transport.decode_object(payload, src)
