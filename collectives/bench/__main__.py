"""``python -m collectives.bench``: nccl-tests style microbenchmarks, peers side by side.

    python -m collectives.bench                                  # all_reduce, shm, 2 ranks
    python -m collectives.bench --backend zmq --nproc 4 --ops all --sizes 4,64K,16M
    python -m collectives.bench --peer mpi4py --peer torch-gloo --memcpy --json rows.json
    python -m collectives.bench --backend mpi --plot busbw.png   # ranks from mpiexec
    python -m collectives.bench --ops all_to_all --uneven --peer mpi4py --peer torch-gloo

Exit status: 0 when every result was right, 1 when some element was wrong or a rank
failed, 2 for a usage error or a missing launcher/library.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence

from ..cli_flags import FlagParser, add_flag, flag_parser, parse_size
from .cases import DTYPES, OPS, check_world

#: 4 B to 64 MiB by factors of 4.
DEFAULT_SIZES = "4,16,64,256,1K,4K,16K,64K,256K,1M,4M,16M,64M"


def _ops(text: str) -> list[str]:
    if text.strip() == "all":
        return list(OPS)
    ops = [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; "
                                         f"choose from {', '.join(OPS)} or 'all'")
    return list(dict.fromkeys(ops))


def _parser(prog: str = "python -m collectives.bench") -> FlagParser:
    from .peers import PEERS
    p = flag_parser(
        prog,
        "nccl-tests style benchmarks of a backend's collectives, with the raw peer\n"
        "libraries side by side (time: median over iterations of the slowest rank;\n"
        "#wrong: wrong elements of the checked result).",
        defaults_in_help=True)
    add_flag(p, "--backend", default="shm", help="our backend to measure")
    add_flag(p, "--nproc", default=2)
    p.add_argument("--ops", type=_ops, default="all_reduce", metavar="LIST",
                   help=f"comma list of {', '.join(OPS)}, or 'all'")
    add_flag(p, "--sizes", default=DEFAULT_SIZES)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type")
    add_flag(p, "--iters", default=50,
             help="timed iterations per size (fewer for large sizes: --byte-budget)")
    add_flag(p, "--warmup", default=5,
             help="untimed iterations per size (fewer where --byte-budget cuts the timed "
                  "ones, in proportion)")
    p.add_argument("--byte-budget", type=parse_size, default="512M", metavar="SIZE",
                   help="at most this many bytes in the timed iterations of one size "
                        "(at least 3 iterations)")
    p.add_argument("--peer", action="append", default=[], metavar="PEER",
                   help=f"also run the raw library: {' or '.join(PEERS)} (repeatable or a "
                        f"comma list)")
    p.add_argument("--memcpy", action="store_true",
                   help="also time a single-process copy (np.copyto) of each size, in "
                        "turn with our backend, and report busbw as a fraction of it")
    p.add_argument("--persistent", action="store_true",
                   help="time our backend's all_reduce, all_gather and reduce_scatter as "
                        "persistent requests (pg.all_reduce_init ...: start + wait per "
                        "iteration); peers and memcpy unchanged")
    p.add_argument("--symmetric", action="store_true",
                   help="our backend's all_reduce on buffers from pg.alloc_symmetric "
                        "(shm reads the peers' buffers in place); other ops skipped")
    p.add_argument("--uneven", action="store_true",
                   help="all_to_all with uneven split sizes: a fixed random pattern per "
                        "size, the same for every implementation (peers: mpi4py's "
                        "Alltoallv, torch's all_to_all_single with splits)")
    add_flag(p, "--json")
    p.add_argument("--plot", metavar="FILE", help="draw busbw against size (matplotlib)")
    add_flag(p, "--timeout", default=120.0)
    add_flag(p, "--job-timeout", default=1800.0,
             help="seconds a whole job (one launcher's ranks) may take")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a rank started by mpiexec
    return p


def _peers(values: Sequence[str]) -> list[str]:
    from .peers import PEERS
    peers = [v.strip() for value in values for v in value.split(",") if v.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"argument --peer: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(PEERS)}")
    return list(dict.fromkeys(peers))


class _Usage(Exception):
    """A usage error or a missing launcher/library: a one-line message, exit status 2."""


def _check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Everything that can be refused before any rank starts: the peers to run, and notes
    on the peers left out (a dtype they cannot carry)."""
    from ..registry import P2P_ONLY_PREFIX, available_backends
    from .job import MPIEXEC_IMPLS, LauncherMissing, mpiexec_program
    from .peers import missing_library, unsupported_dtype

    try:
        peers = _peers(args.peer)
        check_world(args.dtype, args.nproc)
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    if args.uneven and "all_to_all" not in args.ops:
        raise _Usage("argument --uneven: it shapes all_to_all's split sizes; add "
                     "all_to_all to --ops")
    base = args.backend.removeprefix(P2P_ONLY_PREFIX)
    if base not in available_backends():
        raise _Usage(f"argument --backend: {args.backend!r} is not available here; "
                     f"available: {', '.join(available_backends())}")
    for peer in peers:
        why = missing_library(peer)
        if why:
            raise _Usage(why)
    notes = [f"{p}: skipped, {unsupported_dtype(p, args.dtype)}" for p in peers
             if unsupported_dtype(p, args.dtype)]
    peers = [p for p in peers if not unsupported_dtype(p, args.dtype)]
    needs_mpiexec = [i for i in [args.backend] + peers if i in MPIEXEC_IMPLS]
    if needs_mpiexec:
        try:
            mpiexec_program()
        except LauncherMissing as exc:
            raise _Usage(f"{', '.join(needs_mpiexec)} {exc}") from None
    if args.plot:
        from .plot import PlotUnavailable, check_available
        try:
            check_available()
        except PlotUnavailable as exc:
            raise _Usage(str(exc)) from None
    return peers, notes


def _run(args: argparse.Namespace, peers: list[str]) -> tuple[list[dict], list[str]]:
    """Every implementation's rows: one job per launcher, ours' job first."""
    from .job import MPIEXEC_IMPLS, JobSpec, run_mpiexec, run_spawned

    spec = JobSpec(impls=[], ops=args.ops, sizes=args.sizes, dtype=args.dtype,
                   iters=args.iters, warmup=args.warmup, byte_budget=args.byte_budget,
                   timeout=args.timeout, persistent=args.persistent,
                   symmetric=args.symmetric, uneven=args.uneven)
    impls = [args.backend] + peers
    by_mpiexec = [i for i in impls if i in MPIEXEC_IMPLS]
    by_spawn = [i for i in impls if i not in MPIEXEC_IMPLS]
    rows: list[dict] = []
    notes: list[str] = []
    for job in sorted((j for j in (by_mpiexec, by_spawn) if j),
                      key=lambda j: args.backend not in j):
        launcher = "mpiexec" if job is by_mpiexec else "collectives.spawn"
        print(f"# running {', '.join(job)} on {args.nproc} ranks started by {launcher}",
              file=sys.stderr, flush=True)
        launch = run_mpiexec if job is by_mpiexec else run_spawned
        # The copy is timed in our backend's job, in turn with ours (and the peers there).
        job_rows, skipped = launch(
            dataclasses.replace(spec, impls=job, memcpy=args.memcpy and args.backend in job,
                                persistent=args.persistent and args.backend in job,
                                symmetric=args.symmetric and args.backend in job),
            args.nproc, args.job_timeout)
        rows += job_rows
        notes += skipped
    return rows, notes


def main(argv: Optional[Sequence[str]] = None, *,
         prog: str = "python -m collectives.bench") -> int:
    """The command line; returns the exit status (see the module docstring). ``prog``
    names the command in help and errors (``collectives bench`` from :mod:`collectives.cli`)."""
    args = _parser(prog).parse_args(argv)
    if args.worker:
        from .job import worker
        return worker(args.worker)

    from ..spawn import SpawnError
    from . import report
    from .job import LauncherMissing

    peers: list[str] = []
    try:
        peers, notes = _check(args)
        load = f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
        print(f"# collectives.bench: {args.backend} on {args.nproc} ranks"
              f"{', peers ' + ', '.join(peers) if peers else ''}; {args.dtype}; up to "
              f"{args.iters} timed iterations after {args.warmup} warm-up (at most "
              f"{args.byte_budget >> 20} MiB per size); {load}"
              f"{'; ' + args.backend + ' through persistent requests' if args.persistent else ''}"
              f"{'; all_reduce on symmetric memory' if args.symmetric else ''}"
              f"{'; all_to_all with uneven split sizes' if args.uneven else ''}",
              flush=True)
        rows, skipped = _run(args, peers)
    except (_Usage, LauncherMissing) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except SpawnError as exc:
        print(f"{prog}: a rank failed ({args.backend} and peers "
              f"{peers or 'none'}, {args.nproc} ranks): {exc}", file=sys.stderr)
        return 1

    if args.persistent:  # which rows timed persistent requests
        for r in rows:
            r["persistent"] = r["impl"] == args.backend
    if args.symmetric:
        for r in rows:
            r["symmetric"] = r["impl"] == args.backend
    rows = report.add_memcpy(rows)
    report.add_ratios(rows, args.backend, peers)
    print(report.table(rows, args.backend, peers, args.nproc))
    for note in notes + skipped:
        print(f"# {note}")
    if args.json:
        report.write_json(rows, args.json)
    if args.plot:
        from .plot import plot
        plot(rows, args.plot, [args.backend] + peers,
             title=f"{args.nproc} ranks, {args.dtype}, {os.cpu_count()} cores")
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
