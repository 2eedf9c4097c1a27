"""Per-rank jobs of ``tests/test_torch_backend.py``: torch's own wrappers over the
``"collectives"`` torch.distributed backend.

    python tests/scripts/torch_backend_job.py ddp                 # one rank: RANK, WORLD_SIZE,
    mpiexec -n 2 python tests/scripts/torch_backend_job.py ops    # MASTER_ADDR/PORT from env
    torchrun --nproc-per-node 2 tests/scripts/torch_backend_job.py wrappers   # FSDP2, PP, TP

Each rank prints one JSON line ``{"rank": r, ...}``. Started through ``collectives.spawn``
the same functions return their results instead.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import collectives.torch_backend as tb  # noqa: E402
from examples.common.harness import build_mlp  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402

STEPS, BATCH, LR, MOMENTUM = 6, 32, 0.05, 0.9


def _env_rank() -> tuple[int, int]:
    """Rank and size from torchrun/spawn's variables or MPICH/Open MPI's."""
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if os.environ.get(rank_var):
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("no launcher variables (RANK/WORLD_SIZE or an MPI launcher's)")


def init(seconds: float = 60.0, transport: str | None = None,
         group_timeout: float | None = None) -> None:
    rank, size = _env_rank()
    torch.set_num_threads(1)
    dist.init_process_group("collectives", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=seconds),
                            pg_options=tb.Options(transport, group_timeout))


def _flat(params) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).double() for p in params]).numpy()


def _batch(step: int, rank: int, size: int):
    x, y = _data()
    start = (step * size + rank) * BATCH
    return x[start:start + BATCH], y[start:start + BATCH]


_DATA: list = []


def _data():
    if not _DATA:
        _DATA.extend(map(torch.from_numpy, load_mnist(None, "train")))
    return _DATA[0], _DATA[1]


class SGD:
    """SGD with momentum in a few lines (torch.optim's first use imports torch._dynamo:
    seconds per rank on a small machine). Works on DTensor parameters too."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.bufs: dict = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.bufs.get(p)
            buf = self.bufs[p] = p.grad.clone() if buf is None else buf.mul_(MOMENTUM).add_(p.grad)
            p.add_(buf, alpha=-LR)
            p.grad = None


def train_ddp(group, hook: str | None) -> np.ndarray:
    """torch's DDP on the DDP example's model (seed 0) and batch, STEPS steps."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_mlp(0), process_group=group)
    if hook == "allreduce":
        model.register_comm_hook(group, default_hooks.allreduce_hook)
    elif hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    opt = SGD(model.parameters())
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for step in range(STEPS):
        x, y = _batch(step, rank, size)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model.module.parameters())


def ddp_job(hooks=(None, "allreduce"), init_here: bool = True) -> dict:
    """DDP over the world ("collectives") and over a gloo group of the same ranks, per
    communication hook: the largest difference of the trained parameters, how far they
    moved from the initial ones, and a digest (every rank must hold the same)."""
    if init_here:
        init()
    gloo = dist.new_group(backend="gloo")
    out = {"rank": dist.get_rank(), "transport": dist.group.WORLD.transport,
           "backend": dist.get_backend()}
    initial = _flat(build_mlp(0).parameters())
    for hook in hooks:
        ours, theirs = train_ddp(dist.group.WORLD, hook), train_ddp(gloo, hook)
        out[f"{hook}/max_diff"] = float(np.abs(ours - theirs).max())
        out[f"{hook}/moved"] = float(np.abs(ours - initial).max())
        out[f"{hook}/digest"] = hashlib.sha1(ours.tobytes()).hexdigest()
    if init_here:
        dist.destroy_process_group()
    return out


def op_checks() -> dict:
    """Every torch.distributed call torch's wrappers make, on the world group, with
    small integer-valued float inputs (exact on every transport)."""
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    t = torch.ones(3) * (r + 1)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.ones(2) * (r + 1)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    future = work.get_future()
    work.wait()  # after it, the future is done: value() must not block or fail
    out["future"] = [x.tolist() for x in future.value()]
    b = torch.tensor([float(r)])
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = b.item()
    parts = [torch.empty(2) for _ in range(n)]
    dist.all_gather(parts, torch.full((2,), float(r)))
    out["all_gather"] = [p.tolist() for p in parts]
    whole = torch.empty(n, 2)
    dist.all_gather_into_tensor(whole, torch.full((2,), float(r)))
    out["all_gather_into_tensor"] = whole.tolist()
    one = torch.empty(1)
    dist.reduce_scatter_tensor(one, torch.arange(float(n)) + r)
    out["reduce_scatter_tensor"] = one.item()
    dist.reduce_scatter(one, [torch.tensor([float(i + r)]) for i in range(n)])
    out["reduce_scatter"] = one.item()
    mixed = torch.empty(n)
    dist.all_to_all_single(mixed, torch.arange(float(n)) + 10 * r)
    out["all_to_all_single"] = mixed.tolist()
    uneven_in = torch.arange(float(n * (r + 1))) + 100 * r    # r + 1 rows to every rank
    uneven_out = torch.empty(sum(q + 1 for q in range(n)))
    dist.all_to_all_single(uneven_out, uneven_in, output_split_sizes=[q + 1 for q in range(n)],
                           input_split_sizes=[r + 1] * n)
    out["all_to_all_single_uneven"] = uneven_out.tolist()
    listed = [torch.empty(1) for _ in range(n)]
    dist.all_to_all(listed, [torch.tensor([10.0 * r + i]) for i in range(n)])
    out["all_to_all"] = [x.item() for x in listed]
    pair = [torch.ones(2) * r, torch.ones(3)]
    dist.all_reduce_coalesced(pair)
    out["all_reduce_coalesced"] = [x.tolist() for x in pair]
    sent, got = torch.full((4,), float(r)), torch.empty(4)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, (r + 1) % n),
                                    dist.P2POp(dist.irecv, got, (r - 1) % n)])
    for w in works:
        w.wait()
    out["batch_isend_irecv"] = got.tolist()
    if r == 0:
        dist.send(torch.tensor([7.0]), dst=n - 1, tag=3)
    elif r == n - 1:
        dist.recv(got[:1], src=0, tag=3)
        out["send_recv"] = got[0].item()
    dist.barrier()
    sub = dist.new_group(list(range(n - 1))) if n > 1 else None
    if sub is not None and r < n - 1:
        x = torch.ones(1)
        dist.all_reduce(x, group=sub)
        out["new_group"] = x.item()
    return out


def ops_job(wrappers: bool = False, mismatch: bool = True) -> dict:
    """The op checks, DDP against gloo, (``wrappers``: FSDP2, pipelining, TP,) then
    (``mismatch``; not on mpi, which cannot detect one) a mismatched call (rank 0
    all_reduce, the others broadcast) that must reach torch's caller as a
    DistBackendError."""
    init()
    out = {"ops": op_checks()}
    out.update(ddp_job(init_here=False))
    if wrappers:
        out.update(wrappers_job(init_here=False))
    if not mismatch:
        dist.destroy_process_group()
        return out
    try:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.broadcast(torch.ones(3), src=0)
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["mismatch"] = {"type": type(exc).__name__, "message": str(exc),
                           "is_dist_backend_error": isinstance(exc, dist.DistBackendError),
                           "cause": type(exc.__cause__).__name__}
    dist.destroy_process_group()
    return out


def _reference(steps_batches) -> list:
    """One process, no wrapper: the DDP example's model trained on the given batches."""
    model = build_mlp(0)
    opt = SGD(model.parameters())
    for x, y in steps_batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _max_diff(params, reference) -> float:
    return max(float((p.detach() - q).abs().max()) for p, q in zip(params, reference))


def fsdp2(n: int, r: int) -> dict:
    """torch's FSDP2, fully_shard per Linear block then the root, against one process on
    the N-times batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (n,))
    model = build_mlp(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = SGD(model.parameters())
    for step in range(STEPS):
        x, y = _batch(step, r, n)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    full = [p.full_tensor() for p in model.parameters()]  # functional all_gather
    x, y = _data()
    ref = _reference((x[s * n * BATCH:(s + 1) * n * BATCH], y[s * n * BATCH:(s + 1) * n * BATCH])
                     for s in range(STEPS))
    return {"max_diff": _max_diff(full, ref),
            "sharded": all(p.to_local().numel() < q.numel()
                           for p, q in zip(model.parameters(), full) if q.numel() >= n)}


def pipelining(n: int, r: int, schedule: str) -> dict:
    """torch.distributed.pipelining: the model cut into n stages (one per rank), 4
    micro-batches of the BATCH-sample batch, against one process on the whole batch."""
    from torch.distributed import pipelining as pp

    model = build_mlp(0)
    cuts = {2: [(0, 3), (3, 7)], 3: [(0, 3), (3, 6), (6, 7)]}[n]
    lo, hi = cuts[r]
    stage_module = torch.nn.Sequential(*list(model)[lo:hi])
    stage = pp.PipelineStage(stage_module, r, n, torch.device("cpu"))
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=4, loss_fn=F.cross_entropy)
    opt = SGD(stage_module.parameters())
    x, y = _data()
    batches = [(x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])
               for s in range(STEPS)]
    for xb, yb in batches:
        if r == 0:
            sched.step(xb)
        elif r == n - 1:
            sched.step(target=yb)
        else:
            sched.step()
        opt.step()
    ref = _reference(batches)
    offsets = [0]
    for layer in model:
        offsets.append(offsets[-1] + len(list(layer.parameters())))
    mine = ref[offsets[lo]:offsets[hi]]
    return {"max_diff": _max_diff(stage_module.parameters(), mine),
            "params": len(mine)}


def tensor_parallel(n: int, r: int) -> dict:
    """DTensor TP: a Megatron MLP (Colwise then Rowwise) against the dense one, forward
    and 3 SGD steps (functional all_reduce forward and backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    def mlp() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            return torch.nn.Sequential(torch.nn.Linear(16, 8 * n), torch.nn.ReLU(),
                                       torch.nn.Linear(8 * n, 4))

    mesh = init_device_mesh("cpu", (n,))
    dense, tp = mlp(), parallelize_module(mlp(), mesh, {"0": ColwiseParallel(),
                                                        "2": RowwiseParallel()})
    opt_dense, opt_tp = SGD(dense.parameters()), SGD(tp.parameters())
    gen = torch.Generator().manual_seed(2)
    diffs = []
    for _ in range(3):
        x = torch.randn(5, 16, generator=gen)
        out_dense, out_tp = dense(x), tp(x)
        diffs.append(float((out_dense - out_tp).detach().abs().max()))
        out_dense.square().mean().backward()
        out_tp.square().mean().backward()
        opt_dense.step()
        opt_tp.step()
    full = [p.full_tensor() for p in tp.parameters()]
    return {"forward_diff": max(diffs),
            "param_diff": _max_diff(full, [p.detach() for p in dense.parameters()])}


def wrappers_job(init_here: bool = True) -> dict:
    """FSDP2, both pipelining schedules and DTensor TP over the "collectives" world."""
    if init_here:
        init()
    n, r = dist.get_world_size(), dist.get_rank()
    out: dict = {"rank": r}
    for name, fn in (("fsdp2", lambda: fsdp2(n, r)),
                     ("gpipe", lambda: pipelining(n, r, "gpipe")),
                     ("1f1b", lambda: pipelining(n, r, "1f1b")),
                     ("tp", lambda: tensor_parallel(n, r))):
        before = collections.Counter(dist.group.WORLD.calls)
        try:
            out[name] = fn()
            out[name]["calls"] = dict(dist.group.WORLD.calls - before)
        except Exception as exc:  # noqa: BLE001 - reported to the test, with its type
            import traceback
            out[name] = {"error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-3000:]}
    if init_here:
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    job = {"ddp": ddp_job, "ops": lambda: ops_job(mismatch=False),
           "wrappers": wrappers_job}[sys.argv[1]]
    result = json.dumps(job())
    if len(sys.argv) > 2:     # a folder: one file per rank (a launcher may interleave the
        from pathlib import Path      # ranks' stdout within a line)
        Path(sys.argv[2], f"rank{json.loads(result)['rank']}.json").write_text(result)
    print(result, flush=True)
