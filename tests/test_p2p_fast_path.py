"""The blocking ``send``/``recv`` fast path (collectives.fast_path, ``_send_now`` /
``_recv_now``; shm: one C call each where the ring allows) keeps every guarantee of the
general path: bitwise payloads of every dtype, MPI's matching by tag, progress of this
rank's other operations, typed errors, the flight record. One 2-rank job per backend
(shm on the core, shm's Python path, zmq) runs the cases below in order.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

import collectives
from collectives import running
from collectives.errors import CollectiveError, CollectiveMismatch

from backends.shm import native

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int64", "bool"]


def _array(name: str, n: int, seed: int) -> np.ndarray:
    dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    bits = np.random.default_rng(seed).integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    a = bits.view(dt).copy()
    return (a != 0) if name == "bool" else a


def _cases() -> dict:
    import torch
    pg = collectives.init_process_group()
    me, peer = pg.rank, 1 - pg.rank
    general = []                                  # calls that took the general path
    start_p2p = running.start_p2p
    running.start_p2p = lambda g, op, *a, **k: (general.append(op), start_p2p(g, op, *a, **k))[1]
    posted = []                                   # shm: sends the core did not move
    engine = getattr(pg.transport, "_engine", None) if pg.backend == "shm" else None
    if engine is not None:
        post_send = engine.post_send
        engine.post_send = lambda *a: (posted.append(a[1]), post_send(*a))[1]
    out: dict = {}

    # Every dtype, bitwise, both ways (float16/bfloat16 as raw bits, NaNs included).
    for i, name in enumerate(DTYPES):
        mine, theirs = _array(name, 33, 10 * me + i), _array(name, 33, 10 * peer + i)
        got = np.zeros_like(theirs)
        if me == 0:
            pg.send(mine, 1, tag=i)
            pg.recv(got, 1, tag=i)
        else:
            pg.recv(got, 0, tag=i)
            pg.send(mine, 0, tag=i)
        out[name] = got.view(np.uint8).tobytes() == theirs.view(np.uint8).tobytes()
    out["fast_only"] = not general
    out["posted"] = len(posted)

    # Blocking, larger than a ring: the core hands it to the engine, which streams it.
    big = np.arange(3 << 20, dtype=np.float32) + me
    into = np.zeros_like(big)
    if me == 0:
        pg.send(big, 1, tag=20)
        pg.recv(into, 1, tag=21)
    else:
        pg.recv(into, 0, tag=20)
        pg.send(big, 0, tag=21)
    out["big"] = bool(np.array_equal(into, np.arange(3 << 20, dtype=np.float32) + peer))

    # Matching by tag: the message of tag 5 comes first; a receive for tag 6 must set it
    # aside, and the receive for tag 5 must find it.
    if me == 0:
        pg.send(np.full(4, 5.0, np.float32), 1, tag=5)
        pg.send(np.full(4, 6.0, np.float32), 1, tag=6)
    else:
        six, five = np.zeros(4, np.float32), np.zeros(4, np.float32)
        pg.recv(six, 0, tag=6)
        pg.recv(five, 0, tag=5)
        out["by_tag"] = (six.tolist(), five.tolist())

    # A blocking receive while this rank's own large isend is in flight (larger than a
    # ring): the receive must keep that send moving, on both ranks at once.
    big = np.arange(3 << 20, dtype=np.float32) + me
    into = np.zeros_like(big)
    w = pg.isend(big, peer, tag=7)
    pg.recv(into, peer, tag=7)
    w.wait()
    out["exchange"] = bool(np.array_equal(into, np.arange(3 << 20, dtype=np.float32) + peer))

    # A late sender: rank 0 sleeps past every spin and yield window.
    t = np.zeros(3, np.float32)
    if me == 0:
        time.sleep(0.3)
        pg.send(np.array([1, 2, 3], np.float32), 1, tag=8)
    else:
        pg.recv(t, 0, tag=8)
        out["late"] = t.tolist()

    # A size mismatch is typed, names both sides, and leaves the group usable.
    if me == 0:
        pg.send(np.ones(8, np.float32), 1, tag=9)
    else:
        try:
            pg.recv(np.zeros(4, np.float32), 0, tag=9)
            out["mismatch"] = "no error"
        except CollectiveMismatch as exc:
            out["mismatch"] = str(exc)
    pg.barrier()

    # torch tensors (the cached host view) and a non-contiguous one (staged).
    x = torch.arange(6, dtype=torch.float32) + 100 * me
    y = torch.zeros(6, 2)[:, 0]
    if me == 0:
        pg.send(x, 1)
        pg.recv(y, 1)
    else:
        pg.recv(y, 0)
        pg.send(x, 0)
    out["torch"] = y.tolist()

    records = pg._recorder.records() if pg._recorder is not None else []
    out["recorded"] = [(r["op"], r["peer"], r["state"]) for r in records
                       if r["op"] in ("send", "recv")][:4]
    out["native"] = getattr(pg.transport, "native", None)
    pg.close()
    try:
        pg.send(np.zeros(1, np.float32), peer)
        out["closed"] = "no error"
    except CollectiveError as exc:
        out["closed"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.parametrize("backend,env", [
    ("shm", {}), ("shm", {"COLLECTIVES_SHM_NATIVE": "0"}), ("zmq", {})],
    ids=["shm", "shm-py", "zmq"])
def test_blocking_send_and_recv_keep_the_general_paths_guarantees(backend, env):
    if backend == "shm" and not env and native.native_module() is None:
        pytest.skip("backends.shm._native is not built")
    results = collectives.spawn(_cases, 2, backend=backend, timeout=120, join_timeout=300,
                                env=env)
    for rank, got in enumerate(results):
        for name in DTYPES:
            assert got[name], (rank, name)
        assert got["fast_only"], rank       # contiguous arrays never took the general path
        assert got["exchange"] and got["big"], rank
        assert got["closed"].startswith(f"CollectiveError: [rank {rank}/2] send"), got["closed"]
        if backend == "shm" and not env:
            assert got["posted"] == 0, rank  # every small send: one C call
        assert got["torch"] == [float(v + 100 * (1 - rank)) for v in range(6)]
        assert got["recorded"] == [("send" if rank == 0 else "recv", 1 - rank, "ok"),
                                   ("recv" if rank == 0 else "send", 1 - rank, "ok")] * 2
    assert results[1]["by_tag"] == ([6.0] * 4, [5.0] * 4)
    assert results[1]["late"] == [1.0, 2.0, 3.0]
    mismatch = results[1]["mismatch"]          # each backend words the sizes its way
    assert mismatch.startswith("[rank 1/2] recv") and "rank 0" in mismatch, mismatch
    assert "tag 9" in mismatch and "float32" in mismatch, mismatch
    if backend == "shm":
        assert [r["native"] for r in results] == [not env] * 2


def _threads_job(rounds: int) -> list:
    """Two threads per rank ping-pong with the peer at once, one per tag, blocking: each
    thread's messages must come back whole and in order while the other thread's share
    the same ring (the core sees the other tag first and hands over to the engine)."""
    import threading
    pg = collectives.init_process_group()
    me, peer = pg.rank, 1 - pg.rank
    wrong = []

    def play(tag: int) -> None:
        got = np.zeros(64, np.int64)
        for i in range(rounds):
            mine = np.full(64, 1000 * tag + i, np.int64)
            if me == 0:
                pg.send(mine, peer, tag=tag)
                pg.recv(got, peer, tag=tag)
            else:
                pg.recv(got, peer, tag=tag)
                pg.send(mine, peer, tag=tag)
            if not np.all(got == 1000 * tag + i):
                wrong.append((tag, i, int(got[0])))
    threads = [threading.Thread(target=play, args=(tag,)) for tag in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    alive = [t.is_alive() for t in threads]
    pg.close()
    return wrong + [("thread still running", a) for a in alive if a]


@pytest.mark.parametrize("env", [{}, {"COLLECTIVES_SHM_NATIVE": "0"}], ids=["shm", "shm-py"])
def test_two_threads_of_a_rank_send_and_receive_at_once(env):
    results = collectives.spawn(_threads_job, 2, backend="shm", args=(300,), timeout=60,
                                join_timeout=200, env=env)
    assert results == [[], []], results
