"""parallel.ep beside data parallelism: a model with an MoE layer trained on a (dp, ep)
mesh, the experts sharded over ep and the rest replicated by DDP or FSDP over dp x ep,
has after ``backward`` + ``average_expert_grads`` the gradients of a one-process model
(all experts in one place) on the mean of every rank's loss; and after a few SGD steps
the same weights. DDP in float64 (to 1e-9), FSDP in float32 (its master copy's dtype).

Also: the wrapper never sees the experts (rank 0's experts are not broadcast over the
others'), ``DeviceMesh.flatten`` gives the right groups, and the checks' bad input.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from collectives.testing.threads import run_threads
from parallel import DDP, FSDP, DeviceMesh
from parallel.ep import (MoE, average_expert_grads, expert_parameters,
                         replicate_outside_experts)

ALONE = SimpleNamespace(rank=0, size=1, all_to_all=None, all_gather_object=None)
AUX = 0.05
STEPS = 3


class Net(nn.Module):
    """in -> dim, a residual MoE, dim -> classes."""

    def __init__(self, moe: MoE, d_in: int, classes: int, gen: torch.Generator,
                 dtype: torch.dtype) -> None:
        super().__init__()
        dim = moe.dim
        self.inp, self.out, self.moe = nn.Linear(d_in, dim), nn.Linear(dim, classes), moe
        with torch.no_grad():
            for p in list(self.inp.parameters()) + list(self.out.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.moe(h))


def _model(seed: int, E: int, group, dtype, capacity) -> Net:
    """The same weights from ``seed`` on every rank; this rank's experts of E."""
    gen = torch.Generator().manual_seed(seed)
    dim, d_in, classes = 4, 5, 3
    router = nn.Linear(dim, E, bias=False)
    experts = [nn.Sequential(nn.Linear(dim, 6), nn.Tanh(), nn.Linear(6, dim)) for _ in range(E)]
    with torch.no_grad():
        for p in [router.weight] + [p for e in experts for p in e.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen))
    L = E // group.size
    mine = experts[group.rank * L:(group.rank + 1) * L]
    moe = MoE(router, [copy.deepcopy(e) for e in mine], group, top_k=2,
              capacity_factor=capacity)
    return Net(moe, d_in, classes, gen, dtype)


def _batch(seed: int, rank: int, dtype) -> tuple:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    T = 3 + (5 * rank) % 4
    return (torch.randn(T, 5, generator=gen).to(dtype), torch.randint(0, 3, (T,), generator=gen))


def _loss(model: nn.Module, moe: MoE, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x), y) + AUX * moe.aux_loss


def run_mesh(pg, dp: int, ep: int, wrap: str, capacity) -> dict:
    """STEPS of SGD on the (dp, ep) mesh and on a one-process reference; this rank's
    largest differences (gradients of the first step, weights at the end)."""
    dtype = torch.float64 if wrap == "ddp" else torch.float32
    E, seed = 2 * ep, 7
    mesh = DeviceMesh(pg, (dp, ep), ("dp", "ep"))
    net = _model(seed, E, mesh["ep"], dtype, capacity)
    dense = mesh.flatten(("dp", "ep"))
    make = (lambda m: DDP(m, dense)) if wrap == "ddp" else (lambda m: FSDP(m, dense))
    model = replicate_outside_experts(net, make, expert_replicas=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = _model(seed, E, ALONE, dtype, capacity)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    L, first = E // ep, mesh.local_rank("ep") * (E // ep)
    errs = {}
    for step in range(STEPS):
        x, y = _batch(seed + step, pg.rank, dtype)
        opt.zero_grad()
        _loss(model, net.moe, x, y).backward()
        average_expert_grads(net, mesh["dp"])
        ref_opt.zero_grad()
        for r in range(pg.size):                   # the mean over every rank's loss
            (_loss(ref, ref.moe, *_batch(seed + step, r, dtype)) / pg.size).backward()
        if step == 0:
            for j, expert in enumerate(net.moe.experts):
                for (name, p), q in zip(expert.named_parameters(),
                                        ref.moe.experts[first + j].parameters()):
                    errs[f"grad expert{first + j}.{name}"] = (p.grad - q.grad).abs().max().item()
            if wrap == "ddp":
                theirs = dict(ref.named_parameters())
                for name, p in net.named_parameters():
                    if not name.startswith("moe.experts"):
                        errs[f"grad {name}"] = (p.grad - theirs[name].grad).abs().max().item()
        opt.step()
        ref_opt.step()
    full = model.full_state_dict() if wrap == "fsdp" else {
        k: v for k, v in net.state_dict().items() if not k.startswith("moe.experts")}
    want = ref.state_dict()
    for k, v in full.items():
        errs[f"weight {k}"] = (v - want[k]).abs().max().item()
    for j, expert in enumerate(net.moe.experts):
        for (name, p), q in zip(expert.named_parameters(),
                                ref.moe.experts[first + j].parameters()):
            errs[f"weight expert{first + j}.{name}"] = (p - q).abs().max().item()
    mesh.close()
    return errs


@pytest.mark.parametrize("dp, ep, wrap, capacity", [
    (1, 2, "ddp", None), (2, 2, "ddp", 1.0), (1, 4, "ddp", 1.5), (2, 1, "ddp", None),
    (1, 2, "fsdp", None), (2, 2, "fsdp", 0.5)])
def test_mesh_training_equals_one_process(dp, ep, wrap, capacity):
    tol = 1e-9 if wrap == "ddp" else 2e-5
    for rank, errs in enumerate(run_threads(lambda pg: run_mesh(pg, dp, ep, wrap, capacity),
                                            dp * ep, timeout=60)):
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: beyond {tol}: {bad}"
        assert any(k.startswith("grad expert") for k in errs)


def test_wrapper_does_not_see_the_experts():
    """DDP over two ranks whose experts differ: the experts stay each rank's own, are not
    in DDP's buckets, and come back in their place among the MoE's children."""
    def body(pg):
        net = _model(3, 4, pg, torch.float64, None)
        mine = [p.detach().clone() for p in expert_parameters(net)]
        order = list(net.moe._modules)
        model = replicate_outside_experts(net, lambda m: DDP(m, pg))
        in_buckets = {id(p) for b in model._buckets for p in b.params}
        return (all(torch.equal(a, b) for a, b in zip(mine, expert_parameters(net))),
                any(id(p) in in_buckets for p in expert_parameters(net)),
                list(net.moe._modules) == order,
                len(list(model.parameters())) == len(list(net.parameters())),
                mine[0])

    (same0, seen0, order0, all0, e0), (same1, seen1, order1, all1, e1) = run_threads(body, 2)
    assert same0 and same1 and not seen0 and not seen1 and order0 and order1 and all0
    assert not torch.equal(e0, e1)       # rank 1 kept its own experts


def test_flatten_groups():
    def body(pg):
        mesh = DeviceMesh(pg, (2, 1, 2), ("dp", "tp", "ep"))
        flat = mesh.flatten(("ep", "dp"))
        pair = mesh.flatten(("tp", "ep"))
        out = (flat.size, flat.rank, pair.size, mesh.flatten(["dp"]) is mesh["dp"],
               mesh.flatten(("dp", "tp", "ep")) is pg)
        with pytest.raises(ValueError, match="no dimension 'cp'"):
            mesh.flatten(("dp", "cp"))
        with pytest.raises(ValueError, match="distinct"):
            mesh.flatten(("dp", "dp"))
        with pytest.raises(TypeError, match="DeviceMesh.flatten: argument `dims`"):
            mesh.flatten("dp")
        mesh.close()
        return out

    for rank, out in enumerate(run_threads(body, 4)):
        assert out == (4, rank, 2, True, True)


def test_flatten_by_name():
    """``flatten(dims, name=...)``: ``mesh[name]`` is the same (cached) group; a name may
    not shadow a dimension nor name two flattenings."""
    def body(pg):
        mesh = DeviceMesh(pg, (2, 2, 2), ("dp", "cp", "tp"))
        dp_cp = mesh.flatten(("cp", "dp"), name="dp_cp")
        out = (dp_cp.size, mesh["dp_cp"] is dp_cp, mesh.flatten(("dp", "cp")) is dp_cp,
               mesh.flatten(("dp", "cp"), name="dp_cp") is dp_cp,
               mesh.flatten(("tp",), name="model") is mesh["tp"], mesh["model"] is mesh["tp"])
        for name in ("tp", "dp_cp", ""):
            with pytest.raises(ValueError, match="argument `name`"):
                mesh.flatten(("dp", "tp") if name == "dp_cp" else ("dp",), name=name)
        with pytest.raises(KeyError, match="flattened: \\['dp_cp', 'model'\\]"):
            mesh["nope"]
        mesh.close()
        return out

    for out in run_threads(body, 8):
        assert out == (4, True, True, True, True, True)


def test_bad_input():
    with pytest.raises(TypeError, match="argument `model`"):
        replicate_outside_experts(object(), lambda m: m)
    with pytest.raises(TypeError, match="argument `wrap`"):
        replicate_outside_experts(nn.Linear(2, 2), None)
