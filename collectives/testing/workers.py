"""The worker side of a :class:`~collectives.testing.WorldPool`: :func:`serve`, what every
worker runs on its connection to the pool, whichever launcher started it.

A task is a module-level callable (pickled by name), a
:class:`~collectives.testing.functions.FunctionRef` (a function of a script, found by
the script's path) or a ``"module:function"`` name; a worker runs it as
``task(group, *args)``.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection
import os
import pickle
import signal
import sys
import traceback
from typing import Any, Callable, Optional, Union

from .. import settings
from ..spawn import die_with_parent

#: A function run on every rank as ``fn(group, *args)``: a module-level callable (pickled
#: by name), a :class:`~collectives.testing.functions.FunctionRef`, or a
#: ``"module:function"`` name.
Task = Union[str, Callable[..., Any]]

#: The environment variable naming the modules a worker imports before it joins.
PRELOAD_VARIABLE = settings.POOL_PRELOAD.name


def _resolve(task: Task) -> Callable[..., Any]:
    if callable(task):
        return task
    module, _, name = task.partition(":")
    return getattr(importlib.import_module(module), name)


def _error_reply(exc: BaseException) -> tuple:
    try:
        pickle.dumps(exc)
        carried: Optional[BaseException] = exc
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
        carried = None
    return ("error", type(exc).__name__, str(exc), traceback.format_exc(), carried)


def serve(conn: multiprocessing.connection.Connection,
          initializer: Optional[Task] = None) -> None:
    """A worker's life: import the modules named in ``COLLECTIVES_POOL_PRELOAD``
    (comma-separated), run ``initializer()``, join the world through
    :func:`collectives.init_process_group` (everything from the environment), say
    ``("ready", rank, pid)``, then answer ``("call", task, args)`` with ``("ok", value)``
    or ``("error", type name, message, traceback, exception)`` until ``("close",)``.

    Any launcher's workers run this with a duplex connection to the pool.
    """
    import collectives

    try:
        for module in filter(None, os.environ.get(PRELOAD_VARIABLE, "").split(",")):
            importlib.import_module(module)
        if initializer is not None:
            _resolve(initializer)()
        group = collectives.init_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the pool
        conn.send(_error_reply(exc))
        return
    conn.send(("ready", group.rank, os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the pool is gone
            break
        if message[0] == "close":
            try:
                group.close()
                conn.send(("ok", None))
            except BaseException as exc:  # noqa: BLE001 - reported to the pool
                conn.send(_error_reply(exc))
            break
        _, task, args = message
        try:
            reply: tuple = ("ok", _resolve(task)(group, *args))
        except BaseException as exc:  # noqa: BLE001 - reported to the pool
            reply = _error_reply(exc)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", type(exc).__name__,
                       f"could not send the result to the pool: {exc}",
                       traceback.format_exc(), None))
    conn.close()


def _spawned_worker(env: dict[str, str], conn: multiprocessing.connection.Connection,
                    initializer: Optional[Task]) -> None:
    """A worker of :func:`~collectives.testing.launchers.spawn_launcher`: ``env`` is its
    whole environment."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops us; Ctrl-C is its job
    os.environ.clear()      # (the whole environment of the caller: not a fork server's)
    os.environ.update(env)
    serve(conn, initializer)
    # The group is closed and the pool has its answer: skip the interpreter's slow
    # shutdown (seconds with torch loaded); what close() did not release shows as a leak.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

