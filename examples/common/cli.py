"""The examples' command line, launch and closing line, without torch: a script imports
this first and parses its arguments before it imports torch, so a bad flag is refused in
a fraction of a second (examples/ddp.py shows the pattern).

The contract every example keeps (the README's Quick start runs ``examples/ddp.py``)::

    python examples/NAME.py [--backend NAME] [--nproc N] [--epochs N] [--batch-size N]
                            [--data-dir D] [--seed N] [--lr LR] [--trace FILE]

(the shared flags of ``collectives.cli_flags``: the benchmarks spell them the same).

Rank 0 shows a tqdm bar on standard error (when it is a terminal and tqdm is installed)
and prints, as the last line of standard output, one JSON object: ``{"example",
"backend", "world_size", "epochs", "wall_s", "total_s", "samples_per_s", "final_loss",
"final_acc"}``: ``wall_s`` is the training loop's time, ``total_s`` the time since the
command started (its process's start, read from the kernel: interpreter start-up,
imports, spawning the ranks, loading data and
evaluation included). The other ranks print nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, Callable, Optional, Sequence

import collectives
from collectives import warm_start
from collectives.cli_flags import add_flag, flag_parser

__all__ = ["SUMMARY_KEYS", "launch", "parse_args", "print_summary", "process_start_time"]


def process_start_time(pid: Optional[int] = None) -> float:
    """When process ``pid`` (default: this one) started, in ``time.time()``'s clock: the
    kernel's record (``/proc``), so the interpreter's own start-up counts; where there is
    no /proc, the time this module was imported.

    >>> 0 <= time.time() - process_start_time() < 3600
    True
    """
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
#: Where the whole run's clock started: the launching process's start, carried to the
#: ranks in ``args.started_at`` (set by :func:`parse_args`, read by :func:`print_summary`).
_started_at: Optional[float] = None


def parse_args(example: str, argv: Optional[Sequence[str]] = None, *, epochs: int = 3,
               batch_size: int = 32, lr: float = 0.05, description: str = "",
               extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
               nproc: Optional[int] = 2, nproc_help: Optional[str] = None,
               batch_help: Optional[str] = None,
               validate: Optional[Callable[[argparse.Namespace], None]] = None,
               ) -> argparse.Namespace:
    """The examples' common options (the shared flags of :mod:`collectives.cli_flags`);
    each example passes its own defaults, and ``extra(parser)`` may add the example's own
    options. ``nproc_help`` and ``batch_help`` say what ``--nproc`` and ``--batch-size``
    mean where an example differs from data parallelism (``nproc=None``: the example
    derives it). ``validate(args)`` checks flags that must fit together and may fill in
    derived values; its ``ValueError`` is a usage error (one line, exit status 2).

    ``--backend`` defaults to the launcher's: ``mpi`` under mpirun, ``COLLECTIVES_BACKEND``
    when set, ``shm`` otherwise.
    """
    p = flag_parser(f"examples/{example}.py", description)
    add_flag(p, "--backend", help="transport, or any registered backend's name (default: "
                                  "shm; mpi when started by mpirun)")
    add_flag(p, "--nproc", default=nproc,
             help=nproc_help or "ranks to spawn (ignored when started by mpirun or "
                                "torchrun)")
    add_flag(p, "--epochs", default=epochs)
    add_flag(p, "--batch-size", default=batch_size, help=batch_help)
    p.add_argument("--lr", type=float, default=lr,
                   help="SGD learning rate, momentum 0.9 (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="folder with the MNIST IDX files (default: the bundled subset)")
    add_flag(p, "--seed", default=0, help="model initialisation and data order")
    add_flag(p, "--trace")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    if validate is not None:
        try:
            validate(args)
        except ValueError as exc:
            p.error(str(exc))
    args.example = example
    args.started_at = process_start_time()
    if collectives.detect_rendezvous().launcher == "single":
        # This process will spawn the ranks: have the fork server import torch on one
        # core while the example imports it on the other.
        warm_start.prewarm(["torch", "parallel"])
    return args


def launch(main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """Run ``main(args)`` on every rank.

    Started by mpirun or torchrun, this process is one rank already: run ``main`` here.
    Started alone, spawn ``args.nproc`` ranks. ``main`` must be importable from a fresh
    interpreter: define it at the top level of the script and keep the script's own top
    level under ``if __name__ == "__main__":`` (spawned ranks import the script as
    ``__mp_main__``).

    Spawned ranks that fail end the process with status 1 after one report (the failing
    rank and its traceback, from :class:`collectives.SpawnError`); Ctrl-C (SIGINT) with
    130 and SIGTERM with 143, every rank stopped and the job's segments removed.
    """
    if collectives.detect_rendezvous().launcher != "single":
        _rank_entry(main, args)
        return
    # collectives.spawn stops every rank and removes the job's segments before it
    # raises; what is left to do here is to say what happened in a few lines, instead of
    # the parent's own traceback on top of the rank's.
    prog = f"examples/{args.example}.py"
    try:
        collectives.spawn(_rank_entry, args.nproc, args=(main, args), backend=args.backend)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every rank was stopped", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    except collectives.SpawnError as exc:  # the failing rank, its traceback, once
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def _rank_entry(main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """One rank: compute with ``OMP_NUM_THREADS`` threads (default 1), then run ``main``.

    One thread per rank makes N ranks use N cores, so that runs with different world sizes
    compare; torch's default, a thread per core in every rank, oversubscribes the cores,
    and its OpenMP threads then slow down by orders of magnitude. ``collectives.spawn``
    and torchrun already export ``OMP_NUM_THREADS=1``; mpirun does not, hence the default.
    """
    global _started_at
    _started_at = getattr(args, "started_at", None)
    import torch   # in the rank: the launching process need not have imported it
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    main(args)


#: The keys of the closing JSON line, in order.
SUMMARY_KEYS = ("example", "backend", "world_size", "epochs", "wall_s", "total_s",
                "samples_per_s", "final_loss", "final_acc")


def print_summary(rank: int, *, example: str, backend: str, world_size: int, epochs: int,
                  wall_s: float, samples: int, final_loss: float, final_acc: float,
                  extra: Optional[dict] = None) -> None:
    """On rank 0, print the closing JSON line. ``wall_s`` is the training loop's time (start-up
    and evaluation excluded; ``total_s``, added here, counts from the command's start),
    ``samples`` the training samples all ranks processed in it;
    ``extra``: an example's own keys, after the common ones (examples/moe.py: the experts'
    load)."""
    if rank != 0:
        return
    started = _started_at if _started_at is not None else process_start_time()
    line = dict(zip(SUMMARY_KEYS, (
        example, backend, world_size, epochs, round(wall_s, 3),
        round(time.time() - started, 3),
        round(samples / wall_s, 1) if wall_s > 0 else None,
        round(final_loss, 5), round(final_acc, 4))))
    line.update({k: v for k, v in (extra or {}).items() if k not in line})
    sys.stderr.flush()
    print(json.dumps(line), flush=True)
