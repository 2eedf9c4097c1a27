"""The errors of the mpi backend: MPI's exceptions as this library's typed errors, and
the diagnosis of a timeout (which ranks did not arrive).

Timeouts. A wait that passes the group's timeout (or the ``timeout`` given to
``Work.wait``) raises :class:`CollectiveTimeout` with the op, its sequence number and,
where knowable, the missing ranks:

- point to point: the peer;
- collectives: the waiting rank asks every peer, over the auxiliary communicator (tags
  reserved at ``MPI.TAG_UB``), how many collectives it has entered on this group. A rank
  waiting anywhere in this library (any group) answers from its polling loop; a rank that
  has not entered the collective, or does not answer in time (a tenth of the timeout,
  between 0.2 s and 1 s, added to the wait: it is computing, sleeping, hung or dead), is
  named in ``missing``. The operation stays posted in MPI (MPI cannot cancel a
  collective): if the late rank arrives, it completes and may still write the tensor.
  Collectives match in issue order, so the group remains usable in principle; after a
  timeout the usual course is to stop the job.

MPI's errors: a truncated message (ranks passing different sizes or dtypes) is a
:class:`CollectiveMismatch`, a failed process (where MPI reports one) a
:class:`PeerError`, anything else a :class:`CollectiveError`, each with MPI's exception
as its cause.

When a rank dies. Under MPICH's ``mpiexec`` (Hydra) a rank that exits without
``MPI_Finalize`` (killed by a signal, ``os._exit``, a segfault, the OOM killer) makes the
launcher kill every other rank at once with SIGKILL: the surviving ranks see no Python
exception (no ``finally`` runs, nothing is printed by them) and ``mpiexec`` exits with the
dead rank's exit status, printing "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
... KILLED BY SIGNAL" (exit status 9) when a signal killed it. A rank that ends by an
uncaught Python exception still runs ``MPI_Finalize`` at exit (mpi4py does it), so MPI
considers it finished: the others wait until their group timeout and raise
``CollectiveTimeout`` naming it (it does not answer). Run scripts as ``python -m mpi4py
script.py`` to abort the whole job at the first uncaught exception instead. Open MPI's
``mpirun`` likewise aborts the job when a rank dies.

Two ranks, rank 1 never arrives: ``pg.all_reduce(t)`` on rank 0 raises
``CollectiveTimeout: ... ranks [1] did not arrive: rank 1 has entered only 3
collective(s) of this group, not yet seq 3``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from typing import Any, Optional

import numpy as np

from collectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerError

from . import library

__all__ = ["Diagnostics", "answer_all_peers"]

#: Seconds a rank that timed out waits for its peers to say where they are (at most).
_DIAG_BUDGET = 1.0
#: Tags ``MPI.TAG_UB - k`` on the auxiliary communicator: questions and answers of the
#: timeout diagnostics, arrivals and releases of new_group.
DIAG_ASK, DIAG_ANSWER, ARRIVE, RELEASE = 0, 1, 2, 3
RESERVED_TAGS = 4

_ASK_IDS = itertools.count(int.from_bytes(os.urandom(3), "little") << 20)
#: Every open group's diagnostics: a rank waiting anywhere answers for all of them.
_LIVE: "weakref.WeakSet[Diagnostics]" = weakref.WeakSet()


def answer_all_peers() -> None:
    """Answer the questions peers asked any open group of this process (what a wait
    does while it sleeps)."""
    for diagnostics in list(_LIVE):
        diagnostics.answer_peers()


class Diagnostics:
    """The errors of one :class:`~backends.mpi.backend.MpiBackend`: ``translate`` MPI's
    exceptions, ``timeout_error`` (asking the peers where they are), and
    ``answer_peers`` (this rank's side of those questions).

    It reads the backend's ``aux`` communicator (None once closed), ``tag_ub``,
    ``entered`` (collectives entered so far) and ``describe_call``.
    """

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        ub = backend.tag_ub
        self.tags = [ub - k for k in range(RESERVED_TAGS)]
        self._answers: list = []
        self._lock = threading.Lock()
        _LIVE.add(self)

    def close(self) -> None:
        _LIVE.discard(self)

    # ------------------------------------------------------------------ MPI's errors
    def translate(self, exc: BaseException, op: str, seq: int, peer: int = -1) -> BaseException:
        """A typed error of this library for MPI's exception ``exc`` in ``op``."""
        if isinstance(exc, CollectiveError) or not isinstance(exc, library.MPI.Exception):
            return exc
        where = self._backend.describe_call(op, seq)
        try:
            cls, text = exc.Get_error_class(), exc.Get_error_string().strip()
        except Exception:  # noqa: BLE001 - the error itself is what matters
            cls, text = -1, str(exc)
        MPI = library.MPI
        failed = {getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                  "ERR_REVOKED")} - {None}
        if cls == MPI.ERR_TRUNCATE:
            error: BaseException = CollectiveMismatch(
                f"{where}: a message was longer than the receive buffer (did the ranks pass "
                f"different sizes or dtypes?): {text}")
        elif cls in failed:
            error = PeerError(f"{where}: a peer rank failed: {text}", peer=peer)
        else:
            error = CollectiveError(f"{where}: MPI error: {text}")
        error.__cause__ = exc
        return error

    # ------------------------------------------------------------------ diagnostics
    def answer_peers(self) -> None:
        """Tell every peer that asked how many collectives this rank entered here."""
        diag = self._backend.aux
        if diag is None or not self._lock.acquire(blocking=False):
            return
        MPI = library.MPI
        try:
            status = MPI.Status()
            while True:
                message = diag.Improbe(MPI.ANY_SOURCE, self.tags[DIAG_ASK], status)
                if message is None:
                    break
                question = np.empty(2, np.int64)
                message.Recv([question, MPI.INT64_T])
                answer = np.array([question[0], self._backend.entered], np.int64)
                self._answers.append(
                    (diag.Isend([answer, MPI.INT64_T], status.Get_source(),
                                self.tags[DIAG_ANSWER]),
                     answer))
            if self._answers:
                self._answers = [(r, a) for r, a in self._answers if not r.Test()]
        except MPI.Exception:
            pass  # diagnostics only
        finally:
            self._lock.release()

    def _ask_peers(self, seq: int, budget: float) -> dict[int, Optional[int]]:
        """Every peer's count of collectives entered on this group (None: no answer
        within ``budget`` seconds)."""
        MPI, backend = library.MPI, self._backend
        ask_id = next(_ASK_IDS)
        question = np.array([ask_id, seq], np.int64)
        peers = [r for r in range(backend.size) if r != backend.rank]
        answers: dict[int, Optional[int]] = dict.fromkeys(peers)
        try:
            ask, answer = self.tags[DIAG_ASK], self.tags[DIAG_ANSWER]
            aux = backend.aux
            sends = [aux.Isend([question, MPI.INT64_T], r, ask) for r in peers]
            with self._lock:
                self._answers.extend((s, question) for s in sends)
            pending = set(peers)
            got = np.empty(2, np.int64)
            deadline = time.monotonic() + budget
            while pending and time.monotonic() < deadline:
                answer_all_peers()  # peers that timed out too ask us meanwhile
                for r in sorted(pending):
                    while True:
                        message = aux.Improbe(r, answer)
                        if message is None:
                            break
                        message.Recv([got, MPI.INT64_T])
                        if got[0] == ask_id:  # not the answer to an earlier question
                            answers[r] = int(got[1])
                            pending.discard(r)
                            break
                if pending:
                    time.sleep(1e-3)
        except MPI.Exception:
            pass
        return answers

    def timeout_error(self, op: str, seq: int, peer: int, limit: float,
                      explicit: bool) -> CollectiveTimeout:
        backend = self._backend
        where = backend.describe_call(op, seq)
        if explicit:
            return CollectiveTimeout(f"{where}: still running after Work.wait(timeout={limit:g})",
                                     op=op, seq=seq, missing=(peer,) if peer >= 0 else ())
        if peer >= 0:
            return CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {limit:g} s; rank "
                f"{peer} did not post the matching operation", op=op, seq=seq, missing=(peer,))
        if seq < 0 or backend.size == 1 or backend.aux is None:
            return CollectiveTimeout(f"{where}: did not complete within the group timeout of "
                                     f"{limit:g} s", op=op, seq=seq)
        budget = min(_DIAG_BUDGET, max(0.2, 0.1 * limit))
        answers = self._ask_peers(seq, budget)
        missing, notes = [], []
        for r, entered in sorted(answers.items()):
            if entered is None:
                missing.append(r)
                notes.append(f"rank {r} did not answer within {budget:g} s (it is not "
                             f"waiting in this library: computing, sleeping, hung or dead)")
            elif entered <= seq:
                missing.append(r)
                notes.append(f"rank {r} has entered only {entered} collective(s) of this "
                             f"group, not yet seq {seq}")
        if missing:
            detail = f"ranks {missing} did not arrive: " + "; ".join(notes)
        else:
            detail = ("every rank entered this collective but MPI did not complete it (did "
                      "the ranks call different collectives, or pass different sizes?)")
        return CollectiveTimeout(f"{where}: did not complete within the group timeout of "
                                 f"{limit:g} s; {detail}", op=op, seq=seq, missing=missing)
