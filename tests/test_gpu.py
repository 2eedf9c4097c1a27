"""What runs only where CUDA is: NCCL against the reference, CUDA tensors through the CPU
transports (staged through host memory), DDP of a CUDA model, FSDP's refusal of one.

Every test here is marked ``gpu`` and skips with a reason where ``torch.cuda`` finds no
device, so the default run (no GPU) reports them as skipped, never as passed. On a GPU
machine: ``python -m pytest -m gpu`` (``tests/gpu/run.sh`` is the whole prepared check).
NCCL refuses two ranks on one device, so its worlds are as large as the device count.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import collectives
from collectives.testing import check_backend
from light_sgd import LightSGD

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA; this machine has none (torch.cuda.is_available() "
                              "is False)"),
]

JOB_TIMEOUT = 120.0


def _nccl_world_sizes() -> tuple[int, ...]:
    return tuple(range(1, min(4, torch.cuda.device_count()) + 1))


@pytest.mark.timeout(900)
def test_nccl_conforms_on_cuda_host_and_numpy_tensors():
    """The hypothesis sweep over NCCL: CUDA tensors in place, host tensors and arrays
    staged through the device."""
    check_backend("nccl", world_sizes=_nccl_world_sizes(), max_examples=120,
                  kinds=("cuda", "torch", "numpy"), timeout=JOB_TIMEOUT)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_cpu_transports_stage_cuda_tensors(backend):
    """CUDA tensors handed to a CPU transport are staged through host memory and the
    results written back into the device tensors (two ranks share the device)."""
    check_backend(backend, world_sizes=(1, 2), max_examples=80, kinds=("cuda",),
                  timeout=JOB_TIMEOUT)


# ------------------------------------------------------------------------ DDP on CUDA
D_IN, D_OUT = 12, 5


def _mlp(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, D_OUT))


def _ddp_on_cuda(steps: int = 3, b: int = 4) -> dict:
    """N ranks of DDP with a CUDA replica against one process on the N-times batch (the
    reference runs on the same device, in float64 to leave rounding out of the bound)."""
    from parallel import DDP

    pg = collectives.init_process_group()
    n, r = pg.size, pg.rank
    dev = torch.device("cuda", torch.cuda.current_device() if pg.backend == "nccl" else 0)
    model = _mlp(seed=100 + r).double().to(dev)
    ddp = DDP(model, pg)
    ref = copy.deepcopy(model)
    opt, ref_opt = LightSGD(ddp.parameters()), LightSGD(ref.parameters())
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(n, b, D_IN, generator=gen, dtype=torch.float64).to(dev)
        y = torch.randint(0, D_OUT, (n, b), generator=gen).to(dev)
        opt.zero_grad()
        F.cross_entropy(ddp(x[r]), y[r]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x.reshape(-1, D_IN)), y.reshape(-1)).backward()
        ref_opt.step()
    on_device = all(p.device.type == "cuda" and p.grad.device.type == "cuda"
                    for p in model.parameters())
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    state = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).numpy()
    pg.close()
    return {"on_device": on_device, "err": err, "state": state}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,nproc", [("nccl", None), ("shm", 2), ("gloo", 2)])
def test_ddp_of_a_cuda_model_equals_one_process(backend, nproc):
    nproc = nproc or torch.cuda.device_count()
    results = collectives.spawn(_ddp_on_cuda, nproc, backend=backend, timeout=JOB_TIMEOUT)
    for res in results:
        assert res["on_device"]
        assert res["err"] < 1e-12, res["err"]
        assert np.array_equal(res["state"], results[0]["state"])  # replicas identical


def _fsdp_on_cuda() -> str:
    from parallel import FSDP

    pg = collectives.init_process_group()
    try:
        FSDP(_mlp(1).cuda(), pg)
    except ValueError as exc:
        return str(exc)
    finally:
        pg.close()
    return "accepted"


def test_fsdp_refuses_a_cuda_model_with_a_clear_error():
    """FSDP shards host memory only (its gathered copies are freed by resizing host
    storage); a CUDA model is a ValueError that says so, not a crash inside a kernel."""
    (message,) = collectives.spawn(_fsdp_on_cuda, 1, backend="shm", timeout=JOB_TIMEOUT)
    assert "on the CPU" in message and "cuda" in message, message


# ------------------------------------------------------------------ abort over NCCL
def _nccl_abort() -> dict:
    """Abort a world of NCCL from another thread (torch's ``ProcessGroupNCCL.abort``
    underneath): abort() returns at once, every later call of the group and of a
    sub-group raises GroupAborted naming the op and the rank, and the process lives on
    (it can still use the device)."""
    import threading
    import time

    pg = collectives.init_process_group()
    sub = pg.new_group(list(range(pg.size)))
    t = torch.ones(8, device="cuda")
    pg.all_reduce(t)
    took: list = []

    def abort() -> None:
        start = time.monotonic()
        pg.abort("test: abort over nccl")
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=abort)
    thread.start()
    thread.join(30)
    later = {}
    for name, call in (("all_reduce", lambda: pg.all_reduce(t)),
                       ("sub", lambda: sub.all_reduce(t)),
                       ("broadcast", lambda: pg.broadcast(t, 0))):
        try:
            call()
            later[name] = "returned"
        except collectives.GroupAborted as exc:
            later[name] = str(exc)
    alive = float((torch.ones(4, device="cuda") * 2).sum().item())
    pg.close()   # after an abort: quiet, no error
    return {"took": took, "later": later, "alive": alive, "sum": float(t.sum().item())}


def test_abort_over_nccl_ends_the_group_and_the_process_lives_on():
    n = torch.cuda.device_count()
    results = collectives.spawn(_nccl_abort, n, backend="nccl", timeout=JOB_TIMEOUT)
    for r, res in enumerate(results):
        assert len(res["took"]) == 1 and res["took"][0] < 2.0, res
        assert res["sum"] == 8.0 * n, res
        for name, message in res["later"].items():
            assert message != "returned", (name, res)
            assert f"[rank {r}/{n}]" in message, (name, message)
        assert "all_reduce" in res["later"]["all_reduce"], res
        assert "broadcast" in res["later"]["broadcast"], res
        assert res["alive"] == 8.0, res
