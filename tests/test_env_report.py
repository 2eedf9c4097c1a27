"""``collectives env``: the report for bug reports, as text and as JSON, made without a
hang (MPI is asked in a child process) and without heavy imports at ``import
collectives``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import collectives
from collectives import env_report

ROOT = Path(__file__).resolve().parent.parent


def _env_command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collectives", "env", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def test_the_json_report_names_everything_a_bug_report_needs():
    done = _env_command("--json", env={"RANK": "1", "WORLD_SIZE": "2",
                                       "COLLECTIVES_TIMEOUT": "30", "SLURM_JOB_ID": "7",
                                       "COLLECTIVES_SECRET": "0123456789abcdef0123"})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["collectives"]["version"] == collectives.__version__
    assert report["collectives"]["path"] == str(ROOT / "collectives")
    assert report["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert set(env_report.PACKAGES) == set(report["packages"])
    assert report["packages"]["numpy"]
    assert "built" in report["shm_core"] and "used" in report["shm_core"]
    assert report["backends"] == collectives.available_backends()
    assert report["launcher"]["rank"] == 1 and report["launcher"]["world_size"] == 2
    assert {"COLLECTIVES_SECRET": "<set>", "COLLECTIVES_TIMEOUT": "30", "RANK": "1",
            "SLURM_JOB_ID": "7", "WORLD_SIZE": "2"}.items() <= report["environment"].items()
    assert all(k.startswith(("COLLECTIVES_", "RANK", "WORLD_SIZE", "SLURM_"))
               for k in report["environment"]), report["environment"]
    assert report["cores"]["usable"] == len(os.sched_getaffinity(0))
    assert isinstance(report["numa"], list)
    mpi, zmq = report["mpi"], report["zmq"]
    if report["packages"]["mpi4py"]:
        assert mpi.get("library") or "error" in mpi
    else:
        assert "not installed" in mpi["error"]
    assert zmq.get("libzmq") or "error" in zmq


def test_the_text_report_has_one_line_per_subject():
    done = _env_command()
    assert done.returncode == 0, done.stderr
    for label in ("collectives:", "Python:", "numpy:", "torch:", "mpi4py:", "MPI library:",
                  "pyzmq:", "libzmq:", "shm core:", "transports:", "launcher:", "cores:",
                  "NUMA nodes:", "environment:"):
        assert any(line.startswith(label) for line in done.stdout.splitlines()), label


def test_a_hanging_mpi_is_a_line_of_the_report_not_a_hang(monkeypatch):
    monkeypatch.setattr(env_report, "_MPI_QUERY", "import time; time.sleep(60)")
    monkeypatch.setattr(env_report, "_version", lambda name: "1.0")
    assert env_report.mpi_library(timeout=0.5) == \
        {"error": "importing mpi4py.MPI did not finish within 0.5 s"}
    monkeypatch.setattr(env_report, "_MPI_QUERY", "raise SystemExit('no libmpi.so')")
    assert env_report.mpi_library()["error"] == "importing mpi4py.MPI failed: no libmpi.so"


def test_the_shm_core_is_reported_as_built_and_used_or_why_not(monkeypatch):
    from backends.shm import native
    core = env_report.shm_core()
    assert core["built"] == (native.load_error() is None)
    monkeypatch.setenv("COLLECTIVES_SHM_NATIVE", "0")
    off = env_report.shm_core()
    assert off["used"] is False and (off["why"] == "COLLECTIVES_SHM_NATIVE=0"
                                     or not off["built"])


def test_cores_and_numa_nodes_read_from_the_system(tmp_path):
    assert env_report.cpu_list([3, 0, 1, 2, 9]) == "0-3,9"
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert env_report.numa_nodes(str(tmp_path)) == [{"node": 0, "cpus": "0-3"},
                                                    {"node": 1, "cpus": "4-7"}]


def test_import_collectives_and_the_env_module_load_no_heavy_library():
    code = ("import sys, collectives, collectives.env_report, collectives.cli\n"
            "print(sorted(m for m in ('torch', 'zmq', 'mpi4py') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
