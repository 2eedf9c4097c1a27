"""docs/cp.md runs as written: its Python script runs on two spawned ranks (the stated
output checked), its commands parse with the scripts' own option parsers, the README
links to it, and it shows the overlap picture."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from job_env import job_env
from readme_parse import readme_blocks

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cp.md"


def _blocks(lang: str) -> list:
    """The text of every fenced block tagged ``lang`` ("" for untagged), in order."""
    return [b.text for b in readme_blocks(PAGE.read_text()) if b.lang == lang]


@pytest.mark.slow
def test_python_block_prints_what_it_states(tmp_path):
    """The page's one script, run as written on two spawned ranks, prints the list its
    last line's comment shows."""
    (block,) = _blocks("python")
    (tmp_path / "page.py").write_text(block)
    run = subprocess.run([sys.executable, "page.py"], cwd=tmp_path,
                         env=dict(job_env(), PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    stated = re.search(r"# (\[.*\])\s*$", block.strip().splitlines()[-1]).group(1)
    assert ast.literal_eval(run.stdout.strip().splitlines()[-1]) == ast.literal_eval(stated)


def test_commands_parse():
    from examples.cp import cp_args
    from examples.mesh import mesh_args
    seen = set()
    for block in _blocks(""):
        for line in block.splitlines():
            argv = shlex.split(line.split("#", 1)[0])
            if argv[:1] == ["mpirun"]:
                argv = argv[3:]
            if not argv:
                continue
            script = argv[1]
            seen.add(script)
            if script == "examples/cp.py":
                cp_args(argv[2:])
            elif script == "examples/mesh.py":
                assert mesh_args(argv[2:]).cp == 2
            elif script == "examples/plot_trace.py":
                assert argv[3] == "docs/cp_trace.png" and (ROOT / argv[3]).exists()
            else:
                raise AssertionError(f"unknown command on the page: {argv}")
    assert seen == {"examples/cp.py", "examples/mesh.py", "examples/plot_trace.py"}


def test_readme_links_the_page_and_the_page_shows_the_picture():
    readme = (ROOT / "README.md").read_text()
    assert "[docs/cp.md](docs/cp.md)" in readme and "(cp_trace.png)" in PAGE.read_text()
