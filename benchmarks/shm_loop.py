"""A 2-rank shm all_reduce loop to profile, e.g. with py-spy:

    py-spy record --native --subprocesses -r 500 -d 8 -f raw -o prof.txt -- \\
        python benchmarks/shm_loop.py --bytes 4 --seconds 6

Each rank calls ``all_reduce`` on ``--bytes`` of float32 for ``--seconds`` and returns how
many calls it made (printed).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import collectives  # noqa: E402
from collectives.cli_flags import seconds  # noqa: E402
from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _job(nbytes: int, seconds: float) -> int:
    pg = collectives.init_process_group()
    a = np.ones(max(1, nbytes // 4), np.float32)
    end = time.time() + seconds
    calls = 0
    stop = np.zeros(1, np.int32)
    while not stop[0]:
        for _ in range(100):
            pg.all_reduce(a)
        calls += 100
        a[...] = 1.0
        stop[0] = time.time() >= end     # every rank stops after the same call
        pg.all_reduce(stop, op=collectives.ReduceOp.MAX)
    pg.close()
    return calls


def main() -> None:
    ap = flag_parser(description=__doc__)
    add_flag(ap, "--bytes", default="4")
    ap.add_argument("--seconds", type=seconds, default=6.0,
                    help="how long each rank loops (default: %(default)s)")
    add_flag(ap, "--nproc", default=2)
    args = ap.parse_args()
    print(collectives.spawn(_job, args.nproc, args=(args.bytes, args.seconds),
                            backend="shm"))


if __name__ == "__main__":
    main()
