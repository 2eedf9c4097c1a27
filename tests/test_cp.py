"""parallel.cp: ring attention and all-gather attention equal dense attention on the
unsharded tensors, forward and backward; what they keep for backward is 1/C of dense
attention's; the zigzag layout balances causal work.

The equivalence check is a function of a process group and a case (sizes, seed, layout,
algorithm, causal, dtype; drawn by hypothesis in the driver). Every rank builds the full
q, k, v and output gradient from the seed with its own ``torch.Generator`` (never the
global random state, which the threads of one process share), shards them with
``shard_sequence``, runs the context-parallel attention and its backward, gathers the
output and dq, dk, dv with ``unshard_sequence`` and compares with
``F.scaled_dot_product_attention`` on the full tensors in float64. It runs in the thread
world (world sizes 1 to 4) and as one job per backend in real processes:
``collectives.spawn`` for shm, zmq and gloo, ``mpiexec`` running this file for mpi.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script under mpiexec
    sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402
from real_jobs import mpi_rank_main, mpiexec_job, spawn_cases, spawn_job  # noqa: E402
from parallel.cp import (all_gather_attention, blocks, ring_attention,  # noqa: E402
                         saved_tensor_bytes, shard_sequence, unshard_sequence, work_of)

ATTENTIONS = {"ring": ring_attention, "all_gather": all_gather_attention}
FLOAT64_TOL = 1e-9
MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------ the check
def _inputs(case: dict) -> tuple:
    """Full q, k, v and the output's gradient, float64, the same on every rank."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["batch"], case["heads"], case["length"], case["head_dim"])
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))


def _dense(q, k, v, dout, causal: bool) -> tuple:
    """Dense attention's output and dq, dk, dv on the full tensors, in their dtype."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def _context_parallel(pg, case: dict, q, k, v, dout) -> tuple:
    """The context-parallel output and dq, dk, dv, gathered to full tensors."""
    layout, dtype = case["layout"], DTYPES[case.get("dtype", "float64")]
    shard = lambda t: shard_sequence(t.to(dtype), pg, 2, layout)  # noqa: E731
    q_r, k_r, v_r = (shard(t).requires_grad_(True) for t in (q, k, v))
    out_r = ATTENTIONS[case["algorithm"]](q_r, k_r, v_r, pg, causal=case["causal"],
                                          layout=layout)
    out_r.backward(shard(dout))
    with torch.no_grad():
        return tuple(unshard_sequence(t, pg, 2, layout)
                     for t in (out_r, q_r.grad, k_r.grad, v_r.grad))


def check_equivalence(pg, case: dict) -> dict:
    """Max |context parallel - dense float64| of the output and dq, dk, dv; for a low
    precision dtype also dense attention's own error in that dtype."""
    q, k, v, dout = _inputs(case)
    truth = _dense(q, k, v, dout, case["causal"])
    ours = _context_parallel(pg, case, q, k, v, dout)
    names = ("out", "dq", "dk", "dv")
    errs = {n: (a.double() - b).abs().max().item() if a.numel() else 0.0
            for n, a, b in zip(names, ours, truth)}
    result = {"errs": errs}
    dtype = DTYPES[case.get("dtype", "float64")]
    if dtype != torch.float64:
        low = _dense(*(t.to(dtype) for t in (q, k, v, dout)), case["causal"])
        result["dense_errs"] = {n: (a.double() - b).abs().max().item()
                                for n, a, b in zip(names, low, truth)}
    return result


def _assert_exact(results: list, where: str) -> None:
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v <= FLOAT64_TOL}
        assert not bad, f"{where} rank {rank}: beyond {FLOAT64_TOL}: {bad}"


def _threads(fn, n: int) -> list:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_threads(fn, n, timeout=60)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ thread world
from hypothesis import given, settings, strategies as st  # noqa: E402

PROPERTY = settings(max_examples=int(os.environ.get("CP_EXAMPLES", "30")), deadline=None)


@PROPERTY
@given(n=st.integers(1, 4), seed=st.integers(0, 2**31), batch=st.integers(1, 2),
       heads=st.integers(1, 3), chunk=st.integers(1, 3), head_dim=st.integers(1, 6),
       causal=st.booleans(), layout=st.sampled_from(["contiguous", "zigzag"]),
       algorithm=st.sampled_from(sorted(ATTENTIONS)))
def test_equals_dense_attention_in_float64(n, seed, batch, heads, chunk, head_dim, causal,
                                           layout, algorithm):
    """Output and dq, dk, dv within 1e-9 of dense float64 attention, C = 1..4."""
    case = dict(seed=seed, batch=batch, heads=heads, length=2 * n * chunk,
                head_dim=head_dim, causal=causal, layout=layout, algorithm=algorithm)
    _assert_exact(_threads(lambda pg: check_equivalence(pg, case), n), str(case))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("algorithm", sorted(ATTENTIONS))
def test_bfloat16_within_dense_bfloat16_error(n, algorithm):
    """bfloat16 inputs: no worse than twice dense bfloat16 attention's own error of the
    float64 truth (our merge and backward accumulate in float32)."""
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        case = dict(seed=7 + n, batch=2, heads=2, length=64 * n, head_dim=16, causal=causal,
                    layout=layout, algorithm=algorithm, dtype="bfloat16")
        for rank, res in enumerate(_threads(lambda pg: check_equivalence(pg, case), n)):
            for name, err in res["errs"].items():
                assert err <= 2 * res["dense_errs"][name], (case, rank, name, res)


def test_float32_and_no_grad():
    """float32 inputs to float32 rounding; under ``torch.no_grad`` the same output, no
    graph; batch and heads of 1."""
    def body(pg):
        case = dict(seed=3, batch=1, heads=1, length=48, head_dim=8, causal=True,
                    layout="zigzag", algorithm="ring", dtype="float32")
        errs = check_equivalence(pg, case)["errs"]
        q, k, v, _ = (shard_sequence(t.float(), pg, 2, "zigzag") for t in _inputs(case))
        outs = []
        for fn in ATTENTIONS.values():
            with torch.no_grad():
                plain = fn(q, k, v, pg, causal=True, layout="zigzag")
            graphed = fn(q.requires_grad_(True), k, v, pg, causal=True, layout="zigzag")
            q.requires_grad_(False)
            outs.append((plain.requires_grad, torch.equal(plain, graphed.detach())))
        return errs, outs
    for errs, outs in _threads(body, 3):
        assert max(errs.values()) < 1e-5, errs
        assert outs == [(False, True), (False, True)]


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("algorithm", sorted(ATTENTIONS))
def test_saved_tensors_are_a_cth_of_dense(n, algorithm):
    """Per rank, attention's saved tensors are at most 1/C of the dense run's plus the
    per-row log-sum-exp (float32: 4 bytes per query row)."""
    b, h, length, d = 2, 2, 256, 16
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, length, d, generator=gen).requires_grad_(True) for _ in range(3)]
    dense = saved_tensor_bytes(lambda: F.scaled_dot_product_attention(*full, is_causal=True))

    def body(pg):
        local = [shard_sequence(t.detach(), pg, 2, "zigzag").requires_grad_(True)
                 for t in full]
        return saved_tensor_bytes(lambda: ATTENTIONS[algorithm](*local, pg, causal=True,
                                                          layout="zigzag"))
    stats = b * h * (length // n) * 4
    for rank, ours in enumerate(_threads(body, n)):
        assert ours <= dense / n + stats, (rank, ours, dense, n)


# ------------------------------------------------------------------ balance
def _count_work(pg, layout: str, length: int) -> int:
    """Score entries this rank's causal ring attention really computes (counted in the
    block kernel, per thread)."""
    q, k, v = (torch.randn(1, 1, length // pg.size, 4) for _ in range(3))
    ring_attention(q, k, v, pg, causal=True, layout=layout)
    return _WORK.get(threading.get_ident(), 0)


_WORK: dict = {}


def test_zigzag_balances_causal_work(monkeypatch):
    """Causal, C = 4: under zigzag the busiest rank computes within 10% of the lightest;
    the contiguous layout's last rank computes 4 times its first's. Counted where the
    blocks are computed (fully masked blocks are never passed to the kernel)."""
    original = blocks.attend

    def counting(q, k, v, scale, mask):
        key = threading.get_ident()
        _WORK[key] = _WORK.get(key, 0) + q.shape[-2] * k.shape[-2]
        return original(q, k, v, scale, mask)
    monkeypatch.setattr(blocks, "attend", counting)
    length, n = 64, 4
    ratios = {}
    for layout in ("zigzag", "contiguous"):
        _WORK.clear()
        work = _threads(lambda pg: _count_work(pg, layout, length), n)
        assert work == [work_of(r, n, length // n, layout, True) for r in range(n)]
        ratios[layout] = max(work) / min(work)
    dense_causal = length * length  # every rank skips the blocks above the diagonal
    assert sum(work_of(r, n, length // n, "zigzag", True) for r in range(n)) < dense_causal
    assert ratios["zigzag"] <= 1.10, ratios
    assert ratios["contiguous"] == 4.0, ratios


# ------------------------------------------------------------------ layouts and errors
def test_layouts_and_their_inverse():
    def body(pg):
        x = torch.arange(16.0).reshape(1, 16)
        out = {}
        for layout in ("contiguous", "zigzag"):
            part = shard_sequence(x, pg, 1, layout)
            out[layout] = (part.tolist(), torch.equal(unshard_sequence(part, pg, -1, layout), x))
        return out
    results = _threads(body, 2)
    assert results[0]["contiguous"] == ([[0.0, 1, 2, 3, 4, 5, 6, 7]], True)
    assert results[0]["zigzag"] == ([[0.0, 1, 2, 3, 12, 13, 14, 15]], True)
    assert results[1]["zigzag"] == ([[4.0, 5, 6, 7, 8, 9, 10, 11]], True)


def test_unshard_backward_sums_the_ranks_gradients():
    """Each rank's loss uses the full tensor: the gradient of this rank's part is the sum
    of every rank's gradient there."""
    def body(pg):
        part = torch.full((2, 3), float(pg.rank)).requires_grad_(True)
        full = unshard_sequence(part, pg, 0, "zigzag")
        (full * (pg.rank + 1)).sum().backward()
        return part.grad.tolist()
    assert _threads(body, 2) == [[[3.0] * 3] * 2] * 2


def test_bad_input_is_a_clear_error():
    def body(pg):
        errors = {}
        x = torch.zeros(1, 1, 3, 2)
        for name, call in {
            "length": lambda: shard_sequence(torch.zeros(2, 6), pg, 1, "zigzag"),
            "layout": lambda: ring_attention(x, x, x, pg, layout="diagonal"),
            "odd": lambda: all_gather_attention(x, x, x, pg, layout="zigzag"),
            "shape": lambda: ring_attention(x, x[..., :1], x, pg),
            "type": lambda: ring_attention(x.long(), x, x, pg),
            "dim": lambda: shard_sequence(x, pg, 4),
        }.items():
            try:
                call()
            except (TypeError, ValueError) as exc:
                errors[name] = (type(exc).__name__, str(exc))
        return errors
    errors = _threads(body, 2)[1]
    assert errors["length"][0] == "ValueError"
    for word in ("6", "C=2", "zigzag", "[rank 1/2] shard_sequence"):
        assert word in errors["length"][1], errors["length"]
    assert errors["layout"][0] == "ValueError" and "diagonal" in errors["layout"][1]
    assert errors["odd"][0] == "ValueError" and "all_gather_attention" in errors["odd"][1]
    assert "`q`, `k`, `v`" in errors["shape"][1]
    assert errors["type"][0] == "TypeError" and "`q`" in errors["type"][1]
    assert errors["dim"][0] == "ValueError" and "`dim`" in errors["dim"][1]


# ------------------------------------------------------------------ real processes
def job_cases(n: int) -> list:
    """Both algorithms, both layouts, causal and not, two shapes."""
    return [dict(seed=11 + i, batch=1 + i % 2, heads=2 - i % 2, length=2 * n * (1 + i % 3),
                 head_dim=3 + i % 4, causal=causal, layout=layout, algorithm=algorithm)
            for i, (algorithm, layout, causal) in enumerate(
                (a, lay, c) for a in sorted(ATTENTIONS) for lay in ("contiguous", "zigzag")
                for c in (False, True))]


def _job_on(pg) -> list:
    return [check_equivalence(pg, case) for case in job_cases(pg.size)]


def _spawned_job() -> list:
    torch.set_num_threads(1)
    pg = collectives.init_process_group()
    try:
        out = _job_on(pg)
        pg.barrier()
        return out
    finally:
        pg.close()


def _assert_job(results: list, where: str) -> None:
    for i, case in enumerate(job_cases(len(results))):
        _assert_exact([r[i] for r in results], f"{where} {case}")


@pytest.mark.parametrize("backend, nproc", spawn_cases(others_slow=True))
def test_spawned(backend, nproc):
    """The job's cases in real processes, one job per backend (zmq and gloo under
    ``-m slow``: each starts its ranks in seconds)."""
    _assert_job(spawn_job(_spawned_job, backend, nproc), backend)


needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (pip install mpi4py mpich)")


@needs_mpi
def test_under_mpiexec(tmp_path):
    """The job's cases on the mpi backend: this file run by ``mpiexec -n 3``."""
    _assert_job(mpiexec_job(MPIEXEC, __file__, 3, tmp_path), "mpi")


if __name__ == "__main__":  # one rank of test_under_mpiexec's job: python test_cp.py DIR
    mpi_rank_main(_job_on)
