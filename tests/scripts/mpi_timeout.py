"""A hang diagnosed, for ``tests/test_mpi_backend.py``: ``mpiexec -n 3`` with a group
timeout of ``--timeout`` seconds (default 2).

- rank 0 first waits 0.3 s for a message rank 2 never sends (``Work.wait(timeout)``), then
  calls ``all_reduce``;
- rank 1 waits in ``recv`` from rank 0 (inside this library, so it answers rank 0's
  question "how far are you?"), and only then calls ``all_reduce``;
- rank 2 sleeps ``timeout + 1.5`` s in user code (it cannot answer), then calls it.

Rank 0's ``all_reduce`` raises ``CollectiveTimeout`` naming ranks 1 and 2; rank 0 then
releases rank 1 and everybody meets in a barrier, which completes the pending all_reduce
too (MPI matches collectives in order). Rank 0 prints one JSON line per rank.

    mpiexec -n 2 python tests/scripts/mpi_timeout.py --die   # rank 1 dies mid-collective
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402
from collectives import CollectiveTimeout  # noqa: E402


def _error(exc: BaseException, start: float) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "op": getattr(exc, "op", None),
            "seq": getattr(exc, "seq", None), "missing": list(getattr(exc, "missing", ())),
            "after_s": time.monotonic() - start}


def hang(timeout: float) -> list:
    pg = collectives.init_process_group(timeout=timeout)
    r = pg.rank
    out: dict = {"rank": r, "backend": pg.backend}
    pg.barrier()  # seq 0
    t = np.full(4, r + 1.0)
    if r == 0:
        start = time.monotonic()
        try:
            pg.irecv(np.empty(1), src=2, tag=99).wait(timeout=0.3)
            out["p2p"] = "no error"
        except CollectiveTimeout as exc:
            out["p2p"] = _error(exc, start)
        start = time.monotonic()
        try:
            pg.all_reduce(t)  # seq 1
            out["all_reduce"] = "no error"
        except CollectiveTimeout as exc:
            out["all_reduce"] = _error(exc, start)
        pg.send(np.ones(1), dst=1, tag=5)
    elif r == 1:
        pg.irecv(np.empty(1), src=0, tag=5).wait(timeout=timeout + 20)
        pg.all_reduce(t)
    else:
        time.sleep(timeout + 1.5)
        pg.all_reduce(t)
    start = time.monotonic()
    pg.barrier()  # completes the all_reduce that timed out on rank 0, too
    out["barrier_s"] = time.monotonic() - start
    out["late_result"] = t.tolist()
    everyone = pg.all_gather_object(out)  # printed by rank 0: lines cannot interleave
    pg.close()
    return everyone if r == 0 else []


def die() -> None:
    pg = collectives.init_process_group(timeout=30)
    if pg.rank == 1:
        time.sleep(0.3)
        os._exit(3)  # no MPI_Finalize: mpiexec ends the job
    pg.all_reduce(np.ones(4))
    print(json.dumps({"rank": pg.rank, "survived": True}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--die", action="store_true")
    args = parser.parse_args()
    if args.die:
        die()
        return 0
    for report in hang(args.timeout):
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
