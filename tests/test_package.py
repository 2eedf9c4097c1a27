"""Package basics: the licence, ``py.typed``, one version, the extras, the ``collectives``
command (``collectives bench|doctor|env`` and ``python -m collectives``), and a wheel
built from the tree holding all of it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import collectives
from collectives import cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("collectives", "backends", "parallel")


def _run(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_the_licence_is_mit_as_the_metadata_says():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the collectives authors" in text
    assert PYPROJECT["project"]["license"] == {"text": "MIT"}


def test_every_shipped_package_is_typed():
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == \
        [f"{p}*" for p in PACKAGES]
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in data[package], package


def test_the_version_has_one_source():
    project = PYPROJECT["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == \
        {"attr": "collectives._version.__version__"}
    assert collectives.__version__ == "0.1.0" and "__version__" in collectives.__all__


def test_extras_mpi_is_mpi4py_alone_and_tqdm_is_not_required():
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    names = {k: [d.split(">")[0].split("=")[0] for d in v] for k, v in extras.items()}
    assert names["mpi"] == ["mpi4py"] and names["mpich"] == ["mpich"]
    assert names["examples"] == ["tqdm"]
    assert {"mpi4py", "mpich", "tqdm", "pyzmq", "hypothesis"} <= set(names["test"])
    assert not any(d.startswith("tqdm") for d in project["dependencies"])
    assert project["scripts"] == {"collectives": "collectives.cli:main"}


def test_the_command_lists_its_subcommands_and_refuses_others(capsys):
    assert cli.main([]) == 2 and "bench,doctor,env" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0 and "doctor" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"collectives {collectives.__version__}"
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "doctor", "env"])
def test_each_subcommand_hands_over_to_its_tool(command):
    done = _run("-m", "collectives", command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m collectives {command} ")


def test_the_tools_still_run_as_their_own_modules():
    for module in ("collectives.bench", "collectives.doctor"):
        done = _run("-m", module, "--help")
        assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m {module}")
    done = _run("-m", "collectives", "doctor", "/nonexistent-flight-dir")
    assert done.returncode == 2 and "/nonexistent-flight-dir" in done.stderr


def test_a_wheel_of_the_tree_holds_the_licence_types_version_and_command(tmp_path):
    # (no build isolation: the tree builds with the setuptools already installed)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, = tmp_path.glob("collectives-*.whl")
    assert wheel.name.startswith(f"collectives-{collectives.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert {f"{p}/py.typed" for p in PACKAGES} <= names
    assert any(n.startswith(info) and n.endswith("LICENSE") for n in names), sorted(names)
    assert f"Version: {collectives.__version__}" in metadata
    assert "Provides-Extra: mpich" in metadata and "Requires-Dist: tqdm" in metadata
    assert 'extra == "examples"' in metadata.split("Requires-Dist: tqdm", 1)[1].split("\n")[0]
    assert "collectives = collectives.cli:main" in entry_points
