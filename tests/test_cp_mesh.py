"""Context parallelism in a model: ``ContextParallelAttention`` inside
``parallel.tp.ParallelTransformerBlock`` (heads over tp, sequence over cp) equals the
dense block; ``examples/mesh.py --cp`` follows the one-process loss curve with its
communication account holding; ``examples/cp.py`` keeps the examples' contract, learns,
and its trace shows each ring step's transfer overlapping that step's computation.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from job_env import job_env  # noqa: E402
from examples.common.cli import SUMMARY_KEYS  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402
from parallel import DeviceMesh  # noqa: E402
from parallel.cp import ContextParallelAttention, shard_sequence, unshard_sequence  # noqa: E402
from parallel.tp import ParallelTransformerBlock, TransformerBlock  # noqa: E402

MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (pip install mpi4py mpich)")


def _threads(fn, n: int, timeout: float = 60) -> list:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_threads(fn, n, timeout=timeout)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ the block
def _block_case(pg, cp: int, tp: int, algorithm: str, layout: str, causal: bool) -> dict:
    """A float64 block over a (cp, tp) mesh against the dense block: the output and the
    input's gradient (gathered over cp), the parameters' gradients summed over cp."""
    gen = torch.Generator().manual_seed(5)
    dense = TransformerBlock(8, 4, 12, causal=causal).double()
    with torch.no_grad():     # from the generator: the threads share the global state;
        for p in dense.parameters():  # float32 values (from_dense makes float32 layers)
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
    x = torch.randn(2, 8 * cp, 8, generator=gen, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    mesh = DeviceMesh(pg, (cp, tp), ("cp", "tp"))
    attention = ContextParallelAttention(mesh["cp"], algorithm=algorithm, layout=layout)
    block = ParallelTransformerBlock.from_dense(dense, mesh["tp"], attention=attention).double()
    x_r = shard_sequence(x, mesh["cp"], 1, layout).requires_grad_(True)
    y_r = block(x_r)
    (y_r * shard_sequence(upstream, mesh["cp"], 1, layout)).sum().backward()
    x_d = x.clone().requires_grad_(True)
    y_d = dense(x_d)
    (y_d * upstream).sum().backward()
    with torch.no_grad():
        y = unshard_sequence(y_r, mesh["cp"], 1, layout)
        dx = unshard_sequence(x_r.grad, mesh["cp"], 1, layout)
        errs = {"y": (y - y_d).abs().max().item(), "dx": (dx - x_d.grad).abs().max().item()}
        for name, rows in (("ln1", None), ("q", 0), ("fc1", 0)):
            grad = getattr(block, name).weight.grad.clone()
            mesh["cp"].all_reduce(grad)
            theirs = getattr(dense, name).weight.grad
            if rows is not None:
                theirs = theirs.chunk(tp, 0)[mesh.local_rank("tp")]
            errs[name] = (grad - theirs).abs().max().item()
    mesh.close()
    return errs


@pytest.mark.parametrize("cp, tp", [(2, 2), (4, 1), (3, 1)])
@pytest.mark.parametrize("algorithm", ["ring", "all_gather"])
def test_block_with_context_parallel_attention_equals_dense(cp, tp, algorithm):
    for layout, causal in (("zigzag", True), ("contiguous", False), ("contiguous", True)):
        results = _threads(lambda pg: _block_case(pg, cp, tp, algorithm, layout, causal),
                           cp * tp)
        for rank, errs in enumerate(results):
            assert max(errs.values()) < 1e-12, (cp, tp, algorithm, layout, causal, rank, errs)


# ------------------------------------------------------------------ the mesh example
STEPS = 20
REL_TOL = 1e-5   # float32, the sums in another order


def _mesh_args(dp=1, pp=1, cp=1, tp=1, *extra: str):
    from examples.mesh import mesh_args
    return mesh_args(["--hidden", "16", "--heads", "2", "--ffn", "32", "--layers", "2",
                      "--batch-size", "8", "--epochs", "1", "--max-steps", str(STEPS),
                      "--dp", str(dp), "--pp", str(pp), "--cp", str(cp), "--tp", str(tp),
                      *extra])


def _train(args) -> list:
    from examples.mesh import dense_model, train_on_mesh
    dense = dense_model(args)

    def body(pg):
        run = train_on_mesh(pg, args, dense)
        run["mesh"].close()
        return {"step_losses": run["step_losses"], "coordinate": run["coordinate"],
                "measured": {n: m["bytes"] for n, m in run["measured"].items()},
                "predicted": run["predicted"]}
    return _threads(body, args.nproc, timeout=120)


@functools.lru_cache(maxsize=None)
def _single(dp: int) -> tuple:
    return tuple(_train(_mesh_args(1, 1, 1, 1, "--batch-size", str(8 * dp)))[0]["step_losses"])


@pytest.mark.parametrize("dp, pp, cp, tp, extra", [
    (2, 1, 2, 2, []),
    (1, 2, 2, 1, ["--layout", "zigzag", "--cp-algorithm", "all_gather"]),
    (2, 1, 2, 1, ["--fsdp", "--layout", "zigzag"]),
], ids=["dp2-cp2-tp2", "pp2-cp2-allgather-zigzag", "dp2-cp2-fsdp"])
def test_mesh_with_cp_follows_the_one_process_model(dp, pp, cp, tp, extra):
    """20 steps: the mean over dp of the last stage's step losses is the one process's
    (batch dp x 8) to float32 tolerance; the cp and tp ranks of a replica agree exactly;
    on every rank the measured bytes per dimension equal the predicted."""
    runs = _train(_mesh_args(dp, pp, cp, tp, *extra))
    single = _single(dp)
    by_replica: dict = {}
    for run in runs:
        c = run["coordinate"]
        assert run["measured"] == run["predicted"], (c, run)
        assert (run["measured"]["cp"] > 0) == (cp > 1), run
        if c["pp"] != pp - 1:
            continue
        first = by_replica.setdefault(c["dp"], run["step_losses"])
        assert run["step_losses"] == first, ("cp/tp ranks differ", c)
    mean = [sum(r[i] for r in by_replica.values()) / dp for i in range(STEPS)]
    for step, (ours, theirs) in enumerate(zip(mean, single)):
        assert abs(ours - theirs) <= REL_TOL * abs(theirs), (step, mean, single)
    assert single[-1] < single[0]


def test_mesh_refuses_rows_the_layout_cannot_cut(capsys):
    from examples.mesh import mesh_args
    with pytest.raises(SystemExit) as exc:
        mesh_args(["--cp", "4", "--layout", "zigzag", "--tp", "1"])
    assert exc.value.code == 2 and "28 rows into 8 chunks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mesh_args(["--dp", "2", "--cp", "2", "--tp", "2", "--nproc", "4"])
    assert "dp*cp*tp*pp = 8" in capsys.readouterr().err
    assert mesh_args(["--dp", "2", "--cp", "2", "--tp", "2"]).nproc == 8


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", "mpiexec"])
def test_mesh_example_with_cp_in_real_processes(launcher):
    """``examples/mesh.py --dp 2 --cp 2 --tp 2`` for 10 steps on 8 processes (shm, and
    under mpiexec): the summary line, and measured == predicted bytes on every rank."""
    if launcher == "mpiexec" and (MPIEXEC is None or importlib.util.find_spec("mpi4py") is None):
        pytest.skip("needs mpiexec and mpi4py")
    prefix = [MPIEXEC, "-n", "8"] if launcher == "mpiexec" else []
    proc = subprocess.run([*prefix, sys.executable, "examples/mesh.py", "--dp", "2", "--cp",
                           "2", "--tp", "2", "--epochs", "1", "--max-steps", "10"], cwd=ROOT,
                          env=job_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-1])["world_size"] == 8
    account = json.loads(next(l for l in lines if l.startswith("account "))[len("account "):])
    assert account["every_rank_agrees"] is True and account["measured"]["cp"]["bytes"] > 0


# ------------------------------------------------------------------ examples/cp.py
def _example(argv: list, timeout: float, launcher: tuple = ()) -> dict:
    proc = subprocess.run([*launcher, sys.executable, "examples/cp.py", *argv], cwd=ROOT,
                          env=job_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(summary) == list(SUMMARY_KEYS)
    assert summary["example"] == "cp"
    return summary


def ring_overlaps(events: list) -> dict:
    """For each rank: (ring steps with a transfer, how many of them overlap their
    transfer). A forward ring step i < C-1 posts its isend/irecv of the next block before
    it starts computing and waits for them after: the transfer's slice (post to wait)
    contains the computation's."""
    begins = {(e["pid"], e["id"]): e for e in events
              if e.get("cat") == "comm" and e["ph"] == "b"}
    transfers = {}
    for e in events:
        if e.get("cat") == "comm" and e["ph"] == "e" and (e["pid"], e["id"]) in begins:
            b = begins[(e["pid"], e["id"])]
            if b["name"] in ("cp isend", "cp irecv"):
                transfers.setdefault(e["pid"], []).append((b["ts"], e["ts"]))
    out = {}
    for rank in sorted({e["pid"] for e in events if e.get("cat") == "cp"}):
        steps = [e for e in events if e["pid"] == rank and e.get("cat") == "cp"
                 and e["name"].startswith("ring forward step")]
        last = max(int(e["name"].rsplit(" ", 1)[1]) for e in steps)
        moving = [e for e in steps if int(e["name"].rsplit(" ", 1)[1]) < last]
        covered = sum(1 for e in moving
                      if sum(1 for t0, t1 in transfers.get(rank, [])
                             if t0 <= e["ts"] and t1 >= e["ts"] + e["dur"]) >= 2)
        out[rank] = (len(moving), covered)
    return out


def test_example_quick_run_with_trace(tmp_path):
    """30 steps at C = 2 on shm with --trace: the summary line, and every forward ring
    step that moves a block computes inside its isend's and irecv's slices; the picture
    draws."""
    trace = tmp_path / "cp.json"
    summary = _example(["--nproc", "2", "--epochs", "1", "--max-steps", "30", "--trace",
                        str(trace)], timeout=300)
    assert summary["world_size"] == 2 and summary["backend"] == "shm"
    events = json.loads(trace.read_text())["traceEvents"]
    overlaps = ring_overlaps(events)
    assert sorted(overlaps) == [0, 1]
    for rank, (moving, covered) in overlaps.items():
        assert moving > 0 and covered == moving, (rank, moving, covered)
    pytest.importorskip("matplotlib")
    from examples.plot_trace import main as plot
    plot([str(trace), str(tmp_path / "cp.png"), "--step", "20", "--steps", "1"])
    assert (tmp_path / "cp.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--nproc", "2"], ["--nproc", "4"],
                                  ["--nproc", "4", "--layout", "zigzag", "--causal"],
                                  ["--nproc", "2", "--cp-algorithm", "all_gather"]],
                         ids=["2", "4", "4-zigzag-causal", "2-all-gather"])
def test_example_reaches_85_percent_within_5_minutes(argv):
    summary = _example(argv, timeout=600)
    assert summary["final_acc"] >= 0.85 and summary["wall_s"] < 300, summary


@pytest.mark.slow
@needs_mpi
def test_example_under_mpiexec():
    summary = _example(["--epochs", "1", "--max-steps", "30"], timeout=600,
                       launcher=(MPIEXEC, "-n", "2"))
    assert summary["backend"] == "mpi" and summary["world_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_example_on_other_backends(backend):
    summary = _example(["--epochs", "1", "--max-steps", "30", "--backend", backend],
                       timeout=600)
    assert summary["backend"] == backend
