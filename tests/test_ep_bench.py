"""``python -m collectives.bench --ops all_to_all --uneven``: the split pattern (fixed per
size, the same on every rank and for every implementation), the check of an uneven
result against the testing kit's oracle (which must be able to fail), and real runs of
ours beside mpi4py's Alltoallv and torch gloo's all_to_all_single with splits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from collectives.bench.cases import make_case, uneven_splits
from collectives.testing import reference

ROOT = Path(__file__).resolve().parents[1]
HAVE_MPI = bool(shutil.which(os.environ.get("MPIEXEC") or "mpiexec")
                or shutil.which("mpirun"))
try:
    import mpi4py  # noqa: F401
except ImportError:
    HAVE_MPI = False


@pytest.mark.parametrize("count, n", [(1, 1), (2, 2), (1024, 2), (999, 3), (1 << 22, 4)])
def test_splits_are_fixed_uneven_and_whole(count, n):
    splits = uneven_splits(count, n)
    assert splits == uneven_splits(count, n)                 # the same on every call
    assert all(sum(row) == count and min(row) >= 0 for row in splits)
    if count >= 1024 and n > 1:
        assert len({s for row in splits for s in row}) > n   # parts differ
        receive = [sum(row[j] for row in splits) for j in range(n)]
        assert len(set(receive)) > 1                         # so do the ranks' outputs


@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_uneven_case_matches_the_oracle(n, dtype):
    world = [make_case("all_to_all", 4096, dtype, r, n, uneven=True) for r in range(n)]
    splits = world[0].splits
    assert all(c.splits == splits for c in world)
    want = reference.all_to_all([c.send for c in world], splits)
    for case, out in zip(world, want):
        assert case.send.size == case.count and case.recv.size == out.size
        assert case.send_splits == splits[case.rank]
        np.copyto(case.recv, out)
        assert case.wrong() == 0
    victim = world[-1]
    victim.recv[0] += 1
    assert victim.wrong() == 1
    victim.prepare(final=True)
    assert victim.wrong() == victim.recv.size
    assert make_case("all_reduce", 4096, dtype, 0, n, uneven=True).splits is None


def _cli(tmp_path, *args, timeout=180):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "collectives.bench", *args, "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _check(rows, impls) -> None:
    assert {r["impl"] for r in rows} == set(impls) and len(rows) == 2 * len(impls)
    for row in rows:
        assert row["op"] == "all_to_all" and row["uneven"] is True and row["wrong"] == 0, row
    ours = [r for r in rows if r["impl"] == impls[0]]
    for peer in impls[1:]:
        assert all(f"time_ratio_vs_{peer}" in r for r in ours)


@pytest.mark.slow
def test_cli_uneven_beside_torch_gloo(tmp_path):
    proc, rows = _cli(tmp_path, "--ops", "all_to_all", "--uneven", "--sizes", "4K,64K",
                      "--iters", "3", "--warmup", "1", "--peer", "torch-gloo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(rows, ["shm", "torch-gloo"])
    assert "uneven split sizes" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpiexec and mpi4py")
def test_cli_uneven_zmq_beside_mpi4py(tmp_path):
    proc, rows = _cli(tmp_path, "--backend", "zmq", "--ops", "all_to_all", "--uneven",
                      "--sizes", "4K,64K", "--iters", "3", "--warmup", "1", "--peer", "mpi4py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(rows, ["zmq", "mpi4py"])


def test_uneven_without_all_to_all_is_a_usage_error(tmp_path):
    proc, rows = _cli(tmp_path, "--ops", "all_reduce", "--uneven", timeout=60)
    assert proc.returncode == 2 and rows is None
    assert "--uneven" in proc.stderr and "add all_to_all to --ops" in proc.stderr
