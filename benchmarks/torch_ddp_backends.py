"""torch's own DistributedDataParallel over the ``"collectives"`` torch.distributed backend,
one row per transport of ours, next to torch's DDP over gloo, in one run.

    python benchmarks/torch_ddp_backends.py                      # 2 ranks: shm, zmq, mpi, gloo
    python benchmarks/torch_ddp_backends.py --nproc 2,4 --backend shm --steps 400
    python benchmarks/torch_ddp_backends.py --json torch_ddp.json

The model and batch of ``examples/ddp.py``: its MNIST MLP (``build_mlp``), 32 images per
rank per step, torch.optim.SGD with momentum 0.9 and lr 0.05, on the bundled MNIST images;
the same ``DistributedDataParallel(model, bucket_cap_mb=...)`` call in every row, only the
backend string differs (``"collectives"`` with ``COLLECTIVES_BACKEND=<transport>``, or
``"gloo"``). Each rank runs ``--warmup`` untimed steps, a barrier, then ``--steps`` timed
steps; a run's time is its slowest rank's. Every case runs ``--repeat`` times in fresh
processes, the cases taking turns round by round (the machine's changing load hits them
alike), and the median run is reported as samples per second (steps x batch x ranks /
time) and as the ratio to gloo at the same world size. One compute thread per rank
(``--threads``), so that N ranks use N cores.

Transport ``mpi`` runs under ``mpiexec`` (this script re-executes itself with a hidden
``--mpi-rank`` flag); without mpiexec or mpi4py it is skipped with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives  # noqa: E402
from collectives.cli_flags import FlagParser, add_flag, flag_parser  # noqa: E402
from benchmarks.mpi_jobs import (add_run_options, report_from_rank_0,  # noqa: E402
                                 run_rounds, run_under_mpiexec, unavailable)

#: examples/ddp.py's defaults.
BATCH, LR, SEED = 32, 0.05, 0


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default="2", several=True)
    add_flag(p, "--backend", default="shm,zmq,mpi", several=True,
             help="comma list of our transports under the collectives backend")
    add_run_options(p, batch=BATCH, steps=300,
                    bucket_help="DDP's gradient bucket size (torch's default)")
    return p


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = _parser().parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from collectives.spawn import free_port  # noqa: E402
from examples.common.harness import build_mlp  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402


def run_rank(backend: str, transport: str, threads: int, batch: int, steps: int,
             warmup: int, cap_mb: float) -> float:
    """One rank of torch DDP over ``backend`` (``"collectives"`` with ``transport``, or
    ``"gloo"``); returns the slowest rank's seconds for the timed steps."""
    torch.set_num_threads(threads)
    if backend == "collectives":
        import collectives.torch_backend as tb
        options: Optional[tb.Options] = tb.Options(transport)
    else:
        options = None
    where = collectives.detect_rendezvous()  # spawn's or mpiexec's variables
    dist.init_process_group(backend, rank=where.rank, world_size=where.world_size,
                            timeout=datetime.timedelta(seconds=300), pg_options=options)
    model = torch.nn.parallel.DistributedDataParallel(build_mlp(SEED), bucket_cap_mb=cap_mb)
    x, y = map(torch.from_numpy, load_mnist(None, "train"))
    gen = torch.Generator().manual_seed(where.rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    batches = [torch.randint(0, len(x), (batch,), generator=gen) for _ in range(16)]
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        idx = batches[i % len(batches)]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return float(seconds[0])


def run_mpi(n: int, work: tuple, timeout: float) -> float:
    """The collectives backend on transport mpi, ``n`` ranks started by mpiexec."""
    return float(run_under_mpiexec(
        __file__, n, work, timeout=timeout, tag="SECONDS", threads=work[0],
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}))


def _mpi_rank(work_json: str) -> int:
    report_from_rank_0("SECONDS",
                       repr(run_rank("collectives", "mpi", *json.loads(work_json))))
    return 0


def main(a: argparse.Namespace) -> int:
    if a.mpi_rank:
        return _mpi_rank(a.mpi_rank)

    worlds = a.nproc
    cases: list[tuple[str, str, int]] = []
    for transport in a.backend:
        why = unavailable(transport, "transport")
        if why:
            print(f"# collectives over {transport}: skipped, {why}", flush=True)
            continue
        cases += [("collectives", transport, n) for n in worlds]
    cases += [("gloo", "-", n) for n in worlds]
    work = (a.threads, a.batch_size, a.steps, a.warmup, a.bucket_cap_mb)
    env = {"OMP_NUM_THREADS": str(a.threads)}
    print(f"# torch DistributedDataParallel, examples/ddp.py's MNIST MLP, batch "
          f"{a.batch_size}/rank, {a.steps} timed steps after {a.warmup}, {a.threads} "
          f"thread(s)/rank, buckets of {a.bucket_cap_mb} MiB, median of {a.repeat} runs; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)

    def run_case(case: tuple) -> float:
        backend, transport, n = case
        if transport == "mpi":
            return run_mpi(n, work, a.job_timeout)
        return collectives.spawn(run_rank, n, args=(backend, transport, *work), env=env,
                                 join_timeout=a.job_timeout)[0]

    times = run_rounds(cases, a.repeat, run_case)

    rows = []
    for (backend, transport, n), runs in times.items():
        median = statistics.median(runs)
        rows.append({"backend": backend, "transport": transport, "world_size": n,
                     "steps": a.steps, "batch_per_rank": a.batch_size,
                     "ms_per_step": median / a.steps * 1e3,
                     "samples_per_s": a.steps * a.batch_size * n / median,
                     "samples_per_s_runs": [a.steps * a.batch_size * n / s for s in runs]})
    gloo = {r["world_size"]: r["samples_per_s"] for r in rows if r["backend"] == "gloo"}
    for r in rows:
        if r["world_size"] in gloo:
            r["ratio_to_gloo"] = r["samples_per_s"] / gloo[r["world_size"]]

    print(f"{'backend':<13}{'transport':<11}{'world':>6}{'ms/step':>10}{'samples/s':>12}"
          f"{'vs gloo':>9}   samples/s of each run")
    for r in rows:
        print(f"{r['backend']:<13}{r['transport']:<11}{r['world_size']:>6}"
              f"{r['ms_per_step']:>10.3f}{r['samples_per_s']:>12.1f}"
              f"{r.get('ratio_to_gloo', float('nan')):>9.3f}   "
              f"{' '.join(f'{s:.0f}' for s in r['samples_per_s_runs'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
