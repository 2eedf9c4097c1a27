"""A job for ``tests/test_launcher_signals.py``: ``collectives.spawn`` of ranks that run
collectives until they are stopped (or until one of them fails).

    python tests/faults/signal_job.py --backend shm --nproc 2 --out DIR [--fail-rank 1]

Each rank, once its group is up, writes ``DIR/rank<r>.json``: its pid, the job id, the
meeting port and the TCP ports it listens on, so that the test can check afterwards that
none of them is left. Then it runs ``all_reduce`` in a loop; ``--fail-rank r`` makes rank
r raise ``ValueError("deliberate failure on rank r")`` after a few calls, while the others
are inside a collective (they then fail with secondary errors of their own).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import collectives  # noqa: E402
from faults.tasks import listening_ports  # noqa: E402


def rank_main(out: str, fail_rank: int) -> None:
    """One rank: announce itself, then all_reduce until stopped."""
    pg = collectives.init_process_group()
    a = np.ones(1 << 16, np.float32)
    pg.all_reduce(a)  # every rank's connections are up before it announces itself
    info = {"rank": pg.rank, "pid": os.getpid(), "job": os.environ["COLLECTIVES_JOB_ID"],
            "master_port": int(os.environ["MASTER_PORT"]), "ports": listening_ports(pg)}
    path = Path(out) / f"rank{pg.rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(info))
    path.with_suffix(".tmp").rename(path)  # the test never reads half a file
    calls = 0
    while True:
        if pg.rank == fail_rank and calls == 20:
            raise ValueError(f"deliberate failure on rank {pg.rank}")
        pg.all_reduce(a, op=collectives.ReduceOp.MAX)  # stays 1.0: no overflow warnings
        calls += 1
        if calls % 100 == 0:
            time.sleep(0.001)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    collectives.spawn(rank_main, args.nproc, args=(args.out, args.fail_rank),
                      backend=args.backend, timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
