"""The shm backend's all_reduce next to raw torch.distributed gloo, in one run.

    python benchmarks/shm_vs_gloo.py                    # 4 B and 64 MiB, 2 and 4 ranks
    python benchmarks/shm_vs_gloo.py --nproc 2 --sizes 4,1048576 --iters 50

Every rank holds both groups over the same ranks and times them alternately, one
iteration each, after a barrier on that group; an iteration is 20 back-to-back calls up
to 1 MiB (one call above), and its time per call is its slowest rank's. Prints the median per implementation and the ratio gloo / shm (above 1: shm is
faster). Results are checked once per size. Noisy machines: compare ratios, not times.
This file may import torch.distributed: it is a benchmark, not part of ``parallel/``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _time(fn, reps, barrier, reduce_max):
    """Seconds per call of ``reps`` back-to-back calls, on the slowest rank."""
    barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return reduce_max((time.perf_counter() - start) / reps)


def _rank(sizes, iters):
    import torch
    import torch.distributed as dist
    pg = collectives.init_process_group("shm")
    dist.init_process_group("gloo")
    n = pg.size
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        a = torch.ones(count)
        b = torch.ones(count)

        def slowest(t, group):
            x = torch.tensor([t], dtype=torch.float64)
            if group == "shm":
                pg.all_reduce(x, collectives.ReduceOp.MAX)
            else:
                dist.all_reduce(x, op=dist.ReduceOp.MAX)
            return float(x[0])

        pg.all_reduce(a)
        dist.all_reduce(b)
        wrong = int((a != n).sum() + (b != n).sum())
        a.zero_()  # zeros stay zeros: no overflow however many iterations
        b.zero_()
        small = nbytes <= 1 << 20
        n_iter = iters if small else max(5, iters // 10)
        reps = 20 if small else 1
        times = {"shm": [], "gloo": []}
        for i in range(n_iter):
            order = ("shm", "gloo") if i % 2 == 0 else ("gloo", "shm")
            for name in order:
                if name == "shm":
                    t = _time(lambda: pg.all_reduce(a), reps, pg.barrier,
                              lambda t: slowest(t, "shm"))
                else:
                    t = _time(lambda: dist.all_reduce(b), reps, dist.barrier,
                              lambda t: slowest(t, "gloo"))
                times[name].append(t)
        rows.append((n, nbytes, statistics.median(times["shm"]),
                     statistics.median(times["gloo"]), wrong))
    dist.destroy_process_group()
    pg.close()
    return rows


def main() -> None:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default="2,4", several=True)
    add_flag(p, "--sizes", default="4,64M")
    add_flag(p, "--iters", default=200,
             help="timed iterations per size (above 1 MiB: a tenth, at least 5)")
    args = p.parse_args()
    sizes = args.sizes
    print(f"{'ranks':>5} {'bytes':>10} {'shm_us':>12} {'gloo_us':>12} {'gloo/shm':>9} {'wrong':>5}")
    for nproc in args.nproc:
        for n, nbytes, shm, gloo, wrong in collectives.spawn(_rank, nproc,
                                                            args=(sizes, args.iters))[0]:
            print(f"{n:>5} {nbytes:>10} {shm * 1e6:>12.1f} {gloo * 1e6:>12.1f} "
                  f"{gloo / shm:>9.2f} {wrong:>5}", flush=True)


if __name__ == "__main__":
    main()
