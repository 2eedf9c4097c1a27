"""``collectives.trace``: a timeline of every rank's collectives and spans, streamed to
one file per rank as it happens, merged into one Chrome/Perfetto trace afterwards.

Switch it on for any program with a setting (every group the process makes is traced)::

    COLLECTIVES_TRACE=traces/ python train.py            # each rank: traces/rank<r>.jsonl
    collectives trace merge traces/ -o train.json        # then open it in ui.perfetto.dev

or in code, with a context manager around the work (two ranks, both)::

    from collectives import trace
    with trace.tracing("traces/"):
        pg = collectives.init_process_group()
        with trace.span("forward"):
            pg.all_reduce(t)
        pg.close()

Each rank writes JSON lines to ``<dir>/rank<r>.jsonl``, flushed line by line: a job that
crashes, is killed or hangs still leaves everything up to its last event (a collective
that never finished shows as a slice to the rank's last event, marked ``unfinished``).

What is recorded: every operation of every :class:`~collectives.ProcessGroup` traced (a
``"b"``/``"e"`` pair named after the op, with ``bytes``, ``seq``, ``group``, ``peer`` for
point to point, ``dim`` for a labelled group, and the outcome when it failed), the time
the caller spent in ``Work.wait()`` (an ``"X"`` slice ``wait <op>``), and the program's
own spans (:meth:`Tracer.span`, :meth:`Tracer.add_slice`). The hook is the group's flight
recorder (:mod:`collectives.flight`; with ``COLLECTIVES_FLIGHT_RECORDER=0`` a traced
group keeps a one-entry record). The begin is written when the call starts: a traced
group leaves the fast path of blocking calls, which records a call only once it returned
(each call then costs what the general path costs, plus two lines written).

Clocks: every timestamp is the rank's wall clock (``time.time()``, the flight recorder's
clock), so ranks of one host share it exactly. Each rank's file starts with its host and a
(wall clock, monotonic clock) pair, and :meth:`Tracer.mark` leaves a ``clock sync`` mark
right after a barrier on every rank; ``collectives trace merge`` shifts each other host's
ranks so that their mark lines up with rank 0's (see :mod:`collectives.trace_merge`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Iterator, Optional

import numpy as np

from . import buffers, flight, settings
from .trace_merge import FORMAT, rank_files, write_merged

__all__ = ["Tracer", "active", "span", "tracing", "to_file", "rank_file"]

_log = logging.getLogger("collectives.trace")


def rank_file(directory: str, rank: int) -> str:
    """The file rank ``rank`` streams its events to: ``<directory>/rank<rank>.jsonl``."""
    return os.path.join(directory, f"rank{rank}.jsonl")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


class Tracer:
    """The event stream of one rank (one process). ``directory=None`` makes a tracer that
    records nothing (what the examples hold without ``--trace``).

    Two ranks, each::

        tracer = Tracer("traces/", pg.rank, pg.size)   # opens traces/rank<r>.jsonl
        tracer.wrap(pg)                                # pg's operations go in the stream
        with tracer.span("backward"):
            loss.backward()
        tracer.close()
    """

    def __init__(self, directory: Optional[str], rank: int, size: int = 1) -> None:
        self.directory, self.rank, self.size = directory, rank, size
        self.enabled = directory is not None
        # Unique across ranks: Chrome matches async begin/end events by their id.
        self._ids = itertools.count(rank << 32)
        # Re-entrant: a signal handler may write (collectives.flight_signals) while the
        # main thread is half-way through a write of its own.
        self._lock = threading.RLock()
        self._file: Any = None
        if self.enabled:
            os.makedirs(directory, exist_ok=True)
            self.path = rank_file(directory, rank)
            if rank == 0:   # a previous, larger job's files would be merged with ours
                _remove_stale(directory, size)
            self._file = open(self.path, "w", buffering=1)   # line-buffered: one write a line
            self._write({"collectives_trace": FORMAT, "rank": rank, "size": size,
                         "host": socket.gethostname(), "pid": os.getpid(),
                         "wall": time.time(), "monotonic": time.monotonic()})

    # ------------------------------------------------------------------ writing
    def _write(self, event: dict) -> None:
        line = json.dumps(event, default=str) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)

    def event(self, **event: Any) -> None:
        """One Chrome trace event on this rank's row (``pid`` is the rank)."""
        if self.enabled:
            event.setdefault("tid", 0)
            self._write(dict(event, pid=self.rank))

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """A slice named ``name`` on this rank's row, around the block."""
        if not self.enabled:
            yield
            return
        start = time.time()
        try:
            yield
        finally:
            self.add_slice(name, start, time.time(), **args)

    def add_slice(self, name: str, start_s: float, end_s: float, *, cat: str = "span",
                  **args: Any) -> None:
        """A slice measured elsewhere (``time.time()`` seconds) on this rank's row."""
        self.event(name=name, cat=cat, ph="X", ts=_us(start_s), dur=_us(end_s - start_s),
                   args=args)

    def instant(self, name: str, **args: Any) -> None:
        """A point in time on this rank's row (a signal received, a mark)."""
        self.event(name=name, cat="mark", ph="i", s="p", ts=_us(time.time()), args=args)

    # ------------------------------------------------------------------ groups
    def wrap(self, group: Any, label: Optional[str] = None) -> Any:
        """Trace ``group``'s operations (a :class:`~collectives.ProcessGroup`); returns
        the group itself. With a ``label`` (a mesh dimension: ``"tp"``) each slice is
        named ``"tp all_reduce"`` and carries ``{"dim": "tp"}``. Anything that is not a
        ProcessGroup (a wrapper of one) is returned untouched."""
        if self.enabled and hasattr(group, "_recorder") and hasattr(group, "_flight_name"):
            recorder = group._recorder
            if isinstance(recorder, TracedRecorder) and recorder.tracer is self:
                recorder.label = label if label is not None else recorder.label
            else:
                group._recorder = TracedRecorder(self, group, label, recorder)
        return group

    def mark(self, group: Any, label: str = "clock sync") -> None:
        """A barrier on ``group``, then a mark with this rank's (wall, monotonic) clock
        pair: every rank leaves the barrier at nearly the same moment, which is what the
        merger aligns different hosts by. A collective: call it on every rank."""
        if not self.enabled:
            return
        group.barrier()
        self.instant(label, wall=time.time(), monotonic=time.monotonic(),
                     host=socket.gethostname())

    def close(self) -> None:
        """Stop recording and close the file. Idempotent."""
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.close()
        global _active
        if _active is self:
            _active = None

    def write(self, group: Any, path: Optional[str]) -> None:
        """End the trace of an example's ``--trace FILE`` (a collective: call it on every
        rank): a clock mark, every rank's file closed, then rank 0 merges the files into
        ``path``. The per-rank files stay beside it, in ``<FILE>.ranks/``."""
        if not self.enabled or path is None:
            return
        self.mark(group)
        self.close()
        group.barrier()   # every file complete before rank 0 reads them
        if group.rank == 0:
            write_merged(self.directory, path)


class TracedRecorder(flight.Recorder):
    """A group's flight recorder that also writes each operation to the tracer's stream:
    its start when it begins, its end when it finishes (see :meth:`flight.Recorder.finish`,
    which calls the hook this recorder attaches to each record)."""

    def __init__(self, tracer: Tracer, group: Any, label: Optional[str],
                 previous: Optional[flight.Recorder]) -> None:
        super().__init__(previous.capacity if previous is not None else 1)
        if previous is not None:     # its records, and a failure already dumped, stay
            self._ring.extend(previous._ring)
            self.last_error = previous.last_error
        self.tracer, self.label, self.group_name = tracer, label, group._flight_name
        self.append = self._append   # (the base class binds the ring's append)
        # The fast path records a call when it returns; the general path when it starts,
        # which the trace of a rank that hangs in a call needs.
        group._fast = False

    def _name(self, op: str) -> str:
        return op if self.label is None else f"{self.label} {op}"

    def _begin(self, rec: Any) -> int:
        ident = next(self.tracer._ids)
        args: dict[str, Any] = {"bytes": _nbytes(rec[flight.SHAPE], rec[flight.DTYPE]),
                                "group": self.group_name}
        if rec[flight.SEQ] >= 0:
            args["seq"] = rec[flight.SEQ]
        if rec[flight.PEER] >= 0:
            args["peer"] = rec[flight.PEER]
        if self.label is not None:
            args["dim"] = self.label
        self.tracer.event(name=self._name(rec[flight.OP]), cat="comm", ph="b", id=ident,
                          ts=_us(rec[flight.START]), args=args)
        return ident

    def _end(self, ident: int, rec: Any) -> None:
        args = {} if rec[flight.STATE] == "ok" else {"state": rec[flight.STATE]}
        self.tracer.event(name=self._name(rec[flight.OP]), cat="comm", ph="e", id=ident,
                          ts=_us(rec[flight.END] or time.time()), args=args)

    def blocked(self, op: str) -> Any:
        """A ``wait <op>`` slice around a block where the caller waits for ``op``
        (a persistent request's blocking ``run()``)."""
        return self.tracer.span(f"wait {self._name(op)}")

    def start(self, seq: int, op: str, shape: Any, dtype: Any, root: int, reduce_op: Any,
              peer: int) -> list:
        rec = super().start(seq, op, shape, dtype, root, reduce_op, peer)
        rec.append(_Hook(self, self._begin(rec)))
        return rec

    def _append(self, rec: Any) -> None:
        """A record added whole: a fast call that finished (a tuple: both events now) or
        one that failed (a list still running: its end comes through the hook)."""
        self._ring.append(rec)
        ident = self._begin(rec)
        if rec[flight.STATE] == "running":
            rec.append(_Hook(self, ident))
        else:
            self._end(ident, rec)


class _Hook:
    """What a traced record carries past its fields: the end event, written once, and
    the ``wait`` slice of an async call (``running.GroupWork.wait``)."""

    __slots__ = ("recorder", "ident", "done")

    def __init__(self, recorder: TracedRecorder, ident: int) -> None:
        self.recorder, self.ident, self.done = recorder, ident, False

    def ended(self, rec: Any) -> None:
        if not self.done:
            self.done = True
            self.recorder._end(self.ident, rec)

    def waited(self, rec: Any, start: float, end: float) -> None:
        self.recorder.tracer.add_slice(f"wait {self.recorder._name(rec[flight.OP])}",
                                       start, end)


def _remove_stale(directory: str, size: int) -> None:
    for rank, path in rank_files(directory).items():
        if rank >= size:
            with contextlib.suppress(OSError):
                os.unlink(path)


def to_file(group: Any, path: Optional[str]) -> Tracer:
    """The tracer of an example's ``--trace FILE`` (``path``; None: a tracer that records
    nothing): every rank streams to ``<FILE>.ranks/rank<r>.jsonl`` the groups it is
    given (:meth:`Tracer.wrap`: the program picks them and their labels) and its spans,
    and :meth:`Tracer.write` merges the files into ``FILE`` at the end. A job that dies
    first leaves the folder: ``collectives trace merge FILE.ranks -o FILE``. A
    collective (a clock mark): call it on every rank of ``group``.

    Two ranks, each::

        tracer = trace.to_file(pg, "ddp.json")
        model = DDP(net, tracer.wrap(pg))
        with tracer.span("forward"): ...
        tracer.write(pg, "ddp.json")
    """
    tracer = Tracer(None if path is None else f"{path}.ranks", group.rank, group.size)
    tracer.mark(group)
    return tracer


def _nbytes(shape: Any, dtype: Any) -> int:
    if shape is None or dtype is None:
        return 0
    try:
        count = 1
        for n in shape:
            count *= int(n)
        if isinstance(dtype, np.dtype):
            return count * dtype.itemsize
        travels_as = buffers.torch_numpy_dtype(sys.modules["torch"], dtype)  # bfloat16 too
        return 0 if travels_as is None else count * travels_as.itemsize
    except (TypeError, ValueError, KeyError):
        return 0


# ------------------------------------------------------------ the process's tracer
_active: Optional[Tracer] = None
_pending_dir: Optional[str] = None   # tracing(dir) entered before the first group


def active() -> Optional[Tracer]:
    """The tracer every new group of this process joins, or None."""
    return _active


def span(name: str, **args: Any) -> Any:
    """``active().span(name)`` when the process is traced, else a block that does nothing."""
    return _active.span(name, **args) if _active is not None else contextlib.nullcontext()


def group_created(group: Any) -> None:
    """Called by every new :class:`~collectives.ProcessGroup`: join the process's tracer,
    starting it now when ``tracing(dir)`` (or ``COLLECTIVES_TRACE``) waits for the first
    group to know this process's rank."""
    global _active
    if _active is None:
        directory = _pending_dir or settings.TRACE.get()
        if directory is None:
            return
        _active = Tracer(directory, group.rank, group.size)
        _log.info("tracing rank %d to %s", group.rank, _active.path)
    _active.wrap(group)


def start_from_settings(group: Any) -> None:
    """After ``init_process_group``: with tracing on, a clock mark on the new world."""
    if _active is not None and _active.enabled:
        _active.mark(group)


@contextlib.contextmanager
def tracing(directory: str) -> Iterator[None]:
    """Trace every group this process makes inside the block to
    ``<directory>/rank<r>.jsonl`` (the rank is the first group's: make the world first).
    The file is closed when the block ends."""
    global _pending_dir
    if _active is not None or _pending_dir is not None:
        raise RuntimeError("collectives.trace.tracing: this process is traced already")
    _pending_dir = directory
    try:
        yield
    finally:
        _pending_dir = None
        if _active is not None:
            _active.close()

