"""docs/several-hosts.md: every code block either runs here as written or says why not
(``<!-- not-run: reason -->`` on the line above its fence), and the names it cites exist."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from collectives import settings
from collectives.slurm import slurm_port
from collectives.testing.hosts import rig_unavailable
from job_env import ROOT, job_env

PAGE = ROOT / "docs" / "several-hosts.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.+?)\s*-->\s*$")


def blocks() -> list[tuple[str, str, str]]:
    """``(language, text, not-run reason or "")`` of each fenced block."""
    text = PAGE.read_text()
    found = []
    for match in FENCE.finditer(text):
        above = text[:match.start()].rstrip("\n").splitlines()
        marker = NOT_RUN.search(above[-1]) if above else None
        found.append((match.group(1), match.group(2), marker.group(1) if marker else ""))
    return found


def test_the_page_has_runnable_and_marked_blocks():
    kinds = [(lang, bool(reason)) for lang, _, reason in blocks()]
    assert ("python", False) in kinds and ("bash", False) in kinds
    assert sum(marked for _, marked in kinds) >= 5      # the cluster-only ones say why


@pytest.mark.parametrize("index", [i for i, (_, _, reason) in enumerate(blocks())
                                   if not reason])
def test_unmarked_blocks_run_as_written(index):
    lang, text, _ = blocks()[index]
    command = {"python": [sys.executable, "-c", text],
               "bash": ["bash", "-euo", "pipefail", "-c", text]}[lang]
    proc = subprocess.run(command, cwd=ROOT, env=job_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(rig_unavailable() is not None, reason=rig_unavailable() or "")
def test_the_emulated_hosts_block_runs_as_root():
    """Marked not-run for readers without root; here, with root, it runs as written."""
    [text] = [text for _, text, reason in blocks() if "HostRig(" in text]
    proc = subprocess.run([sys.executable, "-c", text], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 0.5 < float(proc.stdout.strip().splitlines()[-1]) <= 1.0


def test_the_cited_settings_and_port_formula_are_the_code_s():
    text = PAGE.read_text()
    for name in re.findall(r"`(COLLECTIVES_[A-Z_]+)", text):
        assert any(s.name == name for s in settings.SETTINGS), name
    # "20000 + (SLURM_JOB_ID % 1000) * 10 + SLURM_STEP_ID % 10"
    assert "20000 + (SLURM_JOB_ID % 1000) * 10 + SLURM_STEP_ID % 10" in text
    assert slurm_port(123456, 2) == 20000 + (123456 % 1000) * 10 + 2 % 10
