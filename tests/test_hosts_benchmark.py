"""``benchmarks/hosts_allreduce.py``: one short run on the rig of each kind of case it
times (a backend of ours, and the bare-TCP floors of ``--floor``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collectives.testing.hosts import rig_unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_floor_needs_two_hosts():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hosts_allreduce.py"),
                          "--floor", "--hosts", "3"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--floor needs --hosts 2, not 3" in run.stderr, run.stderr


@pytest.mark.timeout(180)
@pytest.mark.skipif(rig_unavailable() is not None, reason=str(rig_unavailable()))
def test_a_short_run_times_hier_and_the_tcp_floors(tmp_path):
    out = tmp_path / "hosts.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hosts_allreduce.py"),
                          "--sizes", "256K", "--backend", "hier", "--floor", "--repeat", "1",
                          "--ddp-epochs", "0", "--rate", "1gbit", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    for case in ("hier", "tcp", "tcp-columns"):
        [seconds] = doc["allreduce_seconds"][case]
        # 256 KiB at 1 Gbit/s needs 2.1 ms of link, less what the tbf's burst lets
        # through after a pause (up to half of it); a loaded machine, far more.
        assert 0.001 < seconds[str(256 << 10)] < 5.0, (case, seconds)
        payload, charged = doc["link_payload_charged"][case]
        assert 0.9 < payload / charged < 1.0, (case, payload, charged)
    assert "hier/tcp" in run.stdout, run.stdout
