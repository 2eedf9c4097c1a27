"""3D parallelism (examples/mesh.py): data x pipeline x tensor parallel training of one small
transformer follows the single-process model step by step, the communication account's
measured bytes equal the predicted ones on every rank, and the example keeps its contract.

The reference is the same model in one process, from the same initial weights, with the
batch of all dp replicas together: the dp shards of ``ShardSampler`` interleave, so one
process with batch dp*b sees the same samples per step. Its step losses are compared with
the mean over the dp replicas of the last pipeline stage's step losses, for 20 steps.
The semantics run in the thread world for every shape; real processes run one 8-rank job
(2x2x2 over the world, the 4-rank shapes over its halves) on shm and under mpiexec.
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script under mpiexec
    sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402
from job_env import job_env  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402

MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (pip install mpi4py mpich)")

STEPS = 20
#: (dp, pp, tp): the 8-rank cube and the 4-rank shapes with one dimension of 1.
SHAPES = [(2, 2, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1)]
#: What each half of the 8-rank job runs, as (shape, strategy flags).
HALVES = [[((1, 2, 2), []), ((2, 2, 1), ["--fsdp"])],
          [((2, 1, 2), ["--fsdp"]), ((2, 2, 1), [])]]
REL_TOL = 1e-5   # float32: the sums run in another order (observed: about 2e-7)


def _args(shape=(1, 1, 1), *extra: str):
    from examples.mesh import mesh_args
    dp, pp, tp = shape
    return mesh_args(["--hidden", "16", "--heads", "2", "--ffn", "32", "--layers", "2",
                      "--batch-size", "8", "--epochs", "1", "--max-steps", str(STEPS),
                      "--dp", str(dp), "--pp", str(pp), "--tp", str(tp), *extra])


def _keep(run: dict) -> dict:
    out = {k: run[k] for k in ("step_losses", "coordinate", "predicted", "steps")}
    out["measured"] = {name: m["bytes"] for name, m in run["measured"].items()}
    return out


def _train_threads(args) -> list:
    import torch
    from examples.mesh import dense_model, train_on_mesh
    dense = dense_model(args)          # once: the threads share torch's global random state
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_threads(lambda pg: _keep(train_on_mesh(pg, args, dense)), args.nproc,
                           timeout=120)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _single(dp: int) -> tuple:
    """The one-process step losses with the batch of ``dp`` replicas."""
    args = _args((1, 1, 1), "--batch-size", str(8 * dp))
    return tuple(_train_threads(args)[0]["step_losses"])


def _assert_follows(runs: list, shape: tuple, label: str) -> None:
    """The last stage's losses, averaged over dp, are the one process's; the tp ranks of
    one replica agree exactly; no other rank reports losses."""
    dp, pp, _ = shape
    single = _single(dp)
    by_replica: dict = {}
    for run in runs:
        c = run["coordinate"]
        if c["pp"] != pp - 1:
            assert run["step_losses"] == [], (label, c)
            continue
        assert len(run["step_losses"]) == STEPS, (label, c)
        first = by_replica.setdefault(c["dp"], run["step_losses"])
        assert run["step_losses"] == first, (label, "tp ranks differ", c)
    assert sorted(by_replica) == list(range(dp)), label
    mean = [sum(losses[i] for losses in by_replica.values()) / dp for i in range(STEPS)]
    for step, (ours, theirs) in enumerate(zip(mean, single)):
        assert abs(ours - theirs) <= REL_TOL * abs(theirs), (label, step, mean, single)
    assert single[-1] < single[0]     # it learns: the comparison is not of constants


def _assert_account(runs: list, shape: tuple, label: str) -> None:
    dp, pp, tp = shape
    for run in runs:
        assert run["measured"] == run["predicted"], (label, run["coordinate"], run)
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for name, size in sizes.items():
            assert (run["measured"][name] > 0) == (size > 1), (label, name, run)


# ------------------------------------------------------------------ thread world
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_follows_the_single_process_model_and_the_account_holds(shape, fsdp):
    """20 steps of 1F1B (4 micro-batches) on the (dp, pp, tp) mesh: the one process's step
    losses, and on every rank the measured bytes per dimension equal the predicted."""
    extra = ["--fsdp"] if fsdp else []
    runs = _train_threads(_args(shape, *extra))
    label = f"{shape} {'fsdp' if fsdp else 'ddp'}"
    _assert_follows(runs, shape, label)
    _assert_account(runs, shape, label)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_gpipe_schedule_follows_too(fsdp):
    """GPipe runs every forward before the backwards: FSDP's root unit must be gathered
    again for the later micro-batches' backward (it is freed when a pass completes its
    gradient), and the account still holds."""
    runs = _train_threads(_args((2, 2, 2), "--schedule", "gpipe", *(["--fsdp"] if fsdp
                                                                     else [])))
    _assert_follows(runs, (2, 2, 2), f"gpipe fsdp={fsdp}")
    _assert_account(runs, (2, 2, 2), f"gpipe fsdp={fsdp}")


def test_stage_layout_and_refusals(capsys):
    from examples.common.mesh_model import stage_pieces
    from examples.mesh import mesh_args
    # pieces: 0 the embedding, 1..L the blocks, L+1 the head
    assert [list(stage_pieces(2, 2, s)) for s in range(2)] == [[0, 1], [2, 3]]
    assert [list(stage_pieces(5, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert list(stage_pieces(3, 1, 0)) == [0, 1, 2, 3, 4]
    for argv, message in [(["--pp", "3"], "need at least as many blocks"),
                          (["--pp", "2", "--microbatches", "3"], "not a multiple"),
                          (["--nproc", "2"], "dp*tp*pp = 4"),
                          (["--pp", "0"], "at least 1")]:
        with pytest.raises(SystemExit) as exc:
            mesh_args(["--dp", "2", "--tp", "2", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    assert mesh_args(["--dp", "2", "--tp", "2", "--pp", "2"]).nproc == 8
    assert mesh_args(["--dp", "2", "--tp", "2", "--nproc", "4"]).nproc == 4


# ------------------------------------------------------------------ real processes
def _follow_on(pg) -> dict:
    """The job: 2x2x2 with DDP and FSDP over the 8 ranks, then the 4-rank shapes over
    each half (a mesh over a sub-group). Plain data back."""
    import torch
    from examples.mesh import dense_model, train_on_mesh
    torch.set_num_threads(1)
    out = {"world": [], "half": []}
    for extra in ([], ["--fsdp"]):
        args = _args((2, 2, 2), *extra)
        out["world"].append(_keep(train_on_mesh(pg, args, dense_model(args))))
    which = 0 if pg.rank < 4 else 1
    half = pg.new_group(list(range(4)) if which == 0 else list(range(4, 8)))
    for shape, extra in HALVES[which]:
        args = _args(shape, *extra)
        out["half"].append(_keep(train_on_mesh(half, args, dense_model(args))))
    half.close()
    return out


def _follow_job() -> dict:
    pg = collectives.init_process_group()
    try:
        return {"backend": pg.backend, "result": _follow_on(pg)}
    finally:
        pg.close()


def _assert_job(reports: list, backend: str) -> None:
    assert len(reports) == 8 and {r["backend"] for r in reports} == {backend}
    for i, label in enumerate(("ddp", "fsdp")):
        runs = [r["result"]["world"][i] for r in reports]
        _assert_follows(runs, (2, 2, 2), f"{backend} 2x2x2 {label}")
        _assert_account(runs, (2, 2, 2), f"{backend} 2x2x2 {label}")
    for which, cases in enumerate(HALVES):
        for i, (shape, extra) in enumerate(cases):
            runs = [r["result"]["half"][i] for r in reports[4 * which:4 * which + 4]]
            label = f"{backend} {shape} {extra}"
            _assert_follows(runs, shape, label)
            _assert_account(runs, shape, label)


def test_real_processes_on_shm():
    reports = collectives.spawn(_follow_job, 8, backend="shm", timeout=60, join_timeout=300)
    _assert_job(reports, "shm")


def _env() -> dict:
    return job_env()


@pytest.mark.slow
@needs_mpi
def test_real_processes_under_mpiexec(tmp_path):
    proc = subprocess.run([MPIEXEC, "-n", "8", sys.executable, __file__, str(tmp_path)],
                          cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_job([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(8)],
                "mpi")


# ------------------------------------------------------------------ examples/mesh.py
def _run_example(argv: list, timeout: float, launcher: tuple = ()) -> dict:
    """Run the example; check the contract's summary line and the account; the summary."""
    cmd = [*launcher, sys.executable, "examples/mesh.py", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert list(summary) == ["example", "backend", "world_size", "epochs", "wall_s", "total_s",
                             "samples_per_s", "final_loss", "final_acc"]
    account = json.loads(next(l for l in lines if l.startswith("account "))[len("account "):])
    assert account["every_rank_agrees"] is True, proc.stdout
    for name in ("dp", "pp", "tp"):
        assert account["measured"][name]["bytes"] == account["predicted"][name], account
    assert "measured == predicted on every rank" in proc.stdout
    return summary


def test_example_quick_run_with_trace(tmp_path):
    """A few steps of ``--dp 2 --tp 2 --pp 2 --fsdp`` on 8 shm ranks: the summary line, the
    account, and a trace whose operations name their dimension: the TP all_reduces, the
    pipeline's sends and receives, FSDP's gathers, and each micro-batch's F and B."""
    trace = tmp_path / "mesh.json"
    summary = _run_example(["--dp", "2", "--tp", "2", "--pp", "2", "--fsdp", "--epochs", "1",
                            "--max-steps", "4", "--trace", str(trace)], timeout=200)
    assert summary["example"] == "mesh" and summary["world_size"] == 8
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in range(8):
        names = {e["name"] for e in events if e["pid"] == rank}
        stage = (rank // 2) % 2
        assert {"pipeline", "tp all_reduce", "dp all_gather", "dp reduce_scatter",
                "pp isend", "pp irecv", f"{stage}F0", f"{stage}B3"} <= names, (rank, names)
    dims = {e["args"].get("dim") for e in events if e.get("cat") == "comm" and e["ph"] == "b"}
    assert dims == {"dp", "pp", "tp"}
    pytest.importorskip("matplotlib")
    from examples.plot_trace import main as plot
    plot([str(trace), str(tmp_path / "mesh.png"), "--step", "1", "--steps", "1"])
    assert (tmp_path / "mesh.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@needs_mpi
def test_example_under_mpiexec():
    summary = _run_example(["--dp", "2", "--tp", "2", "--pp", "2", "--epochs", "1",
                            "--max-steps", "10"], timeout=300, launcher=(MPIEXEC, "-n", "8"))
    assert summary["backend"] == "mpi" and summary["world_size"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--dp", "2", "--tp", "2", "--pp", "2"],
                                  ["--dp", "2", "--tp", "2", "--pp", "2", "--fsdp"],
                                  ["--dp", "2", "--tp", "2"],
                                  ["--dp", "2", "--tp", "2", "--fsdp"]],
                         ids=["3d-ddp", "3d-fsdp", "2d-ddp", "2d-fsdp"])
def test_example_reaches_85_percent(argv):
    """The whole default run (10 epochs): 2x2x2 on 8 shm ranks took about 3 minutes here."""
    summary = _run_example(argv, timeout=600)
    assert summary["final_acc"] >= 0.85, summary


if __name__ == "__main__":  # one rank of the mpiexec job: python test_mesh_3d.py DIR
    _pg = collectives.init_process_group()
    try:
        _report = {"backend": _pg.backend, "result": _follow_on(_pg)}
        Path(sys.argv[1], f"rank{_pg.rank}.json").write_text(json.dumps(_report))
        _pg.barrier()
    finally:
        _pg.close()
