"""Training throughput of parallel.DDP next to torch's own DistributedDataParallel.

    python benchmarks/ddp_vs_torch.py                       # ours on shm at 1 and 2 ranks,
                                                            # torch DDP on gloo at 2 ranks
    python benchmarks/ddp_vs_torch.py --world 2,4 --backends shm,zmq --steps 400

Same model (the examples' MNIST MLP), same per-rank batch of MNIST images, same optimizer
(SGD with momentum), the same number of compute threads per rank (--threads, default 1,
so that N ranks use N cores). Each rank times ``--steps`` steps after ``--warmup`` ones;
a run's time is its slowest rank's, and the best of ``--repeat`` runs is reported (the
least disturbed by whatever else the machine is doing). ``plain`` is one process without
any wrapper: the ceiling for world size 1.

This file may import torch.distributed: it is a benchmark, not part of ``parallel/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import collectives  # noqa: E402
from examples.common.harness import build_mlp  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402


def _train(model, rank: int, batch: int, steps: int, warmup: int) -> float:
    """Seconds for ``steps`` training steps on this rank (after ``warmup`` untimed ones)."""
    x, y = map(torch.from_numpy, load_mnist(None, "train"))
    gen = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [torch.randint(0, len(x), (batch,), generator=gen) for _ in range(16)]
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        idx = batches[i % len(batches)]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def run_ours(threads: int, batch: int, steps: int, warmup: int, cap_mb: float) -> float:
    from parallel import DDP
    torch.set_num_threads(threads)
    pg = collectives.init_process_group()
    model = DDP(build_mlp(0), pg, bucket_cap_mb=cap_mb)
    pg.barrier()
    seconds = _train(model, pg.rank, batch, steps, warmup)
    pg.close()
    return seconds


def run_torch(threads: int, batch: int, steps: int, warmup: int, cap_mb: float) -> float:
    import torch.distributed as dist
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_* come from collectives.spawn
    model = torch.nn.parallel.DistributedDataParallel(build_mlp(0), bucket_cap_mb=cap_mb)
    dist.barrier()
    seconds = _train(model, dist.get_rank(), batch, steps, warmup)
    dist.destroy_process_group()
    return seconds


def run_plain(threads: int, batch: int, steps: int, warmup: int, cap_mb: float) -> float:
    torch.set_num_threads(threads)
    return _train(build_mlp(0), 0, batch, steps, warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="1,2", help="world sizes for parallel.DDP")
    p.add_argument("--backends", default="shm", help="backends for parallel.DDP")
    p.add_argument("--torch-world", default="2", help="world sizes for torch DDP on gloo "
                                                     "('' to skip)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="gradient bucket size of both DDPs (the MLP's gradients are 0.83 MiB: "
                        "below that, several buckets and overlap)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = p.parse_args()
    sizes = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    cases = [("plain", "-", 1)]
    cases += [("parallel.DDP", b, n) for b in a.backends.split(",") for n in sizes(a.world)]
    cases += [("torch DDP", "gloo", n) for n in sizes(a.torch_world)]
    work = (a.threads, a.batch_size, a.steps, a.warmup, a.bucket_cap_mb)
    env = {"OMP_NUM_THREADS": str(a.threads)}

    rows = []
    print(f"MNIST MLP, batch {a.batch_size}/rank, {a.steps} steps, {a.threads} thread(s)/rank, "
          f"buckets of {a.bucket_cap_mb} MiB, "
          f"best of {a.repeat}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", flush=True)
    for impl, backend, n in cases:
        times = []
        for _ in range(a.repeat):
            if impl == "plain":
                times.append(run_plain(*work))
            elif impl == "parallel.DDP":
                times.append(max(collectives.spawn(run_ours, n, args=work, backend=backend,
                                                   env=env)))
            else:
                times.append(max(collectives.spawn(run_torch, n, args=work, env=env)))
        best = min(times)
        rows.append({"impl": impl, "backend": backend, "world_size": n,
                     "ms_per_step": round(best / a.steps * 1e3, 3),
                     "samples_per_s": round(a.steps * a.batch_size * n / best, 1)})

    print(f"{'impl':<14}{'backend':<9}{'world':>6}{'ms/step':>10}{'samples/s':>12}")
    for r in rows:
        print(f"{r['impl']:<14}{r['backend']:<9}{r['world_size']:>6}{r['ms_per_step']:>10.3f}"
              f"{r['samples_per_s']:>12.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
