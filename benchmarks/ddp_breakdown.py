"""Where a step of parallel.DDP goes, on the model and batch of ``benchmarks/ddp_vs_torch.py``.

    python benchmarks/ddp_breakdown.py                 # shm, 2 ranks, 3 rounds
    python benchmarks/ddp_breakdown.py --backend mpi --repeat 5

Two measurements per round, each beside a plain model in the same round:

- **wrapper**: one process, a world of one (no message moves), a plain model and a DDP
  model trained in turns of ``--block`` steps, ``--blocks`` times; the median over turns
  of (DDP's step - the plain step before it) is what the wrapper costs in a training step
  (hooks, end-of-backward callback, bucket bookkeeping, the persistent round's
  numbering). In turns, so that a slow spell of the machine hits both alike.
- **2 ranks**: ``--steps`` synchronised steps on ``--backend``, each rank noting when it
  entered and left its last bucket's round (CLOCK_MONOTONIC: one clock for every process
  of the host). Reported per step, as medians: each rank's step, the round's time after
  the later rank arrived (the all_reduce itself, with its Python) and how far apart the
  ranks arrived (median and mean: now and then one vCPU stalls and the other waits).
  ``efficiency`` is the plain step over the slower rank's.

The round is timed through a thin wrapper around the bucket's persistent request (one
Python call more than a plain run). This file may reach into parallel.DDP's internals: it
is a benchmark, not part of ``parallel/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.cli_flags import (FlagParser, add_flag, flag_parser,  # noqa: E402
                                   positive_int)


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__, defaults_in_help=True)
    add_flag(p, "--backend", default="shm", help="backend of the 2-rank run")
    add_flag(p, "--repeat", default=3, help="rounds, one table row each")
    add_flag(p, "--steps", default=800, help="timed steps of the 2-rank run")
    add_flag(p, "--warmup", default=50, help="untimed steps before them")
    p.add_argument("--block", type=positive_int, default=20,
                   help="steps per turn (world of one)")
    p.add_argument("--blocks", type=positive_int, default=60,
                   help="turns per model (world of one)")
    add_flag(p, "--job-timeout", default=600.0, help="seconds one 2-rank run may take")
    return p


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = _parser().parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

import collectives  # noqa: E402
from benchmarks.ddp_vs_torch import BATCH, SEED, Stepper  # noqa: E402
from examples.common.harness import build_mlp  # noqa: E402


def wrapper_cost(block: int, blocks: int) -> dict:
    """World of one: the plain model and DDP in turns; microseconds per step."""
    from parallel import DDP
    torch.set_num_threads(1)
    pg = collectives.init_process_group("shm")
    try:
        plain = Stepper(build_mlp(SEED), 0)
        ddp = Stepper(DDP(build_mlp(SEED), pg), 0)
        for s in (plain, ddp):
            s.seconds(block)   # warm-up
        rows = [(plain.seconds(block) / block, ddp.seconds(block) / block)
                for _ in range(blocks)]
    finally:
        pg.close()
    return {"plain_us": statistics.median(p for p, _ in rows) * 1e6,
            "wrapper_us": statistics.median(d - p for p, d in rows) * 1e6}


class _TimedRequest:
    """The last bucket's request, its rounds timed (enter, leave) on CLOCK_MONOTONIC."""

    def __init__(self, request, marks: list) -> None:
        self._request, self._marks = request, marks

    def __getattr__(self, name):
        return getattr(self._request, name)

    def run(self) -> None:
        t0 = time.monotonic()
        self._request.run()
        self._marks.append((t0, time.monotonic()))


def _rank(backend: str, steps: int, warmup: int) -> dict:
    from parallel import DDP
    torch.set_num_threads(1)
    pg = collectives.init_process_group(backend, timeout=300)
    try:
        model = DDP(build_mlp(SEED), pg)
        marks: list = []
        last = model.buckets[-1]
        last._request = _TimedRequest(last._request, marks)
        stepper = Stepper(model, pg.rank)
        for _ in range(warmup):
            stepper.step()
        pg.barrier()
        marks.clear()
        per_step = stepper.seconds(steps) / steps
    finally:
        pg.close()
    return {"per_step": per_step, "marks": marks}


def two_ranks(backend: str, steps: int, warmup: int, timeout: float) -> dict:
    results = collectives.spawn(_rank, 2, args=(backend, steps, warmup),
                                env={"OMP_NUM_THREADS": "1"}, join_timeout=timeout)
    enter = np.array([[a for a, _ in r["marks"]] for r in results])
    leave = np.array([[b for _, b in r["marks"]] for r in results])
    skew = np.abs(enter[0] - enter[1]) * 1e6
    after_last = (leave.max(0) - enter.max(0)) * 1e6
    return {"step_us": [r["per_step"] * 1e6 for r in results],
            "round_after_last_us": float(np.median(after_last)),
            "skew_median_us": float(np.median(skew)), "skew_mean_us": float(skew.mean())}


def main(a: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    print(f"# examples/ddp.py's MNIST MLP, batch {BATCH}/rank, 1 thread/rank; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    print(f"{'round':>5}{'plain us':>10}{'wrapper us':>12}{'plain us':>10}"
          f"{'rank 0 us':>11}{'rank 1 us':>11}{'round after':>13}{'skew med':>10}"
          f"{'skew mean':>11}{'efficiency':>12}")
    for r in range(a.repeat):
        w = wrapper_cost(a.block, a.blocks)
        plain = Stepper(build_mlp(SEED), 0)
        plain.seconds(a.warmup)
        plain_us = plain.seconds(a.steps) / a.steps * 1e6
        t = two_ranks(a.backend, a.steps, a.warmup, a.job_timeout)
        print(f"{r:>5}{w['plain_us']:>10.1f}{w['wrapper_us']:>12.1f}{plain_us:>10.1f}"
              f"{t['step_us'][0]:>11.1f}{t['step_us'][1]:>11.1f}"
              f"{t['round_after_last_us']:>13.1f}{t['skew_median_us']:>10.1f}"
              f"{t['skew_mean_us']:>11.1f}{plain_us / max(t['step_us']):>12.3f}", flush=True)
    print("# wrapper: DDP's extra us per step in a world of one (median of paired turns); "
          "round after: the last bucket's round after the later rank arrived; skew: how "
          "far apart the ranks arrived at it; efficiency: plain step / slower rank's step")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
