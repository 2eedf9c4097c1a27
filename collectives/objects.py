"""Object collectives (mixed into :class:`~collectives.group.ProcessGroup`):
``broadcast_object`` and ``all_gather_object``, for set-up metadata, never for tensors.

Objects travel pickled through the group's own tensor collectives. A rank that cannot
pickle its object tells the others first, so every rank raises instead of waiting.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import numpy as np

from .errors import CollectiveError


class ObjectCalls:
    """The object collectives over the group's ``broadcast``/``all_gather``."""

    def _pickled(self, obj: Any, where: str) -> tuple[Optional[np.ndarray], Optional[TypeError]]:
        """``obj`` pickled (see ``_encode_object``), or the TypeError naming the call that
        the rank raises once it told its peers (so that they raise too, not wait)."""
        try:
            return self._encode_object(obj), None
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            error = TypeError(f"{where}: argument `obj` cannot be pickled "
                              f"({type(exc).__name__}: {exc})")
            error.__cause__ = exc
            return None, error

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank (pickled; for set-up metadata).

        Both ranks: ``cfg = pg.broadcast_object({"lr": 0.1} if pg.rank == 0 else None)``.
        """
        w = self._where("broadcast_object")
        src = self._check_rank(src, "src", w)
        payload, error = self._pickled(obj, w) if self.rank == src else (None, None)
        # The length goes first, -1 when `src` could not pickle its object: then every
        # rank raises, instead of the others waiting for bytes that never come.
        length = np.array([-1 if error else 0 if payload is None else payload.size],
                          np.int64)
        self.broadcast(length, src)
        if error is not None:
            raise error
        if length[0] < 0:
            raise CollectiveError(f"{w}: rank {src} could not pickle its object (a "
                                  f"TypeError there says why); nothing was sent")
        data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
        self.broadcast(data, src)
        return obj if self.rank == src else self._decode_object(data, src)

    def all_gather_object(self, obj: Any) -> list:
        """Return the list of every rank's ``obj`` in rank order (pickled).

        Both ranks: ``pg.all_gather_object(pg.rank)`` -> ``[0, 1]``.
        """
        w = self._where("all_gather_object")
        payload, error = self._pickled(obj, w)
        lengths = np.empty(self.size, np.int64)  # -1: that rank could not pickle its object
        self.all_gather(lengths, np.array([-1 if error else payload.size], np.int64))
        if error is not None:
            raise error
        if lengths.min() < 0:
            failed = [r for r in range(self.size) if lengths[r] < 0]
            raise CollectiveError(f"{w}: ranks {failed} could not pickle their objects (a "
                                  f"TypeError there says why); nothing was exchanged")
        longest = int(lengths.max())
        padded = np.zeros(longest, np.uint8)
        padded[:payload.size] = payload
        everything = np.empty(self.size * longest, np.uint8)
        self.all_gather(everything, padded)
        return [obj if r == self.rank else
                self._decode_object(everything[r * longest:r * longest + int(lengths[r])], r)
                for r in range(self.size)]

    def _encode_object(self, obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                             np.uint8).copy()

    def _decode_object(self, data: np.ndarray, src: int) -> Any:
        """Unpickle bytes from ``src``. Backends whose peers are not trusted (a network)
        override this (or the object collectives) with an authenticated route."""
        return pickle.loads(data.tobytes())
