"""Start-up: what ``import collectives`` loads, how ``collectives.spawn`` starts ranks from
its warm fork server (one thread when it forks, the caller's environment and streams, a
fresh numpy seed per rank, ``__main__`` functions, the ``spawn`` setting). That every
example and benchmark refuses a bad flag before importing torch: tests/test_flags.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import collectives
from collectives import warm_start

ROOT = Path(__file__).resolve().parent.parent
FORKSERVER = warm_start.start_method() == "forkserver"


def _python(code: str, *args: str, env: dict | None = None, timeout: float = 120.0):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def test_import_collectives_loads_no_heavy_library():
    done = _python("import sys, collectives, collectives.testing.reference\n"
                   "print(sorted(m for m in ('ml_dtypes', 'torch', 'zmq', 'mpi4py') "
                   "if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_bfloat16_is_resolved_on_first_use_on_every_path():
    # A fresh process: the first bfloat16 argument, a torch tensor, imports ml_dtypes and
    # completes every table; both a numpy array and a tensor then take the fast path.
    code = textwrap.dedent("""
        import sys, numpy as np, torch, collectives
        pg = collectives.init_process_group(backend="shm")
        assert "ml_dtypes" not in sys.modules
        t = torch.full((5,), 1.5, dtype=torch.bfloat16)
        pg.all_reduce(t)
        assert "ml_dtypes" in sys.modules
        from collectives import dtypes, fast_path
        from backends.shm.codes import DTYPE_CODE
        bf16 = dtypes.bfloat16()
        assert DTYPE_CODE[bf16] == dtypes.BFLOAT16_CODE
        assert id(bf16) in fast_path.VALID_REDUCTIONS
        a = np.ones(4, dtype=bf16)
        pg.all_reduce(a)
        pg.close()
        print(t.float().tolist(), a.astype(np.float32).tolist())
    """)
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("]")[0] == "[1.5, 1.5, 1.5, 1.5, 1.5"


def _rank_report():
    import threading

    import torch
    from collectives import preloaded
    return {"server_threads": getattr(sys.modules.get("collectives.preloaded"), "THREADS",
                                      None),
            "server_had_torch": getattr(preloaded, "HAD_TORCH", None),
            "threads_now": preloaded.count_threads(), "py_threads": threading.active_count(),
            "torch_threads": torch.get_num_threads(), "ppid": os.getppid(),
            "marker": os.environ.get("STARTUP_TEST_MARKER"),
            "rank": os.environ.get("RANK"), "draw": float(np.random.random()),
            "comm": Path("/proc/self/comm").read_text().strip(),
            "real_rank": _real_environment().get("RANK")}


def _real_environment() -> dict:
    """This process's environment as the kernel shows it to others (/proc/PID/environ)."""
    raw = Path("/proc/self/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


@pytest.mark.skipif(not FORKSERVER, reason="the fork server is not this platform's default")
def test_fork_server_has_one_thread_when_it_forks_with_torch_preloaded():
    # A fresh parent (a fresh server) that imported torch, as the examples do: the server
    # preloads torch too and still has one thread at the end of its preloading.
    code = textwrap.dedent("""
        import json, sys
        import torch, collectives
        sys.path.insert(0, "tests")
        from test_startup import _rank_report
        print(json.dumps(collectives.spawn(_rank_report, 2)))
    """)
    done = _python(code)
    assert done.returncode == 0, done.stderr
    import json
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    for r in reports:
        assert r["server_threads"] == 1
        assert r["server_had_torch"] is True
        assert r["ppid"] != os.getpid()
    assert reports[0]["ppid"] == reports[1]["ppid"]     # both forked by one server


@pytest.mark.skipif(not FORKSERVER, reason="the fork server is not this platform's default")
def test_a_rank_takes_the_callers_environment_and_threads_not_the_servers(monkeypatch):
    monkeypatch.setenv("STARTUP_TEST_MARKER", "first")
    first = collectives.spawn(_rank_report, 2)
    monkeypatch.setenv("STARTUP_TEST_MARKER", "second")
    second = collectives.spawn(_rank_report, 2, env={"OMP_NUM_THREADS": "2"})
    assert [r["marker"] for r in first + second] == ["first"] * 2 + ["second"] * 2
    assert [r["rank"] for r in second] == ["0", "1"]
    assert [r["torch_threads"] for r in first] == [1, 1]    # spawn's default for N > 1
    assert [r["torch_threads"] for r in second] == [2, 2]
    # every rank of every job drew its own numbers from numpy's global generator
    draws = [r["draw"] for r in first + second]
    assert len(set(draws)) == len(draws)


def _say_hello():
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    return True


def test_ranks_write_to_the_callers_output_of_now(capfd):
    # pytest points fd 1 at a new file for each test; a server started in an earlier
    # test still has that test's. The rank must write where the caller's fd 1 is now.
    assert collectives.spawn(_say_hello, 2) == [True, True]
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_functions_defined_in_main_work(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import collectives, numpy as np

        def work(scale):
            pg = collectives.init_process_group()
            t = np.array([pg.rank + 1.0]); pg.all_reduce(t); pg.close()
            return float(t[0]) * scale

        if __name__ == "__main__":
            print(collectives.spawn(work, 2, args=(10,)))
    """))
    for method in ("forkserver", "spawn"):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(ROOT),
                                       COLLECTIVES_START_METHOD=method))
        assert done.returncode == 0, (method, done.stderr)
        assert done.stdout.strip() == "[30.0, 30.0]", method


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_an_outside_tool_finds_each_rank_by_its_name_or_environment(monkeypatch):
    # Forked from the fork server, a rank's /proc/PID/environ is the server's; its name
    # (/proc/PID/comm) says its rank. Executed (start method spawn), both do.
    forked = collectives.spawn(_rank_report, 2)
    assert [r["comm"] for r in forked] == ["coll-rank0", "coll-rank1"]
    monkeypatch.setenv("COLLECTIVES_START_METHOD", "spawn")
    executed = collectives.spawn(_rank_report, 2)
    assert [r["comm"] for r in executed] == ["coll-rank0", "coll-rank1"]
    assert [r["real_rank"] for r in executed] == ["0", "1"]


def test_the_spawn_start_method_stays_available(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_START_METHOD", "spawn")
    assert warm_start.start_method() == "spawn"
    reports = collectives.spawn(_rank_report, 2)
    assert [r["rank"] for r in reports] == ["0", "1"]
    assert all(r["ppid"] == os.getpid() for r in reports)   # children of this process
    monkeypatch.setenv("COLLECTIVES_START_METHOD", "fork")
    with pytest.raises(ValueError, match="COLLECTIVES_START_METHOD"):
        collectives.spawn(_rank_report, 2)


def test_a_rank_forked_from_a_server_with_threads_refuses(monkeypatch):
    fake = types.ModuleType("collectives.preloaded")
    fake.THREADS = 3
    monkeypatch.setitem(sys.modules, "collectives.preloaded", fake)
    with pytest.raises(RuntimeError, match="3 threads.*COLLECTIVES_START_METHOD=spawn"):
        warm_start.rank_setup(dict(os.environ), "forkserver", ())
