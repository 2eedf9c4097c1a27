"""``collectives.torch_backend``: our transports under torch's own DDP, FSDP2, pipelining.

The per-rank jobs live in ``tests/scripts/torch_backend_job.py`` (also runnable under
mpiexec and as separate processes); one spawned job per transport runs many checks at
once, since starting ranks that import torch is the expensive part.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import collectives
import collectives.torch_backend as tb
from collectives.spawn import free_port

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "scripts" / "torch_backend_job.py"
FAULTS = JOB.parent / "torch_backend_faults.py"
sys.path.insert(0, str(JOB.parent))

import torch_backend_job as job  # noqa: E402

MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec")
HOOKS = (None, "allreduce")


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "COLLECTIVES_BACKEND", "COLLECTIVES_JOB_ID")}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


# ------------------------------------------------------------------ in this process
def test_registered_on_import_and_options_checked():
    assert tb.BACKEND_NAME == "collectives" and "collectives" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["collectives"] == ["cpu", "cuda"]
    with pytest.raises(TypeError, match="pg_options"):
        tb.transport_of({"transport": "zmq"})
    with pytest.raises(ValueError, match="torch.distributed itself"):
        tb.transport_of(tb.Options("gloo"))
    assert tb.transport_of(tb.Options("zmq")) == "zmq"


def test_the_transport_underneath_is_never_this_backend(monkeypatch):
    """``COLLECTIVES_BACKEND=collectives`` (what ``examples/ddp.py --backend collectives``
    exports to its ranks) means the default transport, never a "collectives" group inside
    one; asked for by name in the options, it is a ValueError saying so. Another
    transport in the variable is used as it is, a torch one refused naming the variable."""
    for value in ("collectives", " collectives", "p2p:collectives", ""):
        monkeypatch.setenv("COLLECTIVES_BACKEND", value)
        assert tb.transport_of(None) == tb.DEFAULT_TRANSPORT == "shm", value
        assert tb.transport_of(tb.Options()) == "shm", value
    monkeypatch.setenv("COLLECTIVES_BACKEND", "zmq")
    assert tb.transport_of(None) == "zmq"
    assert tb.transport_of(tb.Options(transport="p2p:shm")) == "p2p:shm"
    for name in ("collectives", "p2p:collectives"):
        with pytest.raises(ValueError, match=r"init_process_group\(backend='collectives'\): "
                                             r"Options.transport '.*collectives' names this "
                                             r"backend itself"):
            tb.transport_of(tb.Options(transport=name))
    monkeypatch.setenv("COLLECTIVES_BACKEND", "gloo")
    with pytest.raises(ValueError, match="'gloo' \\(from COLLECTIVES_BACKEND\\) is "
                                         "torch.distributed itself"):
        tb.transport_of(None)


def test_world_of_one_through_a_hash_store(monkeypatch):
    """init_process_group with an explicit store; the transport from COLLECTIVES_BACKEND;
    bad arguments are typed errors naming the backend and the op."""
    monkeypatch.setenv("COLLECTIVES_BACKEND", "p2p:shm")
    dist.init_process_group("collectives", rank=0, world_size=1, store=dist.HashStore(),
                            timeout=datetime.timedelta(seconds=20))
    try:
        world = dist.group.WORLD
        assert isinstance(world, tb.ProcessGroupCollectives) and world.transport == "p2p:shm"
        assert dist.get_backend() == "collectives" and world.name() == "collectives"
        t = torch.arange(4.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(ValueError, match=r"collectives backend, rank 0/1\] allreduce: "
                                             r"reduce op BAND"):
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
        with pytest.raises(ValueError, match="one per rank"):
            dist.all_gather([torch.empty(1), torch.empty(1)], torch.ones(1))
        with pytest.raises(ValueError, match="any source"):
            dist.recv(torch.empty(1))
        fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
        assert fut.wait()[0].tolist() == [1.0, 1.0]
        for _ in range(50):  # once wait() returned, the future is done (queued path)
            work = dist.all_reduce(torch.ones(2), async_op=True)
            work.wait()
            assert work.is_completed() and work.get_future().value()[0].tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_translate_keeps_op_sequence_rank():
    timeout = collectives.CollectiveTimeout(
        "[rank 1/3] all_reduce (seq 6): timed out after 2 s waiting for ranks [2]",
        op="all_reduce", seq=6, missing=[2])
    exc = tb.errors.translate(timeout, op="allreduce", rank=1, size=3)
    assert isinstance(exc, dist.DistBackendError) and exc.__cause__ is timeout
    assert (exc.op, exc.seq, exc.rank, exc.missing) == ("allreduce", 6, 1, (2,))
    assert "rank 1/3" in str(exc) and "seq 6" in str(exc) and "CollectiveTimeout" in str(exc)
    bad = ValueError("not ours")
    assert tb.errors.translate(bad, op="allreduce", rank=0, size=1) is bad


# ------------------------------------------------------------------ spawned jobs
def _expected_ops(n: int, r: int) -> dict:
    tri = n * (n - 1) / 2
    ex = {
        "all_reduce": [n * (n + 1) / 2] * 3, "future": [[float(n)] * 2],
        "broadcast": float(n - 1),
        "all_gather": [[float(q)] * 2 for q in range(n)],
        "all_gather_into_tensor": [[float(q)] * 2 for q in range(n)],
        "reduce_scatter_tensor": n * r + tri, "reduce_scatter": n * r + tri,
        "all_to_all_single": [10.0 * q + r for q in range(n)],
        "all_to_all_single_uneven": [100.0 * q + r * (q + 1) + k
                                     for q in range(n) for k in range(q + 1)],
        "all_to_all": [10.0 * q + r for q in range(n)],
        "all_reduce_coalesced": [[tri] * 2, [float(n)] * 3],
        "batch_isend_irecv": [float((r - 1) % n)] * 4,
    }
    if r == n - 1:
        ex["send_recv"] = 7.0
    if r < n - 1:
        ex["new_group"] = float(n - 1)
    return ex


def _assert_ddp(results: list, transport: str) -> None:
    for res in results:
        assert res["backend"] == "collectives" and res["transport"] == transport
        for hook in HOOKS:
            assert res[f"{hook}/max_diff"] <= 1e-5, (transport, hook, res)
            assert res[f"{hook}/moved"] > 1e-3, "the parameters did not train"
            assert res[f"{hook}/digest"] == results[0][f"{hook}/digest"], "replicas differ"


def _assert_wrappers(results: list) -> None:
    """FSDP2 (fully_shard per Linear and the root), ScheduleGPipe and Schedule1F1B (one
    stage per rank, 4 micro-batches) each trained 6 steps to one process's parameters;
    DTensor Colwise/Rowwise matched the dense MLP; each went through the backend methods
    it should have (counted by the adapter)."""
    for res in results:
        for name in ("fsdp2", "gpipe", "1f1b", "tp"):
            assert "error" not in res[name], res[name].get("traceback", res[name])
        fsdp = res["fsdp2"]
        assert fsdp["max_diff"] < 1e-5 and fsdp["sharded"], fsdp
        assert fsdp["calls"]["reduce_scatter_single"] >= 6 * 3, fsdp
        assert fsdp["calls"].get("all_gather_single", 0) + \
            fsdp["calls"].get("all_gather_single_coalesced", 0) >= 6 * 3, fsdp
        for name in ("gpipe", "1f1b"):
            assert res[name]["max_diff"] < 1e-5 and res[name]["params"] > 0, res[name]
            assert res[name]["calls"].get("send", 0) >= 6 * 4, res[name]
            assert res[name]["calls"].get("recv", 0) >= 6 * 4, res[name]
        tp = res["tp"]
        assert tp["forward_diff"] < 1e-5 and tp["param_diff"] < 1e-5, tp
        assert tp["calls"]["allreduce"] >= 3, tp


@pytest.mark.parametrize("transport, nproc", [("shm", 3), ("zmq", 2)])
def test_spawned_job(transport, nproc):
    """One job per transport: every call torch's wrappers make gives the closed-form
    result; torch's DDP over "collectives" equals torch's DDP over gloo after 6 steps
    (with and without a comm hook); on shm also FSDP2, pipelining and TP (see
    _assert_wrappers); last, a mismatched call reaches torch's caller as DistBackendError
    naming op, seq and rank, with our CollectiveMismatch as the cause on the rank that
    detected it."""
    results = collectives.spawn(job.ops_job, nproc, args=(transport == "shm",),
                                backend=transport, timeout=60, join_timeout=240)
    for r, res in enumerate(results):
        assert res["ops"] == _expected_ops(nproc, r), (r, res["ops"])
    _assert_ddp(results, transport)
    if transport == "shm":
        _assert_wrappers(results)
    mismatches = [res["mismatch"] for res in results]
    assert all(m and m["type"] == "CollectivesBackendError" and m["is_dist_backend_error"]
               for m in mismatches), mismatches
    assert "CollectiveMismatch" in {m["cause"] for m in mismatches}
    for r, m in enumerate(mismatches):
        assert f"rank {r}/{nproc}" in m["message"] and "(seq " in m["message"], m
        assert ("allreduce" if r == 0 else "broadcast") in m["message"], m


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
def test_ops_and_ddp_under_mpiexec(tmp_path):
    """The op checks and DDP against gloo, two ranks started by mpiexec, transport mpi
    (sub-groups are MPI communicators there). The ranks report through files: mpiexec
    may interleave their stdout lines."""
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(JOB), "ops",
                           str(tmp_path)], cwd=ROOT,
                          env=_clean_env(COLLECTIVES_BACKEND="mpi"), capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")),
                     key=lambda d: d["rank"])
    assert [d["rank"] for d in results] == [0, 1], proc.stdout + proc.stderr
    for r, res in enumerate(results):
        assert res["ops"] == _expected_ops(2, r), (r, res["ops"])
    _assert_ddp(results, "mpi")


def _three_ranks(kind: str, transport: str) -> tuple[list, list]:
    """Run the job ``kind`` as 3 separate processes; their exit codes and outputs."""
    env = _clean_env(WORLD_SIZE="3", COLLECTIVES_BACKEND=transport)
    procs = [subprocess.Popen([sys.executable, str(FAULTS), kind], cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL) for r in range(3)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outputs


def _report(output: tuple) -> dict:
    return json.loads(output[0].strip().splitlines()[-1])


@pytest.mark.parametrize("transport", ["shm", pytest.param("zmq", marks=pytest.mark.slow)])
def test_sigkilled_rank_raises_in_survivors(transport):
    """3 ranks, rank 2 SIGKILLs itself between all_reduces: ranks 0 and 1 raise a
    DistBackendError naming rank 2 within 10 s, with our PeerError as the cause."""
    codes, outputs = _three_ranks("kill", transport)
    assert codes[2] == -9, outputs[2]
    for r in (0, 1):
        assert codes[r] == 0, outputs[r]
        res = _report(outputs[r])
        assert res["type"] == "CollectivesBackendError" and res["is_dist_backend_error"], res
        assert res["cause"] == "PeerError" and res["peer"] == 2, res
        assert res["elapsed_s"] < 10.0, res
        assert "rank 2" in res["message"] and f"rank {r}/3" in res["message"], res
        assert res["op"] == "allreduce" and res["seq"] >= 3, res


def test_sigkilled_rank_stops_torch_ddp_in_survivors():
    """3 ranks training with torch's DDP over shm, rank 2 SIGKILLed after 3 steps: the
    survivors' backward raises within 10 s with a message naming the dead rank, the op and
    the sequence number (DDP's C++ reducer re-raises a failed future as RuntimeError, with
    our error's text); the next collective on the broken group is a DistBackendError.
    And the survivors exit 0: their groups' threads stop before Python finalises (one
    ended by the finalising interpreter inside torch's C++ aborted the process in about
    two runs of three)."""
    codes, outputs = _three_ranks("kill_ddp", "shm")
    assert codes[2] == -9, outputs[2]
    for r in (0, 1):
        assert codes[r] == 0, outputs[r]
        res = _report(outputs[r])
        assert res["elapsed_s"] < 10.0, res
        for text in ("CollectivesBackendError", "PeerError", "rank 2", f"rank {r}/3",
                     "allreduce", "(seq "):
            assert text in res["message"], (text, res)
        after = res["after"]
        assert after["is_dist_backend_error"] and "rank 2" in after["message"], after


def test_silent_rank_times_out_in_survivors():
    """3 ranks on shm, Options(timeout=2): rank 2 stops calling (until the others timed
    out, 6 s at most); ranks 0 and 1 raise a DistBackendError with our CollectiveTimeout as
    the cause, naming the op, the sequence number and the missing rank, after about 2 s."""
    codes, outputs = _three_ranks("hang", "shm")
    assert codes == [0, 0, 0], outputs
    for r in (0, 1):
        res = _report(outputs[r])
        assert res["type"] == "CollectivesBackendError" and res["is_dist_backend_error"], res
        assert res["cause"] == "CollectiveTimeout" and res["missing"] == [2], res
        assert 1.5 < res["elapsed_s"] < 5.5, res
        assert res["op"] == "allreduce" and res["seq"] >= 3, res
        assert f"rank {r}/3" in res["message"] and "(seq " in res["message"], res
