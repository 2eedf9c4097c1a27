"""``--trace FILE``: a Chrome trace of every rank's steps and collectives.

Open the file in ui.perfetto.dev or chrome://tracing: one row per rank (the process), the
training phases as slices, every collective as a slice from the call to the moment its
result was available to the caller (for ``async_op=True`` calls: to the return of
``Work.wait()``), and a separate ``wait`` slice for the time the caller was blocked
waiting. For DDP, the all-reduces start inside ``backward`` (overlap) and the ``wait``
slices at its end show the communication that was not hidden.

The tracer wraps the process group; strategies take it where they take a group::

    tracer = Tracer(pg.rank, enabled=args.trace is not None)
    model = DDP(net, tracer.wrap(pg))
    with tracer.span("backward"):
        loss.backward()
    tracer.write(pg, args.trace)        # every rank calls it; rank 0 writes the file
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from typing import Any, Iterator, Optional

_TRACED = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                     "reduce_scatter", "all_to_all", "barrier", "send", "recv", "isend",
                     "irecv"})


#: Persistent requests (collectives.persistent): each round, start() to wait(), is a
#: slice named after the collective it runs.
_TRACED_INIT = {"all_reduce_init": "all_reduce", "all_gather_init": "all_gather",
                "reduce_scatter_init": "reduce_scatter"}


def _now_us() -> float:
    return time.time() * 1e6  # wall clock: comparable between the ranks of one host


class Tracer:
    """Collects Chrome trace events for one rank; does nothing when not ``enabled``."""

    def __init__(self, rank: int, *, enabled: bool) -> None:
        self.rank, self.enabled = rank, enabled
        self.events: list[dict] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _add(self, **event: Any) -> None:
        with self._lock:
            self.events.append(dict(event, pid=self.rank))

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """A slice named ``name`` on this rank's main row."""
        if not self.enabled:
            yield
            return
        start = _now_us()
        try:
            yield
        finally:
            self._add(name=name, ph="X", ts=start, dur=_now_us() - start, tid=0, args=args)

    def add_slice(self, name: str, start_s: float, end_s: float, *, cat: str = "span",
                  **args: Any) -> None:
        """A slice measured elsewhere (``time.time()`` seconds) on this rank's main row."""
        if self.enabled:
            self._add(name=name, cat=cat, ph="X", ts=start_s * 1e6,
                      dur=(end_s - start_s) * 1e6, tid=0, args=args)

    def wrap(self, group: Any, label: Optional[str] = None) -> Any:
        """``group`` itself, or (when enabled) a proxy recording its collectives. With a
        ``label`` (a mesh dimension: ``"tp"``), each slice is named ``"tp all_reduce"`` and
        carries ``{"dim": "tp"}`` in its arguments."""
        return _TracedGroup(group, self, label) if self.enabled else group

    def write(self, group: Any, path: Optional[str]) -> None:
        """Gather every rank's events (a collective: call it on every rank); rank 0
        writes ``path``."""
        if not self.enabled or path is None:
            return
        everyone = group.all_gather_object(self.events) if group.size > 1 else [self.events]
        if group.rank == 0:
            events = [e for rank_events in everyone for e in rank_events]
            events += [{"name": "process_name", "ph": "M", "pid": r,
                        "args": {"name": f"rank {r}"}} for r in range(group.size)]
            with open(path, "w") as f:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


class _TracedGroup:
    """A process group whose collectives leave trace events; everything else passes through."""

    def __init__(self, group: Any, tracer: Tracer, label: Optional[str] = None) -> None:
        self._group, self._tracer, self._label = group, tracer, label

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        if name in _TRACED_INIT:
            op = _TRACED_INIT[name]
            slice_name = op if self._label is None else f"{self._label} {op}"
            return lambda *args, **kwargs: _TracedRequest(
                attr(*args, **kwargs), self._tracer, slice_name, self._label,
                next((a.numel() * a.element_size() for a in args if hasattr(a, "numel")), 0))
        if name not in _TRACED:
            return attr

        label = self._label
        slice_name = name if label is None else f"{label} {name}"

        def traced(*args: Any, **kwargs: Any) -> Any:
            tracer, ident = self._tracer, next(self._tracer._ids)
            nbytes = next((a.numel() * a.element_size() for a in args if hasattr(a, "numel")), 0)
            start = _now_us()
            info = {"bytes": nbytes} if label is None else {"bytes": nbytes, "dim": label}
            tracer._add(name=slice_name, cat="comm", ph="b", id=ident, ts=start, args=info)
            result = attr(*args, **kwargs)
            if result is None or not hasattr(result, "wait"):
                tracer._add(name=slice_name, cat="comm", ph="e", id=ident, ts=_now_us())
                return result
            return _TracedWork(result, tracer, slice_name, ident)

        return traced


class _TracedWork:
    def __init__(self, work: Any, tracer: Tracer, name: str, ident: int) -> None:
        self._work, self._tracer, self._name, self._id = work, tracer, name, ident
        self._open = True

    def wait(self, timeout: Optional[float] = None) -> None:
        with self._tracer.span(f"wait {self._name}"):
            self._work.wait(timeout)
        if self._open:
            self._open = False
            self._tracer._add(name=self._name, cat="comm", ph="e", id=self._id, ts=_now_us())

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _TracedRequest:
    """A persistent request whose rounds leave trace events, as the plain calls do."""

    def __init__(self, request: Any, tracer: Tracer, name: str, label: Optional[str],
                 nbytes: int) -> None:
        self._request, self._tracer, self._name = request, tracer, name
        self._info = {"bytes": nbytes} if label is None else {"bytes": nbytes, "dim": label}
        self._round: Optional[_TracedWork] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    def start(self) -> None:
        tracer, ident = self._tracer, next(self._tracer._ids)
        tracer._add(name=self._name, cat="comm", ph="b", id=ident, ts=_now_us(),
                    args=dict(self._info, persistent=True))
        self._request.start()
        self._round = _TracedWork(self._request, tracer, self._name, ident)

    def run(self) -> None:
        """A blocking round: its slice, and the rank waiting in it all along."""
        tracer, ident = self._tracer, next(self._tracer._ids)
        tracer._add(name=self._name, cat="comm", ph="b", id=ident, ts=_now_us(),
                    args=dict(self._info, persistent=True))
        with tracer.span(f"wait {self._name}"):
            self._request.run()
        tracer._add(name=self._name, cat="comm", ph="e", id=ident, ts=_now_us())

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._round is None:
            self._request.wait(timeout)
            return
        self._round.wait(timeout)
        self._round = None
