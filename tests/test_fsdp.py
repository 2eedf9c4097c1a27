"""parallel.FSDP: N ranks on batches b_r equal one process on the concatenated batch.

The checks are functions of a process group, run in the in-process thread world of
``collectives.testing`` (fast; world sizes 2, 3, 4) and, a few at once, in one real job
per backend (``collectives.spawn`` for shm, zmq, gloo; ``mpiexec`` for mpi). The
reference is always one plain process: the same initial weights, the whole batch, the
mean loss. Thread ranks share torch's global RNG: models are built under a lock, and
data comes from explicit generators (a draw from the global RNG on one thread while
another builds a model would change that model).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402
from parallel import FSDP  # noqa: E402
from parallel.fsdp import shard_layout  # noqa: E402
from light_sgd import LightSGD as _SGD  # noqa: E402

D_IN, D, D_OUT = 12, 16, 5
TOL = 2e-5
_INIT_LOCK = threading.Lock()


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


def _model(seed: int, blocks: int = 3) -> nn.Module:
    """Blocks (the units) between an input and an output layer (the root's own)."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(D_IN, D), *[Block() for _ in range(blocks)],
                             nn.Linear(D, D_OUT))


class _Adam(_SGD):
    """Adam (Kingma & Ba 2014) in a few lines, for the same reason."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8) -> None:
        super().__init__(params)
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, {}

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        for p in self.params:
            if p.grad is None:
                continue
            m, v = self.bufs.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
            t = self.t[p] = self.t.get(p, 0) + 1
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.addcdiv_(m / (1 - b1 ** t), (v / (1 - b2 ** t)).sqrt_().add_(self.eps),
                       value=-self.lr)


OPTIMIZERS = {"sgd": _SGD, "adam": _Adam,
              "torch_sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "torch_adam": lambda p: torch.optim.Adam(p, lr=1e-2)}


def _max_err(sd: dict, ref: dict) -> float:
    assert list(sd) == list(ref)
    for k in ref:
        assert sd[k].shape == ref[k].shape, k
    return max((sd[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _digest(sd: dict) -> np.ndarray:
    return torch.cat([v.detach().reshape(-1).double() for v in sd.values()]).numpy()


# ------------------------------------------------------------------ checks (per rank)
def check_equivalence(pg, strategy="zero3", optim="sgd", *, steps=5, micro=1, b=4,
                      wrap=Block, model=None, ahead=False, **kwargs) -> dict:
    """``steps`` steps of ``optim``; each step ``micro`` micro-batches of ``b`` per rank,
    the first ``micro - 1`` under no_sync, each loss scaled by 1/micro. ``ahead``: every
    micro-batch's forward before the first backward (as a GPipe pipeline stage runs)."""
    n, r = pg.size, pg.rank
    model = model or _model
    fsdp = FSDP(model(100 + r), pg, wrap=wrap, strategy=strategy, **kwargs)
    ref = model(100)                           # rank 0's initial weights
    opt, ref_opt = OPTIMIZERS[optim](fsdp.parameters()), OPTIMIZERS[optim](ref.parameters())
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(micro, n, b, D_IN, generator=gen)
        y = torch.randint(0, D_OUT, (micro, n, b), generator=gen)
        opt.zero_grad()
        pending = []
        for i in range(micro):
            with fsdp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(fsdp(x[i, r]), y[i, r]) / micro
                if not ahead:
                    loss.backward()
            pending.append(loss)
        if ahead:
            for loss in pending:
                loss.backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x.reshape(-1, D_IN)), y.reshape(-1)).backward()
        ref_opt.step()
    sd = fsdp.full_state_dict()
    return {"err": _max_err(sd, ref.state_dict()), "digest": _digest(sd),
            "units": len(fsdp.units), "shard_params": len(list(fsdp.parameters())),
            "mem": fsdp.memory()}


class _Branchy(nn.Module):
    """``a`` always; ``b`` runs everywhere but reaches the loss on rank 0 only; ``never``
    does not run; a BatchNorm with running statistics (buffers) and a frozen layer (not
    sharded) in the root."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with _INIT_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.trunk, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)
            self.a, self.b, self.never = Block(8), Block(8), Block(8)
            self.head, self.frozen = nn.Linear(8, 3), nn.Linear(8, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.bn(self.trunk(x)))
        hb = self.b(h)
        out = self.a(h) + (hb if use_b else 0)
        return self.head(out) + self.frozen(out)


def check_unused(pg, strategy="zero3", *, steps=3, b=5) -> dict:
    n, r = pg.size, pg.rank
    model = _Branchy(10 + r)
    model.bn = nn.Identity()           # the equivalence part: no batch statistics
    fsdp = FSDP(model, pg, wrap=Block, strategy=strategy)
    ref = _Branchy(10)
    ref.bn = nn.Identity()
    opt, ref_opt = _SGD(fsdp.parameters()), _SGD(ref.parameters())
    gen = torch.Generator().manual_seed(3)
    never = next(u for u in fsdp.units if u.name == "never")
    for _ in range(steps):
        x, y = torch.randn(n, b, 6, generator=gen), torch.randint(0, 3, (n, b), generator=gen)
        opt.zero_grad()
        F.cross_entropy(fsdp(x[r], use_b=r == 0), y[r]).backward()
        never_grad = never.flat.shard.grad
        opt.step()
        ref_opt.zero_grad()
        (sum(F.cross_entropy(ref(x[q], use_b=q == 0), y[q]) for q in range(n)) / n).backward()
        ref_opt.step()
    return {"err": _max_err(fsdp.full_state_dict(), ref.state_dict()),
            "never_grad_is_none": never_grad is None,
            "ref_never_grad_is_none": all(p.grad is None for p in ref.never.parameters())}


def check_buffers(pg) -> dict:
    """BatchNorm's running statistics: trained, broadcast from rank 0 before each forward,
    in full_state_dict with the original keys, equal on every rank."""
    n, r = pg.size, pg.rank
    fsdp = FSDP(_Branchy(1), pg, wrap=Block)
    opt = _SGD(fsdp.parameters())
    gen = torch.Generator().manual_seed(r)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(fsdp(torch.randn(6, 6, generator=gen), use_b=True),
                        torch.randint(0, 3, (6,), generator=gen)).backward()
        opt.step()
    sd = fsdp.full_state_dict()
    return {"keys": list(sd), "ref_keys": list(_Branchy(1).state_dict()),
            "batches": sd["bn.num_batches_tracked"].item(), "digest": _digest(sd)}


def check_memory(pg, strategy="zero3", units=8, width=24) -> dict:
    """``units`` equal units, nothing in the root: what a rank holds at rest and at peak."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)])
    unit_numel = width * width + width
    fsdp = FSDP(model, pg, wrap=nn.Linear, strategy=strategy)
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    peaks = []
    for _ in range(2):
        fsdp.reset_peak_memory()
        opt.zero_grad()
        fsdp(x).sum().backward()
        opt.step()
        peaks.append(fsdp.memory(opt)["full_params_peak"])
    return {"mem": fsdp.memory(opt), "peaks": peaks, "unit_bytes": unit_numel * 4,
            "total_bytes": units * unit_numel * 4, "units": units,
            "padding_bytes": units * shard_layout(unit_numel, pg.size)[1] * 4}


class _Recorder:
    """A group that keeps the Works of the all_gathers it forwards."""

    def __init__(self, pg) -> None:
        self._pg, self.works = pg, []

    def __getattr__(self, name):
        return getattr(self._pg, name)

    def all_gather(self, output, input, *, async_op=False):
        work = self._pg.all_gather(output, input, async_op=async_op)
        self.works.append(work)
        return work

    def all_gather_init(self, output, input):
        """FSDP's units gather through persistent requests: keep each start the same way."""
        return _RecordedRequest(self, self._pg.all_gather_init(output, input))


class _RecordedRequest:
    def __init__(self, recorder: _Recorder, request) -> None:
        self._recorder, self._request = recorder, request

    def __getattr__(self, name):
        return getattr(self._request, name)

    def start(self) -> None:
        self._request.start()
        self._recorder.works.append(_Round(self._request))


class _Round:
    """One round of a persistent request, as the Work a plain call returns: completed
    once it finished (or was waited for and started again: a later round)."""

    def __init__(self, request) -> None:
        self._request, self._active = request, True

    def is_completed(self) -> bool:
        return self._request.is_completed() or not self._request.active


def _note(recorder: _Recorder, log: list) -> None:
    """Sleep (the unit computing), then note how many all_gathers had been issued when it
    began and which had completed by its end."""
    issued = len(recorder.works)
    time.sleep(0.15)
    log.append((issued, [w is None or w.is_completed() for w in recorder.works]))


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recorder, log):
        ctx.recorder, ctx.log = recorder, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _note(ctx.recorder, ctx.log)
        return grad, None, None


class _SlowLinear(nn.Linear):
    """A Linear whose forward and backward are slow and leave notes (see _note)."""

    def __init__(self, d: int, recorder: _Recorder, logs: tuple) -> None:
        super().__init__(d, d)
        self.recorder, self.logs = recorder, logs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _note(self.recorder, self.logs[0])
        return _SlowBackward.apply(super().forward(x), self.recorder, self.logs[1])


def check_prefetch(pg, prefetch: bool, units: int = 4) -> tuple:
    recorder, logs = _Recorder(pg), ([], [])
    with _INIT_LOCK:
        torch.manual_seed(0)
        model = nn.Sequential(*[_SlowLinear(64, recorder, logs) for _ in range(units)])
    fsdp = FSDP(model, recorder, wrap=_SlowLinear, prefetch=prefetch)
    recorder.works.clear()
    fsdp(torch.randn(2, 64, generator=torch.Generator().manual_seed(1))).sum().backward()
    return logs   # (forward notes of units 0..3, backward notes of units 3..0)


def _all_spawned_checks(pg) -> dict:
    """What one real job per backend checks (the thread world covers the rest)."""
    out = {}
    for strategy, optim in (("zero3", "sgd"), ("zero3", "adam"), ("zero2", "adam"),
                            ("zero1", "sgd")):
        res = check_equivalence(pg, strategy, optim)
        out[f"{strategy}_{optim}"] = {"err": res["err"], "digest": res["digest"].tolist()}
    out["no_sync"] = check_equivalence(pg, micro=3, steps=3)["err"]
    out["unused"] = check_unused(pg)["err"]
    return out


def _spawned_job() -> dict:
    """The checks on the world, then on sub-groups of its first ranks down to 2 (FSDP over
    a sub-group, as over a mesh's data-parallel dimension): every world size up to the
    job's in one job. Returns {world size: this rank's results}."""
    pg = collectives.init_process_group()
    try:
        out = {pg.size: _all_spawned_checks(pg)}
        for size in range(pg.size - 1, 1, -1):
            if pg.rank < size:
                sub = pg.new_group(list(range(size)))
                try:
                    out[size] = _all_spawned_checks(sub)
                finally:
                    sub.close()
        pg.barrier()
        return out
    finally:
        pg.close()


def _assert_job(results: list) -> None:
    for size in range(2, len(results) + 1):
        _assert_spawned([r[size] for r in results[:size]])


def _assert_spawned(results: list) -> None:
    for res in results:
        for key, value in res.items():
            err = value["err"] if isinstance(value, dict) else value
            assert err < TOL, (key, err)
    for key in results[0]:
        if isinstance(results[0][key], dict):   # bitwise equal on every rank
            assert all(r[key]["digest"] == results[0][key]["digest"] for r in results), key


# ------------------------------------------------------------------ the thread world
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1"])
def test_equivalence(strategy, n):
    """5 steps of SGD with momentum and of Adam (torch's) equal one process."""
    def body(pg):
        return [check_equivalence(pg, strategy, optim) for optim in ("torch_sgd", "torch_adam")]

    results = run_threads(body, n, timeout=60)
    for which in range(2):
        res = [r[which] for r in results]
        assert all(r["err"] < TOL for r in res), [r["err"] for r in res]
        assert all(np.array_equal(r["digest"], res[0]["digest"]) for r in res)
        assert res[0]["units"] == 4 and res[0]["shard_params"] == 4   # 3 blocks + root


@pytest.mark.parametrize("kwargs", [{"prefetch": False}, {"reshard_after_forward": False},
                                    {"reduce_dtype": torch.float32}])
def test_equivalence_options(kwargs):
    res = run_threads(lambda pg: check_equivalence(pg, "zero3", "adam", **kwargs), 3,
                      timeout=60)
    assert all(r["err"] < TOL for r in res), [r["err"] for r in res]


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1"])
def test_no_sync_accumulation(strategy):
    res = run_threads(lambda pg: check_equivalence(pg, strategy, micro=3, steps=3), 2,
                      timeout=60)
    assert all(r["err"] < TOL for r in res), [r["err"] for r in res]


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_no_sync_with_forwards_ahead_of_backwards(strategy):
    """Three forwards, then their three backwards (a GPipe stage's order): the first pass
    frees the root's parameters when their gradient is complete, and the later passes
    must gather them again (they once read freed storage)."""
    res = run_threads(lambda pg: check_equivalence(pg, strategy, micro=3, steps=3,
                                                   ahead=True), 2, timeout=60)
    assert all(r["err"] < TOL for r in res), [r["err"] for r in res]


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_unused_unit(strategy):
    """A unit that never runs keeps .grad None (as in one process); one whose output
    reaches the loss on rank 0 only is averaged with zeros elsewhere."""
    for res in run_threads(lambda pg: check_unused(pg, strategy), 3, timeout=60):
        assert res["err"] < TOL, res["err"]
        assert res["never_grad_is_none"] and res["ref_never_grad_is_none"]


class _Tied(nn.Module):
    """Two layers sharing one weight: one unit, one slot, two state-dict keys."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _tied_model(seed: int) -> nn.Module:
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(D_IN, D), _Tied(), _Tied(), nn.Linear(D, D_OUT))


@pytest.mark.parametrize("wrap, model, units", [
    ((Block, nn.Linear), None, 8),            # nested: each Block's Linear a unit of its own
    (nn.LayerNorm, None, 4),
    (lambda m: isinstance(m, nn.Linear) and m.in_features == D, None, 5),
    (None, None, 1),                          # the whole model one unit
    (_Tied, _tied_model, 3),                  # tied weights inside a unit
], ids=["nested", "class", "predicate", "none", "tied"])
def test_wrap_forms(wrap, model, units):
    res = run_threads(lambda pg: check_equivalence(pg, "zero3", "adam", wrap=wrap,
                                                   model=model), 3, timeout=60)
    assert all(r["err"] < TOL for r in res), [r["err"] for r in res]
    assert res[0]["units"] == units


def test_buffers():
    res = run_threads(check_buffers, 2, timeout=60)
    for r in res:
        assert r["keys"] == r["ref_keys"]
        assert r["batches"] == 3
        assert np.array_equal(r["digest"], res[0]["digest"])


@pytest.mark.parametrize("n", [2, 4])
def test_memory(n):
    """zero3 at rest: 1/N of parameters + gradients + Adam state, plus padding; at peak
    two units' full parameters (one computing, one prefetched), not eight."""
    for r in run_threads(lambda pg: check_memory(pg, "zero3"), n, timeout=60):
        mem, total = r["mem"], r["total_bytes"]
        resting = mem["param_shards"] + mem["grad_shards"] + mem["optimizer_state"]
        steps_bytes = r["units"] * 4 * 2            # Adam's step scalar per unit (x2 slack)
        unsharded = 4 * total                       # params + grads + exp_avg + exp_avg_sq
        assert resting <= unsharded / n + 4 * r["padding_bytes"] + steps_bytes, (mem, n)
        assert mem["param_shards"] <= total / n + r["padding_bytes"]
        assert mem["full_params"] == 0 and mem["full_grads"] == 0
        for peak in r["peaks"]:
            assert r["unit_bytes"] <= peak <= 2 * r["unit_bytes"] + 4 * n, (peak, r)
    for r in run_threads(lambda pg: check_memory(pg, "zero2"), 2, timeout=60):
        # zero2 keeps the whole model gathered (the difference zero3 makes)
        assert r["mem"]["full_params"] >= r["total_bytes"]


def test_prefetch_overlaps_compute():
    """With prefetch, unit k + 1's all_gather was issued before unit k computed and had
    completed by the end of unit k's forward; without, it was not even issued. Likewise
    in backward for unit k - 1 (all_gathers 0-3 are the forward's, 4-7 the backward's,
    unit 3 first)."""
    for fwd, bwd in run_threads(lambda pg: check_prefetch(pg, True), 2, timeout=60):
        for k, (issued, done) in enumerate(fwd[:-1]):
            assert issued >= k + 2, (k, issued)     # gathers of units 0..k+1 issued
            assert all(done[:k + 2]), (k, done)     # ... and completed by now
        for p, (issued, done) in enumerate(bwd[:-1]):   # unit 3 - p's backward
            assert issued >= 4 + p + 2, (p, issued)      # ... and unit 2 - p's gather
            assert all(done[:4 + p + 2]), (p, done)
    for fwd, bwd in run_threads(lambda pg: check_prefetch(pg, False), 2, timeout=60):
        assert [issued for issued, _ in fwd] == [1, 2, 3, 4]
        assert [issued for issued, _ in bwd] == [5, 6, 7, 8]


def _train_steps(fsdp, opt, steps: int, n: int, r: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(12, D_IN, generator=gen), torch.randint(0, D_OUT, (12,), generator=gen)
        mine = slice(r * 12 // n, (r + 1) * 12 // n)
        opt.zero_grad()
        F.cross_entropy(fsdp(x[mine]), y[mine]).backward()
        opt.step()


def test_checkpoint_resharding(tmp_path):
    """Saved at 4 ranks after 3 Adam steps, loaded at 2 and at 3: the next step's
    parameters equal those of the run that went on at 4."""
    path = str(tmp_path / "ckpt")

    def saver(pg):
        fsdp = FSDP(_model(5), pg, wrap=Block)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
        _train_steps(fsdp, opt, 3, pg.size, pg.rank, seed=1)
        fsdp.save_sharded(path, opt)
        _train_steps(fsdp, opt, 1, pg.size, pg.rank, seed=2)
        return fsdp.full_state_dict()

    uninterrupted = run_threads(saver, 4, timeout=60)[0]
    assert sorted(os.listdir(path)) == [f"shard-{r:05d}-of-00004.pt" for r in range(4)]

    def loader(pg):
        fsdp = FSDP(_model(99), pg, wrap=Block)         # other weights: all overwritten
        opt = torch.optim.Adam(fsdp.parameters(), lr=0.5)  # the saved lr comes back
        fsdp.load_sharded(path, opt)
        _train_steps(fsdp, opt, 1, pg.size, pg.rank, seed=2)
        return fsdp.full_state_dict(), opt.param_groups[0]["lr"]

    for n in (2, 3):
        for sd, lr in run_threads(loader, n, timeout=60):
            assert lr == 1e-2
            assert _max_err(sd, uninterrupted) < TOL


def test_full_state_dict_round_trip():
    def body(pg):
        fsdp = FSDP(_model(1 + pg.rank), pg, wrap=Block, strategy="zero2")
        target = _model(42).state_dict()
        fsdp.load_full_state_dict(target)
        fsdp(torch.ones(2, D_IN))          # zero2: the resident copy is regathered
        out = _max_err(fsdp.full_state_dict(), target)
        with pytest.raises(ValueError, match="missing"):
            fsdp.load_full_state_dict({k: v for k, v in target.items() if k != "0.bias"})
        bad = dict(target, **{"0.bias": torch.zeros(3)})
        with pytest.raises(ValueError, match="0.bias"):
            fsdp.load_full_state_dict(bad)
        plain = _model(7)
        plain.load_state_dict(fsdp.full_state_dict())   # loads into the original module
        return out

    assert run_threads(body, 3, timeout=60) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1"])
def test_bf16_param_dtype_within_autocast_tolerance(strategy):
    """bf16 compute and reduction, fp32 master shards: as far from the fp32 run as one
    process under bf16 autocast is (within a factor), and much closer than random."""
    steps = 5

    def body(pg):
        n, r = pg.size, pg.rank
        fsdp = FSDP(_model(100 + r), pg, wrap=Block, param_dtype=torch.bfloat16,
                    strategy=strategy)
        opt = _SGD(fsdp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(7)
        for _ in range(steps):
            x, y = torch.randn(n, 4, D_IN, generator=gen), torch.randint(0, D_OUT, (n, 4),
                                                                          generator=gen)
            opt.zero_grad()
            F.cross_entropy(fsdp(x[r]).float(), y[r]).backward()
            opt.step()
        shard = fsdp.units[0].flat.shard
        return fsdp.full_state_dict(), shard.dtype

    def reference(autocast: bool) -> dict:
        ref = _model(100)
        opt = _SGD(ref.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(7)
        for _ in range(steps):
            x, y = torch.randn(2, 4, D_IN, generator=gen), torch.randint(0, D_OUT, (2, 4),
                                                                          generator=gen)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = ref(x.reshape(-1, D_IN))
            F.cross_entropy(out.float(), y.reshape(-1)).backward()
            opt.step()
        return ref.state_dict()

    fp32, autocast = reference(False), reference(True)
    autocast_err = _max_err(autocast, fp32)
    for sd, dtype in run_threads(body, 2, timeout=60):
        assert dtype == torch.float32                     # the master copy
        err = _max_err(sd, fp32)
        assert 0 < err <= 4 * autocast_err, (err, autocast_err)


# ------------------------------------------------------------------ real processes
def _spawnable_backends() -> list:
    others = [b for b in collectives.available_backends()
              if b not in ("shm", "mpi", "nccl", "torch")]
    return ["shm"] + others


@pytest.mark.parametrize("backend, nproc",
                         [("shm", 3)] + [(b, 2) for b in _spawnable_backends() if b != "shm"]
                         + [pytest.param("shm", 4, marks=pytest.mark.slow)]
                         + [pytest.param(b, n, marks=pytest.mark.slow)
                            for b in _spawnable_backends() if b != "shm" for n in (4,)])
def test_spawned(backend, nproc):
    """One job per backend (starting ranks is the expensive part): shm, the default, at
    world sizes 3 and 2 (a sub-group), and 4, 3, 2 in the slow set; the others at 2, and at
    4, 3, 2 in the slow set (the thread world covers 2, 3 and 4 on every strategy)."""
    if backend != "shm":
        try:
            collectives.get_backend(backend)
        except ImportError as exc:
            pytest.skip(f"backend {backend} does not import: {exc}")
    _assert_job(collectives.spawn(_spawned_job, nproc, backend=backend, timeout=60,
                                  join_timeout=150))


MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")


@pytest.mark.skipif(MPIEXEC is None or "mpi" not in collectives.available_backends(),
                    reason="needs mpiexec and mpi4py")
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_under_mpiexec(nproc):
    """The same checks on the mpi backend, started by mpiexec (this file is the script):
    2 ranks, and 4 (then 3 and 2 on sub-groups) in the slow set."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([MPIEXEC, "-n", str(nproc), sys.executable, __file__, "--job"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("[")]
    assert len(lines) == 1, proc.stdout
    for size in range(2, nproc + 1):
        _assert_spawned([r[str(size)] for r in lines[0][:size]])   # (JSON keys are strings)


# ------------------------------------------------------------------ single-process API
def test_validates_arguments():
    class _NotAGroup:
        rank, size = 0, 1

    with pytest.raises(TypeError, match="module"):
        FSDP(object(), _NotAGroup())
    with pytest.raises(TypeError, match="group"):
        FSDP(nn.Linear(2, 2), _NotAGroup())

    def body(pg):
        with pytest.raises(ValueError, match="strategy"):
            FSDP(nn.Linear(2, 2), pg, strategy="zero4")
        with pytest.raises(TypeError, match="wrap"):
            FSDP(nn.Linear(2, 2), pg, wrap=3)
        with pytest.raises(TypeError, match="param_dtype"):
            FSDP(nn.Linear(2, 2), pg, param_dtype=torch.int8)
        with pytest.raises(TypeError, match="prefetch"):
            FSDP(nn.Linear(2, 2), pg, prefetch="yes")
        shared = nn.Linear(2, 2)
        tied = nn.Sequential(nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2)))
        tied[1][0].weight = shared.weight
        with pytest.raises(ValueError, match="shared between unit"):
            FSDP(tied, pg, wrap=lambda m: isinstance(m, nn.Sequential))
        with pytest.raises(TypeError, match="float32"):
            FSDP(nn.Linear(2, 2).double(), pg)
        return True

    assert run_threads(body, 2) == [True, True]


def test_padding_and_shards():
    """Odd sizes: the last rank's shard ends in padding zeros; at most size - 1 of them."""
    def body(pg):
        fsdp = FSDP(nn.Linear(3, 2), pg)               # 8 elements over 3 ranks: 3 3 2+1
        return fsdp.units[0].flat.shard.detach().clone(), fsdp.units[0].flat.padding

    res = run_threads(body, 3)
    assert [len(s) for s, _ in res] == [3, 3, 3] and res[0][1] == 1
    assert res[2][0][-1].item() == 0.0


@pytest.mark.parametrize("total, world", [(0, 1), (1, 4), (10, 4), (12, 3), (7, 7), (5, 8)])
def test_shard_layout(total, world):
    shard, padding = shard_layout(total, world)
    assert shard * world == total + padding and 0 <= padding < world
    assert shard * (world - 1) < total or total == 0 or shard == 1


def test_failed_reduce_surfaces_in_backward_and_resets():
    """A reduce_scatter whose Work fails: loss.backward() raises it; the next step runs
    clean (one rank: every collective is local) and equals one process."""
    class Failing:
        def wait(self, timeout=None):
            raise collectives.PeerError("rank 1 hung up")

    def body(pg):
        recorder = _Recorder(pg)
        fsdp = FSDP(_model(3), recorder, wrap=Block)
        ref = _model(3)
        real = recorder.reduce_scatter
        recorder.reduce_scatter = lambda *a, **k: (real(*a, **k), Failing())[1]
        x = torch.ones(2, D_IN)
        with pytest.raises(collectives.PeerError, match="hung up"):
            fsdp(x).sum().backward()
        recorder.reduce_scatter = real
        for p in fsdp.parameters():
            p.grad = None
        fsdp(x).sum().backward()
        ref(x).sum().backward()
        grads = {k: v for k, v in zip([u.name for u in fsdp.units],
                                      [u.flat.shard.grad for u in fsdp.units])}
        full = torch.cat([p.grad.reshape(-1) for p in ref[1].parameters()])
        return (grads["1"][:full.numel()] - full).abs().max().item(), fsdp.memory()

    err, mem = run_threads(body, 1)[0]
    assert err < 1e-6 and mem["full_params"] == 0


# ------------------------------------------------------------------ the example
def _run_example(*args, timeout, launcher=()):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run([*launcher, sys.executable, str(ROOT / "examples" / "fsdp.py"),
                           *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == {"example", "backend", "world_size", "epochs", "wall_s", "total_s",
                            "samples_per_s", "final_loss", "final_acc"}
    return summary, time.monotonic() - start


def test_example_smoke(tmp_path):
    """One epoch with a trace; under mpiexec where there is one (it starts ranks faster
    than spawning them; the slow tests run the spawned default)."""
    trace = tmp_path / "trace.json"
    launcher = (MPIEXEC, "-n", "2") if MPIEXEC else ()
    summary, _ = _run_example("--epochs", "1", "--trace", str(trace), timeout=120,
                              launcher=launcher)
    assert summary["example"] == "fsdp" and summary["world_size"] == 2
    assert summary["final_acc"] > 0.7
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        names = {e["name"] for e in events if e["pid"] == rank}
        assert {"forward", "backward", "all_gather", "reduce_scatter"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--nproc", "4"), ("--backend", "zmq"),
                                  ("--backend", "gloo"), ("--strategy", "zero1"),
                                  ("--strategy", "zero2"), ("--param-dtype", "bfloat16"),
                                  ("mpiexec",)])
def test_example_reaches_accuracy(args):
    if args == ("mpiexec",):
        if MPIEXEC is None:
            pytest.skip("no mpiexec")
        summary, elapsed = _run_example(timeout=300, launcher=(MPIEXEC, "-n", "2"))
        assert summary["backend"] == "mpi"
    else:
        summary, elapsed = _run_example(*args, timeout=300)
    assert summary["final_acc"] >= 0.85, summary
    assert elapsed < 120, elapsed


if __name__ == "__main__" and "--job" in sys.argv:   # the mpiexec job of test_under_mpiexec
    torch.set_num_threads(1)
    _results = _spawned_job()   # this world, then sub-groups of its first ranks down to 2
    _meet = collectives.init_process_group()
    _everyone = _meet.all_gather_object(_results)
    if _meet.rank == 0:
        print(json.dumps(_everyone), flush=True)
    _meet.close()
