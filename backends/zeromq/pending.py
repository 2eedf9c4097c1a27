"""What one rank of a zmq world holds until its counterpart comes, by key ``(src, gid,
tag)``: receives posted before their message (in order), messages that arrived before
their receive (in order), and tensors of several parts whose first parts are in. Plain
tables, with the sweeps that a failure makes over them; which request meets which
message, and which fails, is :class:`~backends.zeromq.matching.Matcher`'s to decide
(under the engine's lock, which guards these tables too).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, Optional

from .calls import Message, Partial, Recv


class Pending:
    """Posted receives, early messages and partly received tensors."""

    def __init__(self) -> None:
        self._posted: dict[tuple, collections.deque] = {}
        self._unexpected: dict[tuple, collections.deque] = {}
        self._partial: dict[tuple, Partial] = {}

    # ----------------------------------------------------------------- one key
    def post(self, req: Recv) -> None:
        self._posted.setdefault(req.key, collections.deque()).append(req)

    def take_posted(self, key: tuple) -> Optional[Recv]:
        """The oldest receive posted for ``key``, no longer posted (None: none is)."""
        return _take_oldest(self._posted, key)

    def keep(self, key: tuple, msg: Message) -> None:
        """``msg`` arrived before its receive."""
        self._unexpected.setdefault(key, collections.deque()).append(msg)

    def take_unexpected(self, key: tuple) -> Optional[Message]:
        """The oldest message kept for ``key``, no longer kept (None: none is)."""
        return _take_oldest(self._unexpected, key)

    def partial(self, key: tuple) -> Optional[Partial]:
        return self._partial.get(key)

    def start_partial(self, key: tuple, part: Partial) -> None:
        self._partial[key] = part

    def end_partial(self, key: tuple) -> None:
        del self._partial[key]

    # ------------------------------------------------------------------- sweeps
    def unexpected_in(self, gid: int) -> Iterator[tuple[int, Message]]:
        """``(src, message)`` of every message kept for group ``gid``."""
        for key, q in self._unexpected.items():
            if key[1] == gid:
                for msg in q:
                    yield key[0], msg

    def drop_group(self, gid: int) -> None:
        """Forget everything of group ``gid`` (it was closed)."""
        for table in (self._unexpected, self._posted, self._partial):
            for key in [k for k in table if k[1] == gid]:
                del table[key]

    def drop_partial(self, key_ok: Callable[[tuple], bool],
                     req_ok: Optional[Callable[[Recv], bool]] = None) -> list[Recv]:
        """Forget the partly received tensors whose key is ``key_ok`` (and, given
        ``req_ok``, whose receive is); return their receives."""
        keys = [k for k, p in self._partial.items() if key_ok(k) and
                (req_ok is None or (p.req is not None and req_ok(p.req)))]
        dropped = [self._partial.pop(k).req for k in keys]
        return [r for r in dropped if r is not None]

    def drop_posted(self, key_ok: Callable[[tuple], bool],
                    req_ok: Optional[Callable[[Recv], bool]] = None) -> list[Recv]:
        """Forget the posted receives whose key is ``key_ok`` (and, given ``req_ok``,
        that are); return them."""
        dropped = []
        for key in [k for k in self._posted if key_ok(k)]:
            kept = collections.deque()
            for r in self._posted[key]:
                (dropped if req_ok is None or req_ok(r) else kept).append(r)
            if kept:
                self._posted[key] = kept
            else:
                del self._posted[key]
        return dropped

    def waiting(self) -> list[Recv]:
        """Every receive posted or partly received."""
        return [r for q in self._posted.values() for r in q] + \
            [p.req for p in self._partial.values() if p.req is not None]

    def clear(self) -> None:
        self._posted.clear()
        self._unexpected.clear()
        self._partial.clear()


def _take_oldest(table: dict, key: tuple) -> Any:
    q = table.get(key)
    if not q:
        return None
    item = q.popleft()
    if not q:  # keys (tags) change from call to call: empty queues would pile up
        del table[key]
    return item
