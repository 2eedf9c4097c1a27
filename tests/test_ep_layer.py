"""parallel.ep's pieces alone: the gating rules, the exchange's permutation, which
collectives one forward and backward call (and that every rank calls them, whatever its
input needs), the one-process layer and ``from_dense``, and clear errors for bad input."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

from collectives.testing.threads import run_threads
from examples.common.comm_account import CountingGroup
from parallel.ep import (MoE, capacity_of, expert_major, load_balancing_loss, top_k_gates,
                         within_capacity)


def _experts(n: int, dim: int = 3) -> list:
    return [nn.Linear(dim, dim) for _ in range(n)]


def test_docstring_examples():
    import collectives.bench.cases
    import parallel.ep.data_parallel
    import parallel.ep.exchange
    import parallel.ep.gating
    for module in (parallel.ep.gating, parallel.ep.exchange, parallel.ep.data_parallel,
                   collectives.bench.cases):
        failed, tried = doctest.testmod(module)
        assert failed == 0 and (tried > 0 or module is parallel.ep.data_parallel), module


# ------------------------------------------------------------------ gating
def test_top_k_breaks_ties_by_lower_index_and_softmaxes_the_k():
    logits = torch.tensor([[1.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0], [3.0, -1.0, 2.0, 9.0]],
                          requires_grad=True)
    experts, gates = top_k_gates(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 1], [3, 0]]
    assert torch.allclose(gates[0], torch.tensor([0.5, 0.5]))
    assert torch.allclose(gates[2], torch.softmax(torch.tensor([9.0, 3.0]), 0))
    gates.sum().backward()              # differentiable (the sum of each row is 1: zero)
    assert logits.grad is not None and logits.grad.abs().max() < 1e-6


def test_capacity_drops_the_lowest_gates_first_and_later_tokens_on_ties():
    assert capacity_of(1.25, 7, 2, 4) == 5 and capacity_of(0.1, 1, 1, 64) == 1
    experts = torch.tensor([[0], [0], [0], [1], [0]])
    gates = torch.tensor([[0.5], [0.9], [0.5], [0.1], [0.7]])
    keep = within_capacity(experts, gates, 2, 2)
    assert keep.reshape(-1).tolist() == [False, True, False, True, True]
    keep = within_capacity(experts, gates, 2, 3)        # a tie at the line: earlier first
    assert keep.reshape(-1).tolist() == [True, True, False, True, True]
    assert within_capacity(experts, gates, 2, None).all()


def test_load_balancing_loss():
    logits = torch.zeros(4, 4, requires_grad=True)
    even = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert load_balancing_loss(logits, even).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0, 1]] * 4)
    logits2 = torch.tensor([[5.0, 5.0, 0.0, 0.0]] * 4, requires_grad=True)
    loss = load_balancing_loss(logits2, skewed)
    assert loss.item() > 1.9                    # everything to two experts: about 2
    loss.backward()
    assert logits2.grad[:, :2].sum() > 0        # pushes the favoured experts' logits down
    empty = torch.zeros(0, 4, requires_grad=True)
    loss = load_balancing_loss(empty, torch.zeros(0, 2, dtype=torch.int64))
    loss.backward()
    assert loss.item() == 0.0 and empty.grad.shape == (0, 4)


def test_expert_major_regroups_received_rows():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])   # 2 sources x 3 local experts
    idx = expert_major(counts)
    arrived = [("s0", 0), ("s0", 0), ("s0", 2), ("s1", 0), ("s1", 1), ("s1", 1), ("s1", 1)]
    regrouped = [arrived[i] for i in idx.tolist()]
    assert regrouped == sorted(arrived, key=lambda a: (a[1], a[0]))
    assert expert_major(torch.zeros(2, 2, dtype=torch.int64)).numel() == 0


# ------------------------------------------------------------------ collectives called
def _count(pg) -> dict:
    group = CountingGroup(pg)           # counts every collective: MoE calls only all_to_all
    gen = torch.Generator().manual_seed(1)
    router = nn.Linear(3, 2 * pg.size, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    moe = MoE(router, _experts(2), group, top_k=2)
    out = {}

    def take(name: str) -> None:
        out[name] = group.calls
        group.start()
    group.start()
    # rank 0's input needs a gradient, rank 1's is data; rank 1 has no tokens at all
    x = torch.randn(4 if pg.rank == 0 else 0, 3, requires_grad=pg.rank == 0)
    y = moe(x)
    take("forward")
    (y.sum() + moe.aux_loss).backward()
    take("backward")
    with torch.no_grad():
        moe(torch.randn(3, 3))
    take("no_grad")
    out["expert_grads"] = all(p.grad is not None for p in moe.experts.parameters())
    return out


def test_collectives_of_one_forward_and_backward():
    """Forward: the counts, dispatch, combine (three all_to_alls); backward: the two
    exchanges reversed, on every rank, also where the input needs no gradient and holds
    no tokens; no_grad: forward's three only. One rank: no collective at all."""
    for counts in run_threads(_count, 2, timeout=30):
        assert (counts["forward"], counts["backward"], counts["no_grad"]) == (3, 2, 3)
        assert counts["expert_grads"]
    alone = run_threads(_count, 1, timeout=30)[0]
    assert alone["forward"] == alone["backward"] == alone["no_grad"] == 0


# ------------------------------------------------------------------ one process, from_dense
def test_one_process_layer_and_its_shards():
    """``MoE(..., None)`` holds every expert; ``from_dense`` gives each rank its share and
    the ranks together compute what it computes."""
    torch.manual_seed(0)
    whole = MoE(nn.Linear(3, 4, bias=False), _experts(4), None, top_k=2).double()
    xs = [torch.randn(5, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)]
    want = [whole(x).detach() for x in xs]

    def body(pg):
        mine = MoE.from_dense(whole, pg)
        return mine.first_expert, len(mine.experts), mine(xs[pg.rank]).detach()

    for rank, (first, local, y) in enumerate(run_threads(body, 2)):
        assert (first, local) == (2 * rank, 2)
        assert torch.allclose(y, want[rank], rtol=0, atol=1e-12)
    assert whole.group.size == 1 and whole.extra_repr().startswith("dim=3, experts=0...3")


# ------------------------------------------------------------------ errors
def test_bad_input_is_a_clear_error():
    def body(pg):
        msgs = {}
        r = pg.rank
        cases = {
            "bias": (TypeError, lambda: MoE(nn.Linear(3, 4), _experts(2), pg)),
            "router": (TypeError, lambda: MoE(nn.Conv1d(3, 4, 1), _experts(2), pg)),
            "divisible": (ValueError, lambda: MoE(nn.Linear(3, 5, bias=False), _experts(2), pg)),
            "count": (ValueError, lambda: MoE(nn.Linear(3, 4, bias=False), _experts(3), pg)),
            "module": (TypeError, lambda: MoE(nn.Linear(3, 4, bias=False), [nn.Linear(3, 3), 7],
                                               pg)),
            "sequential": (TypeError, lambda: MoE(nn.Linear(3, 4, bias=False),
                                                  nn.Sequential(*_experts(2)), pg)),
            "top_k": (ValueError, lambda: MoE(nn.Linear(3, 4, bias=False), _experts(2), pg,
                                               top_k=5)),
            "top_k_bool": (ValueError, lambda: MoE(nn.Linear(3, 4, bias=False), _experts(2), pg,
                                                    top_k=True)),
            "capacity": (ValueError, lambda: MoE(nn.Linear(3, 4, bias=False), _experts(2), pg,
                                                  capacity_factor=0)),
            "capacity_inf": (ValueError, lambda: MoE(nn.Linear(3, 4, bias=False), _experts(2),
                                                      pg, capacity_factor=float("inf"))),
            "differ": (ValueError, lambda: MoE(nn.Linear(3, 4, bias=False), _experts(2), pg,
                                                top_k=1 + r)),
        }
        for name, (error, make) in cases.items():
            with pytest.raises(error) as info:
                make()
            msgs[name] = str(info.value)
        moe = MoE(nn.Linear(3, 4, bias=False), _experts(2), pg)
        for bad in (torch.zeros(2, 4), torch.zeros(3), [[1.0, 2.0, 3.0]]):
            with pytest.raises(ValueError) as info:
                moe(bad)
            msgs.setdefault("forward", str(info.value))
        wide = MoE(nn.Linear(3, 4, bias=False), [nn.Linear(3, 2), nn.Linear(3, 2)], pg)
        with pytest.raises(ValueError) as info:
            wide(torch.ones(6, 3))
        msgs["expert"] = str(info.value)
        with pytest.raises(TypeError) as info:
            MoE.from_dense(moe, pg)
        msgs["from_dense"] = str(info.value)
        whole = MoE(nn.Linear(3, 3, bias=False), _experts(3), None)
        with pytest.raises(ValueError) as info:
            MoE.from_dense(whole, pg)
        msgs["from_dense_divisible"] = str(info.value)
        return msgs

    for rank, msgs in enumerate(run_threads(body, 2, timeout=30)):
        where = f"[rank {rank}/2] MoE"
        assert all(m.startswith(where) for m in msgs.values())
        assert "argument `router` must be an nn.Linear(dim, E, bias=False), got " \
               "nn.Linear(3, 4, bias=True)" in msgs["bias"]
        assert "got Conv1d" in msgs["router"]
        assert "E=5 experts are not divisible by the group size P=2" in msgs["divisible"]
        assert "holds 3 experts, expected E/P = 4/2 = 2" in msgs["count"]
        assert "argument `experts` must hold nn.Modules; item 1 is int" in msgs["module"]
        assert "argument `experts` must be a list of nn.Module, got Sequential" \
            in msgs["sequential"]
        assert "argument `top_k` must be an int in [1, 4], got 5" in msgs["top_k"]
        assert "got True" in msgs["top_k_bool"]
        assert "argument `capacity_factor` must be None or a positive finite number, got 0" \
            in msgs["capacity"]
        assert "got inf" in msgs["capacity_inf"]
        assert "the ranks' layers differ" in msgs["differ"] and "(3, 4, 1, None) on rank 0" \
            in msgs["differ"] and "(3, 4, 2, None) on rank 1" in msgs["differ"]
        assert "MoE.forward: argument `x` must be a tensor of shape (tokens, 3), got (2, 4)" \
            in msgs["forward"]
        assert f"expert {2 * rank} (local 0) must map" in msgs["expert"] and "got (" \
            in msgs["expert"]
        assert f"[rank {rank}/2] MoE.from_dense: argument `moe` must be a one-process MoE " \
               "(group=None), got an MoE over 2 ranks" == msgs["from_dense"]
        assert f"[rank {rank}/2] MoE.from_dense: the layer's E=3 experts are not divisible" \
            in msgs["from_dense_divisible"]
    with pytest.raises(TypeError, match="MoE: argument `group` must be a collectives"):
        MoE(nn.Linear(3, 2, bias=False), _experts(2), object())
