"""One vocabulary of command-line flags for every example, every benchmark and
``collectives bench``: wherever a flag means the same thing it has the same name, the same
parser and the same help, defined here once. Imports neither torch nor a backend, so a
script parses its flags first and refuses a bad one in a fraction of a second.

    --backend NAME    a transport (shm, zmq, mpi, gloo, nccl) or a registered backend; a
                      comma list where a script compares several
    --nproc N         ranks; a comma list where a script sweeps world sizes
    --repeat N        runs of each case
    --sizes LIST      message sizes, with K, M or G suffixes (binary: 4K = 4096)
    --json FILE       also write the results to FILE
    --trace FILE      write a Chrome trace of every rank to FILE

and ``--warmup``, ``--steps``, ``--iters``, ``--timeout`` (one collective),
``--job-timeout`` (one run), ``--seed``, ``--epochs``, ``--batch-size``, ``--bytes``.
A bad value is one line on standard error and exit status 2 (argparse's usage error)::

    $ python benchmarks/shm_latency.py --sizes 4X
    shm_latency.py: error: argument --sizes: '4X' is not a size like 4, 4K, 1M or 1G

A script builds its parser with :func:`flag_parser` and adds shared flags with
:func:`add_flag`; its own flags it adds as usual (``parser.add_argument``). Every
script's flags are checked against :data:`FLAGS` and :data:`RENAMED` by
``tests/test_flags.py``. A sweep over two world sizes::

    >>> p = flag_parser("sweep.py")
    >>> _ = add_flag(p, "--nproc", default="2", several=True)
    >>> _ = add_flag(p, "--sizes", default="4,64K")
    >>> p.parse_args(["--nproc", "2,4", "--sizes", "1M,4K"])
    Namespace(nproc=[2, 4], sizes=[4096, 1048576])
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable, NoReturn, Optional

from .registry import check_backend_name

__all__ = ["FLAGS", "RENAMED", "Flag", "FlagParser", "add_flag", "backend_name",
           "backend_names", "comma_choices", "flag_parser", "nonnegative_int", "parse_size",
           "parse_sizes", "positive_int", "positive_ints", "seconds"]


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``PROG: error: MESSAGE``,
    with exit status 2 (where argparse would print the usage block first: the message
    names the flag and what it accepts, and ``--help`` shows the rest). Abbreviations
    are refused: a flag has one spelling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag_parser(prog: Optional[str] = None, description: Optional[str] = None, *,
                defaults_in_help: bool = False) -> FlagParser:
    """A :class:`FlagParser` that keeps ``description``'s layout (a module docstring's
    command lines stay lines). ``defaults_in_help``: every option's help ends with its
    default where it has one, for scripts whose own flags do not say it themselves;
    shared flags (:func:`add_flag`) always say it."""
    formatter = (_RawDefaultsFormatter if defaults_in_help
                 else argparse.RawDescriptionHelpFormatter)
    return FlagParser(prog=prog, description=description, formatter_class=formatter)


class _RawDefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; an option's help ends with its default, unless it says
    it already or there is none to say (None, False: a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


# ------------------------------------------------------------------ value parsers

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
           "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"4"``, ``"4K"``, ``"1M"``, ``"64MiB"``, ``"1G"`` -> bytes (binary multiples:
    K = 1024); ``argparse.ArgumentTypeError`` for anything else or below 1 byte.

    >>> parse_size("64M"), parse_size("4k")
    (67108864, 4096)
    """
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _SUFFIX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4, 4K, 1M or 1G")
    value = int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma list of :func:`parse_size` values, ascending, each once.

    >>> parse_sizes("1M,4,4K,4096")
    [4, 4096, 1048576]
    """
    sizes = sorted({parse_size(s) for s in text.split(",") if s.strip()})
    if not sizes:
        raise argparse.ArgumentTypeError(f"{text!r} names no size")
    return sizes


def positive_int(text: str) -> int:
    """An integer of at least 1.

    >>> positive_int("3")
    3
    """
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer of at least 0.

    >>> nonnegative_int("0")
    0
    """
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma list of integers of at least 1 (world sizes), in the order given, each once.

    >>> positive_ints("2,4,2")
    [2, 4]
    """
    values = list(dict.fromkeys(positive_int(s) for s in text.split(",") if s.strip()))
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no number")
    return values


def seconds(text: str) -> float:
    """A positive number of seconds.

    >>> seconds("2.5")
    2.5
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def backend_name(text: str) -> str:
    """A backend's name (built in, registered, or ``p2p:`` one of those), checked without
    importing it; the error lists the backends available here.

    >>> backend_name("zmq")
    'zmq'
    """
    try:
        return check_backend_name(text.strip())
    except ValueError as exc:   # keep the reason, not check_backend_name's call prefix
        message = str(exc)
        raise argparse.ArgumentTypeError(
            message[message.find("unknown backend"):]) from None


def backend_names(text: str) -> list[str]:
    """A comma list of backend names (see :func:`backend_name`), in order, each once.

    >>> backend_names("shm,zmq")
    ['shm', 'zmq']
    """
    names = list(dict.fromkeys(backend_name(s) for s in text.split(",") if s.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no backend")
    return names


def comma_choices(*choices: str) -> Callable[[str], list[str]]:
    """The parser of a comma list of some of ``choices`` (in the order given, each once),
    for a script's own list flags (``--launchers``, ``--impls``).

    >>> comma_choices("zmq", "gloo")("gloo,zmq")
    ['gloo', 'zmq']
    """
    def parse(text: str) -> list[str]:
        picked = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
        unknown = [c for c in picked if c not in choices]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or repr(text)}; "
                                             f"choose from {', '.join(choices)}")
        return picked
    return parse


# ------------------------------------------------------------------ the vocabulary

@dataclasses.dataclass(frozen=True)
class Flag:
    """One shared flag: its parser and help, and where a script takes a comma list
    (``several=True`` in :func:`add_flag`), the list's parser and help."""

    type: Callable[[str], Any]
    metavar: str
    help: str
    several_type: Optional[Callable[[str], Any]] = None
    several_help: str = ""


FLAGS: dict[str, Flag] = {
    "--backend": Flag(backend_name, "NAME",
                      "transport: shm, zmq, mpi, gloo, nccl, or any registered backend",
                      backend_names, "comma list of the backends to compare"),
    "--nproc": Flag(positive_int, "N", "ranks", positive_ints,
                    "comma list of world sizes, one run each"),
    "--repeat": Flag(positive_int, "N", "runs of each case"),
    "--sizes": Flag(parse_sizes, "LIST",
                    "comma list of message sizes in bytes, K/M/G suffixes (binary: 4K = "
                    "4096)"),
    "--bytes": Flag(parse_size, "SIZE", "message size in bytes, K/M/G suffix (binary)"),
    "--iters": Flag(positive_int, "N", "timed iterations"),
    "--warmup": Flag(nonnegative_int, "N", "untimed iterations before the timed ones"),
    "--steps": Flag(positive_int, "N", "timed training steps"),
    "--epochs": Flag(positive_int, "N", "passes over the training set"),
    "--batch-size": Flag(positive_int, "N", "samples per rank per step"),
    "--seed": Flag(int, "N", "random seed"),
    "--timeout": Flag(seconds, "S", "seconds one collective may wait before it fails"),
    "--job-timeout": Flag(seconds, "S", "seconds one run (a job of ranks) may take"),
    "--json": Flag(str, "FILE", "also write the results to FILE as JSON"),
    "--trace": Flag(str, "FILE", "write a Chrome trace (chrome://tracing, ui.perfetto.dev) "
                                 "of every rank's steps and collectives to FILE; each rank "
                                 "streams its part to FILE.ranks/ as it runs"),
}

#: Flags that no script defines, and the shared flag that says the same.
RENAMED: dict[str, str] = {
    "--nprocs": "--nproc", "--world": "--nproc", "--world-size": "--nproc",
    "--ranks": "--nproc", "--np": "--nproc",
    "--repeats": "--repeat", "--rounds": "--repeat", "--reps": "--repeat",
    "--runs": "--repeat",
    "--backends": "--backend", "--transports": "--backend", "--transport": "--backend",
    "--iterations": "--iters", "--warm-up": "--warmup", "--json-out": "--json",
    "--batch": "--batch-size",
}


def add_flag(parser: argparse.ArgumentParser, name: str, *, default: Any = None,
             several: bool = False, help: Optional[str] = None,
             **kwargs: Any) -> argparse.Action:
    """Add shared flag ``name`` (a key of :data:`FLAGS`) to ``parser`` with its parser,
    metavar and help; ``several``: the comma-list form (``--backend``, ``--nproc``).
    ``help`` replaces the shared text where a script says more (what a run is); the
    default is appended either way. A string default goes through the flag's parser
    (``default="2,4"`` for ``--nproc`` gives ``[2, 4]``). ``kwargs`` go to
    ``add_argument`` (``required``, ``dest``)."""
    if name not in FLAGS:
        raise ValueError(f"add_flag: argument `name`: {name!r} is not a shared flag; "
                         f"shared: {', '.join(FLAGS)}")
    flag = FLAGS[name]
    kind = flag.several_type if several else flag.type
    if kind is None:
        raise ValueError(f"add_flag: argument `several`: {name} has no comma-list form")
    text = help or (flag.several_help if several else flag.help)
    if default is not None and "%(default)" not in text:
        text += " (default: %(default)s)"
    return parser.add_argument(name, type=kind, metavar="LIST" if several else flag.metavar,
                               default=default, help=text, **kwargs)

