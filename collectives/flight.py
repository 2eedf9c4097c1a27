"""The flight recorder: every group remembers its last N operations, and writes them to
a file when one fails (and on SIGTERM and SIGUSR1: :mod:`collectives.flight_signals`), so
that ``collectives doctor`` can show where the ranks went different ways.

A hang in a distributed job is usually one rank that called something else, or nothing:
the rank that is stuck cannot see why. Each rank's record answers "what had I called,
in which order, with which shapes, and what was still running", and the doctor lines
the ranks' records up by sequence number.

Recording is on by default and costs one small list per call (see ``Recorder.start``);
``COLLECTIVES_FLIGHT_RECORDER=0`` turns it off, another number sets how many operations
each group keeps (default 256). Records are written to ``COLLECTIVES_FLIGHT_DIR``
(default: ``<tmp>/collectives-flight``), one JSON file per rank and group, in a folder
per job of which the last ``COLLECTIVES_FLIGHT_KEEP`` (default 10) are kept::

    /tmp/collectives-flight/<job>/<group>.rank1.json

Two ranks, rank 1 stuck in a barrier while rank 0 waits in an all_reduce: both raise
``CollectiveTimeout``, both write their records, and ``collectives doctor`` (the latest
job) says that at sequence number 7 rank 0 called all_reduce and rank 1 called barrier.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import tempfile
import time
from typing import Any, Optional, Sequence

from . import settings

#: How many operations a group keeps when ``COLLECTIVES_FLIGHT_RECORDER`` is unset.
DEFAULT_CAPACITY: int = settings.FLIGHT_RECORDER.default
#: The file format's version, checked by the doctor.
FORMAT = 1

# Field positions of a record (a list, for speed: one is made per call on the hot path).
SEQ, OP, SHAPE, DTYPE, ROOT, REDUCE_OP, PEER, START, END, STATE = range(10)
FIELDS = ("seq", "op", "shape", "dtype", "root", "reduce_op", "peer", "start", "end", "state")
#: Where a traced group's record carries its trace hook (collectives.trace), past FIELDS.
HOOK = len(FIELDS)


def flight_dir() -> str:
    """Where records are written (``COLLECTIVES_FLIGHT_DIR`` or ``<tmp>/collectives-flight``)."""
    return settings.FLIGHT_DIR.get() or os.path.join(tempfile.gettempdir(),
                                                     "collectives-flight")


def job_name() -> str:
    """A name shared by every rank of this job (so their files land together)."""
    from .launch import job_id
    job = job_id()
    return _safe(job.split("=", 1)[1]) if job else "job"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", name)[:120] or "job"


class Recorder:
    """The last ``capacity`` operations of one group, oldest first.

    >>> r = Recorder(2)
    >>> rec = r.start(0, "all_reduce", (4,), "float32", -1, "SUM", -1)
    >>> r.finish(rec)
    >>> r.records()[0]["state"]
    'ok'
    """

    def __init__(self, capacity: int) -> None:
        #: How many operations are kept.
        self.capacity = capacity
        #: How many job folders a dump leaves (read now: a bad value is an error when the
        #: group is made, not one that hides the failure being recorded).
        self.keep: int = settings.FLIGHT_KEEP.get()
        #: The error of the last dump that had one: a later dump (a SIGTERM that follows
        #: the failure) keeps saying what failed.
        self.last_error: Optional[str] = None
        self._ring: collections.deque = collections.deque(maxlen=capacity)
        #: Add a finished record (a tuple in the order of FIELDS) as it is: the fast
        #: path's one step per call (collectives.fast_path).
        self.append = self._ring.append

    def start(self, seq: int, op: str, shape: Any, dtype: Any, root: int, reduce_op: Any,
              peer: int) -> list:
        """Note that an operation began (``seq`` is -1 for point to point); returns the
        record to pass to :meth:`finish`. Values are kept as given and turned into text
        only when written: this runs on every call."""
        rec = [seq, op, shape, dtype, root, reduce_op, peer, time.time(), None, "running"]
        self._ring.append(rec)
        return rec

    @staticmethod
    def finish(rec: list, error: Optional[BaseException] = None) -> None:
        """Note that the operation of ``rec`` ended, successfully or with ``error``."""
        rec[END] = time.time()
        rec[STATE] = "ok" if error is None else f"{type(error).__name__}: {error}"
        if len(rec) > HOOK:   # a traced group's record: its end goes into the trace too
            rec[HOOK].ended(rec)

    def records(self) -> list[dict]:
        """The kept operations as plain dicts (JSON-ready), oldest first."""
        return [as_dict(rec) for rec in list(self._ring)]

    def dump(self, *, rank: int, size: int, backend: str, group: str,
             error: Optional[BaseException] = None, directory: Optional[str] = None,
             reason: Optional[str] = None, in_flight: Sequence[Sequence] = ()) -> str:
        """Write the record to ``<directory>/<job>/<group>.rank<rank>.json``; returns the
        path. Written to a temporary name and renamed, so a reader never sees half.
        ``reason`` says why when no error does (``"SIGTERM"``); ``in_flight``: records
        of calls still running that the ring does not hold yet (a fast call is added
        when it returns). The oldest job folders beyond ``COLLECTIVES_FLIGHT_KEEP`` are
        removed (:func:`prune`)."""
        if error is not None:
            self.last_error = f"{type(error).__name__}: {error}"
        root = directory or flight_dir()
        folder = os.path.join(root, job_name())
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{_safe(group)}.rank{rank}.json")
        document = {
            "format": FORMAT, "rank": rank, "size": size, "backend": backend,
            "group": group, "job": job_name(), "host": socket.gethostname(),
            "pid": os.getpid(), "written": time.time(),
            "error": self.last_error,
            "reason": reason if reason is not None else
            (None if error is None else type(error).__name__),
            "records": self.records() + [as_dict(rec) for rec in in_flight],
        }
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(document, f, indent=1)
        os.replace(tmp, path)
        if folder not in _PRUNED:   # once per job folder: a later dump adds no job
            _PRUNED.add(folder)
            prune(root, keep=self.keep, spare=folder)
        return path


#: The job folders this process has pruned beside already (:meth:`Recorder.dump`).
_PRUNED: set = set()


def job_folders(root: str) -> list[str]:
    """The job folders under ``root`` (those holding flight records), oldest first (by
    the time a record was last written into them)."""
    found = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        folder = os.path.join(root, name)
        try:
            files = os.listdir(folder)
        except OSError:   # not a folder, or gone
            continue
        if any(_RECORD.match(f) for f in files):
            found.append((os.path.getmtime(folder), folder))
    return [folder for _, folder in sorted(found)]


#: A record file's name: ``<group>.rank<r>.json`` (or its temporary while written).
_RECORD = re.compile(r".*\.rank\d+\.json(\.\d+\.tmp)?$")


def prune(root: str, *, keep: int, spare: Optional[str] = None) -> list[str]:
    """Remove the oldest job folders under ``root`` beyond the newest ``keep`` (never
    ``spare``, the one being written); a folder holding anything but flight records is
    left alone. Returns the folders removed.

    >>> prune("/nonexistent", keep=10)
    []
    """
    folders = job_folders(root)
    removed = []
    for folder in folders[:max(0, len(folders) - keep)]:
        if folder == spare:
            continue
        try:
            files = os.listdir(folder)
            if not all(_RECORD.match(f) for f in files):
                continue
            for f in files:
                os.unlink(os.path.join(folder, f))
            os.rmdir(folder)
            removed.append(folder)
        except OSError:   # another rank of another job pruned it first
            continue
    return removed


def as_dict(rec: Sequence) -> dict:
    """One record (a list or tuple in the order of FIELDS) as a JSON-ready dict."""
    d = dict(zip(FIELDS, rec))
    d["shape"] = None if rec[SHAPE] is None else [int(x) for x in rec[SHAPE]]
    d["dtype"] = None if rec[DTYPE] is None else _dtype_name(rec[DTYPE])
    d["reduce_op"] = None if rec[REDUCE_OP] is None else getattr(
        rec[REDUCE_OP], "name", str(rec[REDUCE_OP]))
    return d


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text
