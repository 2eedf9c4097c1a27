"""Training throughput of parallel.DDP on every backend next to torch's own
DistributedDataParallel on gloo, in one run.

    python benchmarks/ddp_vs_torch.py                        # 2 ranks: ours on shm, zmq,
                                                             # gloo, mpi; torch DDP on gloo
    python benchmarks/ddp_vs_torch.py --nproc 2,4 --backend shm,zmq --steps 400
    python benchmarks/ddp_vs_torch.py --json ddp.json

The model and batch of ``examples/ddp.py``: its MNIST MLP (``build_mlp``), 32 images per
rank per step, SGD with momentum 0.9 and lr 0.05, on the bundled MNIST images; both DDPs
use buckets of ``--bucket-cap-mb``. Each rank runs ``--warmup`` untimed steps, a barrier,
then ``--steps`` timed steps; a run's time is its slowest rank's. Every case runs
``--repeat`` times in fresh processes, the cases taking turns round by round (so that the
machine's changing load hits them alike), and the median run is reported, as samples per
second (steps x batch x ranks / time) and as the ratio to torch DDP at the same world size
(above 1: ours trains faster); ``scaling`` is the median over rounds of each run's
samples/s over the world size times the plain run's of the same round (scaling
efficiency against one process, 1.0 ideal). ``--threads`` compute threads per rank
(default 1, so that N ranks use N cores). ``plain`` is one process without any wrapper
(``--no-plain`` leaves it out): the ceiling of one rank.

``independent`` is N processes that each train their own plain model at the same time
and never communicate (a barrier starts their clocks together; the slowest one's time,
as for every row): the machine's own ceiling for N ranks, which no data-parallel
wrapper can pass. Its ``scaling`` says how much of N times one process the host gives
N busy processes at all (on a shared VM it can be far below 1.0: its vCPUs may share
cores or be descheduled), and ``of ceiling`` (every row of world N) is the median over
rounds of a run's samples/s over the independent run's of the same round: the part of
the gap that is the wrapper's and its communication's (``--no-independent`` leaves the
row out).

Backend ``mpi`` runs under ``mpiexec`` (this script re-executes itself with a hidden
``--mpi-rank`` flag); without mpiexec or mpi4py it is skipped with the reason, as is any
backend that is not installed.

This file may import torch.distributed: it is a benchmark, not part of ``parallel/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives  # noqa: E402
from collectives.cli_flags import FlagParser, add_flag, flag_parser  # noqa: E402
from benchmarks.mpi_jobs import (add_run_options, report_from_rank_0,  # noqa: E402
                                 run_rounds, run_under_mpiexec, unavailable)

#: examples/ddp.py's defaults.
BATCH, LR, SEED = 32, 0.05, 0
_ROOT = str(Path(__file__).resolve().parent.parent)


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default="2", several=True)
    add_flag(p, "--backend", default="shm,zmq,gloo,mpi", several=True,
             help="comma list of the backends for parallel.DDP")
    p.add_argument("--no-plain", action="store_true", help="leave out the one-process row")
    p.add_argument("--no-independent", action="store_true",
                   help="leave out the row of N processes that never communicate")
    add_run_options(p, batch=BATCH, steps=300,
                    bucket_help="gradient bucket size of both DDPs (the MLP's gradients are "
                                "0.83 MiB: below that, several buckets and overlap)")
    return p


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = _parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common.harness import build_mlp  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402


class Stepper:
    """One model, its SGD (lr ``LR``, momentum 0.9) and 16 fixed batches of ``batch``
    bundled MNIST images drawn with seed ``rank``: ``step()`` is one training step of
    ``examples/ddp.py``'s loop (also benchmarks/ddp_breakdown.py's)."""

    def __init__(self, model: torch.nn.Module, rank: int, batch: int = BATCH) -> None:
        self.x, self.y = map(torch.from_numpy, load_mnist(None, "train"))
        gen = torch.Generator().manual_seed(rank)
        self.batches = [torch.randint(0, len(self.x), (batch,), generator=gen)
                        for _ in range(16)]
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        self.i = 0

    def step(self) -> None:
        idx = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx])
        self.opt.zero_grad(set_to_none=False)  # .grad stays a view into DDP's buckets
        loss.backward()
        self.opt.step()

    def seconds(self, steps: int) -> float:
        """Seconds for the next ``steps`` steps."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return time.perf_counter() - t0


def _train(model: torch.nn.Module, rank: int, batch: int, steps: int, warmup: int,
           barrier: Callable[[], None]) -> float:
    """Seconds for ``steps`` training steps on this rank, after ``warmup`` untimed ones and
    a barrier (so every rank's clock starts together)."""
    stepper = Stepper(model, rank, batch)
    stepper.seconds(warmup)
    barrier()
    return stepper.seconds(steps)


def run_ours(backend: str, threads: int, batch: int, steps: int, warmup: int,
             cap_mb: float, ddp: bool = True) -> float:
    """One rank of parallel.DDP on ``backend`` (``ddp=False``: of the independent row, a
    plain model that only meets the others at the barrier and the final maximum);
    returns the slowest rank's seconds."""
    from collectives import ReduceOp
    from parallel import DDP
    torch.set_num_threads(threads)
    pg = collectives.init_process_group(backend, timeout=300)
    model = DDP(build_mlp(SEED), pg, bucket_cap_mb=cap_mb) if ddp else build_mlp(SEED)
    seconds = torch.tensor([_train(model, pg.rank, batch, steps, warmup, pg.barrier)],
                           dtype=torch.float64)
    pg.all_reduce(seconds, ReduceOp.MAX)
    pg.close()
    return float(seconds[0])


def run_torch(threads: int, batch: int, steps: int, warmup: int, cap_mb: float) -> float:
    """One rank of torch's DistributedDataParallel on gloo; the slowest rank's seconds."""
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(threads)
    # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from collectives.spawn
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    model = torch.nn.parallel.DistributedDataParallel(build_mlp(SEED), bucket_cap_mb=cap_mb)
    seconds = torch.tensor([_train(model, dist.get_rank(), batch, steps, warmup,
                                   dist.barrier)], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return float(seconds[0])


def run_plain(threads: int, batch: int, steps: int, warmup: int, cap_mb: float) -> float:
    """One process, no wrapper."""
    torch.set_num_threads(threads)
    return _train(build_mlp(SEED), 0, batch, steps, warmup, lambda: None)


def run_independent(threads: int, batch: int, steps: int, warmup: int,
                    cap_mb: float) -> float:
    """One of N processes each training its own plain model, no communication between
    them but the barrier that starts their clocks together and the final maximum of
    their times (the ceiling row); returns the slowest one's seconds."""
    return run_ours("shm", threads, batch, steps, warmup, cap_mb, ddp=False)


def run_mpi(n: int, work: tuple, timeout: float) -> float:
    """parallel.DDP on the mpi backend, ``n`` ranks started by mpiexec; the slowest rank's
    seconds (RuntimeError with mpiexec's output if it fails)."""
    return float(run_under_mpiexec(__file__, n, work, timeout=timeout, tag="SECONDS",
                                   threads=work[0]))


def _mpi_rank(work_json: str) -> int:
    """Body of a rank started by mpiexec (the hidden ``--mpi-rank`` flag)."""
    report_from_rank_0("SECONDS", repr(run_ours("mpi", *json.loads(work_json))))
    return 0


def main(a: argparse.Namespace) -> int:
    if a.mpi_rank:
        return _mpi_rank(a.mpi_rank)

    worlds = a.nproc
    cases: list[tuple[str, str, int]] = [] if a.no_plain else [("plain", "-", 1)]
    if not a.no_independent:
        cases += [("independent", "-", n) for n in worlds if n > 1]
    for backend in a.backend:
        why = unavailable(backend)
        if why:
            print(f"# parallel.DDP on {backend}: skipped, {why}", flush=True)
            continue
        cases += [("parallel.DDP", backend, n) for n in worlds]
    cases += [("torch DDP", "gloo", n) for n in worlds]
    work = (a.threads, a.batch_size, a.steps, a.warmup, a.bucket_cap_mb)
    env = {"OMP_NUM_THREADS": str(a.threads)}
    print(f"# examples/ddp.py's MNIST MLP, batch {a.batch_size}/rank, {a.steps} timed steps "
          f"after {a.warmup}, {a.threads} thread(s)/rank, buckets of {a.bucket_cap_mb} MiB, "
          f"median of {a.repeat} runs; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", flush=True)

    def run_case(case: tuple) -> float:
        impl, backend, n = case
        if impl == "plain":
            return run_plain(*work)
        if impl == "independent":
            return collectives.spawn(run_independent, n, args=work, env=env,
                                     join_timeout=a.job_timeout)[0]
        if impl == "torch DDP":
            return collectives.spawn(run_torch, n, args=work, env=env,
                                     join_timeout=a.job_timeout)[0]
        if backend == "mpi":
            return run_mpi(n, work, a.job_timeout)
        return collectives.spawn(run_ours, n, args=(backend, *work), env=env,
                                 join_timeout=a.job_timeout)[0]

    times = run_rounds(cases, a.repeat, run_case)

    rows = []
    for (impl, backend, n), runs in times.items():
        median = statistics.median(runs)
        rows.append({"impl": impl, "backend": backend, "world_size": n,
                     "steps": a.steps, "batch_per_rank": a.batch_size,
                     "ms_per_step": median / a.steps * 1e3,
                     "samples_per_s": a.steps * a.batch_size * n / median,
                     "samples_per_s_runs": [a.steps * a.batch_size * n / s for s in runs]})
    torch_rate = {r["world_size"]: r["samples_per_s"] for r in rows if r["impl"] == "torch DDP"}
    plain = next((r["samples_per_s_runs"] for r in rows if r["impl"] == "plain"), None)
    ceiling = {r["world_size"]: r["samples_per_s_runs"] for r in rows
               if r["impl"] == "independent"}
    for r in rows:
        if r["world_size"] in torch_rate and r["impl"] not in ("plain", "independent"):
            r["ratio_to_torch_ddp"] = r["samples_per_s"] / torch_rate[r["world_size"]]
        if r["world_size"] in ceiling and r["impl"] != "independent":
            r["of_ceiling_runs"] = [s / c for s, c in
                                    zip(r["samples_per_s_runs"], ceiling[r["world_size"]])]
            r["of_ceiling"] = statistics.median(r["of_ceiling_runs"])
        if plain is not None and r["impl"] != "plain":
            # Scaling efficiency against one process, round by round (each run beside
            # the plain run of its own round, so that a slow spell of the machine hits
            # both), then the median: n ranks' samples/s over n x one process's.
            r["scaling_runs"] = [s / (r["world_size"] * p)
                                 for s, p in zip(r["samples_per_s_runs"], plain)]
            r["scaling"] = statistics.median(r["scaling_runs"])

    print(f"{'impl':<14}{'backend':<9}{'world':>6}{'ms/step':>10}{'samples/s':>12}"
          f"{'vs torch DDP':>14}{'scaling':>9}{'of ceiling':>12}   samples/s of each run "
          f"(scaling)")
    for r in rows:
        ratio, scaling = r.get("ratio_to_torch_ddp"), r.get("scaling")
        of_ceiling = r.get("of_ceiling")
        runs = " ".join(f"{s:.0f}" for s in r["samples_per_s_runs"])
        if scaling is not None:
            runs += " (" + " ".join(f"{e:.2f}" for e in r["scaling_runs"]) + ")"
        print(f"{r['impl']:<14}{r['backend']:<9}{r['world_size']:>6}{r['ms_per_step']:>10.3f}"
              f"{r['samples_per_s']:>12.1f}{'' if ratio is None else f'{ratio:.3f}':>14}"
              f"{'' if scaling is None else f'{scaling:.3f}':>9}"
              f"{'' if of_ceiling is None else f'{of_ceiling:.3f}':>12}   {runs}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
