"""parallel.ep: the expert-parallel MoE layer equals a one-process MoE that holds all E
experts with the same weights, in float64, to 1e-9.

Per rank r: its outputs and the gradient of its inputs; the router's gradient from its own
tokens (the router is replicated, not averaged, here); and on each expert's owner that
expert's gradient summed over every rank's tokens. Also the layer's statistics
(``aux_loss``, ``tokens_per_expert``, ``dropped``). The loss on rank r is
``sum(w_r * y_r) + 0.3 * aux_loss_r`` with random weights ``w_r``, so every output element
and the load-balancing loss carry a gradient.

The reference (:func:`reference_moe`) is written independently of ``parallel.ep``: a loop
over tokens, their experts ranked by sorting ``(-logit, expert)``, the capacity applied per
expert by sorting ``(-gate, token)``, each chosen expert run on its token alone. The
reference sees each rank's tokens in a separate call, since the capacity counts the
tokens of one source rank.

The checks are functions of a process group and a case (sizes and a seed; every rank
builds the same router, experts and inputs from the seed with its own generator). They
run in the in-process thread world (P = 1, 2, 4, drawn by hypothesis), and as one job per
transport in real processes: ``collectives.spawn`` for shm, zmq and gloo, ``mpiexec``
running this file for mpi. Results are plain floats, so they travel back as JSON.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script under mpiexec
    sys.path.insert(0, str(ROOT))
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import collectives  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402
from job_env import job_env  # noqa: E402
from parallel.ep import MoE  # noqa: E402

TOL = 1e-9
AUX_WEIGHT = 0.3
MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
DT = torch.float64


# ------------------------------------------------------------------ the reference
def reference_moe(router: nn.Linear, experts: list, x: torch.Tensor, k: int,
                  capacity_factor) -> tuple:
    """One rank's tokens through a one-process MoE holding every expert: ``(y, aux_loss,
    tokens_per_expert, dropped)``."""
    T, E = x.shape[0], router.out_features
    logits = router(x)
    choices = []                                    # (token, expert, gate)
    for t in range(T):
        ranked = sorted(range(E), key=lambda e: (-logits[t, e].item(), e))[:k]
        gates = torch.softmax(logits[t, ranked], dim=0)
        choices += [(t, e, gates[i]) for i, e in enumerate(ranked)]
    kept = choices
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * T * k / E)
        kept = []
        for e in range(E):
            mine = sorted((c for c in choices if c[1] == e), key=lambda c: (-c[2].item(), c[0]))
            kept += mine[:cap]
    rows = [x.new_zeros(router.in_features) for _ in range(T)]
    for t, e, gate in kept:
        rows[t] = rows[t] + gate * experts[e](x[t:t + 1])[0]
    y = torch.stack(rows) if T else x.new_zeros((0, router.in_features)) + 0 * logits.sum()
    counts = torch.zeros(E, dtype=torch.int64)
    for _, e, _ in kept:
        counts[e] += 1
    if T:
        chosen = torch.zeros(E, dtype=DT)
        for _, e, _ in choices:
            chosen[e] += 1
        aux = E * (chosen / (T * k) * torch.softmax(logits, -1).mean(0)).sum()
    else:
        aux = logits.sum() * 0.0
    return y, aux, counts, len(choices) - len(kept)


# ------------------------------------------------------------------ one case
def build(case: dict) -> tuple:
    """The router, all E experts, every rank's tokens and loss weights, from the seed."""
    gen = torch.Generator().manual_seed(case["seed"])
    dim, E, hidden = case["dim"], case["experts"], case["hidden"]
    router = nn.Linear(dim, E, bias=False).to(DT)
    experts = [nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)).to(DT)
               for _ in range(E)]
    with torch.no_grad():
        for p in [router.weight] + [p for e in experts for p in e.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
        if case["ties"]:          # experts 0 and 1 always tie; so do duplicated tokens
            router.weight[1] = router.weight[0]
        if case["silent"] is not None:   # positive tokens never choose this expert
            router.weight[case["silent"]] = -5.0
    xs, ws = [], []
    for T in case["tokens"]:
        x = torch.randn(T, dim, generator=gen, dtype=DT)
        if case["silent"] is not None:
            x = x.abs() + 0.1
        if case["ties"] and T >= 2:
            x[T - 1] = x[0]
        xs.append(x)
        ws.append(torch.randn(T, dim, generator=gen, dtype=DT))
    return router, experts, xs, ws


def _grads(params) -> list:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` relative to ``max(1, |want|)`` (inf on a shape mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()


def check_moe(pg, case: dict) -> dict:
    """This rank's errors against the reference (each must be <= TOL) and whether its
    statistics match."""
    router, experts, xs, ws = build(case)
    P, r, k, c = pg.size, pg.rank, case["top_k"], case["capacity"]
    L = case["experts"] // P
    mine = [copy.deepcopy(e) for e in experts[r * L:(r + 1) * L]]
    moe = MoE(copy.deepcopy(router), mine, pg, top_k=k, capacity_factor=c)
    x = xs[r].clone().requires_grad_()
    y = moe(x)
    ((ws[r] * y).sum() + AUX_WEIGHT * moe.aux_loss).backward()

    # The reference, rank by rank: its outputs and gradients, and the experts' sums.
    ref_router = copy.deepcopy(router)
    expert_grads = [[torch.zeros_like(p) for p in e.parameters()] for e in experts]
    for s in range(P):
        ref_router.zero_grad()
        for e in experts:
            e.zero_grad()
        xr = xs[s].clone().requires_grad_()
        yr, aux, counts, dropped = reference_moe(ref_router, experts, xr, k, c)
        ((ws[s] * yr).sum() + AUX_WEIGHT * aux).backward()
        for e, sums in zip(experts, expert_grads):
            for acc, g in zip(sums, _grads(e.parameters())):
                acc += g
        if s == r:
            want = {"y": yr.detach(), "dx": _grads([xr])[0], "aux": aux.detach(),
                    "router": _grads([ref_router.weight])[0], "counts": counts,
                    "dropped": dropped}
    errs = {"y": _err(y.detach(), want["y"]), "dx": _err(_grads([x])[0], want["dx"]),
            "aux": _err(moe.aux_loss.detach(), want["aux"]),
            "router": _err(_grads([moe.router.weight])[0], want["router"])}
    for j, expert in enumerate(moe.experts):
        for i, g in enumerate(_grads(expert.parameters())):
            errs[f"expert{r * L + j}.p{i}"] = _err(g, expert_grads[r * L + j][i])
    return {"errs": errs,
            "stats": [moe.tokens_per_expert.tolist() == want["counts"].tolist(),
                      moe.dropped == want["dropped"]],
            "moved": [moe.sent_rows, moe.received_rows]}


def _assert_ok(results: list, where: str) -> None:
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
        assert not bad, f"{where} rank {rank}: beyond {TOL}: {bad}"
        assert res["stats"] == [True, True], f"{where} rank {rank}: statistics differ"
    sent = sum(r["moved"][0] for r in results)
    assert sent == sum(r["moved"][1] for r in results), f"{where}: rows lost in transit"


# ------------------------------------------------------------------ the cases
def case_of(seed: int, P: int, per_rank: int, k: int, capacity, tokens: list, *,
            silent=None, ties: bool = False, dim: int = 3, hidden: int = 4) -> dict:
    return dict(seed=seed, experts=per_rank * P, top_k=k, capacity=capacity, tokens=tokens,
                silent=silent, ties=ties, dim=dim, hidden=hidden)


def fixed_cases(P: int) -> list:
    """Every feature at least once for a world of ``P``: E = P..4P, top_k 1 and 2, with
    and without a capacity (one that drops), uneven token counts, a rank with no tokens,
    an expert nobody chooses, ties in logits and gates."""
    last = P - 1
    return [
        case_of(1, P, 1, 1, None, [3 + r for r in range(P)]),
        case_of(2, P, 2, 2, None, [5 if r != last else 0 for r in range(P)], silent=0),
        case_of(3, P, 4, 2, 1.0, [(7 * r + 6) % 9 for r in range(P)]),
        case_of(4, P, 3, 1, 0.5, [8 - r for r in range(P)], ties=True),
        case_of(5, P, 2, 2, 1.25, [0] + [6] * (P - 1), silent=P, ties=True),
        case_of(6, P, 4, 2, 2.0, [r % 3 for r in range(P)], silent=2 * P - 1),
    ]


def sweep_cases(P: int, count: int = 4, seed: int = 0) -> list:
    rng = random.Random(seed * 7919 + P)
    cases = []
    for _ in range(count):
        per_rank = rng.randint(1, 4)
        E = per_rank * P
        k = rng.randint(1, min(2, E))
        cases.append(case_of(
            rng.randrange(2**31), P, per_rank, k,
            rng.choice([None, 0.5, 1.0, 1.5]), [rng.randint(0, 7) for _ in range(P)],
            silent=rng.choice([None, rng.randrange(E)]) if k < E else None,
            ties=rng.random() < 0.3 and E >= 2))
    return cases


def job_cases(P: int) -> list:
    return fixed_cases(P) + sweep_cases(P)


def _job_on(pg) -> list:
    return [check_moe(pg, case) for case in job_cases(pg.size)]


def _assert_job(results: list, where: str) -> None:
    n = len(results)
    for i, case in enumerate(job_cases(n)):
        _assert_ok([r["world"][i] for r in results], f"{where} P={n} {case}")
    if n == 4:
        for i, case in enumerate(job_cases(2)):
            _assert_ok([r["pair"][i] for r in results[:2]], f"{where} pair {case}")


# ------------------------------------------------------------------ in-process worlds
@pytest.mark.parametrize("P", [1, 2, 4])
def test_fixed_cases_on_threads(P):
    for case in fixed_cases(P):
        _assert_ok(run_threads(lambda pg: check_moe(pg, case), P, timeout=30), str(case))


from hypothesis import given, settings, strategies as st  # noqa: E402

PROPERTY = settings(max_examples=int(os.environ.get("EP_EXAMPLES", "30")), deadline=None)


@PROPERTY
@given(P=st.sampled_from([1, 2, 4]), per_rank=st.integers(1, 4), seed=st.integers(0, 2**31),
       k=st.integers(1, 2), capacity=st.sampled_from([None, 0.25, 0.5, 1.0, 1.5, 3.0]),
       tokens=st.lists(st.integers(0, 8), min_size=4, max_size=4), silent=st.booleans(),
       ties=st.booleans(), dim=st.integers(1, 5))
def test_moe_equals_one_process_reference(P, per_rank, seed, k, capacity, tokens, silent,
                                          ties, dim):
    E = per_rank * P
    k = min(k, E)
    case = case_of(seed, P, per_rank, k, capacity, tokens[:P],
                   silent=seed % E if silent and k < E else None,
                   ties=ties and E >= 2, dim=dim)
    _assert_ok(run_threads(lambda pg: check_moe(pg, case), P, timeout=30), str(case))


# ------------------------------------------------------------------ real processes
def _spawned_job() -> dict:
    """The job's cases on the world and, in a world of 4, on the sub-group {0, 1}."""
    torch.set_num_threads(1)
    pg = collectives.init_process_group()
    try:
        out = {"world": _job_on(pg), "pair": None}
        if pg.size == 4 and pg.rank < 2:
            sub = pg.new_group([0, 1])
            try:
                out["pair"] = _job_on(sub)
            finally:
                sub.close()
        pg.barrier()
        return out
    finally:
        pg.close()


def _spawnable_backends() -> list:
    return ["shm"] + [b for b in collectives.available_backends()
                      if b not in ("shm", "mpi", "nccl", "torch")]


@pytest.mark.parametrize("backend, nproc", [("shm", 4)]
                         + [(b, 2) for b in _spawnable_backends()[1:]])
def test_spawned(backend, nproc):
    """The job's cases in real processes, one job per transport (shm at 4 ranks also on
    the sub-group {0, 1})."""
    if backend != "shm":
        try:
            collectives.get_backend(backend)
        except ImportError as exc:
            pytest.skip(f"backend {backend} does not import: {exc}")
    results = collectives.spawn(_spawned_job, nproc, backend=backend, timeout=60,
                                join_timeout=180)
    _assert_job(results, backend)


needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (pip install mpi4py mpich)")


@needs_mpi
def test_under_mpiexec(tmp_path):
    """The job's cases on the mpi backend: this file run by ``mpiexec -n 2``, each rank
    writing its results to a file."""
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, __file__, str(tmp_path)],
                          cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert {d["backend"] for d in reports} == {"mpi"}
    _assert_job([d["result"] for d in reports], "mpi")


if __name__ == "__main__":  # one rank of test_under_mpiexec's job: python test_ep.py DIR
    torch.set_num_threads(1)
    _pg = collectives.init_process_group()
    try:
        _report = {"backend": _pg.backend, "result": {"world": _job_on(_pg), "pair": None}}
        Path(sys.argv[1], f"rank{_pg.rank}.json").write_text(json.dumps(_report))
        _pg.barrier()
    finally:
        _pg.close()
