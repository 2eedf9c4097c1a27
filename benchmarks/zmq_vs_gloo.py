"""all_reduce latency and bandwidth: the ``zmq`` backend against raw torch.distributed gloo.

Both run in one invocation, on the same machine, with the same launcher
(``collectives.spawn``), the same float32 torch tensors and the same timing: after a
warm-up, rank 0 times each call separately (the next call starts when the previous one
returned on rank 0) and takes the median. With ``--repeat R`` the two are run R times,
alternating, each time in fresh processes, and the median of the R medians is reported
(shared machines drift: alternating keeps the comparison fair). gloo is driven directly
through ``torch.distributed`` (no wrapper of ours in the way).

    python benchmarks/zmq_vs_gloo.py                       # 4 B, 1 MiB, 64 MiB at 2 and 4 ranks
    python benchmarks/zmq_vs_gloo.py --sizes 4,64K --nproc 2,3 --json out.json
    COLLECTIVES_ZMQ_TRANSPORT=tcp python benchmarks/zmq_vs_gloo.py   # zmq over TCP only
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collectives  # noqa: E402
from collectives.cli_flags import (add_flag, comma_choices, flag_parser,  # noqa: E402
                                   positive_int)


def _iterations(nbytes: int, small: int, large: int) -> int:
    return small if nbytes <= 1 << 20 else large


def _time(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def zmq_rank(sizes: list[int], small: int, large: int) -> dict:
    import torch
    pg = collectives.init_process_group("zmq")
    out = {}
    for nbytes in sizes:
        # zeros: repeated sums stay finite (ones overflow to inf after ~128 calls,
        # with a warning per call)
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        iters = _iterations(nbytes, small, large)
        pg.barrier()
        times = _time(lambda: pg.all_reduce(t), max(2, iters // 10), iters)
        t.fill_(pg.rank + 1.0)
        pg.all_reduce(t)
        wrong = not bool((t == pg.size * (pg.size + 1) / 2).all())
        out[nbytes] = (statistics.median(times), wrong)
    info = {"auth": pg.transport.auth_mode, "endpoints": pg.transport.endpoints, "malloc": pg.transport.malloc}
    pg.close()
    return {"times": out, "info": info} if pg.rank == 0 else {}


def gloo_rank(sizes: list[int], small: int, large: int) -> dict:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    out = {}
    for nbytes in sizes:
        # zeros: repeated sums stay finite (ones overflow to inf after ~128 calls,
        # with a warning per call)
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        iters = _iterations(nbytes, small, large)
        dist.barrier()
        times = _time(lambda: dist.all_reduce(t), max(2, iters // 10), iters)
        n = dist.get_world_size()
        t.fill_(dist.get_rank() + 1.0)
        dist.all_reduce(t)
        wrong = not bool((t == n * (n + 1) / 2).all())
        out[nbytes] = (statistics.median(times), wrong)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"times": out} if rank == 0 else {}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = flag_parser(description=__doc__)
    add_flag(parser, "--sizes", default="4,1M,64M")
    add_flag(parser, "--nproc", default="2,4", several=True)
    parser.add_argument("--iters-small", type=positive_int, default=300,
                        help="timed calls of sizes up to 1 MiB (default: %(default)s)")
    parser.add_argument("--iters-large", type=positive_int, default=10,
                        help="timed calls of larger sizes (default: %(default)s)")
    parser.add_argument("--impls", type=comma_choices("zmq", "gloo"), default="zmq,gloo",
                        metavar="LIST",
                        help="comma list of zmq (ours) and gloo (raw torch.distributed) "
                             "(default: %(default)s)")
    add_flag(parser, "--repeat", default=3,
             help="runs per implementation, alternating (median of medians)")
    add_flag(parser, "--json")
    args = parser.parse_args(argv)
    sizes = args.sizes
    rows = []
    for n in args.nproc:
        runs: dict = {}
        for rep in range(args.repeat):
            for impl in args.impls:
                fn = zmq_rank if impl == "zmq" else gloo_rank
                t0 = time.time()
                result = collectives.spawn(
                    fn, n, args=(sizes, args.iters_small, args.iters_large),
                    backend="zmq" if impl == "zmq" else None, timeout=600)[0]
                for nbytes, (median, wrong) in result["times"].items():
                    runs.setdefault((impl, nbytes), []).append((median, wrong))
                extra = ""
                if impl == "zmq":
                    eps = result["info"]["endpoints"]
                    tr = "ipc" if "ipc" in eps and os.environ.get(
                        "COLLECTIVES_ZMQ_TRANSPORT") != "tcp" else "tcp"
                    info = result["info"]
                    extra = f" ({info['auth']} auth, {tr}, malloc {info['malloc']})"
                print(f"# run {rep + 1}/{args.repeat} {impl} x{n}{extra}: "
                      f"{time.time() - t0:.1f} s", file=sys.stderr)
        for (impl, nbytes), got in runs.items():
            median = statistics.median(m for m, _ in got)
            rows.append({"impl": impl, "op": "all_reduce", "world_size": n, "bytes": nbytes,
                         "dtype": "float32", "time_us": median * 1e6,
                         "algbw_gbps": nbytes / median / 1e9,
                         "busbw_gbps": nbytes / median / 1e9 * 2 * (n - 1) / n,
                         "wrong": any(w for _, w in got),
                         "runs_us": [round(m * 1e6, 1) for m, _ in got]})
    print(f"{'ranks':>5} {'bytes':>10} {'zmq us':>12} {'gloo us':>12} {'zmq/gloo':>9} "
          f"{'zmq busbw':>10} {'gloo busbw':>10}")
    for n in sorted({r["world_size"] for r in rows}):
        for nbytes in sizes:
            by = {r["impl"]: r for r in rows if r["world_size"] == n and r["bytes"] == nbytes}
            z, g = by.get("zmq"), by.get("gloo")
            ratio = f"{z['time_us'] / g['time_us']:.2f}" if z and g else "-"
            fmt = lambda r, k, f: format(r[k], f) if r else "-"  # noqa: E731
            print(f"{n:>5} {nbytes:>10} {fmt(z, 'time_us', '12.1f')} {fmt(g, 'time_us', '12.1f')} "
                  f"{ratio:>9} {fmt(z, 'busbw_gbps', '10.3f')} {fmt(g, 'busbw_gbps', '10.3f')}"
                  + ("  WRONG" if any(r and r["wrong"] for r in (z, g)) else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
