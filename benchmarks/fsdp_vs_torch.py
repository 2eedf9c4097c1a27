"""Training throughput and memory of parallel.FSDP on every backend next to torch's own
FSDP2 (``torch.distributed.fsdp.fully_shard``) on gloo, in one run.

    python benchmarks/fsdp_vs_torch.py                       # 2 ranks: ours on shm, zmq,
                                                             # gloo, mpi; FSDP2 on gloo
    python benchmarks/fsdp_vs_torch.py --nproc 2,4 --backend shm --steps 300
    python benchmarks/fsdp_vs_torch.py --json fsdp.json

The model and batch of ``examples/fsdp.py``: its MNIST MLP (``build_mlp``), each
``nn.Linear`` a unit (``fully_shard`` on each, then on the root, for FSDP2), 32 images per
rank per step, SGD with momentum 0.9, on the bundled MNIST images, zero3 (parameters
resharded after forward, prefetch on). Each rank runs ``--warmup`` untimed steps, a
barrier, then ``--steps`` timed steps; a run's time is its slowest rank's. Every case runs
``--repeat`` times in fresh processes, the cases taking turns round by round, and the
median is reported, as samples per second and as the ratio to FSDP2 at the same world
size (above 1: ours trains faster). Memory: each rank's peak resident set (``ru_maxrss``,
the largest rank's, MiB: the same measure for both), and for ours also the peak bytes of
gathered full parameters that ``FSDP.memory()`` accounts.

Backend ``mpi`` runs under ``mpiexec`` (this script re-executes itself with a hidden
``--mpi-rank`` flag); without mpiexec or mpi4py, or a backend not installed, a case is
skipped with the reason.

This file may import torch.distributed: it is a benchmark, not part of ``parallel/``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

BATCH, LR, SEED = 32, 0.05, 0


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default="2", several=True)
    add_flag(p, "--backend", default="shm,zmq,gloo,mpi", several=True,
             help="comma list of the backends for parallel.FSDP")
    add_run_options(p, batch=BATCH, steps=200)
    return p


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = _parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from examples.common.harness import build_mlp  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402


def _train(model: nn.Module, rank: int, batch: int, steps: int, warmup: int,
           barrier: Callable[[], None]) -> float:
    """Seconds for ``steps`` steps on this rank, after ``warmup`` untimed ones and a barrier."""
    x, y = map(torch.from_numpy, load_mnist(None, "train"))
    gen = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    batches = [torch.randint(0, len(x), (batch,), generator=gen) for _ in range(16)]
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            barrier()
            start = time.perf_counter()
        idx = batches[i % len(batches)]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_ours(backend: str, threads: int, batch: int, steps: int, warmup: int) -> list:
    """One rank of parallel.FSDP; returns [slowest seconds, max peak RSS MiB, full-param
    peak bytes]."""
    from collectives import ReduceOp
    from parallel import FSDP
    torch.set_num_threads(threads)
    pg = collectives.init_process_group(backend, timeout=300)
    model = FSDP(build_mlp(SEED), pg, wrap=nn.Linear)
    seconds = _train(model, pg.rank, batch, steps, warmup, pg.barrier)
    out = torch.tensor([seconds, _peak_rss_mib(), model.memory()["full_params_peak"]],
                       dtype=torch.float64)
    pg.all_reduce(out, ReduceOp.MAX)
    pg.close()
    return out.tolist()


def run_torch(threads: int, batch: int, steps: int, warmup: int) -> list:
    """One rank of torch's FSDP2 on gloo; [slowest seconds, max peak RSS MiB, None]."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_mlp(SEED)
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seconds = _train(model, dist.get_rank(), batch, steps, warmup, dist.barrier)
    out = torch.tensor([seconds, _peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return out.tolist() + [None]


def run_mpi(n: int, work: tuple, timeout: float) -> list:
    """parallel.FSDP on the mpi backend, ``n`` ranks started by mpiexec."""
    return json.loads(run_under_mpiexec(__file__, n, work, timeout=timeout, tag="RESULT",
                                        threads=work[0]))


def _mpi_rank(work_json: str) -> int:
    report_from_rank_0("RESULT", json.dumps(run_ours("mpi", *json.loads(work_json))))
    return 0


def main(a: argparse.Namespace) -> int:
    if a.mpi_rank:
        return _mpi_rank(a.mpi_rank)

    worlds = a.nproc
    cases: list[tuple[str, str, int]] = []
    for backend in a.backend:
        why = unavailable(backend)
        if why:
            print(f"# parallel.FSDP on {backend}: skipped, {why}", flush=True)
            continue
        cases += [("parallel.FSDP", backend, n) for n in worlds]
    cases += [("torch FSDP2", "gloo", n) for n in worlds]
    work = (a.threads, a.batch_size, a.steps, a.warmup)
    env = {"OMP_NUM_THREADS": str(a.threads)}
    print(f"# examples/fsdp.py's MNIST MLP (each nn.Linear a unit), zero3, batch "
          f"{a.batch_size}/rank, {a.steps} timed steps after {a.warmup}, {a.threads} "
          f"thread(s)/rank, median of {a.repeat} runs; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)

    def run_case(case: tuple) -> list:
        impl, backend, n = case
        if impl == "torch FSDP2":
            return collectives.spawn(run_torch, n, args=work, env=env,
                                     join_timeout=a.job_timeout)[0]
        if backend == "mpi":
            return run_mpi(n, work, a.job_timeout)
        return collectives.spawn(run_ours, n, args=(backend, *work), env=env,
                                 join_timeout=a.job_timeout)[0]

    results = run_rounds(cases, a.repeat, run_case)

    rows = []
    for (impl, backend, n), runs in results.items():
        median = statistics.median(r[0] for r in runs)
        full_peak = runs[0][2]
        rows.append({"impl": impl, "backend": backend, "world_size": n, "steps": a.steps,
                     "batch_per_rank": a.batch_size, "ms_per_step": median / a.steps * 1e3,
                     "samples_per_s": a.steps * a.batch_size * n / median,
                     "samples_per_s_runs": [a.steps * a.batch_size * n / r[0] for r in runs],
                     "peak_rss_mib": max(r[1] for r in runs),
                     "full_params_peak_bytes": None if full_peak is None else int(full_peak)})
    torch_rate = {r["world_size"]: r["samples_per_s"] for r in rows
                  if r["impl"] == "torch FSDP2"}
    for r in rows:
        if r["world_size"] in torch_rate:
            r["ratio_to_torch_fsdp2"] = r["samples_per_s"] / torch_rate[r["world_size"]]

    print(f"{'impl':<15}{'backend':<9}{'world':>6}{'ms/step':>10}{'samples/s':>12}"
          f"{'vs FSDP2':>10}{'peak RSS MiB':>14}{'full params peak':>18}   samples/s of runs")
    for r in rows:
        ratio = r.get("ratio_to_torch_fsdp2")
        full = r["full_params_peak_bytes"]
        print(f"{r['impl']:<15}{r['backend']:<9}{r['world_size']:>6}{r['ms_per_step']:>10.3f}"
              f"{r['samples_per_s']:>12.1f}{'' if ratio is None else f'{ratio:.3f}':>10}"
              f"{r['peak_rss_mib']:>14.1f}{'-' if full is None else f'{full:,} B':>18}   "
              f"{' '.join(f'{s:.0f}' for s in r['samples_per_s_runs'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
