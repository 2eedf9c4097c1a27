"""Every collective through the public API only, for ``tests/test_mpi_backend.py``.

    mpiexec -n 4 python tests/scripts/mpi_collectives.py              # backend mpi (default)
    mpiexec -n 2 python tests/scripts/mpi_collectives.py --backend shm
    python tests/scripts/mpi_collectives.py --backend shm --nproc 2   # collectives.spawn

Every rank's results are one JSON line on standard output, in rank order, printed by rank
0 (or, under ``--nproc``, the parent) after an ``all_gather_object``, so that the lines of
ranks writing at once cannot interleave: ``{"rank", "size", "backend", "launcher",
"exact": {...}, "inexact": {...}, "specific": {...}}``.

- ``exact``: small integer-valued inputs, so every backend and reduction order gives the
  same values; the test checks them against closed forms and across backends.
- ``inexact``: random float16/bfloat16/float32 inputs (inexact sums); per op, a digest of
  the result's bytes (all ranks must agree: bitwise-identical all_reduce) and its largest
  error against the float64 sum, in units of ``sum(|x_i|)``.
- ``specific``: what depends on the backend (MPI's largest tag).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402
from collectives import ReduceOp  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
          "int64")
INEXACT_SIZES = (1000, 100_003)


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _list(a) -> list:
    """JSON-able values of a numpy array or torch tensor."""
    if not isinstance(a, np.ndarray):
        a = a.float().numpy() if a.is_floating_point() else a.numpy()
    return np.asarray(a).astype(np.float64).tolist()


def _random(dtype: np.dtype, size: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.standard_normal(size).astype(np.float32).astype(dtype)


def _inexact(pg, out: dict) -> None:
    n, r = pg.size, pg.rank
    for seed, size in enumerate(INEXACT_SIZES):
        for name in ("float16", "bfloat16", "float32"):
            dt = _dtype(name)
            xs = [_random(dt, size, q, seed) for q in range(n)]
            exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
            scale = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0) + 1e-30
            for op in ("SUM", "AVG"):
                t = xs[r].copy()
                pg.all_reduce(t, op=ReduceOp[op])
                div = n if op == "AVG" else 1
                err = float(np.max(np.abs(t.astype(np.float64) - exact / div) / (scale / div)))
                out[f"all_reduce_{op}_{name}_{size}"] = {
                    "digest": hashlib.sha1(t.tobytes()).hexdigest(), "error": err}
            part = size // n
            o = np.empty(part, dt)
            pg.reduce_scatter(o, xs[r][:part * n].copy())
            want = exact[r * part:(r + 1) * part]
            s = scale[r * part:(r + 1) * part]
            out[f"reduce_scatter_{name}_{size}"] = {
                "error": float(np.max(np.abs(o.astype(np.float64) - want) / s, initial=0.0))}
            t = xs[r].copy()
            pg.reduce(t, dst=0)
            if r == 0:
                out[f"reduce_{name}_{size}"] = {
                    "error": float(np.max(np.abs(t.astype(np.float64) - exact) / scale))}
            else:  # a non-root's tensor is left unchanged
                out[f"reduce_{name}_{size}"] = {"unchanged": t.tobytes() == xs[r].tobytes()}


def run(backend: str | None) -> list:
    import torch

    pg = collectives.init_process_group(backend, timeout=60)
    n, r = pg.size, pg.rank
    ex: dict = {}

    # reductions: every dtype, every operator; rank r contributes r + 1
    for name in DTYPES:
        dt = _dtype(name)
        for op in ("SUM", "PRODUCT", "MIN", "MAX") + (("AVG",) if "float" in name else ()):
            t = np.full(5, r + 1, dt)
            pg.all_reduce(t, op=ReduceOp[op])
            ex[f"all_reduce_{op}_{name}"] = _list(t)
        t = np.full(3, r + 1, dt)
        pg.reduce(t, dst=n - 1, op=ReduceOp.SUM)
        ex[f"reduce_{name}"] = _list(t)
        rs = np.empty(2, dt)
        pg.reduce_scatter(rs, (np.arange(2 * n) + r).astype(dt))
        ex[f"reduce_scatter_{name}"] = _list(rs)
    t = (np.arange(6) * 9000 + r).astype(np.int16)
    pg.all_reduce(t)  # wraps around like numpy's int16 arithmetic
    ex["all_reduce_int16_wrap"] = _list(t)
    rs = np.empty(2, np.float32)
    pg.reduce_scatter(rs, np.arange(2 * n, dtype=np.float32) + r, op=ReduceOp.AVG)
    ex["reduce_scatter_AVG"] = _list(rs)

    # non-contiguous torch views (staged, written back; the gaps stay untouched)
    base = torch.zeros(10, dtype=torch.bfloat16)
    base[::2] = r + 1
    pg.all_reduce(base[::2], op=ReduceOp.AVG)
    ex["all_reduce_strided_bf16"] = _list(base)
    m = torch.arange(6, dtype=torch.float16).reshape(2, 3) + r
    pg.all_reduce(m.t())  # a transposed view
    ex["all_reduce_transposed_f16"] = _list(m)
    out = torch.full((2 * n, 2), -1.0)
    pg.all_gather(out[:, 0], torch.tensor([r, -r], dtype=torch.float32))
    ex["all_gather_strided_out"] = _list(out)

    # data movement
    t = np.arange(5, dtype=np.float32) + 10 * r
    pg.broadcast(t, src=n - 1)
    ex["broadcast"] = _list(t)
    t = np.full(3, r % 2 == 0)
    pg.broadcast(t, src=0)
    ex["broadcast_bool"] = _list(t)
    g = np.empty(2 * n, np.int32)
    pg.all_gather(g, np.array([r, -r], np.int32))
    ex["all_gather"] = _list(g)
    g = np.empty(2 * n, ml_dtypes.bfloat16) if r == 0 else None
    pg.gather(np.array([r, r + 0.5], ml_dtypes.bfloat16), g, dst=0)
    ex["gather"] = None if g is None else _list(g)
    s = np.empty(2, np.int64)
    pg.scatter(s, np.arange(2 * n, dtype=np.int64) * 3 if r == n - 1 else None, src=n - 1)
    ex["scatter"] = _list(s)
    a2a = np.empty(n, np.int64)
    pg.all_to_all(a2a, np.arange(n, dtype=np.int64) + 100 * r)
    ex["all_to_all"] = _list(a2a)
    rows_in = [j + 1 for j in range(n)]  # rank r sends j + 1 rows to rank j
    rows_out = [r + 1] * n
    x = np.repeat(np.arange(n, dtype=np.float16) + 10 * r, rows_in)
    y = np.empty(sum(rows_out), np.float16)
    pg.all_to_all(y, x, output_split_sizes=rows_out, input_split_sizes=rows_in)
    ex["all_to_all_splits"] = _list(y)
    pg.barrier()
    e = np.empty(0, np.float32)
    pg.all_reduce(e)
    pg.broadcast(e, src=0)
    ex["empty"] = _list(e)

    # async: all in flight at once, waited for in reverse order
    a = np.full(1000, r + 1.0, np.float32)
    b = np.full(7, r, np.int64)
    o = np.empty(3 * n, np.int16)
    works = [pg.all_reduce(a, op=ReduceOp.AVG, async_op=True),
             pg.broadcast(b, src=n - 1, async_op=True),
             pg.all_gather(o, np.full(3, r, np.int16), async_op=True),
             pg.barrier(async_op=True)]
    for w in reversed(works):
        w.wait(timeout=60)
    ex["async"] = {"a": _list(a[:3]), "b": _list(b[:2]), "o": _list(o),
                   "done": [w.is_completed() for w in works]}

    # point to point with tags, out of order; into a strided torch tensor
    if n > 1:
        nxt, prv = (r + 1) % n, (r - 1) % n
        sends = [pg.isend(np.full(4, 70.0 + r), nxt, tag=7),
                 pg.isend(np.full(5, 30 + r, np.int32), nxt, tag=3)]
        three, seven = np.empty(5, np.int32), torch.zeros(8, dtype=torch.float64)
        pg.recv(three, prv, tag=3)
        pg.irecv(seven[::2], prv, tag=7).wait()
        for w in sends:
            w.wait()
        ex["p2p"] = {"three": _list(three), "seven": _list(seven)}

    # objects
    ex["broadcast_object"] = pg.broadcast_object({"from": r, "n": n} if r == n - 1 else None,
                                                 src=n - 1)
    ex["all_gather_object"] = pg.all_gather_object(f"rank{r}")

    # sub-groups: evens and odds, a world op in between, a group of one inside
    members = [q for q in range(n) if q % 2 == r % 2]
    sub = pg.new_group(members)
    t = np.array([r + 1.0], np.float16)
    sub.all_reduce(t)
    world = np.array([1.0])
    pg.all_reduce(world)
    b = np.array([r], np.int64)
    sub.broadcast(b, src=sub.size - 1)
    solo = sub.new_group([sub.rank])
    u = np.array([r + 0.5])
    solo.all_reduce(u)
    ex["sub_group"] = {"rank": sub.rank, "size": sub.size, "all_reduce": _list(t),
                       "world": _list(world), "broadcast": _list(b), "solo": _list(u)}
    solo.close()
    sub.close()

    specific: dict = {}
    if pg.backend == "mpi" and n > 1:
        from mpi4py import MPI
        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        specific["tag_ub"] = ub
        nxt, prv = (r + 1) % n, (r - 1) % n
        got = np.empty(1, np.int64)
        w = pg.isend(np.array([r], np.int64), nxt, tag=ub)  # the largest MPI tag works
        pg.recv(got, prv, tag=ub)
        w.wait()
        specific["max_tag_recv"] = int(got[0])
        try:
            pg.send(got, nxt, tag=ub + 1)
            specific["above_tag_ub"] = "no error"
        except ValueError as exc:
            specific["above_tag_ub"] = str(exc)

    inexact: dict = {}
    _inexact(pg, inexact)
    pg.barrier()
    report = {"rank": r, "size": n, "backend": pg.backend,
              "launcher": collectives.detect_rendezvous().launcher,
              "exact": ex, "inexact": inexact, "specific": specific}
    everyone = pg.all_gather_object(report)
    pg.close()
    return everyone if r == 0 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None,
                        help="default: the launcher's (mpi under mpiexec)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="start this many ranks with collectives.spawn (leave out under "
                             "mpiexec)")
    args = parser.parse_args()
    if args.nproc is not None:
        reports = collectives.spawn(run, args.nproc, args=(args.backend,),
                                    backend=args.backend, timeout=60)[0]
    else:
        reports = run(args.backend)
    for report in reports:
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
