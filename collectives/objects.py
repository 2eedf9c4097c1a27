"""Object collectives of a :class:`~collectives.group.ProcessGroup`:
``broadcast_object`` and ``all_gather_object``, for set-up metadata, never for tensors.

Objects travel pickled through the group's own tensor collectives. A rank that cannot
pickle its object tells the others first, so every rank raises instead of waiting. The
backend unpickles (``Backend.decode_object``): a network backend refuses what an
unauthenticated peer could have sent.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import numpy as np

from .errors import CollectiveError


def _pickled(obj: Any, where: str) -> tuple[Optional[np.ndarray], Optional[TypeError]]:
    """``obj`` pickled, or the TypeError naming the call that the rank raises once it
    told its peers (so that they raise too, not wait)."""
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                             np.uint8).copy(), None
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        error = TypeError(f"{where}: argument `obj` cannot be pickled "
                          f"({type(exc).__name__}: {exc})")
        error.__cause__ = exc
        return None, error


def broadcast_object(group: Any, obj: Any, src: int) -> Any:
    """``pg.broadcast_object(obj, src)``: rank ``src``'s ``obj`` on every rank."""
    w = group._where("broadcast_object")
    src = group._args.rank_of(src, "src", w)
    payload, error = _pickled(obj, w) if group.rank == src else (None, None)
    # The length goes first, -1 when `src` could not pickle its object: then every
    # rank raises, instead of the others waiting for bytes that never come.
    length = np.array([-1 if error else 0 if payload is None else payload.size], np.int64)
    group.broadcast(length, src)
    if error is not None:
        raise error
    if length[0] < 0:
        raise CollectiveError(f"{w}: rank {src} could not pickle its object (a "
                              f"TypeError there says why); nothing was sent")
    data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
    group.broadcast(data, src)
    return obj if group.rank == src else group.transport.decode_object(data, src)


def all_gather_object(group: Any, obj: Any) -> list:
    """``pg.all_gather_object(obj)``: every rank's ``obj`` in rank order."""
    w = group._where("all_gather_object")
    payload, error = _pickled(obj, w)
    lengths = np.empty(group.size, np.int64)  # -1: that rank could not pickle its object
    group.all_gather(lengths, np.array([-1 if error else payload.size], np.int64))
    if error is not None:
        raise error
    if lengths.min() < 0:
        failed = [r for r in range(group.size) if lengths[r] < 0]
        raise CollectiveError(f"{w}: ranks {failed} could not pickle their objects (a "
                              f"TypeError there says why); nothing was exchanged")
    longest = int(lengths.max())
    padded = np.zeros(longest, np.uint8)
    padded[:payload.size] = payload
    everything = np.empty(group.size * longest, np.uint8)
    group.all_gather(everything, padded)
    decode = group.transport.decode_object
    return [obj if r == group.rank else
            decode(everything[r * longest:r * longest + int(lengths[r])], r)
            for r in range(group.size)]
