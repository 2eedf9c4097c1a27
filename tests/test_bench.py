"""``python -m collectives.bench``: busbw factors, the correctness check (which must be
able to fail), the JSON rows of real runs with both peers, the plot, and the errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from collectives.bench import cases
from collectives.bench.__main__ import main, parse_size
from collectives.bench.cases import OPS, bandwidths, busbw_factor, element_count, make_case
from collectives.bench.job import JobSpec, run_mpiexec, run_spawned
from collectives.bench.measure import iterations
from collectives.spawn import SpawnError
from collectives.testing import reference

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_FIELDS = {"impl", "op", "world_size", "bytes", "dtype", "time_us", "algbw_gbps",
                   "busbw_gbps", "wrong"}
HAVE_MPIEXEC = bool(shutil.which(os.environ.get("MPIEXEC") or "mpiexec")
                    or shutil.which("mpirun"))
try:
    import mpi4py  # noqa: F401
except ImportError:
    HAVE_MPIEXEC = False


# ------------------------------------------------------------------------------- units
@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 0.75), ("reduce_scatter", 4, 0.75), ("all_to_all", 4, 0.75),
    ("broadcast", 4, 1.0), ("reduce", 4, 1.0), ("gather", 2, 0.5), ("scatter", 3, 2 / 3),
])
def test_busbw_factors_are_nccl_tests(op, n, factor):
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_bandwidths_by_hand():
    # 1e9 bytes in 0.5 s: algbw 2 GB/s; all_reduce at 4 ranks moves 2*3/4 of it per link
    assert bandwidths("all_reduce", 10**9, 4, 0.5) == pytest.approx((2.0, 3.0))
    assert bandwidths("all_gather", 10**9, 2, 2.0) == pytest.approx((0.5, 0.25))


def test_sizes_round_to_whole_parts():
    assert element_count("all_reduce", 4, 4, 2) == 1
    assert element_count("all_gather", 4, 4, 2) == 2      # one element per part at least
    assert element_count("all_to_all", 40, 4, 3) == 9     # 10 elements -> 3 parts of 3
    assert make_case("reduce_scatter", 4096, "float32", 1, 4).nbytes == 4096
    assert parse_size("4") == 4 and parse_size("4K") == 4096 and parse_size("64M") == 64 << 20
    assert iterations(64 << 20, 50, 5, 512 << 20) == (8, 1)
    assert iterations(4, 50, 5, 512 << 20) == (50, 5)


def _reference_outputs(op: str, world: list) -> list:
    """What the testing kit's oracle says every rank's ``recv`` must hold."""
    n = len(world)
    if op in ("all_reduce", "reduce", "broadcast"):
        inputs = [c.restore if c.restore is not None else c.recv for c in world]
    else:
        inputs = [c.send for c in world]
    return {
        "all_reduce": lambda: reference.all_reduce(inputs),
        "reduce": lambda: reference.reduce(inputs, dst=cases.ROOT),
        "broadcast": lambda: reference.broadcast(inputs, src=cases.ROOT),
        "all_gather": lambda: reference.all_gather(inputs),
        "gather": lambda: reference.gather(inputs, dst=cases.ROOT),
        "scatter": lambda: reference.scatter(inputs, src=cases.ROOT),
        "reduce_scatter": lambda: reference.reduce_scatter(inputs),
        "all_to_all": lambda: reference.all_to_all(inputs),
    }[op]()[:n]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("op", OPS)
def test_checker_counts_every_wrong_element(op, dtype):
    n = 3
    world = [make_case(op, 20 * 4, dtype, r, n) for r in range(n)]
    want = _reference_outputs(op, world)
    checked = [r for r in range(n) if world[r].expected() is not None]
    # the root checks rooted reductions and gathers; everyone checks the rest
    assert checked == ([cases.ROOT] if op in ("reduce", "gather") else list(range(n)))
    for case, out in zip(world, want):
        if case.recv is not None and out is not None:
            np.copyto(case.recv, out)          # what a correct implementation leaves
    assert [c.wrong() for c in world] == [0] * n
    victim = world[checked[-1]]
    victim.recv[len(victim.recv) - 1] += 1     # one wrong element ...
    assert victim.wrong() == 1                 # ... is counted, once
    victim.recv[0] = 100                       # and a second one (no value is above 33)
    assert victim.wrong() == 2
    victim.prepare(final=True)                 # the outputs before the op: all wrong
    assert victim.wrong() == victim.recv.size


def test_inputs_differ_between_ranks_and_parts():
    a, b = (make_case("all_to_all", 64 * 4, "float32", r, 2) for r in range(2))
    assert not np.array_equal(a.send, b.send)
    assert not np.array_equal(a.send[:32], a.send[32:])


def test_too_many_ranks_for_exact_sums_is_refused():
    with pytest.raises(ValueError, match="bfloat16"):
        make_case("all_reduce", 64, "bfloat16", 0, 64)


# ----------------------------------------------------------------------- real runs
def _run_cli(tmp_path, *args, timeout=120):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "collectives.bench", *args, "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def _check_rows(rows, impls, ops, sizes):
    assert {r["impl"] for r in rows} == set(impls)
    assert {r["op"] for r in rows} == set(ops)
    for row in rows:
        assert CONTRACT_FIELDS <= row.keys(), row
        assert row["wrong"] == 0, row
        assert row["world_size"] == 2 and row["dtype"] == "float32"
        assert row["time_us"] > 0 and row["busbw_gbps"] == pytest.approx(
            row["algbw_gbps"] * busbw_factor(row["op"], 2))
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
    assert len(rows) == len(impls) * len(ops) * len(sizes)


def test_cli_all_ops_on_shm_with_torch_gloo(tmp_path):
    rows, text = _run_cli(tmp_path, "--backend", "shm", "--nproc", "2", "--ops", "all",
                          "--sizes", "4,4K", "--iters", "3", "--warmup", "1",
                          "--peer", "torch-gloo", "--memcpy")
    _check_rows(rows, ["shm", "torch-gloo"], OPS, [4, 4096])
    ours = [r for r in rows if r["impl"] == "shm"]
    assert all("time_ratio_vs_torch-gloo" in r and r["memcpy_gbps"] > 0 for r in ours)
    assert all(r["busbw_frac_memcpy"] == pytest.approx(r["busbw_gbps"] / r["memcpy_gbps"])
               for r in rows)
    assert "# wrong elements in total: 0" in text
    for op in OPS:
        assert f"# {op}: 2 ranks" in text


@pytest.mark.skipif(not HAVE_MPIEXEC, reason="needs mpiexec and mpi4py (pip install "
                                              "'collectives[mpi]')")
def test_cli_with_mpi4py_peer(tmp_path):
    ops = ["all_reduce", "reduce_scatter", "scatter"]
    rows, _ = _run_cli(tmp_path, "--backend", "shm", "--ops", ",".join(ops), "--sizes",
                       "4,64K", "--iters", "3", "--warmup", "1", "--peer", "mpi4py")
    _check_rows(rows, ["shm", "mpi4py"], ops, [4, 65536])


def test_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    from collectives.bench.plot import plot
    rows = [dict(impl=impl, op=op, bytes=b, busbw_gbps=b / 1e4 * k, memcpy_gbps=b / 1e3)
            for k, impl in enumerate(["shm", "mpi4py"], 1) for op in ("all_reduce", "gather")
            for b in (4, 4096, 1 << 20)]
    path = tmp_path / "busbw.png"
    plot(rows, str(path), ["shm", "mpi4py"], title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_mpiexec_is_a_message(monkeypatch, capsys):
    monkeypatch.setattr("collectives.mpiexec.shutil.which", lambda name: None)
    assert main(["--peer", "mpi4py", "--sizes", "4"]) == 2
    err = capsys.readouterr().err
    assert "mpi4py" in err and "mpiexec" in err and "Traceback" not in err


def test_bad_arguments_are_messages(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:   # refused by the parser (cli_flags.backend_name)
        main(["--backend", "no-such-backend"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert "argument --backend: unknown backend 'no-such-backend'" in err
    # a backend we know whose library is missing here: refused after the parse, as a usage
    # error too
    monkeypatch.setattr("collectives.registry.available_backends", lambda: ["shm"])
    assert main(["--backend", "zmq"]) == 2
    assert "argument --backend: 'zmq' is not available here" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["--peer", "nccl-tests"]) == 2
    assert "--peer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sizes", "4X"])
    assert "--sizes" in capsys.readouterr().err


def test_rank_failure_is_a_spawn_error():
    spec = JobSpec(impls=["no-such-backend"], ops=["all_reduce"], sizes=[4], timeout=30)
    with pytest.raises(SpawnError, match=r"rank \d failed: ValueError: .*unknown backend") as info:
        run_spawned(spec, 2, job_timeout=60)
    assert info.value.rank in (0, 1)


@pytest.mark.skipif(not HAVE_MPIEXEC, reason="needs mpiexec and mpi4py")
def test_rank_failure_under_mpiexec_names_the_rank():
    # int8 is not a benchmark dtype: every rank fails in make_case, rank 0 is reported
    spec = JobSpec(impls=["mpi4py"], ops=["all_reduce"], sizes=[4], dtype="int8", timeout=30)
    with pytest.raises(SpawnError, match=r"rank \d failed: ValueError.*dtype") as info:
        run_mpiexec(spec, 2, job_timeout=60)
    assert "Traceback" in info.value.remote_traceback


@pytest.mark.skipif(not HAVE_MPIEXEC, reason="needs mpiexec and mpi4py")
def test_peer_without_the_dtype_is_left_out_with_a_note():
    from collectives.bench.__main__ import _check, _parser
    args = _parser().parse_args(["--dtype", "bfloat16", "--peer", "mpi4py,torch-gloo"])
    peers, notes = _check(args)
    assert peers == ["torch-gloo"]
    assert notes == ["mpi4py: skipped, MPI has no bfloat16 datatype"]


def test_ratio_and_memcpy_columns_by_hand():
    from collectives.bench import report
    def r(impl, us, busbw):
        return {"impl": impl, "op": "all_reduce", "world_size": 2, "bytes": 4096,
                "count": 1024, "dtype": "float32", "time_us": us, "algbw_gbps": busbw,
                "busbw_gbps": busbw, "wrong": 0}
    rows = report.add_memcpy([r("shm", 10.0, 2.0), r("mpi4py", 40.0, 0.5),
                              r("memcpy", 1.0, 8.0)])
    report.add_ratios(rows, "shm", ["mpi4py"])
    assert [row["impl"] for row in rows] == ["shm", "mpi4py"]   # the copy is a column
    shm = rows[0]
    assert shm["time_ratio_vs_mpi4py"] == 0.25 and shm["busbw_ratio_vs_mpi4py"] == 4.0
    assert shm["memcpy_gbps"] == 8.0 and shm["busbw_frac_memcpy"] == 0.25
    text = report.table(rows, "shm", ["mpi4py"], 2)
    assert "0.250" in text and "4.000" in text and "25.0" in text
