"""The shm backend's two paths side by side: the compiled core against the Python path.

    python benchmarks/shm_native_vs_python.py                    # 2 ranks, 4 B .. 64 MiB
    python benchmarks/shm_native_vs_python.py --nproc 4 --sizes 4,4096,1048576

One job of ``--nproc`` ranks holds two groups over the same ranks: the world (on the
compiled core, where it is built) and a sub-group made with ``COLLECTIVES_SHM_NATIVE=0``
(the Python path). Per size, float32 SUM, the two are timed in turn, twice each (the
machine's load drifts; alternating puts both under the same drift): a barrier, then one
``all_reduce``, timed on rank 0; the median over the calls. Prints one line per size
and the ratio native / python (below 1: the core is faster).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import collectives  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402

DEFAULT_SIZES = "4,64,1K,4K,64K,1M,16M,64M"


def _job(sizes: list[int], iters: int) -> list[tuple[int, float, float]]:
    pg = collectives.init_process_group()
    os.environ["COLLECTIVES_SHM_NATIVE"] = "0"
    python = pg.new_group(list(range(pg.size)))
    del os.environ["COLLECTIVES_SHM_NATIVE"]
    rows = []
    for nbytes in sizes:
        a = np.ones(max(1, nbytes // 4), np.float32)
        n = max(3, min(iters, (256 << 20) // max(nbytes, 1)))
        times: dict[str, list[float]] = {"native": [], "python": []}
        for _ in range(2):
            for name, g in (("native", pg), ("python", python)):
                for _ in range(max(2, n // 10)):
                    g.all_reduce(a)
                for _ in range(n):
                    g.barrier()
                    t0 = time.perf_counter()
                    g.all_reduce(a)
                    times[name].append(time.perf_counter() - t0)
                a[...] = 1.0
        rows.append((nbytes, float(np.median(times["native"]) * 1e6),
                     float(np.median(times["python"]) * 1e6)))
    native = pg.transport.native
    python.close()
    pg.close()
    return [native] + rows


def main() -> None:
    ap = flag_parser(description=__doc__)
    add_flag(ap, "--nproc", default=2)
    add_flag(ap, "--sizes", default=DEFAULT_SIZES)
    add_flag(ap, "--iters", default=300,
             help="timed calls of each path per size (fewer for large sizes: at most "
                  "256 MiB moved, at least 3 calls)")
    args = ap.parse_args()
    sizes = args.sizes
    out = collectives.spawn(_job, args.nproc, args=(sizes, args.iters), backend="shm",
                            timeout=300)[0]
    native, rows = out[0], out[1:]
    print(f"# shm all_reduce, float32, {args.nproc} ranks, world on the core: {native}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"# {'bytes':>10} {'native us':>11} {'python us':>11} {'native/python':>14}")
    for nbytes, t_native, t_python in rows:
        print(f"  {nbytes:>10} {t_native:11.1f} {t_python:11.1f} {t_native / t_python:14.2f}")


if __name__ == "__main__":
    main()
