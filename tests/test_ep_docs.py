"""docs/expert-parallel.md runs as written: its Python scripts run on two spawned ranks (the
stated output checked), its commands parse with the scripts' own option parsers, and the
README links to it."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from job_env import job_env

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "expert-parallel.md"


def _blocks(lang: str) -> list:
    """The text of every fenced block tagged ``lang`` ("" for untagged), in order."""
    blocks, current, tag = [], None, ""
    for line in PAGE.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, tag = [], line[3:].strip()
            else:
                if tag == lang:
                    blocks.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _commands() -> list:
    """Every command of the page's unlabelled blocks, continuations joined, comments and
    an ``mpirun -n N`` prefix taken off."""
    commands = []
    for block in _blocks(""):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                argv = shlex.split(line)
                if argv[0] == "mpirun":
                    argv = argv[3:]
                commands.append(argv)
    return commands


@pytest.mark.slow
@pytest.mark.parametrize("index", range(2))
def test_python_block_runs(index, tmp_path):
    block = _blocks("python")[index]
    script = tmp_path / f"block{index}.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    stated = re.search(r"print\(.*\)\s+# (\[.*\])$", block, flags=re.M)
    if stated:                                   # the output the page shows
        assert printed == ast.literal_eval(stated.group(1))
    else:
        assert len(printed) == 2 and all(isinstance(v, float) for v in printed)


def test_commands_parse():
    from collectives.bench.__main__ import _parser
    from examples.moe import moe_args
    commands = _commands()
    assert len(commands) >= 5
    for argv in commands:
        if argv[:2] == ["python", "examples/moe.py"]:
            args = moe_args(argv[2:])
            assert args.experts % args.nproc == 0
        elif argv[:3] == ["python", "-m", "collectives.bench"]:
            args = _parser().parse_args(argv[3:])
            assert args.uneven and args.ops == ["all_to_all"] and args.nproc == 2
            assert args.sizes[0] == 4096 and args.sizes[-1] == 16 << 20
        else:
            raise AssertionError(f"unknown command on the page: {argv}")


def test_readme_links_the_page():
    assert "[docs/expert-parallel.md](docs/expert-parallel.md)" in (ROOT / "README.md").read_text()
