"""Writes into a peer's memory, and a rank's exit from a call that failed.

Two all_reduce paths of the shm backend write results into memory of other ranks: the
single copy (``cma.py``: the reduced block into every peer's array, through the
kernel) and symmetric memory (``symmetric.py``: the reduced piece into every peer's
buffer). On success the call's last phase orders those writes before any rank leaves.
A rank may also leave early with an error (a timeout, a failed peer, a failure of its
own) and hand its memory back to its caller, while a slower peer is still writing: that
would change the caller's data after the call returned.

So every such write is fenced against the target's exit, as a Dekker lock:

- the writer stores "writing into r" (``r + 1``) in its ``W_PUSHING`` control word,
  then loads r's state, writes only if r has neither failed nor closed, and clears the
  word after the write (the core's ``push_begin``/``push_end``, a 16 KiB piece or a
  quarter-MiB block at a time; :meth:`PushGuard._push_into` on the Python path);
- a rank leaving with an error stores its failed state (``ops._fail``), then loads every
  peer's ``W_PUSHING`` and waits while a live one names it
  (:meth:`PushGuard._await_pushers`).

With a full fence between each side's store and load, at least one of the two sees the
other's store: the writer skips the write (and raises PeerError naming the failed
rank), or the leaving rank waits for it to end. A piece takes microseconds, so that wait
is bounded by the group's timeout like every other: a peer stopped in the middle of a
piece for longer than that (a debugger, SIGSTOP) may still finish it after this rank
raised, and the error's note names it. Nothing else is written after the call returned.
"""

from __future__ import annotations

import time

import numpy as np

from collectives.errors import CollectiveError

from . import segment as sg


class PushGuard:
    """Mixed into ShmGroup: both sides of the fence above."""

    def _await_pushers(self) -> list:
        """After this rank marked itself failed: wait until no live peer is in the middle
        of a write into this rank's memory, at most the group's timeout; the ranks still
        writing then (empty unless one is stopped)."""
        u64 = self._u64
        if u64 is None or self.size == 1:
            return []
        self._bells.fence()
        lay, mine = self._layout, self.rank + 1
        deadline = time.monotonic() + self.timeout
        while True:
            writing = [r for r in self._peers
                       if u64[lay.ctrl_word(r, sg.W_PUSHING)] == mine and not self._dead(r)]
            if not writing or time.monotonic() >= deadline:
                return writing
            time.sleep(0.0002)

    def _raise_failed_peer(self) -> None:
        """A write into a peer was refused (the core's CANCELED / -ECANCELED): raise the
        PeerError naming the peer that failed or closed (or died, its cause)."""
        for r in self._peers:
            self._check_peer(r, self._op_name, self._op_seq, check_pid=True)
        raise CollectiveError(f"{self.where(self._op_name)} (seq {self._op_seq}): a write "
                              f"into a peer was refused, but no peer failed")

    def _push_into(self, r: int, view: np.ndarray, values: np.ndarray) -> None:
        """``view[...] = values`` where ``view`` is memory of rank ``r``, fenced against
        r's exit (the Python path's ``push_begin``/``push_end``): PeerError naming r,
        and nothing written, where r has failed or closed."""
        u64, word = self._u64, self._layout.ctrl_word(self.rank, sg.W_PUSHING)
        try:
            u64[word] = r + 1
            self._bells.fence()
            self._check_peer(r, self._op_name, self._op_seq, check_pid=False)
            np.copyto(view, values)
        finally:
            u64[word] = 0
