"""examples/mesh.py with an ``ep`` dimension: experts sharded over ep, the rest replicated
and averaged over the dp x ep ranks by DDP or FSDP, in every combination with tp and pp.
Trained on the thread world, the mean of the replicas' step losses follows the one-process
model (all experts in one place, the batch of all dp x ep replicas), and on every rank the
communication account's measured bytes equal the predicted ones, ep included.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.testing.threads import run_threads
from job_env import job_env

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
REL_TOL = 1e-5       # float32 sums in another order, as tests/test_mesh_3d.py
MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")


def _args(dp=1, ep=1, pp=1, tp=1, *extra: str):
    from examples.mesh import mesh_args
    return mesh_args(["--hidden", "16", "--heads", "2", "--ffn", "32", "--layers", "2",
                      "--batch-size", "8", "--epochs", "1", "--max-steps", str(STEPS),
                      "--experts", "4", "--dp", str(dp), "--ep", str(ep), "--pp", str(pp),
                      "--tp", str(tp), *extra])


def _train(args) -> list:
    import torch
    from examples.mesh import dense_model, train_on_mesh
    dense = dense_model(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def body(pg):
            run = train_on_mesh(pg, args, dense)
            out = {k: run[k] for k in ("step_losses", "coordinate", "predicted")}
            out["measured"] = {n: m["bytes"] for n, m in run["measured"].items()}
            run["mesh"].close()
            return out
        return run_threads(body, args.nproc, timeout=120)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _single(replicas: int) -> tuple:
    return tuple(_train(_args(1, 1, 1, 1, "--batch-size", str(8 * replicas)))[0]["step_losses"])


@pytest.mark.parametrize("dp, ep, pp, tp, extra", [
    (1, 2, 1, 1, ()), (2, 2, 1, 1, ("--fsdp",)), (1, 2, 1, 2, ()), (1, 2, 2, 1, ()),
    (1, 2, 2, 1, ("--fsdp", "--schedule", "gpipe")), (1, 4, 1, 1, ())],
    ids=lambda v: str(v) if not isinstance(v, tuple) else "-".join(v) or "ddp")
def test_follows_the_one_process_model_and_the_account_holds(dp, ep, pp, tp, extra):
    runs = _train(_args(dp, ep, pp, tp, *extra))
    single = _single(dp * ep)
    by_replica: dict = {}
    for run in runs:
        c = run["coordinate"]
        assert run["measured"] == run["predicted"], (c, run)
        assert run["measured"]["ep"] > 0 and (run["measured"]["dp"] > 0)
        if c["pp"] != pp - 1:
            assert run["step_losses"] == []
            continue
        first = by_replica.setdefault((c["dp"], c["ep"]), run["step_losses"])
        assert run["step_losses"] == first, ("tp ranks differ", c)
    assert len(by_replica) == dp * ep
    mean = [sum(r[i] for r in by_replica.values()) / len(by_replica) for i in range(STEPS)]
    for step, (ours, theirs) in enumerate(zip(mean, single)):
        assert abs(ours - theirs) <= REL_TOL * abs(theirs), (step, mean, single)
    assert single[-1] < single[0]
    # the replicas trained on different batches: their losses differ
    assert len({tuple(r) for r in by_replica.values()}) == dp * ep


def test_refusals(capsys):
    from examples.mesh import mesh_args
    for argv, message in ((["--ep", "2", "--experts", "3"], "--experts 3 must be a positive "
                           "multiple of --ep 2"),
                          (["--ep", "2", "--nproc", "2"], "dp*ep*tp*pp = 4"),
                          (["--experts", "2", "--top-k", "3"], "--top-k 3 must be between")):
        with pytest.raises(SystemExit) as info:
            mesh_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err
    args = mesh_args(["--ep", "2", "--tp", "1"])
    assert args.experts == 4 and args.nproc == 2
    assert mesh_args([]).experts == 0


def _example(command: list) -> dict:
    proc = subprocess.run(command, cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    account = json.loads(next(l for l in lines if l.startswith("account "))[len("account "):])
    assert account["every_rank_agrees"] is True, proc.stdout
    assert account["measured"]["ep"]["bytes"] > 0
    return json.loads(lines[-1])


@pytest.mark.slow
def test_example_with_experts_on_shm():
    summary = _example([sys.executable, "examples/mesh.py", "--dp", "2", "--ep", "2", "--tp",
                        "1", "--epochs", "1", "--max-steps", "10"])
    assert summary["world_size"] == 4 and summary["example"] == "mesh"


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_example_with_experts_under_mpiexec():
    summary = _example([MPIEXEC, "-n", "4", sys.executable, "examples/mesh.py", "--ep", "2",
                        "--tp", "2", "--epochs", "1", "--max-steps", "10"])
    assert summary["backend"] == "mpi" and summary["world_size"] == 4
