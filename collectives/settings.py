"""Every ``COLLECTIVES_*`` environment variable, in one typed table.

Library code reads a variable only through its row here (``settings.TIMEOUT.get()``), so
each has one name, one type, one default and one line of documentation, and a bad value
is one clear ``ValueError`` naming the variable, what it holds and what it may hold. No
other module of ``collectives``, ``backends`` or ``parallel`` spells a variable's name
(``tests/test_settings.py`` fails if one does): messages that mention one format
``setting.name``.

:func:`check_environment` (run once per process by ``init_process_group``) warns about a
``COLLECTIVES_*`` variable the table does not know, naming the nearest known one: a typo
in a tuning variable would otherwise be ignored in silence.

The documentation site's table of variables (docs/settings.md) is generated from this
table when the site is built; in a terminal::

    python -m collectives.settings            # the table, as Markdown

Two ranks, both::

    from collectives import settings
    settings.TIMEOUT.get()                    # 300.0, or COLLECTIVES_TIMEOUT as a float
    settings.SHM_WAIT.get({"COLLECTIVES_SHM_WAIT": "sleep"})   # 'sleep'
"""

from __future__ import annotations

import difflib
import os
import shlex
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["Setting", "SETTINGS", "check_environment", "markdown_table", "by_name"]

PREFIX = "COLLECTIVES_"


# --------------------------------------------------------------------------- parsers
def _integer(text: str) -> int:
    return int(text, 0)


def _number(text: str) -> float:
    value = float(text)
    if value != value:  # NaN
        raise ValueError("not a number")
    return value


def _flag(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("not 0 or 1")


def _text(text: str) -> str:
    return text


def _words(text: str) -> list:
    return shlex.split(text)


_KINDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "int": (_integer, "an integer"),
    "float": (_number, "a number"),
    "flag": (_flag, "0 or 1"),
    "str": (_text, "text"),
    "path": (_text, "a path"),
    "words": (_words, "shell words"),
}


@dataclass(frozen=True)
class Setting:
    """One ``COLLECTIVES_*`` variable: its ``name``, ``kind`` (int, float, flag, str,
    path, words, or choice when ``choices`` is set), ``default`` (what :meth:`get`
    returns when it is unset or blank; None: decided by the code that reads it, which
    ``default_doc`` describes), the smallest value it may hold (``minimum``), ``scope``
    (who reads it: ``all``, a backend's name, ``spawn``, ``testing``) and ``doc``."""

    name: str
    kind: str
    default: Any
    scope: str
    doc: str
    choices: tuple[str, ...] = ()
    minimum: Optional[float] = None
    default_doc: str = ""

    def get(self, env: Optional[Mapping[str, str]] = None) -> Any:
        """The value in ``env`` (default ``os.environ``), parsed; the default when unset
        or blank. A bad value is a ``ValueError`` naming the variable."""
        raw = (os.environ if env is None else env).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(raw)

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's type, or ``ValueError`` naming the variable."""
        text = raw.strip()
        if self.choices:
            value = text.lower()
            if value not in self.choices:
                raise ValueError(f"environment variable {self.name}={raw!r} must be one of "
                                 f"{', '.join(self.choices)}")
            return value
        parse, what = _KINDS[self.kind]
        try:
            value = parse(text)
        except ValueError:
            raise ValueError(f"environment variable {self.name}={raw!r} is not {what}") \
                from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"environment variable {self.name}={raw!r} must be at least "
                             f"{self.minimum:g}")
        return value

    def is_set(self, env: Optional[Mapping[str, str]] = None) -> bool:
        """Whether the variable holds a non-blank value."""
        raw = (os.environ if env is None else env).get(self.name)
        return raw is not None and bool(raw.strip())

    @property
    def type_doc(self) -> str:
        """The type as the documentation shows it: the kind, or the choices."""
        return " | ".join(self.choices) if self.choices else self.kind

    @property
    def default_text(self) -> str:
        """The default as the documentation shows it (``default_doc`` where set)."""
        if self.default_doc:
            return self.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default) if self.default != [] else "none"


def _s(name: str, kind: str, default: Any, scope: str, doc: str, **extra: Any) -> Setting:
    return Setting(PREFIX + name, kind, default, scope, doc, **extra)


# ----------------------------------------------------------------------------- the table
# Start-up, every backend
BACKEND = _s("BACKEND", "str", None, "all",
             "backend of init_process_group() when none is given",
             default_doc="mpi under an MPI launcher, else shm")
TIMEOUT = _s("TIMEOUT", "float", 300.0, "all",
             "seconds any blocking wait lasts before CollectiveTimeout", minimum=1e-9)
JOB_ID = _s("JOB_ID", "str", None, "all",
            "a string naming this job on every rank (shm names its segments after it)",
            default_doc="from the launcher's variables")
SPAWNED = _s("SPAWNED", "flag", False, "spawn",
             "set by collectives.spawn in its ranks (the launcher is then 'spawn')")
FT_COORDINATOR = _s("FT_COORDINATOR", "str", None, "parallel.ft",
                    "host:port of the fault-tolerance coordinator a parallel.ft.Manager "
                    "asks for quorums and commits", default_doc="the Manager's argument")
START_METHOD = _s("START_METHOD", "choice", None, "spawn",
                  "how collectives.spawn starts ranks: forked from a warm fork server, or "
                  "each a fresh interpreter", choices=("forkserver", "spawn"),
                  default_doc="forkserver where the platform has it, else spawn")
DEBUG = _s("DEBUG", "flag", False, "all",
           "check before every collective that all ranks make the same call")
LOG_LEVEL = _s("LOG_LEVEL", "choice", None, "all",
               "log the library's logger tree (collectives.*) from this level on, to "
               "standard error with the rank", choices=("debug", "info", "warning", "error"),
               default_doc="unset: no handler of ours (the application's logging decides)")
FLIGHT_RECORDER = _s("FLIGHT_RECORDER", "int", 256, "all",
                     "operations each group remembers for the doctor (0: off)", minimum=0)
FLIGHT_DIR = _s("FLIGHT_DIR", "path", None, "all", "where flight records are written",
                default_doc="<tmp>/collectives-flight")
FLIGHT_KEEP = _s("FLIGHT_KEEP", "int", 10, "all",
                 "job folders of flight records kept in the flight folder (older ones are "
                 "removed when a record is written)", minimum=1)
TRACE = _s("TRACE", "path", None, "all",
           "trace every group of the process: each rank streams its events to "
           "DIR/rank<r>.jsonl (collectives trace merge DIR)",
           default_doc="unset: no trace")
SECRET = _s("SECRET", "str", None, "zmq",
            "the job's secret (at least 16 characters) that authenticates peers; "
            "collectives.spawn makes one per job")
SECRET_FILE = _s("SECRET_FILE", "path", None, "zmq", "a file holding the job's secret")
# shm
SHM_CHUNK_BYTES = _s("SHM_CHUNK_BYTES", "int", 1 << 20, "shm",
                     "bytes of a data slot (a larger message is chunked); read by the "
                     "group's leader", minimum=1)
SHM_RING_BYTES = _s("SHM_RING_BYTES", "int", None, "shm",
                    "bytes of each point-to-point ring; read by the group's leader",
                    minimum=1, default_doc="1 MiB, shrinking to 64 KiB as ranks grow")
SHM_WAIT = _s("SHM_WAIT", "choice", "futex", "shm",
              "how a waiter sleeps: on a futex, or in sleeps growing to 1 ms",
              choices=("futex", "sleep"))
SHM_SPIN_US = _s("SHM_SPIN_US", "int", None, "shm",
                 "microseconds a waiter spins before it yields", minimum=0,
                 default_doc="50 with a core per rank, 0 oversubscribed")
SHM_YIELD_US = _s("SHM_YIELD_US", "int", None, "shm",
                  "microseconds a waiter yields before it sleeps in the kernel", minimum=0,
                  default_doc="1000 with a core per rank, 50 oversubscribed")
SHM_BIND = _s("SHM_BIND", "choice", "auto", "shm",
              "bind each rank to one core: when ranks outnumber cores (auto), always, never",
              choices=("auto", "core", "none"))
SHM_PID_CHECK = _s("SHM_PID_CHECK", "flag", True, "shm",
                   "check the peers' pids for liveness (0 for peers in another PID "
                   "namespace)")
SHM_NATIVE = _s("SHM_NATIVE", "flag", True, "shm",
                "use the compiled core where it is built (0: the Python path)")
SHM_CMA = _s("SHM_CMA", "choice", "auto", "shm",
             "this rank's vote for the single-copy all_reduce: where the kernel copies "
             "fast enough (auto), always (1), never (0)", choices=("auto", "1", "0"))
# zmq
ZMQ_REQUIRE_SECRET = _s("ZMQ_REQUIRE_SECRET", "flag", False, "zmq",
                        "refuse to start without a secret (no trust on first use)")
ZMQ_BIND_ADDR = _s("ZMQ_BIND_ADDR", "str", None, "zmq",
                   "address the data sockets bind to",
                   default_doc="the interface that routes to MASTER_ADDR")
ZMQ_TRANSPORT = _s("ZMQ_TRANSPORT", "choice", "auto", "zmq",
                   "ipc between ranks of one host where possible (auto), or tcp only",
                   choices=("auto", "tcp"))
ZMQ_HEARTBEAT_S = _s("ZMQ_HEARTBEAT_S", "float", 5.0, "zmq",
                     "seconds of silence after which a connection is declared dead",
                     minimum=0.001)
ZMQ_SPIN_US = _s("ZMQ_SPIN_US", "float", 0.0, "zmq",
                 "microseconds a waiter polls before it blocks", minimum=0)
ZMQ_IO_THREADS = _s("ZMQ_IO_THREADS", "int", 1, "zmq", "libzmq I/O threads", minimum=1)
ZMQ_LINGER_S = _s("ZMQ_LINGER_S", "float", 2.0, "zmq",
                  "seconds queued sends to live peers get at close", minimum=0)
ZMQ_INIT_TIMEOUT = _s("ZMQ_INIT_TIMEOUT", "float", None, "zmq",
                      "seconds the rendezvous may take", minimum=1e-9,
                      default_doc="the group timeout, at least 60")
ZMQ_MALLOC = _s("ZMQ_MALLOC", "choice", "keep", "zmq",
                "keep libzmq's receive buffers mapped (glibc thresholds), or leave "
                "malloc alone", choices=("keep", "system"))
ZMQ_PAIR_ONE_ROUND_BYTES = _s("ZMQ_PAIR_ONE_ROUND_BYTES", "int", 8 << 20, "zmq",
                              "two-rank all_reduce in one round up to this size", minimum=0)
ZMQ_ALL_REDUCE_DIRECT_BYTES = _s("ZMQ_ALL_REDUCE_DIRECT_BYTES", "int", 64 << 10, "zmq",
                                 "all_reduce sends whole vectors to every peer up to this "
                                 "size", minimum=0)
ZMQ_ROOTED_SPLIT_BYTES = _s("ZMQ_ROOTED_SPLIT_BYTES", "int", 256 << 10, "zmq",
                            "broadcast and reduce split the message from this size",
                            minimum=0)
ZMQ_SCRATCH_KEEP_BYTES = _s("ZMQ_SCRATCH_KEEP_BYTES", "int", 256 << 20, "zmq",
                            "largest receive scratch a group keeps between calls", minimum=0)
ZMQ_DIRECT_MAX_RANKS = _s("ZMQ_DIRECT_MAX_RANKS", "int", 8, "zmq",
                          "largest group that uses the one-round direct algorithms",
                          minimum=1)
# hier (shm inside a host, a network transport between hosts)
HOST = _s("HOST", "str", None, "hier",
          "this process's host for the hier backend, or a comma-separated list of every "
          "rank's host (virtual hosts on one machine)",
          default_doc="hostname, boot id, /dev/shm, network namespace and user")
HIER_NET = _s("HIER_NET", "choice", "zmq", "hier",
              "the transport between hosts of the hier backend", choices=("zmq", "mpi", "gloo"))
HIER_SPLIT_BYTES = _s("HIER_SPLIT_BYTES", "int", 64 << 10, "hier",
                      "all_reduce splits a message among a host's ranks from this size "
                      "(below: one rank per host talks to the other hosts)", minimum=0)
HIER_PIECE_BYTES = _s("HIER_PIECE_BYTES", "int", 256 << 10, "hier",
                      "a split all_reduce is pipelined in pieces of at least this size (at "
                      "most 256): the host's steps of one overlap the network's of another",
                      minimum=1)
# mpi
MPI_TUNE = _s("MPI_TUNE", "flag", True, "mpi",
              "make MPICH's own loops yield when ranks outnumber cores")
MPI_YIELD_EVERY = _s("MPI_YIELD_EVERY", "int", None, "mpi",
                     "yield the core after this many polls of an MPI request", minimum=1,
                     default_doc="1 oversubscribed, else 64")
MPI_SPIN_US = _s("MPI_SPIN_US", "float", 1000.0, "mpi",
                 "microseconds a wait polls before it sleeps between polls", minimum=0)
MPIEXEC_ARGS = _s("MPIEXEC_ARGS", "words", [], "testing",
                  "extra arguments for the mpiexec that starts test and bench workers")
# the testing kit
CHECK_BACKENDS = _s("CHECK_BACKENDS", "str", None, "testing",
                    "comma-separated backends check_algorithm() checks",
                    default_doc="every available one")
POOL_PRELOAD = _s("POOL_PRELOAD", "str", None, "testing",
                  "modules a pool's workers import at start (set by the pool)")
POOL_ADDRESS = _s("POOL_ADDRESS", "str", None, "testing",
                  "where mpiexec-started workers reach their pool (set by the pool)")
POOL_AUTHKEY = _s("POOL_AUTHKEY", "str", None, "testing",
                  "the key of that connection (set by the pool)")
# this repository's test suite
MAX_EXAMPLES = _s("MAX_EXAMPLES", "int", 200, "tests",
                  "hypothesis examples per backend and world size in the conformance sweep",
                  minimum=1)
SKEW_EXAMPLES = _s("SKEW_EXAMPLES", "int", 5, "tests",
                   "examples of the skewed-arrival sweep", minimum=1)
HYPOTHESIS = _s("HYPOTHESIS", "choice", "repeatable", "tests",
                "draw the same examples every run, or new ones", choices=("repeatable",
                                                                          "explore"))
SOAK_SECONDS = _s("SOAK_SECONDS", "float", None, "tests", "how long the soak test runs",
                  minimum=0, default_doc="the test's own")
SOAK_SEED = _s("SOAK_SEED", "int", None, "tests", "the soak test's random seed",
               default_doc="random")
HYGIENE_CYCLES = _s("HYGIENE_CYCLES", "int", None, "tests",
                    "open/close cycles of the hygiene test", minimum=1,
                    default_doc="the test's own")

SETTINGS: tuple[Setting, ...] = tuple(v for v in list(globals().values())
                                      if isinstance(v, Setting))
_BY_NAME = {s.name: s for s in SETTINGS}


def by_name(name: str) -> Setting:
    """The row of variable ``name`` (``KeyError`` for one the table does not know)."""
    return _BY_NAME[name]


_checked = False


def check_environment(env: Optional[Mapping[str, str]] = None, *, once: bool = True) -> list:
    """Warn (``RuntimeWarning``) about every ``COLLECTIVES_*`` variable in ``env``
    (default ``os.environ``) that no row of the table names, with the nearest known name;
    returns the unknown names. With ``once`` (the default) only the first call of the
    process looks.

    >>> check_environment({"COLLECTIVES_TIMEOUT": "5"}, once=False)
    []
    """
    global _checked
    if once and _checked:
        return []
    _checked = True
    unknown = sorted(k for k in (os.environ if env is None else env)
                     if k.startswith(PREFIX) and k not in _BY_NAME)
    tails = {name[len(PREFIX):]: name for name in _BY_NAME}   # (the prefix says nothing)
    for name in unknown:
        near = difflib.get_close_matches(name[len(PREFIX):], list(tails), n=1, cutoff=0.6)
        hint = f"; did you mean {tails[near[0]]}?" if near else \
            " (python -m collectives.settings lists every one)"
        warnings.warn(f"unknown environment variable {name} is ignored{hint}",
                      RuntimeWarning, stacklevel=3)
    return unknown


def markdown_table() -> str:
    """The table as Markdown: the documentation's page of environment variables."""
    lines = ["| variable | type | default | read by | meaning |",
             "| --- | --- | --- | --- | --- |"]
    for s in SETTINGS:
        cells = (f"`{s.name}`", s.type_doc, s.default_text, s.scope, s.doc)
        # (a "|" inside a cell, as in the choices "auto | tcp", would end the cell)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
