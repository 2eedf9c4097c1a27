"""Regression tests for three bugs a new user met at once (the fourth, zmq's close race,
is in ``test_close_stress.py``):

- the send/recv defaults (``p2p:shm``, every default sub-group, any backend with point to
  point only) failed on shaped tensors: ``all_reduce`` of a ``(256, 64)`` tensor raised
  ``operands could not be broadcast together with shapes (0,) (0,64) (0,)``, because
  broadcast, all_reduce and reduce handed their hooks the caller's shape;
- gloo: a receive that waited longer than 0.5 s failed, because a sliced ``wait`` on a
  send or receive that times out closes gloo's connection;
- gloo: a run that ended well printed torch's ``recvValueWithTimeout failed`` warning with
  a C++ stack, when rank 0 let its store server go before a client's last wait was
  answered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from collectives.testing.pool import WorldPool
from test_hygiene import _backends

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("shm", "p2p:shm", "zmq", "gloo", "mpi")


def shaped_collectives(group: Any) -> list[str]:
    """Shaped and 0-d tensors through the size-dependent paths of broadcast, all_reduce
    and reduce; returns what came out wrong (empty: all right)."""
    n, r, wrong = group.size, group.rank, []
    total = n * (n + 1) / 2
    for shape in [(256, 64), (4, 40000), (2, 3, 5), ()]:
        t = torch.full(shape, r + 1.0)
        group.all_reduce(t)
        if not bool((t == total).all()):
            wrong.append(f"all_reduce {shape}")
        a = np.full(shape, r + 1.0, np.float32)
        group.reduce(a, dst=n - 1)
        if not (a == (total if r == n - 1 else r + 1)).all():
            wrong.append(f"reduce {shape}")
    b = torch.full((3, 200000), float(r))  # 2.4 MB: the two-phase broadcast for n > 2
    group.broadcast(b, src=n - 1)
    if not bool((b == n - 1).all()):
        wrong.append("broadcast (3, 200000)")
    v = torch.full((8, 6000), r + 1.0)[:, ::2]  # a non-contiguous view, staged
    group.all_reduce(v)
    if not bool((v == total).all()):
        wrong.append("all_reduce of a (8, 3000) view")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3], ids=["n2", "n3"])
@pytest.mark.parametrize("backend", _backends(BACKENDS))
def test_shaped_tensors_through_every_path(pool: WorldPool) -> None:
    results = pool.call(shaped_collectives)
    assert results == [[]] * pool.world_size, results


def late_peers(group: Any, delay: float) -> dict:
    """Rank 1 sends ``delay`` seconds late; then rank 0 joins an all_reduce late; then an
    irecv is polled with ``is_completed`` and ``wait(timeout)`` while its sender is late."""
    r = group.rank
    t = torch.zeros(3)
    if r == 1:
        time.sleep(delay)
        group.send(torch.full((3,), 7.0), dst=0)
    elif r == 0:
        start = time.monotonic()
        group.recv(t, src=1)
        waited = time.monotonic() - start
    u = torch.full((2,), float(r))
    if r == 0:
        time.sleep(delay)
    group.all_reduce(u)
    polled = None
    if r == 0:
        got = torch.zeros(4)
        work = group.irecv(got, src=1, tag=3)
        early = work.is_completed()
        start = time.monotonic()
        while not work.is_completed():
            if time.monotonic() - start > 30:
                raise AssertionError("irecv.is_completed() never became true")
            time.sleep(0.01)
        work.wait(timeout=5.0)
        polled = (early, got.tolist())
    elif r == 1:
        time.sleep(delay)
        group.send(torch.arange(4.0), dst=0, tag=3)
    return {"recv": t.tolist(), "waited": waited if r == 0 else None,
            "all_reduce": u.tolist(), "polled": polled}


@pytest.mark.parametrize("world_size", [2], ids=["n2"])
@pytest.mark.parametrize("backend", _backends(BACKENDS))
def test_a_late_sender_is_waited_for(pool: WorldPool) -> None:
    delay = 1.2  # longer than every backend's internal watch interval (gloo: 0.5 s)
    res = pool.call(late_peers, delay)
    assert res[0]["recv"] == [7.0] * 3
    assert res[0]["waited"] >= delay - 0.2
    assert res[0]["all_reduce"] == res[1]["all_reduce"] == [1.0, 1.0]
    assert res[0]["polled"] == (False, [0.0, 1.0, 2.0, 3.0])


_GLOO_WORLDS = textwrap.dedent("""
    import os, sys, torch, collectives
    from collectives.spawn import free_port

    def main(worlds):
        meet = collectives.init_process_group("shm")
        for _ in range(worlds):
            os.environ["MASTER_PORT"] = str(meet.broadcast_object(
                free_port() if meet.rank == 0 else None))
            pg = collectives.init_process_group("gloo")
            t = torch.ones(4)
            pg.all_reduce(t)
            assert t.tolist() == [2.0] * 4
            pg.close()
        meet.close()

    if __name__ == "__main__":
        collectives.spawn(main, 2, args=(int(sys.argv[1]),))
        print("done")
""")


def test_gloo_worlds_that_end_well_print_no_warning(tmp_path: Path) -> None:
    """30 gloo worlds, each closed right after an all_reduce: nothing on stderr from
    torch's store (before the fix, about one world in eight printed the warning)."""
    script = tmp_path / "gloo_worlds.py"
    script.write_text(_GLOO_WORLDS)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), "30"], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("done")
    assert "recvValueWithTimeout" not in proc.stderr, proc.stderr[-3000:]
    assert "TCPStore" not in proc.stderr, proc.stderr[-3000:]


def _abort_on_rank_1() -> None:
    import collectives
    pg = collectives.init_process_group()
    if pg.rank == 1:
        os.abort()  # as gloo's C++ terminate() does on some mismatched calls
    pg.barrier()


def test_a_rank_killed_by_sigabrt_is_named_with_the_way_out() -> None:
    """A rank that aborts inside gloo: the parent's error says which signal, and how to
    have a mismatch named."""
    import collectives
    with pytest.raises(collectives.SpawnError) as info:
        collectives.spawn(_abort_on_rank_1, 2, backend="gloo", timeout=20)
    text = str(info.value)
    assert "killed by signal 6 (SIGABRT)" in text, text
    assert "COLLECTIVES_DEBUG=1" in text, text


def test_describe_exit() -> None:
    from collectives.spawn import describe_exit
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9, "gloo") == "was killed by signal 9 (SIGKILL)"
    assert "COLLECTIVES_DEBUG=1" in describe_exit(-6, "mpi")
    assert describe_exit(-6, "shm") == "was killed by signal 6 (SIGABRT)"
