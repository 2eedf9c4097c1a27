"""shm wait policies side by side: how long a waiter spins and yields before it sleeps.

    python benchmarks/shm_wait_policy.py                 # 2 ranks
    python benchmarks/shm_wait_policy.py --nproc 4       # 4 ranks (oversubscribed on 2 cores)

One job holds one group per policy (``COLLECTIVES_SHM_SPIN_US`` / ``_YIELD_US`` are read
when a group is made), all over the same ranks; they are timed in turn, six times each:
a loop of back-to-back 4-byte all_reduce calls, microseconds per call on rank 0, the
median of the six. ``0/0`` sleeps in the kernel at once. The policy
``backends.shm.native.wait_policy`` picks for this machine is printed first.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import collectives  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402

POLICIES = [(0, 50), (0, 500), (1, 50), (1, 500), (10, 500), (50, 200), (0, 0)]


def _job(iters: int) -> dict:
    from backends.shm.native import wait_policy
    pg = collectives.init_process_group()
    chosen = tuple(round(x * 1e6) for x in wait_policy(pg.size))
    groups = []
    for spin, yld in POLICIES:
        os.environ["COLLECTIVES_SHM_SPIN_US"] = str(spin)
        os.environ["COLLECTIVES_SHM_YIELD_US"] = str(yld)
        groups.append(pg.new_group(list(range(pg.size))))
    a = np.ones(1, np.float32)
    samples: dict[tuple, list[float]] = {p: [] for p in POLICIES}
    for _ in range(6):
        for policy, g in zip(POLICIES, groups):
            for _ in range(50):
                g.all_reduce(a)
            t0 = time.perf_counter()
            for _ in range(iters):
                g.all_reduce(a)
            samples[policy].append((time.perf_counter() - t0) / iters * 1e6)
    for g in groups:
        g.close()
    pg.close()
    return {"chosen": chosen,
            "us": {f"{p[0]}/{p[1]}": round(float(np.median(v)), 1) for p, v in samples.items()}}


def main() -> None:
    ap = flag_parser(description=__doc__)
    add_flag(ap, "--nproc", default=2)
    add_flag(ap, "--iters", default=500, help="calls in one timed loop")
    args = ap.parse_args()
    res = collectives.spawn(_job, args.nproc, args=(args.iters,), backend="shm",
                            timeout=300)[0]
    print(f"# {args.nproc} ranks, load average {os.getloadavg()[0]:.1f} on "
          f"{len(os.sched_getaffinity(0))} cores; wait_policy picks spin/yield "
          f"{res['chosen'][0]}/{res['chosen'][1]} us")
    print("# spin/yield us -> us per 4-byte all_reduce:", res["us"])


if __name__ == "__main__":
    main()
