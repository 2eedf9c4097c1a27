"""Where an uneven all_to_all's time goes: ``cProfile`` of rank 0 of a spawned job,
with the split pattern of ``python -m collectives.bench --uneven``.

    python benchmarks/all_to_all_profile.py --backend zmq --bytes 4K --iters 2000
    python benchmarks/all_to_all_profile.py --backend shm --bytes 1M --iters 500 --nproc 2

Every rank runs the same calls (after a warm-up and a barrier); only rank 0 is profiled,
so its peers wait for it where the profiler slows it, and the per-call time printed
(under the profiler) is above the benchmark's. Prints the functions that took the most
time of their own (``tottime``), the first lines of ``pstats``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import numpy as np

import collectives
from collectives.bench.cases import uneven_splits
from collectives.cli_flags import add_flag, flag_parser, positive_int

WARMUP = 50


def _job(nbytes: int, iters: int, lines: int) -> tuple:
    pg = collectives.init_process_group()
    me, n = pg.rank, pg.size
    count = nbytes // 4
    splits = uneven_splits(count, n)
    inp = np.ones(count, np.float32)
    recv = [splits[j][me] for j in range(n)]
    out = np.empty(sum(recv), np.float32)
    send = splits[me]
    for _ in range(WARMUP):
        pg.all_to_all(out, inp, output_split_sizes=recv, input_split_sizes=send)
    pg.barrier()
    profile = cProfile.Profile() if me == 0 else None
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    for _ in range(iters):
        pg.all_to_all(out, inp, output_split_sizes=recv, input_split_sizes=send)
    if profile is not None:
        profile.disable()
    per_call = (time.perf_counter() - t0) / iters
    text = ""
    if profile is not None:
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(lines)
        text = stream.getvalue()
    pg.close()
    return per_call, text


def main() -> None:
    p = flag_parser(description=__doc__)
    add_flag(p, "--backend", default="shm")
    add_flag(p, "--nproc", default=2)
    add_flag(p, "--bytes", default="4K",
             help="what each rank sends in all, K/M/G suffix (binary)")
    add_flag(p, "--iters", default=2000)
    p.add_argument("--lines", type=positive_int, default=14,
                   help="functions to print (default: %(default)s)")
    args = p.parse_args()
    results = collectives.spawn(_job, args.nproc, args=(args.bytes, args.iters, args.lines),
                                backend=args.backend, join_timeout=600)
    per_call, text = results[0]
    print(f"{args.backend}, {args.nproc} ranks, {args.bytes} B per rank: "
          f"{per_call * 1e6:.1f} us per call on rank 0 under the profiler")
    body = text.splitlines()
    start = next((i for i, line in enumerate(body) if "ncalls" in line), 0)
    print("\n".join(body[start:]))


if __name__ == "__main__":
    main()
