"""parallel.DeviceMesh: row-major coordinates and sub-groups as torch's init_device_mesh lays
them out, collectives on every dimension, clear errors, and no deadlock in the member-only
``new_group`` calls on any backend.

The expected groups are computed here in plain python (nested loops over coordinates), not
with the mesh's own helper. The semantics run in the thread world for many shapes
(hypothesis); the real backends run one job each (8 ranks: meshes over the world and over
its two halves, so several shapes, nested sub-groups included, in one start-up), and mpi
under mpiexec (this file run as a script).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script under mpiexec
    sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402
from job_env import job_env  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402
from parallel import DeviceMesh  # noqa: E402
from parallel.mesh import mesh_groups  # noqa: E402

MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
#: (shape, names) the real-process job checks over the world of 8 ...
WORLD_CASES = [((2, 2, 2), ("dp", "pp", "tp")), ((8,), ("dp",)), ((2, 4), ("dp", "tp")),
               ((4, 1, 2), ("a", "b", "c"))]
#: ... and over each half {0..3}, {4..7} (a mesh over a sub-group)
HALF_CASES = [((2, 2), ("dp", "tp")), ((2, 1, 2), ("dp", "pp", "tp")),
              ((1, 2, 2), ("dp", "pp", "tp"))]


# ------------------------------------------------------------------ the expectation
def expected_groups(shape: tuple, dim: int) -> list:
    """The sub-groups along ``dim`` of a row-major mesh, by brute force: for every choice of
    the other coordinates, the ranks with those coordinates, ``dim`` running 0..n-1."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    others = [range(s) if d != dim else [0] for d, s in enumerate(shape)]
    groups = []
    for fixed in itertools.product(*others):
        groups.append(tuple(sum((c if d != dim else i) * strides[d]
                                for d, c in enumerate(fixed)) for i in range(shape[dim])))
    return sorted(groups)


def expected_coordinate(rank: int, shape: tuple) -> tuple:
    coord = []
    for s in reversed(shape):
        coord.append(rank % s)
        rank //= s
    return tuple(reversed(coord))


def check_mesh(pg, shape: tuple, names: tuple, world_ranks: tuple) -> dict:
    """Build the mesh over ``pg`` and check it; returns what every rank saw (plain data).

    ``world_ranks[i]`` is the world rank of ``pg``'s rank i (for the sums: each rank
    contributes its world rank, so a wrong member shows in the sum)."""
    mesh = DeviceMesh(pg, shape, names)
    seen = {"coordinate": list(mesh.coordinate), "dims": {}}
    assert mesh.shape == shape and mesh.names == names and mesh.size() == pg.size
    assert mesh.coordinate == expected_coordinate(pg.rank, shape), (pg.rank, mesh.coordinate)
    for dim, name in enumerate(names):
        group = mesh[name]
        assert mesh.group(name) is group
        mine = [g for g in expected_groups(shape, dim) if pg.rank in g]
        assert len(mine) == 1 and mesh.ranks(name) == mine[0], (name, mesh.ranks(name), mine)
        assert group.size == mesh.size(name) == shape[dim]
        assert group.rank == mesh.local_rank(name) == mesh.coordinate[dim]
        t = np.array([world_ranks[pg.rank] + 1.0, 1.0])
        group.all_reduce(t)
        want = sum(world_ranks[r] + 1.0 for r in mine[0])
        assert t.tolist() == [want, shape[dim]], (name, t, want)
        seen["dims"][name] = [group.rank, group.size, t.tolist()]
    mesh.close()
    return seen


# ------------------------------------------------------------------ thread world
def test_mesh_groups_match_torch_convention():
    """The helper's order is init_device_mesh's: ``arange(n).reshape(shape)``, the
    dimension moved last, one group per row (written out for (2, 2, 2))."""
    assert mesh_groups((2, 2, 2), 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh_groups((2, 2, 2), 1) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh_groups((2, 2, 2), 0) == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert mesh_groups((2, 3), 0) == [(0, 3), (1, 4), (2, 5)]
    for shape in [(2, 2, 2), (2, 3), (3, 1, 2), (4,), (1, 1)]:
        for dim in range(len(shape)):
            assert sorted(mesh_groups(shape, dim)) == expected_groups(shape, dim)


@st.composite
def meshes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)
                       .filter(lambda s: math.prod(s) <= 8)))
    names = tuple(draw(st.lists(st.text("abcdpt", min_size=1, max_size=3), min_size=len(shape),
                                max_size=len(shape), unique=True)))
    return shape, names


@settings(max_examples=25, deadline=None)
@given(meshes())
def test_mesh_semantics_in_thread_world(case):
    shape, names = case
    n = math.prod(shape)
    seen = run_threads(lambda pg: check_mesh(pg, shape, names, tuple(range(n))), n)
    assert [tuple(s["coordinate"]) for s in seen] == [expected_coordinate(r, shape)
                                                      for r in range(n)]


def test_mesh_over_a_subgroup_in_thread_world():
    """A mesh over a sub-group: ranks are the sub-group's, sums over the world's members."""
    def fn(pg):
        half = pg.new_group([0, 1, 2, 3] if pg.rank < 4 else [4, 5, 6, 7])
        world = tuple(range(4)) if pg.rank < 4 else tuple(range(4, 8))
        return [check_mesh(half, s, nm, world) for s, nm in HALF_CASES]
    run_threads(fn, 8)


def test_bad_input_is_a_clear_error():
    def fn(pg):
        errors = {}
        for args in [((3, 2), ("dp", "tp")), ((2, 2), ("dp",)), ((2, 2), ("dp", "dp")),
                     ((2, 0, 2), ("a", "b", "c")), ((2, 2), "dt"), ("22", ("a", "b")),
                     ((2, 2), ("dp", 3)), ((), ())]:
            try:
                DeviceMesh(pg, *args)
            except (ValueError, TypeError) as exc:
                errors[repr(args)] = (type(exc).__name__, str(exc))
        mesh = DeviceMesh(pg, (2, 2), ("dp", "tp"))
        try:
            mesh["pp"]
        except KeyError as exc:
            errors["pp"] = ("KeyError", str(exc))
        for method in (mesh.group, mesh.size, mesh.local_rank, mesh.ranks):
            with pytest.raises(ValueError, match="no dimension 'pp'"):
                method("pp")
        try:
            DeviceMesh(object(), (1,), ("dp",))
        except TypeError as exc:
            errors["object"] = ("TypeError", str(exc))
        return errors
    errors = run_threads(fn, 4)[0]
    assert len(errors) == 10, errors
    kind, msg = errors[repr(((3, 2), ("dp", "tp")))]
    assert kind == "ValueError" and "(3, 2)" in msg and "6" in msg and "4" in msg
    assert "rank 0" in msg and "DeviceMesh" in msg
    assert "names" in errors[repr(((2, 2), ("dp",)))][1]
    assert "unique" in errors[repr(((2, 2), ("dp", "dp")))][1]
    assert errors[repr(((2, 2), "dt"))][0] == "TypeError"
    assert "('dp', 'tp')" in errors["pp"][1]
    assert "new_group" in errors["object"][1] or "rank" in errors["object"][1]


# ------------------------------------------------------------------ real processes
def _job_on(pg) -> dict:
    """Every case of the real-process job on ``pg``: with 8 ranks the world's cases and the
    halves'; with 4, the halves' cases over the world."""
    if pg.size == 4:
        return {"world": [], "half": [check_mesh(pg, s, nm, tuple(range(4)))
                                      for s, nm in HALF_CASES]}
    world = tuple(range(pg.size))
    out = {"world": [check_mesh(pg, s, nm, world) for s, nm in WORLD_CASES]}
    half = pg.new_group(list(range(4)) if pg.rank < 4 else list(range(4, 8)))
    members = tuple(range(4)) if pg.rank < 4 else tuple(range(4, 8))
    out["half"] = [check_mesh(half, s, nm, members) for s, nm in HALF_CASES]
    half.close()
    return out


def _spawned_job() -> dict:
    pg = collectives.init_process_group()
    try:
        return {"backend": pg.backend, "result": _job_on(pg)}
    finally:
        pg.close()


def _assert_job(reports: list, backend: str, n: int = 8) -> None:
    assert len(reports) == n and {r["backend"] for r in reports} == {backend}
    for rank, report in enumerate(reports):
        world = report["result"]["world"]
        assert len(world) == (len(WORLD_CASES) if n == 8 else 0)
        for (shape, _), seen in zip(WORLD_CASES, world):
            assert tuple(seen["coordinate"]) == expected_coordinate(rank, shape)
        half = report["result"]["half"]
        assert len(half) == len(HALF_CASES)
        for (shape, _), seen in zip(HALF_CASES, half):
            assert tuple(seen["coordinate"]) == expected_coordinate(rank % 4, shape)


def _spawnable() -> list:
    return ["shm"] + [b for b in collectives.available_backends()
                      if b not in ("shm", "mpi", "nccl", "torch")]


def _spawn_checked(backend: str, n: int) -> None:
    if backend != "shm":
        try:
            collectives.get_backend(backend)
        except ImportError as exc:
            pytest.skip(f"backend {backend} does not import: {exc}")
    reports = collectives.spawn(_spawned_job, n, backend=backend, timeout=60, join_timeout=150)
    _assert_job(reports, backend, n)


@pytest.mark.parametrize("backend", [pytest.param("shm", marks=pytest.mark.slow)]
                         + _spawnable()[1:])
def test_spawned_4_ranks(backend):
    """One 4-rank job per backend: the meshes (2,2), (2,1,2), (1,2,2) over the world. A
    deadlock in the member-only new_group calls would show as the job's timeout. (shm's
    8-rank job runs these shapes over sub-groups by default; this one is slow-only.)"""
    _spawn_checked(backend, 4)


@pytest.mark.parametrize("backend", ["shm"] + [pytest.param(b, marks=pytest.mark.slow)
                                             for b in _spawnable()[1:]])
def test_spawned_8_ranks(backend):
    """One 8-rank job per backend (shm by default, ~20 s each on 2 cores): the meshes
    (2,2,2), (8,), (2,4), (4,1,2) over the world and (2,2), (2,1,2), (1,2,2) over each half
    (a mesh over a sub-group)."""
    _spawn_checked(backend, 8)


def _env() -> dict:
    return job_env()


needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (pip install mpi4py mpich)")


@needs_mpi
@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_under_mpiexec(tmp_path, n):
    """The same job on the mpi backend: this file run by ``mpiexec -n 4`` (and 8)."""
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, __file__, str(tmp_path)],
                          cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    _assert_job(reports, "mpi", n)


if __name__ == "__main__":  # one rank of test_under_mpiexec's job: python test_mesh.py DIR
    _pg = collectives.init_process_group()
    try:
        _report = {"backend": _pg.backend, "result": _job_on(_pg)}
        Path(sys.argv[1], f"rank{_pg.rank}.json").write_text(json.dumps(_report))
        _pg.barrier()
    finally:
        _pg.close()
