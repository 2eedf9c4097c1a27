"""What the ``mpi`` backend adds to MPI: all_reduce through ``pg.all_reduce`` against raw
mpi4py, in one ``mpiexec`` job per world size.

    python benchmarks/mpi_overhead.py                   # mpiexec -n 2, then -n 4; a table
    python benchmarks/mpi_overhead.py --nproc 2 --json out.json
    mpiexec -n 4 python benchmarks/mpi_overhead.py      # one world size, run directly

Per size (float32; 4 B, 64 KiB, 64 MiB by default) and iteration, every rank runs, each
after a barrier, in turn (interleaved, so that drift in the machine's load hits all
alike):

- ``ours``: ``pg.all_reduce(t)`` of the backend (``MPI_Iallreduce`` polled with
  ``Test()``, yield/sleep between polls, with the group's timeout);
- ``raw``: ``comm.Allreduce(MPI.IN_PLACE, t)``, mpi4py's blocking call, what an MPI
  user writes;
- ``raw_nb``: ``comm.Iallreduce(MPI.IN_PLACE, t).Wait()``, the same non-blocking MPI
  operation as ours, waited for by MPI itself.

Rank 0 reports the median over iterations of the slowest rank's time per iteration, and
``ours - raw`` in microseconds and percent. The raw calls run on a duplicate of the
group's own communicator, so they share its MPI settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectives.cli_flags import add_flag, flag_parser  # noqa: E402

SIZES = "4,64K,64M"


def _iterations(nbytes: int) -> int:
    return 2000 if nbytes <= 4096 else 300 if nbytes <= 1 << 20 else 12


def bench(sizes: tuple, iters_scale: float) -> list:
    import collectives
    from mpi4py import MPI

    pg = collectives.init_process_group("mpi", timeout=120)
    comm = pg.transport.comm.Dup()  # raw mpi4py on a communicator like ours
    n, rank = pg.size, pg.rank
    rows = []
    for nbytes in sizes:
        t = np.ones(max(nbytes // 4, 1), np.float32)
        iters = max(3, int(_iterations(nbytes) * iters_scale))
        impls = {
            "ours": lambda: pg.all_reduce(t),
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, [t, MPI.FLOAT], MPI.SUM),
            "raw_nb": lambda: comm.Iallreduce(MPI.IN_PLACE, [t, MPI.FLOAT], MPI.SUM).Wait(),
        }
        times = {name: np.empty(iters) for name in impls}
        for name, fn in impls.items():  # warm up
            for _ in range(3):
                fn()
        for i in range(iters):
            for name, fn in impls.items():
                comm.Barrier()
                start = time.perf_counter()
                fn()
                times[name][i] = time.perf_counter() - start
        row = {"world_size": n, "bytes": nbytes, "iters": iters}
        for name, mine in times.items():
            slowest = np.empty_like(mine)
            comm.Allreduce(mine, slowest, MPI.MAX)
            row[f"{name}_us"] = float(np.median(slowest) * 1e6)
        row["overhead_us"] = row["ours_us"] - row["raw_us"]
        row["overhead_pct"] = 100.0 * row["overhead_us"] / row["raw_us"]
        row["overhead_vs_nb_us"] = row["ours_us"] - row["raw_nb_us"]
        rows.append(row)
    comm.Free()
    pg.close()
    return rows if rank == 0 else []


def _table(rows: list) -> str:
    head = (f"{'ranks':>5} {'bytes':>9} {'iters':>5} {'ours us':>10} {'raw us':>10} "
            f"{'raw_nb us':>10} {'ours-raw us':>12} {'ours/raw-1':>10} {'ours-raw_nb':>12}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['world_size']:>5} {r['bytes']:>9} {r['iters']:>5} {r['ours_us']:>10.1f} "
                     f"{r['raw_us']:>10.1f} {r['raw_nb_us']:>10.1f} {r['overhead_us']:>12.1f} "
                     f"{r['overhead_pct']:>9.1f}% {r['overhead_vs_nb_us']:>12.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = flag_parser(description=__doc__)
    add_flag(parser, "--nproc", default="2,4", several=True,
             help="comma list of world sizes, one mpiexec job each (ignored under "
                  "mpiexec)")
    add_flag(parser, "--sizes", default=SIZES)
    parser.add_argument("--iters-scale", type=float, default=1.0,
                        help="multiplies the iteration counts (default: %(default)s)")
    add_flag(parser, "--json")
    args = parser.parse_args()
    if any(os.environ.get(v) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        rows = bench(args.sizes, args.iters_scale)
        if rows:
            print("ROWS " + json.dumps(rows), flush=True)
        return 0
    mpiexec = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        print("no mpiexec on PATH", file=sys.stderr)
        return 2
    rows = []
    for n in args.nproc:
        proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, __file__,
                               "--sizes", ",".join(map(str, args.sizes)),
                               "--iters-scale", str(args.iters_scale)],
                              capture_output=True, text=True)
        found = [line for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
        if proc.returncode != 0 or not found:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            return 1
        rows += json.loads(found[-1][5:])
    print(_table(rows))
    try:
        print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    except OSError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
