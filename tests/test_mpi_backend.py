"""Backend-specific tests of ``backends/mpi.py``, run under ``mpiexec`` started from here.

The generic conformance suite covers ``mpi`` through its ``mpiexec`` launcher
(``collectives/testing/mpi_launch.py``); this file checks what is particular to MPI:
every collective at world sizes 1..4 against closed forms (``tests/scripts/
mpi_collectives.py``: every dtype, float16/bfloat16 reductions through user-defined MPI
operators, AVG, non-contiguous torch views, async, sub-groups, tags, objects), the same
script giving the same answers on ``shm`` (through ``collectives.spawn`` and under
``mpiexec``), bitwise-identical float16/bfloat16 all_reduce results on inexact inputs,
MPI's tag limit, timeouts that name the missing ranks, and what a dead rank does to the
job. Skipped, with the reason, where ``mpiexec`` or ``mpi4py`` is missing.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")

if importlib.util.find_spec("mpi4py") is None:
    pytest.skip("mpi4py is not installed (pip install mpi4py mpich)", allow_module_level=True)
if MPIEXEC is None:
    pytest.skip("no mpiexec/mpirun on PATH (pip install mpich)", allow_module_level=True)

#: Seconds one mpiexec job may take (4 ranks importing torch on 2 busy cores).
JOB_TIMEOUT = 120.0
#: Unit roundoff of the 16-bit float types and float32.
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def _env() -> dict:
    return job_env()


def _run(command: list, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def _reports(proc: subprocess.CompletedProcess, n: int) -> list[dict]:
    """The JSON line of every rank, in rank order."""
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # mpiexec forwards each rank's stdout on its own, so one rank's line can land in the
    # middle of another's line: read every object that starts with {"rank", wherever.
    decoder, lines, out, at = json.JSONDecoder(), [], proc.stdout, proc.stdout.find('{"rank"')
    while at >= 0:
        try:
            report, end = decoder.raw_decode(out, at)
            lines.append(report)
        except json.JSONDecodeError:
            end = at + 1      # cut by another rank's output; its rank shows as missing
        at = out.find('{"rank"', end)
    assert sorted(d["rank"] for d in lines) == list(range(n)), proc.stdout + proc.stderr
    return sorted(lines, key=lambda d: d["rank"])


@functools.lru_cache(maxsize=None)
def collectives_job(n: int, backend: str = "", how: str = "mpiexec") -> tuple:
    script = str(SCRIPTS / "mpi_collectives.py")
    extra = ["--backend", backend] if backend else []
    if how == "mpiexec":
        command = [MPIEXEC, "-n", str(n), sys.executable, script, *extra]
    else:
        command = [sys.executable, script, *extra, "--nproc", str(n)]
    return tuple(_reports(_run(command), n))


# --------------------------------------------------------------------- closed forms
def _members(n: int, r: int) -> list:
    return [q for q in range(n) if q % 2 == r % 2]


def expected_exact(n: int, r: int) -> dict:
    """What ``tests/scripts/mpi_collectives.py`` must report in ``exact`` on rank r of n."""
    tri = n * (n + 1) / 2
    ex: dict = {}
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16",
                 "int32", "int64"):
        ex[f"all_reduce_SUM_{name}"] = [tri] * 5
        ex[f"all_reduce_PRODUCT_{name}"] = [float(math.factorial(n))] * 5
        ex[f"all_reduce_MIN_{name}"] = [1.0] * 5
        ex[f"all_reduce_MAX_{name}"] = [float(n)] * 5
        if name.startswith(("float", "bfloat")):
            ex[f"all_reduce_AVG_{name}"] = [(n + 1) / 2] * 5
        ex[f"reduce_{name}"] = [tri if r == n - 1 else r + 1.0] * 3
        ex[f"reduce_scatter_{name}"] = [n * (2 * r + j) + n * (n - 1) / 2 for j in (0, 1)]
    wrap = (n * np.arange(6, dtype=np.int64) * 9000 + n * (n - 1) // 2).astype(np.int16)
    ex["all_reduce_int16_wrap"] = wrap.astype(float).tolist()
    ex["reduce_scatter_AVG"] = [2 * r + j + (n - 1) / 2 for j in (0, 1)]
    ex["all_reduce_strided_bf16"] = [(n + 1) / 2, 0.0] * 5
    ex["all_reduce_transposed_f16"] = (n * np.arange(6.0) + n * (n - 1) / 2).reshape(2, 3).tolist()
    col = np.full((2 * n, 2), -1.0)
    col[:, 0] = np.array([[q, -q] for q in range(n)]).ravel()
    ex["all_gather_strided_out"] = col.tolist()
    ex["broadcast"] = (np.arange(5) + 10.0 * (n - 1)).tolist()
    ex["broadcast_bool"] = [1.0] * 3
    ex["all_gather"] = [float(v) for q in range(n) for v in (q, -q)]
    ex["gather"] = [v for q in range(n) for v in (q, q + 0.5)] if r == 0 else None
    ex["scatter"] = [6.0 * r, 6.0 * r + 3]
    ex["all_to_all"] = [r + 100.0 * j for j in range(n)]
    ex["all_to_all_splits"] = [r + 10.0 * j for j in range(n) for _ in range(r + 1)]
    ex["empty"] = []
    ex["async"] = {"a": [(n + 1) / 2] * 3, "b": [n - 1.0] * 2,
                   "o": [float(q) for q in range(n) for _ in range(3)], "done": [True] * 4}
    if n > 1:
        prv = (r - 1) % n
        ex["p2p"] = {"three": [30.0 + prv] * 5, "seven": [70.0 + prv, 0.0] * 4}
    ex["broadcast_object"] = {"from": n - 1, "n": n}
    ex["all_gather_object"] = [f"rank{q}" for q in range(n)]
    members = _members(n, r)
    ex["sub_group"] = {"rank": members.index(r), "size": len(members),
                       "all_reduce": [float(sum(q + 1 for q in members))], "world": [float(n)],
                       "broadcast": [float(members[-1])], "solo": [r + 0.5]}
    return ex


def _check_exact(reports: list, n: int) -> None:
    for r, report in enumerate(reports):
        expected = expected_exact(n, r)
        got = report["exact"]
        assert sorted(got) == sorted(expected), f"rank {r}: keys differ"
        wrong = {k: (got[k], expected[k]) for k in expected if got[k] != expected[k]}
        assert not wrong, f"rank {r} of {n}: {json.dumps(wrong, indent=1)}"


# ----------------------------------------------------------------------------- tests
def test_importing_the_backend_neither_starts_mpi_nor_is_needed_by_shm():
    code = ("import sys, collectives, backends.mpi as m; "
            "assert 'mpi4py.MPI' not in sys.modules, 'import started MPI'; "
            "assert collectives.registry._BUILTIN['mpi'][0] == 'backends.mpi:create'; "
            "pg = collectives.init_process_group('shm'); pg.close(); "
            "assert 'mpi4py.MPI' not in sys.modules, 'shm imported MPI'; print('ok')")
    proc = _run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_internal_tags_fold_into_mpi_tags():
    from backends.mpi import fold_tag
    from collectives.algorithms.links import COLLECTIVE_TAG_BIT
    from collectives.subgroup import GROUP_ID_SHIFT

    for bits in (15, 29, 31):  # MPI's minimum TAG_UB, MPICH's, and more
        seen = set()
        for seq in range(3000):
            for step in (0, 1, 4095):
                for group_id in (0, 5, (1 << 21) - 1):
                    tag = (group_id << GROUP_ID_SHIFT) | COLLECTIVE_TAG_BIT | \
                        ((seq & 0xFFFFFF) << 12) | step
                    folded = fold_tag(tag, bits)
                    assert 0 <= folded < 1 << bits and folded & 0xFFF == step
                    seen.add((group_id, folded))
        # one group's consecutive collectives never share a tag within 2**(bits-12)
        window = min(3000, 1 << (bits - 12))
        assert len({f for g, f in seen if g == 5}) >= 3 * window


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_matches_closed_forms(n):
    reports = collectives_job(n)
    for report in reports:
        assert (report["backend"], report["launcher"], report["size"]) == ("mpi", "mpi", n), \
            "init_process_group() under mpiexec must pick the mpi backend"
    _check_exact(list(reports), n)
    if n > 1:
        for r, report in enumerate(reports):
            spec = report["specific"]
            assert spec["max_tag_recv"] == (r - 1) % n, "the largest MPI tag must work"
            assert "MPI.TAG_UB" in spec["above_tag_ub"], spec["above_tag_ub"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_inexact_float16_bfloat16_reductions_are_identical_on_every_rank(n):
    """Random (inexact) inputs: all_reduce results are bitwise identical on every rank, and
    float16/bfloat16/float32 results (reduced in their own dtype through user-defined MPI
    operators for the 16-bit types) are within ``(n + 1)`` unit roundoffs of the float64
    sum, in units of ``sum(|x_i|)``; non-root tensors of reduce are left unchanged."""
    reports = collectives_job(n)
    first = reports[0]["inexact"]
    for r, report in enumerate(reports):
        for key, value in report["inexact"].items():
            if "digest" in value:
                assert value["digest"] == first[key]["digest"], \
                    f"rank {r}: {key} differs from rank 0's bits"
            if "error" in value:
                dtype = next(d for d in UNIT if f"_{d}_" in key)
                assert value["error"] <= (n + 1) * UNIT[dtype], (r, key, value)
            if "unchanged" in value:
                assert value["unchanged"] and r != 0, (r, key)


def test_shm_gives_the_same_results_through_spawn_and_under_mpiexec():
    """The same public-API script: ``mpiexec -n 2 ... --backend mpi``, ``... --backend shm
    --nproc 2`` (collectives.spawn), and ``mpiexec -n 2 ... --backend shm`` (shm started
    by an MPI launcher: its job id comes from the launcher)."""
    mpi = collectives_job(2)
    spawned = collectives_job(2, "shm", "spawn")
    under_mpiexec = collectives_job(2, "shm", "mpiexec")
    assert [d["launcher"] for d in spawned] == ["spawn"] * 2
    assert [(d["backend"], d["launcher"]) for d in under_mpiexec] == [("shm", "mpi")] * 2
    for r in range(2):
        assert spawned[r]["exact"] == mpi[r]["exact"], f"rank {r}: shm (spawn) != mpi"
        assert under_mpiexec[r]["exact"] == mpi[r]["exact"], f"rank {r}: shm (mpiexec) != mpi"


def test_a_rank_that_sleeps_makes_the_others_time_out_naming_it():
    timeout = 2.0
    proc = _run([MPIEXEC, "-n", "3", sys.executable, str(SCRIPTS / "mpi_timeout.py"),
                 "--timeout", str(timeout)], timeout=60)
    zero, one, two = _reports(proc, 3)
    p2p = zero["p2p"]  # Work.wait(timeout) on a receive nobody matches
    assert p2p["type"] == "CollectiveTimeout" and p2p["missing"] == [2], p2p
    assert 0.3 <= p2p["after_s"] < 0.3 + 1.0, p2p
    err = zero["all_reduce"]
    assert err["type"] == "CollectiveTimeout", err
    assert (err["op"], err["seq"], err["missing"]) == ("all_reduce", 1, [1, 2]), err
    assert timeout <= err["after_s"] < timeout + 2.0, err  # the timeout plus a little slack
    assert "rank 1 has entered only 1 collective" in err["message"], err["message"]
    assert "rank 2 did not answer" in err["message"], err["message"]
    # The all_reduce stayed posted: the late ranks completed it, with the right values.
    for report in (zero, one, two):
        assert report["late_result"] == [6.0] * 4, report


def test_a_dead_rank_ends_the_whole_job_at_once():
    """A rank that exits without MPI_Finalize: mpiexec kills the others at once (they do
    not wait for their 30 s timeout) and reports a failure."""
    before = set(os.listdir("/dev/shm"))
    start = time.monotonic()
    try:
        proc = _run([MPIEXEC, "-n", "2", sys.executable, str(SCRIPTS / "mpi_timeout.py"),
                     "--die"], timeout=60)
    finally:
        # MPICH's own shared memory (mpich_shm_*) outlives a rank killed mid-job: MPI's
        # semantics, not ours (README, "mpi"). Remove what this job left.
        for name in set(os.listdir("/dev/shm")) - before:
            if name.startswith("mpich_shm_"):
                os.unlink(os.path.join("/dev/shm", name))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "survived" not in proc.stdout
    assert time.monotonic() - start < 20.0


def test_a_world_of_one_without_launcher_and_spawned_ranks_are_refused():
    code = """
import numpy as np, collectives
pg = collectives.init_process_group("mpi")
t = np.array([2.0], np.float16); pg.all_reduce(t, op=collectives.ReduceOp.AVG)
sub = pg.new_group([0]); sub.barrier()
assert (pg.size, pg.backend, t.tolist()) == (1, "mpi", [2.0])
try:
    collectives.spawn(collectives.init_process_group, 2, backend="mpi", timeout=20)
except collectives.CollectiveError as exc:
    assert "mpiexec" in str(exc), exc
    print("ok")
"""
    proc = _run([sys.executable, "-c", code], timeout=90)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
