"""shm ranks bound one per core against ranks left to the kernel, job after job.

    python benchmarks/shm_placement.py                  # 4 ranks, 8 jobs of each
    python benchmarks/shm_placement.py --nproc 3 --jobs 4

Each job times what ``python -m collectives.bench`` times for a 4-byte all_reduce (per
iteration: a barrier, then one timed call; the slowest rank's time; the median over the
iterations), over more iterations. The jobs alternate ``COLLECTIVES_SHM_BIND=auto``
(bound, when the ranks outnumber the cores) and ``none``, so that a slow spell of the
machine hits both alike. Whether a job is fast or slow is settled by where the kernel
puts the ranks, which is why it takes several jobs to see: one line per job pair, then
the median and the worst of each.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import collectives  # noqa: E402
from collectives.cli_flags import positive_int  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _job(iters: int, warmup: int) -> dict:
    pg = collectives.init_process_group()
    a = np.ones(1, np.float32)
    mine = np.empty(iters)
    for i in range(warmup + iters):
        pg.barrier()
        start = time.perf_counter()
        pg.all_reduce(a)
        if i >= warmup:
            mine[i - warmup] = time.perf_counter() - start
    slowest = mine.copy()
    pg.all_reduce(slowest, collectives.ReduceOp.MAX)
    res = {"us": float(np.median(slowest)) * 1e6, "core": pg.transport.bound_core}
    pg.close()
    return res


def main() -> None:
    ap = flag_parser(description=__doc__)
    add_flag(ap, "--nproc", default=4)
    ap.add_argument("--jobs", type=positive_int, default=8,
                    help="jobs of each placement (default: %(default)s)")
    add_flag(ap, "--iters", default=2000)
    add_flag(ap, "--warmup", default=200)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"# {args.nproc} ranks on {cores} cores; 4-byte all_reduce after a barrier, "
          f"median of the slowest rank over {args.iters} iterations, us")
    times: dict[str, list[float]] = {"auto": [], "none": []}
    for j in range(args.jobs):
        line = []
        for mode in ("auto", "none") if j % 2 == 0 else ("none", "auto"):
            res = collectives.spawn(_job, args.nproc, args=(args.iters, args.warmup),
                                    backend="shm", env={"COLLECTIVES_SHM_BIND": mode},
                                    timeout=120)
            times[mode].append(res[0]["us"])
            cores_used = [r["core"] for r in res]
            line.append(f"{mode}: {res[0]['us']:6.1f} (cores {cores_used})")
        print("  " + "   ".join(sorted(line)))
    for mode, values in times.items():
        print(f"# {mode}: median {np.median(values):.1f} us, worst {max(values):.1f} us "
              f"over {len(values)} jobs")


if __name__ == "__main__":
    main()
