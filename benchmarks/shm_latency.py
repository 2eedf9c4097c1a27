"""Latency and bandwidth of the shm backend's all_reduce.

    python benchmarks/shm_latency.py                      # 4 B and 64 MiB at 2 and 4 ranks
    python benchmarks/shm_latency.py --gib                # plus a 4-rank 1 GiB all_reduce
    python benchmarks/shm_latency.py --nproc 2 --sizes 4,65536 --wait sleep

Prints one line per (world size, size): the median over the timed iterations, and for
4-byte messages what one iteration costs with a single rank (the Python overhead of the
call itself: validation, staging, the hook), so the share of the transport is visible.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import collectives  # noqa: E402
from collectives.cli_flags import positive_int  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _bench(sizes, iters_small, iters_large):
    pg = collectives.init_process_group()
    rows = []
    for nbytes in sizes:
        a = np.ones(max(1, nbytes // 4), np.float32)
        iters = iters_small if nbytes <= 65536 else iters_large
        warm = max(3, iters // 10)
        for _ in range(warm):
            a[...] = 1.0
            pg.all_reduce(a)
        times = []
        for _ in range(iters):
            a[:1] = 1.0  # keep values finite without touching the whole buffer
            pg.barrier() if nbytes > 65536 else None
            t0 = time.perf_counter()
            pg.all_reduce(a)
            times.append(time.perf_counter() - t0)
        rows.append({"bytes": nbytes, "median_us": float(np.median(times) * 1e6),
                     "p10_us": float(np.percentile(times, 10) * 1e6),
                     "p90_us": float(np.percentile(times, 90) * 1e6)})
    mode = pg.transport.wait_mode
    pg.close()
    return mode, rows


def _gib():
    pg = collectives.init_process_group()
    n = pg.size
    count = (1 << 30) // 4
    a = np.full(count, float(pg.rank + 1), np.float32)
    a[::4097] = pg.rank  # not all equal: check positions too
    pg.barrier()
    t0 = time.perf_counter()
    pg.all_reduce(a)
    elapsed = time.perf_counter() - t0
    expect_bulk, expect_marked = n * (n + 1) / 2, n * (n - 1) / 2
    ok = True
    step = 1 << 24
    for lo in range(0, count, step):  # check in slices: no 1 GiB temporaries
        part = a[lo:lo + step]
        marked = np.zeros(part.size, bool)
        marked[(-lo) % 4097::4097] = True
        ok &= bool((part[~marked] == expect_bulk).all() and
                   (part[marked] == expect_marked).all())
    footprint = pg.transport.footprint_bytes
    chunk = pg.transport.chunk_bytes
    pg.close()
    return {"seconds": elapsed, "correct": ok, "segment_bytes": footprint,
            "data_banks_bytes": 2 * n * chunk, "chunk_bytes": chunk}


def main() -> None:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default="2,4", several=True)
    add_flag(p, "--sizes", default="4,64M")
    p.add_argument("--iters-small", type=positive_int, default=3000,
                   help="timed iterations of sizes up to 64 KiB (default: %(default)s)")
    p.add_argument("--iters-large", type=positive_int, default=15,
                   help="timed iterations of larger sizes (default: %(default)s)")
    p.add_argument("--wait", choices=["futex", "sleep"], default=None,
                   help="COLLECTIVES_SHM_WAIT for the ranks (default: the backend's)")
    p.add_argument("--gib", action="store_true", help="also a 4-rank 1 GiB all_reduce")
    add_flag(p, "--json")
    args = p.parse_args()
    env = {}
    if args.wait:
        env["COLLECTIVES_SHM_WAIT"] = args.wait
    sizes = args.sizes
    out = []
    if 4 in sizes:
        _, rows = collectives.spawn(_bench, 1, args=([4], args.iters_small, 1),
                                    backend="shm", env=env)[0]
        print(f"1 rank : {rows[0]['median_us']:8.1f} us for a 4 B all_reduce "
              f"(call overhead, no transport)")
    for n in args.nproc:
        mode, rows = collectives.spawn(_bench, n, args=(sizes, args.iters_small,
                                                         args.iters_large),
                                       backend="shm", env=env, timeout=600)[0]
        for row in rows:
            row.update(world_size=n, wait=mode)
            out.append(row)
            b = row["bytes"]
            bw = b / row["median_us"] / 1e3 if b > 65536 else None
            print(f"{n} ranks: {b:>10d} B  median {row['median_us']:10.1f} us  "
                  f"(p10 {row['p10_us']:.1f}, p90 {row['p90_us']:.1f})"
                  + (f"  algbw {bw:.2f} GB/s" if bw else "") + f"  [{mode}]")
    if args.gib:
        res = collectives.spawn(_gib, 4, backend="shm", env=env, timeout=600)[0]
        print(f"4 ranks: 1 GiB float32 all_reduce in {res['seconds']:.2f} s, correct: "
              f"{res['correct']}; shared memory: {res['data_banks_bytes'] >> 20} MiB of data "
              f"banks (2 x 4 ranks x {res['chunk_bytes'] >> 20} MiB), segment "
              f"{res['segment_bytes'] / 2**20:.1f} MiB (sparse)")
        out.append({"gib": res})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
