"""Every collective once, through the public API only, with integer-valued inputs whose
results are exact on every backend: the same script under torchrun and under
``collectives.spawn`` must print the same JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/scripts/torchdist_collectives.py --backend gloo
    python tests/scripts/torchdist_collectives.py --backend shm --nproc 2

Rank 0 prints, as its last line of standard output, one JSON object:
``{"backend", "world_size", "launcher", "results": [per-rank dict of op -> values]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402
from collectives import ReduceOp  # noqa: E402


def run(backend: str) -> dict:
    pg = collectives.init_process_group(backend, timeout=60)
    n, r = pg.size, pg.rank
    out: dict = {}

    t = np.arange(5, dtype=np.float32) + 10 * r
    pg.broadcast(t, src=n - 1)
    out["broadcast"] = t.tolist()

    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        t = np.arange(6, dtype=np.float64) - 2 + r
        pg.all_reduce(t, op=ReduceOp[op])
        out[f"all_reduce_{op}"] = t.tolist()
    t = (np.arange(6) * 9000 + r).astype(np.int16)
    pg.all_reduce(t)  # wraps around, like numpy's int16 arithmetic
    out["all_reduce_int16"] = t.tolist()

    t = np.full(3, r + 1, np.int64)
    pg.reduce(t, dst=0)
    out["reduce"] = t.tolist()

    g = np.empty(2 * n, np.int32)
    pg.all_gather(g, np.array([r, -r], np.int32))
    out["all_gather"] = g.tolist()

    g = np.empty(2 * n, np.float32) if r == 0 else None
    pg.gather(np.array([r, r + 0.5], np.float32), g, dst=0)
    out["gather"] = None if g is None else g.tolist()

    s = np.empty(2, np.int64)
    pg.scatter(s, np.arange(2 * n, dtype=np.int64) * 3 if r == n - 1 else None, src=n - 1)
    out["scatter"] = s.tolist()

    rs = np.empty(2, np.float32)
    pg.reduce_scatter(rs, np.arange(2 * n, dtype=np.float32) + r)
    out["reduce_scatter"] = rs.tolist()

    a2a = np.empty(n, np.int64)
    pg.all_to_all(a2a, np.arange(n, dtype=np.int64) + 100 * r)
    out["all_to_all"] = a2a.tolist()

    # Uneven splits: rank r sends j + 1 rows to rank j.
    rows_in = [j + 1 for j in range(n)]
    rows_out = [r + 1] * n
    x = np.repeat(np.arange(n, dtype=np.float32) + 10 * r, rows_in)
    y = np.empty(sum(rows_out), np.float32)
    pg.all_to_all(y, x, output_split_sizes=rows_out, input_split_sizes=rows_in)
    out["all_to_all_splits"] = y.tolist()

    t = np.full(4, float(r))
    pg.all_reduce(t, async_op=True).wait()
    out["async_all_reduce"] = t.tolist()

    if n > 1:
        nxt, prv = (r + 1) % n, (r - 1) % n
        got = np.empty(2, np.int64)
        send = pg.isend(np.array([r, 7], np.int64), nxt, tag=7)
        pg.recv(got, prv, tag=7)
        send.wait()
        out["ring_send_recv"] = got.tolist()

    out["broadcast_object"] = pg.broadcast_object({"from": r, "n": n} if r == 0 else None)
    out["all_gather_object"] = pg.all_gather_object(f"rank{r}")

    sub_ranks = list(range(0, n, 2)) if r % 2 == 0 else list(range(1, n, 2))
    sub = pg.new_group(sub_ranks)
    t = np.array([r + 1.0])
    sub.all_reduce(t)
    out["sub_group_all_reduce"] = t.tolist()
    sub.close()

    pg.barrier()
    everyone = pg.all_gather_object(out)
    launcher = collectives.detect_rendezvous().launcher
    pg.close()
    return {"backend": backend, "world_size": n, "launcher": launcher, "results": everyone}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--nproc", type=int, default=None,
                        help="spawn this many ranks (leave out under torchrun)")
    args = parser.parse_args()
    if args.nproc is not None:
        report = collectives.spawn(run, args.nproc, args=(args.backend,),
                                   backend=args.backend, timeout=60)[0]
    else:
        report = run(args.backend)
        if collectives.detect_rendezvous().rank != 0:
            return 0
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
