"""Flight records written on request: on SIGTERM (a launcher or a scheduler stopping the
job, often because a peer failed), and on SIGUSR1 (ask a hung job where it is, without
stopping it).

Every open :class:`~collectives.ProcessGroup` registers here; the first one made in the
main thread installs the handlers. A handler writes the record of every open group of
the process (``reason`` ``"SIGTERM"``/``"SIGUSR1"`` in the file), notes the signal in the
trace when the process is traced, then hands the signal on to the handler that was
there before (a function is called; SIGTERM's default action still terminates the
process, by the same signal, so its exit status is unchanged). SIGUSR1 with no handler
before only writes the records.

Python runs a signal handler in the main thread between two bytecodes: a rank blocked
inside a wait writes its record when the wait next wakes up (every wait of the library
does, at least every few milliseconds, to check its deadline).

Two ranks, rank 1 hung in a barrier: ``kill -USR1 <pid of rank 1>`` writes
``<tmp>/collectives-flight/<job>/world.rank1.json``; ``collectives doctor`` reads it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any, Callable, Optional, Union

__all__ = ["register", "unregister", "dump_open_groups", "install", "is_ours"]

_log = logging.getLogger("collectives.flight")

#: The signals that write the records.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

from . import fast_path, running

_FAST_FILES = {fast_path.__file__, running.__file__}
_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
_previous: dict[int, Union[Callable[..., Any], int, None]] = {}
_installed_in: Optional[int] = None   # the pid that installed them (a fork re-installs)


def register(group: Any) -> None:
    """Note an open group; install the handlers when this is the main thread."""
    _groups.add(group)
    install()


def unregister(group: Any) -> None:
    """A closed group: nothing left to write."""
    _groups.discard(group)


def dump_open_groups(reason: str) -> list[str]:
    """Write the flight record of every open group of the process; returns the paths.
    A record that cannot be written is logged and skipped."""
    paths = []
    for group in list(_groups):
        recorder = getattr(group, "_recorder", None)
        if recorder is None or getattr(group, "_closed", True):
            continue
        try:
            paths.append(recorder.dump(rank=group.rank, size=group.size,
                                       backend=group.backend, group=group._flight_name,
                                       reason=reason, in_flight=fast_calls_running(group)))
        except OSError as exc:
            _log.warning("could not write the flight record of group %r on %s: %s",
                         group._flight_name, reason, exc)
    if paths:
        _log.warning("%s: flight records written to %s", reason, ", ".join(paths))
    return paths


#: The fast path's functions (collectives.fast_path, running.run_numbered): they add a
#: call's record when it returns, so one still running is found in their frames.
_FAST_FRAMES = {"fast_collective", "fast_p2p", "run_numbered"}


def fast_calls_running(group: Any) -> list[tuple]:
    """The records of ``group``'s fast-path calls running in any thread now (a rank hung
    in a blocking all_reduce), read from the callers' frames: the hot path pays nothing
    for a record it might never need."""
    found = []
    for top in sys._current_frames().values():
        frame = top
        while frame is not None:
            code = frame.f_code
            if code.co_name in _FAST_FRAMES and code.co_filename in _FAST_FILES:
                seen = frame.f_locals
                if seen.get("group") is group and "t0" in seen:
                    p2p = code.co_name == "fast_p2p"
                    found.append((-1 if p2p else seen["seq"], seen["op"], seen["shape"],
                                  seen["dtype"], -1 if p2p else seen["root"],
                                  None if p2p else seen["reduce_op"],
                                  seen["peer"] if p2p else -1, seen["t0"], None, "running"))
            frame = frame.f_back
    return found


def _handle(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    dump_open_groups(name)
    from . import trace
    tracer = trace.active()
    if tracer is not None:
        tracer.instant(f"signal {name}")
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous in (signal.SIG_DFL, None) and signum == signal.SIGTERM:
        # The default action, as if we had not been there: die by this signal.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def is_ours(handler: Any) -> bool:
    """Whether ``handler`` (from ``signal.getsignal``) is this module's."""
    return handler is _handle


def previous_handler(signum: int) -> Any:
    """The handler ours replaced for ``signum`` (what a launcher that treats SIGTERM
    itself may chain to)."""
    return _previous.get(signum, signal.SIG_DFL)


def install() -> None:
    """Install the handlers (idempotent per process; only from the main thread, where
    Python allows it). A handler installed later by the application replaces ours and
    is not chained to: it decides."""
    global _installed_in
    if _installed_in == os.getpid() or \
            threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if is_ours(current):
            continue
        _previous[sig] = current
        signal.signal(sig, _handle)
    _installed_in = os.getpid()
