"""A persistent all_reduce (``pg.all_reduce_init``: start + wait) against the plain call,
side by side in one run.

    python benchmarks/persistent_vs_plain.py                       # shm, 2 ranks
    python benchmarks/persistent_vs_plain.py --backend zmq --nproc 2 --sizes 4,65536
    mpiexec -n 2 python benchmarks/persistent_vs_plain.py --backend mpi

Every rank alternates the two forms iteration by iteration on one float32 buffer (a
barrier before each timed call, so that both start together), and the slowest rank's
time of each iteration counts; one row per size: the medians and their ratio. Rows also
show the async form (``async_op=True`` + ``wait()``), which is what a persistent round
replaces in DDP's buckets, and ``req.run()``, the blocking round (DDP's last bucket).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import collectives  # noqa: E402
from collectives import ReduceOp  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _job(sizes: list[int], iters: int) -> list[dict]:
    pg = collectives.init_process_group()
    rows = []
    try:
        for nbytes in sizes:
            a = np.ones(max(1, nbytes // 4), np.float32)
            req = pg.all_reduce_init(a)
            forms = {
                "plain": lambda: pg.all_reduce(a),
                "async": lambda: pg.all_reduce(a, async_op=True).wait(),
                "persistent": lambda: (req.start(), req.wait()),
                "run": req.run,
            }
            times = {name: [] for name in forms}
            n = iters if nbytes <= 65536 else max(5, iters // 20)
            for i in range(n + 5):
                for name, fn in (list(forms.items()) if i % 2 else
                                 list(reversed(forms.items()))):
                    a[...] = 1.0             # (outside the timed region)
                    pg.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if i >= 5:
                        times[name].append(time.perf_counter() - t0)
            slowest = {}
            for name, ts in times.items():
                arr = np.asarray(ts)
                pg.all_reduce(arr, ReduceOp.MAX)
                slowest[name] = float(np.median(arr) * 1e6)
            req.free()
            rows.append({"backend": pg.backend, "world_size": pg.size, "bytes": nbytes,
                         "plain_us": round(slowest["plain"], 2),
                         "async_us": round(slowest["async"], 2),
                         "persistent_us": round(slowest["persistent"], 2),
                         "run_us": round(slowest["run"], 2),
                         "persistent_vs_plain": round(slowest["persistent"] / slowest["plain"], 3),
                         "persistent_vs_async": round(slowest["persistent"] / slowest["async"], 3),
                         "native": req.native})
    finally:
        pg.close()
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'backend':<7} {'n':>2} {'bytes':>9} {'plain us':>9} {'async us':>9} "
          f"{'persist us':>10} {'run() us':>9} {'vs plain':>8} {'vs async':>8} native")
    for r in rows:
        print(f"{r['backend']:<7} {r['world_size']:>2} {r['bytes']:>9} {r['plain_us']:>9.2f} "
              f"{r['async_us']:>9.2f} {r['persistent_us']:>10.2f} {r['run_us']:>9.2f} "
              f"{r['persistent_vs_plain']:>8.3f} {r['persistent_vs_async']:>8.3f} {r['native']}")
    print(json.dumps({"benchmark": "persistent_vs_plain", "rows": rows}))


def main() -> int:
    parser = flag_parser(description=__doc__)
    add_flag(parser, "--backend", default="shm")
    add_flag(parser, "--nproc", default=2, help="ranks (ignored under mpiexec)")
    add_flag(parser, "--sizes", default="4,4K,64K,1M")
    add_flag(parser, "--iters", default=400,
             help="timed iterations of each form per size (above 64 KiB: a 20th, at least "
                  "5)")
    args = parser.parse_args()
    sizes = args.sizes
    if collectives.detect_rendezvous().world_size > 1:  # started by mpiexec / torchrun
        rows = _job(sizes, args.iters)
        if collectives.detect_rendezvous().rank == 0:
            _print(rows)
        return 0
    rows = collectives.spawn(_job, args.nproc, args=(sizes, args.iters), backend=args.backend,
                             timeout=120)[0]
    _print(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
