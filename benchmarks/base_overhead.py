"""What the base class alone costs per call: validation, staging, sequencing and the
flight record, with a transport that does nothing.

    python benchmarks/base_overhead.py                     # all_reduce, broadcast, 4 B
    python benchmarks/base_overhead.py --iters 200000 --json out.json

A world of one rank whose collective hooks return at once (``NoOpGroup`` below), so the
time per call is the base class's and nothing else's. Each row times N calls in a tight
loop (the least of many repeats) for a contiguous CPU float32 torch tensor and numpy
array, once through the fast path (``collectives.fast_path``) and once through the
general path (the fast path switched off on the group), side by side in one run, and
through a persistent request (``all_reduce_init``: ``start(); wait()``) beside the
``async_op=True`` call it replaces in DDP's buckets: both hand the round to the group's
thread (a wait that finds a persistent round still queued runs it itself). The last column
subtracts the cost of calling an empty Python method (the floor any Python API pays).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from collectives.group import ProcessGroup  # noqa: E402
from collectives.work import CompletedWork  # noqa: E402


class NoOpGroup(ProcessGroup):
    """A world of one whose hooks do nothing: what remains is the base class."""

    backend = "noop"

    def __init__(self) -> None:
        super().__init__(0, 1, timeout=60.0)

    def _isend(self, array, dst, tag):
        return CompletedWork()

    def _irecv(self, array, src, tag):
        return CompletedWork()

    def _barrier(self, seq):
        return None

    def _broadcast(self, a, src, seq):
        return None

    def _all_reduce(self, a, op, seq):
        return None


def _per_call(fn, iters: int, repeats: int) -> float:
    """The least, over ``repeats`` loops of ``iters`` calls, of the mean time of one
    ``fn()`` (as ``timeit`` advises: the other loops were slowed by other processes)."""
    for _ in range(min(iters, 1000)):
        fn()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        means.append((time.perf_counter() - t0) / iters)
    return min(means) * 1e6


def run(iters: int, repeats: int) -> list[dict]:
    import torch

    pg = NoOpGroup()
    rows = []

    class Empty:
        def call(self, tensor):
            return None

    empty = Empty()
    floor = _per_call(lambda: empty.call(None), iters, repeats)
    for kind, t in (("torch", torch.ones(1)), ("numpy", np.ones(1, np.float32))):
        cases = {
            "all_reduce": lambda t=t: pg.all_reduce(t),
            "broadcast": lambda t=t: pg.broadcast(t, 0),
        }
        cases["all_reduce async+wait"] = lambda t=t: pg.all_reduce(t, async_op=True).wait()
        if hasattr(pg, "all_reduce_init"):
            req = pg.all_reduce_init(t)

            def persistent(req=req):
                req.start()
                req.wait()
            cases["all_reduce_init start+wait"] = persistent
        for name, fn in cases.items():
            paths = [("fast", True), ("general", False)] if "+wait" not in name else [
                ("persistent" if "init" in name else "async", True)]
            for path, fast in paths:
                pg._fast = fast
                us = _per_call(fn, iters, repeats)
                rows.append({"op": name, "tensor": kind, "path": path,
                             "us_per_call": round(us, 3), "base_us": round(us - floor, 3)})
            pg._fast = True
    pg.close()
    rows.append({"op": "empty method call", "tensor": "-", "path": "-",
                 "us_per_call": round(floor, 3), "base_us": 0.0})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    rows = run(args.iters, args.repeats)
    print(f"{'op':<28} {'tensor':<6} {'path':<10} {'us/call':>8} {'base us':>8}")
    for r in rows:
        print(f"{r['op']:<28} {r['tensor']:<6} {r['path']:<10} {r['us_per_call']:>8.3f} "
              f"{r['base_us']:>8.3f}")
    print(json.dumps({"benchmark": "base_overhead", "rows": rows}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
