"""Point-to-point ping-pong: shm (compiled core and Python path) against raw MPI.

    python benchmarks/shm_pingpong.py                      # 4 B .. 64 KiB
    python benchmarks/shm_pingpong.py --sizes 4,65536 --iters 2000

Two ranks bounce one float32 message: rank 0 sends and then receives, rank 1 receives
and then sends back. The time is half a round trip, the median of five samples of
``--iters`` round trips each. shm runs as one job with two groups over the same two
ranks (the world, on the core where it is built, and a sub-group made with
``COLLECTIVES_SHM_NATIVE=0``), sampled in turn; MPI is ``comm.Send``/``comm.Recv`` of
raw mpi4py under ``mpiexec -n 2`` (the ``mpich`` wheel), in a job started right after.
The last column is shm (core) / MPI: the issue's target is at most 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import collectives  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402

SAMPLES = 5


def _pingpong(send, recv, rank: int, a: np.ndarray, iters: int) -> float:
    """Median over SAMPLES of half a round trip, in microseconds."""
    times = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                send(a, 1)
                recv(a, 1)
            else:
                recv(a, 0)
                send(a, 0)
        times.append((time.perf_counter() - t0) / iters / 2 * 1e6)
    return float(np.median(times))


def _shm_job(sizes: list[int], iters: int) -> list:
    pg = collectives.init_process_group()
    os.environ["COLLECTIVES_SHM_NATIVE"] = "0"
    python = pg.new_group([0, 1])
    del os.environ["COLLECTIVES_SHM_NATIVE"]
    rows = []
    for nbytes in sizes:
        a = np.zeros(max(1, nbytes // 4), np.float32)
        res = {}
        for name, g in (("native", pg), ("python", python)) * 2:
            _pingpong(g.send, g.recv, g.rank, a, max(10, iters // 10))
            res.setdefault(name, []).append(_pingpong(g.send, g.recv, g.rank, a, iters))
        rows.append((nbytes, min(res["native"]), min(res["python"])))
    native = pg.transport.native
    python.close()
    pg.close()
    return [native, rows]


def _mpi_rank(work: list) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    sizes, iters = work
    rows = []
    for nbytes in sizes:
        a = np.zeros(max(1, nbytes // 4), np.float32)
        send = lambda x, peer: comm.Send(x, dest=peer)       # noqa: E731
        recv = lambda x, peer: comm.Recv(x, source=peer)     # noqa: E731
        _pingpong(send, recv, comm.rank, a, max(10, iters // 10))
        rows.append(min(_pingpong(send, recv, comm.rank, a, iters) for _ in range(2)))
    if comm.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    ap = flag_parser(description=__doc__)
    add_flag(ap, "--sizes", default="4,64,1K,4K,64K")
    add_flag(ap, "--iters", default=1000, help="round trips in one timed sample")
    ap.add_argument("--mpi-rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mpi_rank:
        _mpi_rank(json.loads(args.mpi_rank))
        return
    sizes = args.sizes
    native, rows = collectives.spawn(_shm_job, 2, args=(sizes, args.iters), backend="shm",
                                     timeout=300)[0]
    try:
        from mpi_jobs import run_under_mpiexec
        mpi = json.loads(run_under_mpiexec(__file__, 2, (sizes, args.iters), timeout=600,
                                           tag="RESULT", threads=1))
    except (RuntimeError, ImportError) as exc:
        print(f"# no MPI run: {exc}")
        mpi = [float("nan")] * len(sizes)
    print(f"# ping-pong, half a round trip (us), 2 ranks; world on the core: {native}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"# {'bytes':>8} {'shm core':>9} {'shm py':>9} {'mpi':>9} {'core/mpi':>9} "
          f"{'py/mpi':>8}")
    for (nbytes, t_native, t_python), t_mpi in zip(rows, mpi):
        print(f"  {nbytes:>8} {t_native:9.2f} {t_python:9.2f} {t_mpi:9.2f} "
              f"{t_native / t_mpi:9.2f} {t_python / t_mpi:8.2f}")


if __name__ == "__main__":
    main()
