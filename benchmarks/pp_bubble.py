"""Measured pipeline bubbles next to theory, for every schedule, in one run.

    python benchmarks/pp_bubble.py                  # P=4, M=8, 15 ms per unit
    python benchmarks/pp_bubble.py --nproc 2 --microbatches 4 --unit-ms 30

Each rank is a thread of the in-process world (collectives.testing), each stage two
layers whose forward, input gradient and weight gradient *sleep* a fixed time, so that
the ranks' compute overlaps perfectly even on a 2-core machine shared with other jobs
(threads that sleep do not compete for cores), and the measured bubble is the schedule's,
not the machine's. One unit is a forward: 2 x 0.5 unit sleeps; a backward is 2 units
(1 + 1 split into B and W for ZB-H1), except on the first stage, whose first layer has no
input gradient (B 1.5, split 0.5). Interleaved runs 2 stages per rank, each as costly as
the others' one, so its step holds twice the work.

The theory is the schedule replayed with those costs (parallel.pp.replay). Printed:
the bubble (1 - the busiest rank's compute / the step) and the idle share of all ranks,
measured and replayed, and the step's time. The first step is not timed (it imports and
exchanges shapes), and Python's garbage collector is off while the ranks run (one full
collection, which holds every thread, took 0.2 s of a 0.5 s step on a loaded machine).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.cli_flags import (FlagParser, add_flag, flag_parser,  # noqa: E402
                                   positive_int)


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default=4, help="ranks (threads), one pipeline stage each: P")
    p.add_argument("--microbatches", type=positive_int, default=8,
                   help="micro-batches per step: M (default: %(default)s)")
    p.add_argument("--unit-ms", type=float, default=15.0,
                   help="milliseconds one forward sleeps (default: %(default)s)")
    return p


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = _parser().parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from collectives.testing.threads import run_threads  # noqa: E402
from parallel.pp import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                         ScheduleInterleaved1F1B, ScheduleZeroBubble, idle_fraction,
                         pipeline_bubble, replay)
from parallel.pp.sleepy import SleepyMul, sleepy_costs  # noqa: E402

RUNTIMES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
            "interleaved": ScheduleInterleaved1F1B, "zb": ScheduleZeroBubble}


def rank(pg, name: str, M: int, unit_s: float):
    V = 2 if name == "interleaved" else 1
    S = pg.size * V
    layers = [nn.Sequential(SleepyMul(), SleepyMul()) for _ in range(V)]
    stages = [PipelineStage(layers[s // pg.size], pg, s, S) for s in range(pg.rank, S, pg.size)]
    sched = RUNTIMES[name](stages if V > 1 else stages[0], M, lambda out, y: (out * y).sum())
    x = torch.ones(M, 4)
    for sleep in (0.0, unit_s / 2):
        for layer in layers:
            for mul in layer:
                mul.t = sleep
        sched.step(x if pg.rank == 0 else None, target=x if (S - 1) % pg.size == pg.rank else None)
    return sched.timeline, sched.schedule, S


def main(args: argparse.Namespace) -> None:
    P, M = args.nproc, args.microbatches
    print(f"P={P} M={M}, one unit = {args.unit_ms:g} ms")
    print(f"{'schedule':<12} {'bubble':>8} {'theory':>8} {'idle':>8} {'theory':>8} "
          f"{'step ms':>8} {'theory':>8}")
    for name in RUNTIMES:
        if name == "interleaved" and M % P:
            print(f"{name:<12} (needs M a multiple of P)")
            continue
        gc.disable()   # a full collection holds every thread for up to 0.2 s here
        try:
            res = run_threads(lambda pg: rank(pg, name, M, args.unit_ms / 1000), P,
                              timeout=120)
        finally:
            gc.enable()
        timelines, schedule, S = [r[0] for r in res], res[0][1], res[0][2]
        ideal = replay(schedule, S, sleepy_costs(name == "zb"))
        span = max(e for t in timelines for _, _, e in t) - min(s for t in timelines
                                                                for _, s, _ in t)
        ideal_span = max(e for t in ideal for _, _, e in t) * args.unit_ms
        print(f"{name:<12} {pipeline_bubble(timelines):8.3f} {pipeline_bubble(ideal):8.3f} "
              f"{idle_fraction(timelines):8.3f} {idle_fraction(ideal):8.3f} "
              f"{span * 1000:8.0f} {ideal_span:8.0f}")


if __name__ == "__main__":
    main(ARGS)
