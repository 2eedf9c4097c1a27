"""Waiting in the mpi backend (:mod:`backends.mpi`): the polling loop every wait runs,
:class:`MpiWork` (MPI's request(s) of one operation) and :class:`MpiDiagnostics` (the
errors an :class:`~backends.mpi.MpiGroup` raises: MPI's exceptions as this library's
typed errors, timeouts with the ranks that did not arrive).

They live together because they call each other: ``MpiWork.wait`` polls, and raises the
group's diagnosis when the poll times out; the poll, while it sleeps, answers the
questions of peers that are diagnosing their own timeout. MPI itself is the one
:func:`load_mpi` loaded (:mod:`backends.mpi_library`); importing this module does not
initialise it.

Waits and timeouts. Every wait (``Work.wait``, every blocking call, group creation)
polls MPI's request with ``Test()`` and a deadline instead of blocking in ``MPI_Wait``:
first ``Test()`` in a loop for ``COLLECTIVES_MPI_SPIN_US`` microseconds (default 1000),
calling ``os.sched_yield()`` after every poll when this host's ranks outnumber its cores
(the peer that must answer then gets the core) and after every 64 polls otherwise (like
MPICH's own loops; ``COLLECTIVES_MPI_YIELD_EVERY`` overrides), then ``time.sleep`` from
20 us doubling up to 1 ms, so a long wait costs almost no CPU. MPI makes progress only
inside these ``Test()`` calls (there is no progress thread); the 1 ms cap keeps them
frequent enough for large messages (``benchmarks/mpi_overhead.py`` measures the cost
against raw mpi4py). A wait that passes the group's timeout (or the ``timeout`` given to
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
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from collectives.buffers import HostBuffer
from collectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerError
from collectives.lifetime import open_groups
from collectives.work import Work

from .mpi_library import yield_every
from .mpi_library import load_mpi as _load_library

if TYPE_CHECKING:
    from .mpi import MpiGroup

__all__ = ["MpiDiagnostics", "MpiWork", "load_mpi"]

#: ``mpi4py.MPI`` once :func:`load_mpi` ran.
MPI: Any = None

#: Seconds of polling (``Test()``, with a ``sched_yield`` every ``_YIELD_EVERY`` polls)
#: before a wait starts sleeping.
_SPIN_S = float(os.environ.get("COLLECTIVES_MPI_SPIN_US", "1000")) * 1e-6
#: Polls between two ``sched_yield`` calls while spinning (set by :func:`load_mpi`, see
#: :func:`backends.mpi_library.yield_every`).
_YIELD_EVERY = 64
_SLEEP_MIN = 20e-6
_SLEEP_MAX = 1e-3
#: Seconds a rank that timed out waits for its peers to say where they are (at most).
_DIAG_BUDGET = 1.0
#: Tags ``MPI.TAG_UB - k`` on the auxiliary communicator: questions and answers of the
#: timeout diagnostics, arrivals and releases of new_group.
_DIAG_ASK, _DIAG_ANSWER, _ARRIVE, _RELEASE = 0, 1, 2, 3
_RESERVED_TAGS = 4


# ---------------------------------------------------------------------- initialisation
def load_mpi() -> Any:
    """``mpi4py.MPI``, initialising MPI on first use (:mod:`backends.mpi_library`), and
    this module's wait tuned to the host."""
    global MPI, _YIELD_EVERY
    if MPI is None:
        _YIELD_EVERY = yield_every(os.environ)
        MPI = _load_library()
    return MPI


# ------------------------------------------------------------------------------ polling
def _poll(test: Callable[[], bool], limit: float) -> bool:
    """Call ``test`` until it returns True (then True) or ``limit`` seconds passed (then
    False): yielding the CPU between calls for ``_SPIN_S``, then sleeping with a delay
    that doubles from 20 us to 1 ms. While sleeping, answer peers' questions about where
    this rank is (see :meth:`MpiDiagnostics._answer_peers`)."""
    if test():
        return True
    now = time.monotonic()
    deadline = now + limit
    spin_end = min(now + _SPIN_S, deadline)
    burst = min(_YIELD_EVERY, 16)  # polls between two looks at the clock
    bursts_per_yield, bursts = max(_YIELD_EVERY // burst, 1), 0
    yield_cpu = os.sched_yield
    while now < spin_end:
        for _ in range(burst):
            if test():
                return True
        bursts += 1
        if bursts >= bursts_per_yield:
            yield_cpu()
            bursts = 0
        now = time.monotonic()
    delay = _SLEEP_MIN
    while now < deadline:
        _answer_all_peers()
        time.sleep(min(delay, deadline - now))
        if test():
            return True
        delay = min(2 * delay, _SLEEP_MAX)
        now = time.monotonic()
    return test()


# ------------------------------------------------------------------------------- works
class MpiWork(Work):
    """One operation of an :class:`MpiGroup`: MPI's request(s) plus what remains to do once
    they completed (AVG's division, writing staged results back).

    ``wait(timeout)`` raises :class:`CollectiveTimeout` when the operation is still
    running after ``timeout`` seconds (the group's timeout when None); the operation goes
    on and may be waited for again.
    """

    __slots__ = ("_group", "_op", "_seq", "_peer", "_requests", "_then", "_buffers", "_keep",
                 "_lock", "_finished", "_error", "_timed_out")

    def __init__(self, group: "MpiGroup", op: str, seq: int, requests: list,
                 then: Optional[Callable[[], None]] = None,
                 buffers: Sequence[HostBuffer] = (), keep: Any = None,
                 peer: int = -1) -> None:
        self._group = group
        self._op, self._seq, self._peer = op, seq, peer
        self._requests = requests
        self._then = then
        self._buffers = buffers
        self._keep = keep  # the arrays MPI reads and writes, alive until completion
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None
        self._timed_out = False

    def _test(self) -> bool:
        """True once every request completed (or failed: then ``_error`` is set)."""
        with self._lock:
            if self._finished:
                return True
            try:
                reqs = self._requests
                return reqs[0].Test() if len(reqs) == 1 else MPI.Request.Testall(reqs)
            except MPI.Exception as exc:
                self._error = self._group._translate(exc, self._op, self._seq, self._peer)
                return True

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self._finished:
            limit = self._group.timeout if timeout is None else float(timeout)
            if not _poll(self._test, limit):
                self._group._keep_alive(self)
                raise self._group._timeout_error(self._op, self._seq, self._peer, limit,
                                                 explicit=timeout is not None)
            self._finish()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if not self._finished and self._test():
            self._finish()
        return self._finished

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                if self._error is None:
                    if self._then is not None:
                        self._then()
                    for b in self._buffers:
                        b.commit()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc
            finally:
                self._finished = True
                self._requests, self._then, self._buffers, self._keep = [], None, (), None
        self._group._untrack(self)


# ------------------------------------------------------------------------- diagnostics
_ASK_IDS = itertools.count(int.from_bytes(os.urandom(3), "little") << 20)


def _answer_all_peers() -> None:
    for group in open_groups(MpiDiagnostics):
        group._answer_peers()


class MpiDiagnostics:
    """The errors of an :class:`~backends.mpi.MpiGroup` (a mixin, before ProcessGroup in
    its bases so that ``_translate`` replaces the base class's default).

    ``MpiGroup.__init__`` sets what these methods use: ``_aux`` (the auxiliary
    communicator, None once closed), ``_diag_tags`` (the tags reserved at
    ``MPI.TAG_UB``), ``_answers`` (answers in flight, with their arrays) and
    ``_diag_lock``.
    """

    # ------------------------------------------------------------------ MPI's errors
    def _translate(self, exc: BaseException, op: str, seq: int, peer: int = -1) -> BaseException:
        """A typed error of this library for MPI's exception ``exc`` in ``op``."""
        if isinstance(exc, CollectiveError) or not isinstance(exc, MPI.Exception):
            return exc
        where = self._describe(op, seq)
        try:
            cls, text = exc.Get_error_class(), exc.Get_error_string().strip()
        except Exception:  # noqa: BLE001 - the error itself is what matters
            cls, text = -1, str(exc)
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
    def _answer_peers(self) -> None:
        """Tell every peer that asked how many collectives this rank entered here."""
        diag = self._aux
        if diag is None or not self._diag_lock.acquire(blocking=False):
            return
        try:
            status = MPI.Status()
            while True:
                message = diag.Improbe(MPI.ANY_SOURCE, self._diag_tags[_DIAG_ASK], status)
                if message is None:
                    break
                question = np.empty(2, np.int64)
                message.Recv([question, MPI.INT64_T])
                answer = np.array([question[0], self._seq], np.int64)
                self._answers.append(
                    (diag.Isend([answer, MPI.INT64_T], status.Get_source(),
                                self._diag_tags[_DIAG_ANSWER]),
                     answer))
            if self._answers:
                self._answers = [(r, a) for r, a in self._answers if not r.Test()]
        except MPI.Exception:
            pass  # diagnostics only
        finally:
            self._diag_lock.release()

    def _ask_peers(self, seq: int, budget: float) -> dict[int, Optional[int]]:
        """Every peer's count of collectives entered on this group (None: no answer
        within ``budget`` seconds)."""
        ask_id = next(_ASK_IDS)
        question = np.array([ask_id, seq], np.int64)
        peers = [r for r in range(self.size) if r != self.rank]
        answers: dict[int, Optional[int]] = dict.fromkeys(peers)
        try:
            ask, answer = self._diag_tags[_DIAG_ASK], self._diag_tags[_DIAG_ANSWER]
            sends = [self._aux.Isend([question, MPI.INT64_T], r, ask) for r in peers]
            with self._diag_lock:
                self._answers.extend((s, question) for s in sends)
            pending = set(peers)
            got = np.empty(2, np.int64)
            deadline = time.monotonic() + budget
            while pending and time.monotonic() < deadline:
                _answer_all_peers()  # peers that timed out too ask us meanwhile
                for r in sorted(pending):
                    while True:
                        message = self._aux.Improbe(r, answer)
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

    def _timeout_error(self, op: str, seq: int, peer: int, limit: float,
                       explicit: bool) -> CollectiveTimeout:
        where = self._describe(op, seq)
        if explicit:
            return CollectiveTimeout(f"{where}: still running after Work.wait(timeout={limit:g})",
                                     op=op, seq=seq, missing=(peer,) if peer >= 0 else ())
        if peer >= 0:
            return CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {limit:g} s; rank "
                f"{peer} did not post the matching operation", op=op, seq=seq, missing=(peer,))
        if seq < 0 or self.size == 1 or self._aux is None:
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
