"""One rank of a start-collective-close cycle on the ``gloo`` backend, as its own
interpreter: tests/test_torchdist_backend.py starts a few ranks of it (with the variables
torchrun would set) and checks that every process exits with code 0, run after run.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python tests/scripts/torchdist_cycle.py --cycles 20 --leave-open

Each cycle opens the world, runs collectives on numpy-backed and torch tensors (some
async), and closes it. With ``--leave-open`` the last cycle ends with async work nobody
waited for and without ``close()``: the backend's exit hook must clean up before the
interpreter finalises (gloo's worker threads otherwise abort the process now and then).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402


_LEFT_OPEN: list = []


def cycle(last_left_open: bool) -> None:
    pg = collectives.init_process_group("gloo", timeout=60)
    n, r = pg.size, pg.rank
    a = np.full(1000, r + 1.0, np.float32)
    pg.all_reduce(a)
    if not (a == n * (n + 1) / 2).all():
        raise AssertionError(f"rank {r}: all_reduce gave {a[:4]}")
    t = torch.from_numpy(np.ones(4096, np.float32))
    works = [pg.all_reduce(t, async_op=True) for _ in range(3)]
    out = np.empty(2 * n, np.int64)
    pg.all_gather(out, np.full(2, r, np.int64))
    if last_left_open:
        # Like a script whose world is a global it never closes: the group, an async
        # all_reduce nobody waits for and tensors viewing numpy memory live on until the
        # interpreter exits; the backend's exit hook must close the group first.
        _LEFT_OPEN.extend([pg, t, works, pg.all_reduce(torch.ones(1 << 16), async_op=True)])
        return
    for w in works:
        w.wait()
    if not (t == n ** 3).all():
        raise AssertionError(f"rank {r}: async all_reduce gave {t[:4]}")
    pg.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--leave-open", action="store_true")
    args = parser.parse_args()
    for i in range(args.cycles):
        cycle(args.leave_open and i == args.cycles - 1)
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
