"""Backend-specific tests of the zmq backend (the generic conformance suite runs it too):
every collective at 2 and 3 ranks incl. a 64 MiB all_reduce, mismatch detection, a dead
and a hung peer, timeouts, clean close, hostile clients on the data and rendezvous ports,
the authentication modes, and a 4-rank world across two network namespaces.

Each spawned job starts fresh interpreters (about half a second), so each job runs many
checks; the ``_job_*`` functions run inside the ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import collectives
from collectives import CollectiveMismatch, CollectiveTimeout, ReduceOp
from collectives.launch import Rendezvous
from collectives.reduce_op import reduce_arrays
from collectives.spawn import SpawnError, free_port
from faults.tasks import listening_inodes

zmq = pytest.importorskip("zmq")

from backends.zeromq import auth, wire  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(n, count, dtype, seed):
    """Every rank's input (each rank builds all of them, for the reference): small
    integers, so every reduction is exact in every dtype and order."""
    out = []
    for r in range(n):
        rng = np.random.default_rng(seed * 1000 + r)
        out.append(rng.integers(-3, 4, size=count).astype(np.float32).astype(dtype))
    return out


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------- every collective
def _job_collectives(large: bool):
    pg = collectives.init_process_group()
    r, n = pg.rank, pg.size
    assert pg.backend == "zmq" and pg.transport.auth_mode == "secret", pg.transport.auth_mode
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    seed = 0
    # all_reduce and reduce: sizes around the direct / reduce-scatter threshold and the
    # 4 MiB part size, odd sizes, empty; several dtypes and every operator.
    cases = [(np.dtype(d), c, op) for d in (np.float32, np.float64, np.int64, np.int8)
             for c in (0, 1, 7) for op in ReduceOp if not (op is ReduceOp.AVG and d in (np.int64, np.int8))]
    cases += [(f32, 16_385, ReduceOp.SUM), (bf16, 40_001, ReduceOp.MAX),
              (np.dtype(np.float16), 33_000, ReduceOp.MIN), (f32, 1_048_577 * 2 + 3, ReduceOp.SUM),
              (np.dtype(np.int32), 300_001, ReduceOp.MAX)]
    for dtype, count, op in cases:
        seed += 1
        ins = _inputs(n, count, dtype, seed)
        ref = reduce_arrays(op, ins)
        a = ins[r].copy()
        pg.all_reduce(a, op=op)
        assert _same(a, ref), ("all_reduce", dtype, count, op)
        dst = seed % n
        a = ins[r].copy()
        pg.reduce(a, dst=dst, op=op)
        assert _same(a, ref if r == dst else ins[r]), ("reduce", dtype, count, op)
    for count in (0, 5, 300_001):
        for src in range(n):
            seed += 1
            ins = _inputs(n, count, f32, seed)
            a = ins[r].copy()
            pg.broadcast(a, src=src)
            assert _same(a, ins[src]), ("broadcast", count, src)
    for count in (0, 3, 70_001):
        seed += 1
        ins = _inputs(n, count, bf16, seed)
        out = np.empty(n * count, bf16)
        pg.all_gather(out, ins[r])
        assert _same(out, np.concatenate(ins)), ("all_gather", count)
        dst = seed % n
        out = np.empty(n * count, bf16) if r == dst else None
        pg.gather(ins[r], out, dst=dst)
        assert r != dst or _same(out, np.concatenate(ins)), ("gather", count)
        whole = _inputs(n, n * count, f32, seed + 500)
        part = np.empty(count, f32)
        pg.scatter(part, whole[dst] if r == dst else None, src=dst)
        assert _same(part, whole[dst][r * count:(r + 1) * count]), ("scatter", count)
        pg.reduce_scatter(part, whole[r])
        assert _same(part, reduce_arrays(ReduceOp.SUM, whole)[r * count:(r + 1) * count])
    # all_to_all, equal and uneven splits
    ins = _inputs(n, 4 * n, np.int64, 77)
    out = np.empty(4 * n, np.int64)
    pg.all_to_all(out, ins[r])
    assert _same(out, np.concatenate([ins[p][4 * r:4 * r + 4] for p in range(n)]))
    splits = [[(i + j) % 3 for j in range(n)] for i in range(n)]  # rank i sends splits[i][j] to j
    ins = [np.arange(sum(splits[i]), dtype=np.float64) + 100 * i for i in range(n)]
    out = np.empty(sum(splits[j][r] for j in range(n)))
    pg.all_to_all(out, ins[r], output_split_sizes=[splits[j][r] for j in range(n)],
                  input_split_sizes=splits[r])
    expect = np.concatenate([ins[j][sum(splits[j][:r]):sum(splits[j][:r + 1])] for j in range(n)])
    assert _same(out, expect)
    pg.barrier()
    # torch tensors, a non-contiguous view, async work waited in reverse
    import torch
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (r + 1)
    pg.all_reduce(t)
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (n * (n + 1) / 2))
    a, b = np.full(100_000, r + 1.0), np.full(5, r, np.int32)
    works = [pg.all_reduce(a, async_op=True), pg.broadcast(b, src=n - 1, async_op=True),
             pg.barrier(async_op=True)]
    for w in reversed(works):
        w.wait(timeout=60)
    assert (a == n * (n + 1) / 2).all() and (b == n - 1).all()
    # point to point: a ring of 5 MiB messages (two parts) on two tags, received out of order
    nxt, prv = (r + 1) % n, (r - 1) % n
    big = np.arange(1_310_721, dtype=np.float32) + r
    sends = [pg.isend(big, nxt, tag=5), pg.isend(np.full(3, r, np.int16), nxt, tag=6)]
    got_small, got_big = np.empty(3, np.int16), np.empty_like(big)
    pg.recv(got_small, prv, tag=6)
    pg.irecv(got_big, prv, tag=5).wait()
    for w in sends:
        w.wait()
    assert (got_small == prv).all() and _same(got_big, np.arange(1_310_721, dtype=np.float32) + prv)
    # two waiters at once: an async collective on the group's thread while this thread
    # exchanges point to point (they share the progress token)
    c = np.full(1_100_001, r + 1.0, np.float32)  # more than one 4 MiB part
    work = pg.all_reduce(c, async_op=True)
    for i in range(8):
        w = pg.isend(np.full(1000, i + r, np.int64), nxt, tag=100 + i)
        got = np.empty(1000, np.int64)
        pg.recv(got, prv, tag=100 + i)
        w.wait()
        assert (got == i + prv).all()
    work.wait()
    assert (c == n * (n + 1) / 2).all()
    # a sub-group over the same sockets, interleaved with the world
    if r in (0, n - 1):
        sub = pg.new_group([0, n - 1])
        x = np.full(10, r + 1.0)
        sub.all_reduce(x)
        assert (x == 1 + n).all()
        assert sub.transport.connections.keys() == {1 - sub.rank}
    pg.barrier()
    objs = pg.all_gather_object({"rank": r, "eps": pg.transport.endpoints})
    assert [o["rank"] for o in objs] == list(range(n))
    digest = None
    if large:  # 64 MiB, once: results right and bitwise identical on every rank
        count = (64 << 20) // 4
        a = np.full(count, r + 1.0, np.float32)
        a[::4097] = 0.5 * r
        t0 = time.perf_counter()
        pg.all_reduce(a)
        elapsed = time.perf_counter() - t0
        expect = np.full(count, n * (n + 1) / 2, np.float32)
        expect[::4097] = 0.5 * n * (n - 1) / 2
        assert _same(a, expect)
        digest = hashlib.sha256(a.tobytes()).hexdigest()
        digests = pg.all_gather_object(digest)
        assert len(set(digests)) == 1
        digest = (digest, elapsed)
    pg.close()
    return {"stats": pg.transport.stats, "large": digest}


@pytest.mark.parametrize("n", [2, 3])
def test_every_collective(n):
    results = collectives.spawn(_job_collectives, n, args=(n == 2,), backend="zmq", timeout=60)
    assert all(res["stats"]["rejected"] == 0 for res in results)
    if n == 2:
        assert results[0]["large"][0] == results[1]["large"][0]


def test_default_algorithms_over_zmq_point_to_point():
    """``p2p:zmq``: the send/recv algorithms of collectives.algorithms over this backend's
    point to point (no sequence checks of its own), against the reference."""
    from collectives.testing import check_backend
    check_backend("p2p:zmq", world_sizes=(3,), max_examples=25, timeout=20)


# ------------------------------------------------------------- the fast paths' edges
def _nan_with_payload(dtype, payload: int):
    """A quiet NaN of ``dtype`` carrying ``payload``: x86 adds, multiplies and compares two
    NaNs into the first operand's, so the operand order shows in the result's bits."""
    bits = {np.dtype(np.float32): (np.uint32, 0x7FC00000),
            np.dtype(np.float64): (np.uint64, 0x7FF8000000000000)}[np.dtype(dtype)]
    return np.array([bits[1] | payload], bits[0]).view(dtype)[0]


def _job_reduce_from_received_parts():
    """Large all_reduce read straight from the received parts (two ranks' one round up to
    PAIR_ONE_ROUND_BYTES, reduce-scatter + all-gather above it and at three ranks): random
    floats with a NaN of a different payload on every rank at a few places (so a swapped
    operand order changes bits), one and several frames per message, a late rank whose
    peers' messages are read before it posts its receives (they wait as unexpected
    messages), several dtypes and AVG."""
    from backends.zeromq import native
    pg = collectives.init_process_group()
    r, n = pg.rank, pg.size
    taken = []  # the algorithm each call took
    for name in ("pair_all_reduce", "direct_rsag_all_reduce"):
        def counted(*args, _name=name, _fn=getattr(native, name)):
            taken.append(_name)
            return _fn(*args)
        setattr(native, name, counted)
    out = []
    for count, dtype, op, late in [(3 * 300_001, np.float32, ReduceOp.SUM, 1),
                                   (1_500_001, np.float32, ReduceOp.SUM, 0),  # 2 frames
                                   (1_048_576 * 3 + 7, np.float32, ReduceOp.AVG, 0),
                                   (200_003, ml_dtypes.bfloat16, ReduceOp.MAX, n - 1),
                                   (70_001, np.float64, ReduceOp.PRODUCT, -1)]:
        ins = [np.random.default_rng(100 * p + count).standard_normal(count).astype(dtype)
               for p in range(n)]
        if dtype is not ml_dtypes.bfloat16:
            for p in range(n):
                ins[p][count // 7::count // 3] = _nan_with_payload(dtype, p + 1)
        a = ins[r].copy()
        unexpected = None
        if r == late:
            time.sleep(0.3)
            before = pg.transport.stats["unexpected"]
            pg.transport._engine._progress.drain_if_free()  # read what the peers sent first
            unexpected = pg.transport.stats["unexpected"] > before
        pg.all_reduce(a, op=op)
        pair = n == 2 and a.nbytes <= native.PAIR_ONE_ROUND_BYTES
        if pair:  # the documented order: a0 op a1 on both ranks
            expect = reduce_arrays(op, ins)
        else:  # chunk j's owner folds its own part first, then the others in rank order;
            # every rank receives the owner's bits
            bounds = [count * j // n for j in range(n + 1)]
            expect = np.empty(count, dtype)
            for j in range(n):
                lo, hi = bounds[j], bounds[j + 1]
                expect[lo:hi] = reduce_arrays(op, [ins[j][lo:hi]] + [ins[p][lo:hi]
                                                                      for p in range(n) if p != j])
        algorithm = "pair_all_reduce" if pair else "direct_rsag_all_reduce"
        out.append((count, _same(a, expect), hashlib.sha256(a.tobytes()).hexdigest(),
                    taken.pop() == algorithm, unexpected))
    pg.close()
    return out


@pytest.mark.parametrize("n", [2, 3])  # 2: zero-copy parts; 3: parts copied into scratch
def test_large_all_reduce_reads_received_parts_in_rank_order(n):
    results = collectives.spawn(_job_reduce_from_received_parts, n, backend="zmq", timeout=60)
    for case in zip(*results):
        assert all(ok and algorithm for _, ok, _, algorithm, _ in case), case
        assert len({digest for _, _, digest, _, _ in case}) == 1, case  # bitwise identical
        # the late rank (if any) had its peers' messages waiting before it called
        assert all(late is not False for *_, late in case), case


def _job_backlog_then_close(count):
    """Rank 0 floods rank 1 with small messages, meets it in a barrier and closes at
    once; rank 1 reads the backlog (longer than the lost-peer grace) inside that barrier."""
    pg = collectives.init_process_group()
    got = 0
    if pg.rank == 0:
        works = [pg.isend(np.full(2, i, np.int32), 1, tag=1) for i in range(count)]
        pg.barrier()
        for w in works:
            w.wait()
    else:
        time.sleep(1.0)
        pg.barrier()  # rank 0's barrier message is behind `count` others
        buf = np.empty(2, np.int32)
        for i in range(count):
            pg.recv(buf, 0, tag=1)
            got += int(buf[0] == i)
    pg.close()
    return got


def test_a_backlog_from_a_closing_peer_is_read_before_it_counts_as_lost():
    assert collectives.spawn(_job_backlog_then_close, 2, args=(20_000,), backend="zmq",
                             timeout=60) == [0, 20_000]


def _job_talk_to_a_closed_peer():
    """Rank 1 closes after a barrier; rank 0 then receives from it and sends to it."""
    pg = collectives.init_process_group()
    pg.barrier()
    out = {}
    if pg.rank == 0:
        for what, call in (("recv", lambda: pg.recv(np.empty(2, np.int32), 1, tag=3)),
                           ("send", lambda: pg.send(np.zeros(2, np.int32), 1, tag=3))):
            try:
                call()
                out[what] = None
            except collectives.PeerError as exc:
                out[what] = (str(exc), exc.peer)
    pg.close()
    return out


def test_a_closed_peer_is_named_first_in_every_error():
    zero, _ = collectives.spawn(_job_talk_to_a_closed_peer, 2, backend="zmq", timeout=60)
    message, peer = zero["recv"]
    assert peer == 1 and message.startswith("[rank 0/2] recv") and message.endswith(
        ": rank 1 closed its process group before sending the message this rank waits for"), \
        message
    message, peer = zero["send"]
    assert peer == 1 and message.startswith("[rank 0/2] send") and message.endswith(
        ": rank 1 closed its process group; this rank cannot send to it"), message


def test_rendezvous_connection_retries_within_milliseconds():
    """A rank connecting to the rendezvous before rank 0 listens retries after a few ms,
    backing off to 50 ms (libzmq's fixed 100 ms made 1 world creation in 3 take ~150 ms
    instead of ~5 ms); data connections, made once every peer listens, never retry."""
    from backends.zeromq import sockets

    ctx = zmq.Context()
    try:
        rdv = sockets.new_dealer(ctx, 5.0, False, reconnect=True)
        data = sockets.new_dealer(ctx, 5.0, False, reconnect=False)
        assert rdv.getsockopt(zmq.RECONNECT_IVL) <= 10
        assert 10 < rdv.getsockopt(zmq.RECONNECT_IVL_MAX) <= 100
        assert data.getsockopt(zmq.RECONNECT_IVL) == -1
        rdv.close(0)
        data.close(0)
    finally:
        ctx.term()


def test_inline_frames_are_checked():
    """Small tensors travel as one INLINE frame (header + payload): a frame whose length
    does not match its header, or an oversized one, is not ours (dropped)."""
    a = np.arange(5, dtype=np.float32)
    header = wire.pack(wire.Kind.DATA, 0, 1, meta=wire.Meta(3, 7, 5), tag=9, array=a)
    frame = wire.pack_inline(header, a.data.cast("B"))
    h = wire.parse(frame)
    assert h is not None and h.kind == wire.Kind.INLINE and h.nbytes == 20 and h.tag == 9
    assert np.array_equal(np.frombuffer(frame, np.float32, 5, wire.HEADER.size), a)
    assert wire.parse(frame + b"x") is None and wire.parse(frame[:-1]) is None
    assert wire.parse(header + bytes(20)) is None  # a DATA header is never INLINE-sized
    big = np.zeros(wire.INLINE_MAX // 4 + 1, np.float32)
    assert wire.parse(wire.pack_inline(wire.pack(wire.Kind.DATA, 0, 1, array=big),
                                       big.data.cast("B"))) is None


# ---------------------------------------------------------------------------- mismatch
def _expect_mismatch(fn):
    t0 = time.monotonic()
    try:
        fn()
    except CollectiveMismatch as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


def _job_mismatch():
    pg = collectives.init_process_group()
    r, n = pg.rank, pg.size
    everyone = list(range(n))
    out = {}

    def fresh():
        return pg.new_group(everyone)  # a group of its own, over the same sockets

    scenarios = {
        "size": lambda g: g.all_reduce(np.ones(10 if r == 0 else 20, np.float32)),
        "dtype": lambda g: g.all_reduce(np.ones(8, np.int32 if r == 1 else np.float32)),
        "op": lambda g: g.broadcast(np.ones(4), src=2) if r == 2 else g.all_reduce(np.ones(4)),
        "root": lambda g: g.broadcast(np.ones(4), src=0 if r == 0 else 1),
    }
    for what, call in scenarios.items():
        g = pg.new_group(everyone)  # a group of its own, over the same sockets

        def run():
            call(g)
            g.barrier()  # a root that returned early learns of the mismatch here
        out[what] = _expect_mismatch(run)
    # p2p: the receiver expects another dtype and size; the world stays usable
    p2p = None
    if r == 0:
        pg.send(np.ones(4), dst=1, tag=3)
    elif r == 1:
        p2p = _expect_mismatch(lambda: pg.recv(np.empty(5, np.int32), src=0, tag=3))
    out["p2p"] = p2p
    x = np.full(3, r + 1.0)
    pg.all_reduce(x)
    out["world_ok"] = bool((x == n * (n + 1) / 2).all())
    pg.close()
    return out


def test_mismatches_are_detected_and_name_both_sides():
    results = collectives.spawn(_job_mismatch, 3, backend="zmq", timeout=30)
    for r, res in enumerate(results):
        assert res["world_ok"]
        for what in ("size", "dtype", "op", "root"):
            text, elapsed = res[what]
            assert text is not None, f"rank {r}: no CollectiveMismatch for a {what} mismatch"
            assert f"[rank {r}/3]" in text and elapsed < 10, (what, text, elapsed)
    texts = {what: " | ".join(res[what][0] for res in results) for what in ("size", "dtype", "op")}
    assert "float32[10]" in texts["size"] and "float32[20]" in texts["size"], texts["size"]
    assert "int32" in texts["dtype"] and "float32" in texts["dtype"], texts["dtype"]
    assert "broadcast" in texts["op"] and "all_reduce" in texts["op"], texts["op"]
    for r, res in enumerate(results):  # each rank names both roots, its own too
        text = res["root"][0]
        assert "root 0" in text and "root 1" in text, f"rank {r}: {text}"
    p2p, _ = results[1]["p2p"]
    assert "float64[4]" in p2p and "int32[5]" in p2p and "tag 3" in p2p, p2p


def _job_member_aborts_subgroup():
    """World rank 1 (the sub-group's rank 0) aborts a sub-group of world ranks 1 and 2
    while world rank 2 waits in its all_reduce."""
    pg = collectives.init_process_group()
    sub = pg.new_group([1, 2]) if pg.rank else None
    pg.barrier()
    out = None
    if pg.rank == 1:
        time.sleep(0.5)
        sub.abort("a failure of its own")
    elif pg.rank == 2:
        t0 = time.monotonic()
        try:
            sub.all_reduce(np.ones(8))
            out = {"error": None}
        except collectives.CollectiveError as exc:
            out = {"error": type(exc).__name__, "peer": getattr(exc, "peer", None),
                   "message": str(exc), "after_s": time.monotonic() - t0}
    pg.barrier()
    pg.close()
    return out


def test_a_member_that_aborts_a_subgroup_is_named_by_the_others():
    # (a peer that left the call is a PeerError naming it by its rank in the group, where
    # disagreeing calls are a CollectiveMismatch: test_mismatches_are_detected_and_name_both_sides)
    got = collectives.spawn(_job_member_aborts_subgroup, 3, backend="zmq", timeout=30)[2]
    assert got["error"] == "PeerError" and got["peer"] == 0, got
    assert got["message"].startswith("[rank 1/2] all_reduce"), got
    assert "rank 0 reported" in got["message"] and got["after_s"] < 10, got


# ------------------------------------------------------------------- faults and timeouts
def _write(path: str, rank: int, payload: dict) -> None:
    with open(f"{path}.{rank}", "w") as f:
        json.dump(payload, f)


def _job_peer_dies(path: str):
    pg = collectives.init_process_group()
    if pg.rank == pg.size - 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    # spawn stops the survivors (SIGTERM, then SIGKILL 2 s later) once it sees the death:
    # ignore the SIGTERM so that a survivor slowed by a loaded machine still reports.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    t0 = time.monotonic()
    try:
        pg.all_reduce(np.ones(1000))
        outcome = {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = {"error": type(exc).__name__, "message": str(exc),
                   "peer": getattr(exc, "peer", None)}
    outcome["elapsed"] = time.monotonic() - t0
    _write(path, pg.rank, outcome)
    pg.close()


def _job_peer_hangs(path: str):
    pg = collectives.init_process_group()
    pids = pg.all_gather_object(os.getpid())
    if pg.rank == 1:
        time.sleep(60)  # stopped by rank 0 meanwhile
        return
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        pg.recv(np.empty(4), src=1)
        outcome = {"error": None}
    except Exception as exc:  # noqa: BLE001
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["elapsed"] = time.monotonic() - t0
    os.kill(pids[1], signal.SIGKILL)
    _write(path, 0, outcome)
    pg.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_hung_peer_is_a_peer_error_within_seconds(tmp_path, how):
    path = str(tmp_path / "outcome")
    if how == "killed":  # the connection closes at once
        job, n, env, survivors = _job_peer_dies, 3, {}, [0, 1]
    else:  # a silent peer: ZMTP heartbeats close its connection
        job, n, env, survivors = _job_peer_hangs, 2, {"COLLECTIVES_ZMQ_HEARTBEAT_S": "1.5"}, [0]
    with pytest.raises(SpawnError):
        collectives.spawn(job, n, args=(path,), backend="zmq", timeout=60, env=env)
    for r in survivors:
        with open(f"{path}.{r}") as f:
            outcome = json.load(f)
        assert outcome["error"] == "PeerError", outcome
        assert outcome["elapsed"] < 10, outcome
        assert f"rank {n - 1}" in outcome["message"], outcome


def _outcome(fn, t0: float) -> dict:
    try:
        fn()
        out = {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"error": type(exc).__name__, "message": str(exc),
               "peer": getattr(exc, "peer", None)}
    out["elapsed"] = time.monotonic() - t0
    return out


def _job_death_reaches_everyone(path: str):
    """Rank 2 dies (SIGSTOPped by rank 0 first, then SIGKILLed) while rank 0 waits for a
    zero-copy send to it that its stopped I/O thread could not take, and rank 1 waits in
    a broadcast for rank 0 only (a survivor that never sends)."""
    pg = collectives.init_process_group()
    pids = pg.all_gather_object(os.getpid())
    pg.barrier()  # (rank 0 leaving it means every rank finished the all_gather above)
    if pg.rank == 2:
        time.sleep(60)  # stopped, then killed by rank 0
        return
    if pg.rank == 1:
        # spawn stops the survivors (SIGTERM, then SIGKILL 2 s later) as soon as it sees
        # rank 2 die: ignore the SIGTERM so that this rank reports what it saw.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        t0 = time.monotonic()
        _write(path, 1, {"broadcast": _outcome(
            lambda: pg.broadcast(np.ones(4, np.float32), src=0), t0)})
        pg.close()
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # (as rank 1: report what it saw)
    time.sleep(0.2)  # rank 1 leaves the barrier and waits in its broadcast
    os.kill(pids[2], signal.SIGSTOP)
    work = pg.isend(np.ones(16 << 20, np.float32), dst=2)  # 64 MiB: more than buffers hold
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    out = {"send": _outcome(work.wait, t0)}
    t1 = time.monotonic()  # the next collective over the broken world fails at once
    out["barrier"] = _outcome(pg.barrier, t1)
    _write(path, 0, out)
    pg.close()


def test_a_death_reaches_every_survivor_naming_the_dead_rank(tmp_path):
    """A send the dead rank never took fails at once (it used to wait for the timeout),
    and so does a survivor's wait for another survivor: a collective over a dead rank
    cannot complete. The group timeout (30 s) is far beyond the launcher's patience with
    the survivors (~3 s after the death: they ignore its SIGTERM, not its SIGKILL), so
    only a prompt PeerError writes its file."""
    path = str(tmp_path / "outcome")
    with pytest.raises(SpawnError):
        collectives.spawn(_job_death_reaches_everyone, 3, args=(path,), backend="zmq",
                          timeout=30)
    outcomes = {}
    for r in (0, 1):
        with open(f"{path}.{r}") as f:
            outcomes.update(json.load(f))
    for what, out in outcomes.items():
        assert out["error"] == "PeerError" and out["peer"] == 2, (what, out)
        assert "rank 2" in out["message"] and out["elapsed"] < 2.0, (what, out)
    assert outcomes["barrier"]["elapsed"] < 0.5, outcomes["barrier"]


def _job_timeouts():
    pg = collectives.init_process_group()
    out = {}
    if pg.rank == 1:
        time.sleep(3.0)
        pg.all_reduce(np.ones(4))
    else:
        t0 = time.monotonic()
        try:
            pg.all_reduce(np.ones(4))
        except CollectiveTimeout as exc:
            out["collective"] = (str(exc), exc.op, exc.seq, list(exc.missing),
                                 time.monotonic() - t0)
        t0 = time.monotonic()
        try:
            pg.irecv(np.empty(2), src=1, tag=9).wait(timeout=0.3)
        except CollectiveTimeout as exc:
            out["p2p"] = (str(exc), exc.op, time.monotonic() - t0)
    x = np.full(2, pg.rank + 1.0)
    pg.all_reduce(x)  # the group is usable after a timeout
    out["after"] = x.tolist()
    pg.close()
    return out


def test_timeouts_name_op_seq_and_missing_rank():
    results = collectives.spawn(_job_timeouts, 2, backend="zmq", timeout=1.5)
    text, op, seq, missing, elapsed = results[0]["collective"]
    assert op == "all_reduce" and seq == 0 and missing == [1], results[0]
    assert "[rank 0/2] all_reduce (seq 0)" in text and "rank 1" in text, text
    assert 1.4 < elapsed < 3.0, elapsed
    text, op, elapsed = results[0]["p2p"]
    assert "recv" in text and elapsed < 1.5, text
    assert results[0]["after"] == results[1]["after"] == [3.0, 3.0]


# ------------------------------------------------------------------------ clean close
def _socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _listening_ports() -> set:
    return set(listening_inodes().values())


def _job_close():
    threads0 = sorted(t.name for t in threading.enumerate())
    fds0 = _socket_fds()
    pg = collectives.init_process_group()
    master = int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + 2  # libzmq closes a socket in its own thread, soon after
    while master in _listening_ports() and time.monotonic() < deadline:
        time.sleep(0.01)
    rendezvous_open_after_init = master in _listening_ports()
    port = int(pg.transport.endpoints["tcp"].rsplit(":", 1)[1])
    ipc_dir = os.path.dirname(pg.transport.endpoints["ipc"][len("ipc://"):])
    listening = port in _listening_ports()
    a = np.ones(1 << 20, np.float32)  # zero-copy sends
    pg.all_reduce(a, async_op=True).wait()
    sub = pg.new_group([0, 1])
    sub.broadcast(a, src=1, async_op=True).wait()
    pg.close()
    pg.close()  # idempotent
    try:
        pg.barrier()
        used_after_close = "no error"
    except collectives.CollectiveError as exc:
        used_after_close = type(exc).__name__
    deadline = time.monotonic() + 3
    while sorted(t.name for t in threading.enumerate()) != threads0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"threads": (threads0, sorted(t.name for t in threading.enumerate())),
            "fds": (fds0, _socket_fds()), "port": (listening, port in _listening_ports()),
            "rendezvous_open_after_init": rendezvous_open_after_init,
            "ipc_dir_left": os.path.exists(ipc_dir), "used_after_close": used_after_close}


def test_close_leaves_no_thread_socket_port_or_file():
    for res in collectives.spawn(_job_close, 2, backend="zmq", timeout=30):
        assert res["threads"][0] == res["threads"][1], res["threads"]
        assert res["fds"][0] == res["fds"][1], res["fds"]
        assert res["port"] == (True, False), res["port"]
        assert not res["rendezvous_open_after_init"] and not res["ipc_dir_left"]
        assert res["used_after_close"] == "CollectiveError"


# --------------------------------------------------------------------- hostile clients
_PWNED = "/tmp/czmq-test-pwned"


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_PWNED}",))


def _attack(endpoint: str, victim: int) -> int:
    """Garbage, a forged header, a forged handshake and an oversized frame at
    ``endpoint`` (tcp://host:port) from a raw TCP client and a ZeroMQ client without the
    secret. Returns how many messages were sent."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    sent = 0
    for payload in (b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n", os.urandom(5000),
                    b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 100):
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(payload)
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        evil = pickle.dumps(_Evil())
        arr = np.frombuffer(evil, np.uint8)
        for tag in (0, 1 << 39):  # the tags of p2p and of the first collectives
            for seq in (0, 1, 2, 3, wire.NO_SEQ):
                forged = wire.pack(wire.Kind.DATA, 0, victim, tag=tag | (seq & 0xFFFFFF) << 12,
                                   array=arr, meta=wire.Meta(wire.OP_CODES["broadcast"], seq))
                d.send_multipart([forged, evil])
                sent += 1
        d.send_multipart([b"garbage", b"more garbage"])
        d.send(b"x" * 10)
        hello = wire.pack(wire.Kind.HELLO, 0, victim)
        d.send_multipart([hello, bytes([auth.PURPOSE_DATA, 1]) + os.urandom(32)])
        d.send_multipart([wire.pack(wire.Kind.PROOF, 0, victim), os.urandom(32)])
        d.send_multipart([wire.pack(wire.Kind.DATA, 0, victim), b"y" * (5 << 20)])  # > MAXMSGSIZE
        sent += 5
        time.sleep(0.3)
    finally:
        ctx.destroy(0)
    return sent


def _job_under_attack():
    pg = collectives.init_process_group()
    r = pg.rank
    endpoints = pg.all_gather_object(pg.transport.endpoints["tcp"])
    sent = _attack(endpoints[1], 1) if r == 0 else 0
    pg.barrier()
    config = pg.broadcast_object({"lr": 0.5} if r == 0 else None, src=0)
    x = np.full(1000, r + 1.0)
    pg.all_reduce(x)
    y = np.zeros(3)
    if r == 0:
        pg.send(np.full(3, 7.0), dst=1)
    else:
        pg.recv(y, src=0)
    stats = pg.transport.stats
    pg.close()
    return {"config": config, "x": float(x[0]), "y": y.tolist(), "stats": stats, "sent": sent}


def _hammer_rendezvous(port: int, stop: threading.Event) -> None:
    """Keep knocking at MASTER_PORT while the ranks meet: garbage, and a client that
    claims rank 1 but cannot prove the secret."""
    ctx = zmq.Context()
    try:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(os.urandom(300))
            except OSError:
                pass
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{port}")
            d.send_multipart([wire.pack(wire.Kind.HELLO, 1, 0),
                              bytes([auth.PURPOSE_RENDEZVOUS, 1]) + os.urandom(32)])
            if d.poll(100):
                d.recv_multipart()
                d.send_multipart([wire.pack(wire.Kind.PROOF, 1, 0), os.urandom(32), b"{}"])
            time.sleep(0.05)
            d.close(0)
    finally:
        ctx.destroy(0)


def test_hostile_clients_are_ignored():
    if os.path.exists(_PWNED):
        os.unlink(_PWNED)
    port, stop = free_port(), threading.Event()
    hammer = threading.Thread(target=_hammer_rendezvous, args=(port, stop), daemon=True)
    hammer.start()
    try:
        results = collectives.spawn(_job_under_attack, 2, backend="zmq", timeout=20,
                                    env={"MASTER_PORT": str(port)}, join_timeout=60)
    finally:
        stop.set()
        hammer.join(5)
    assert not os.path.exists(_PWNED), "a forged message was unpickled"
    for res in results:
        assert res["config"] == {"lr": 0.5} and res["x"] == 3.0
    assert results[1]["y"] == [7.0] * 3
    victim = results[1]["stats"]
    assert victim["rejected"] >= results[0]["sent"] - 1, victim
    # once every rank is connected, a HELLO claiming a rank is refused before any challenge
    assert victim["refused"] >= 1, victim


# ---------------------------------------------------------------------- authentication
class _Custom:
    pass


def _job_auth_mode():
    pg = collectives.init_process_group()
    plain = pg.broadcast_object({"a": [1, 2.5, "x", None, (True,)]}, src=0)
    try:
        pg.broadcast_object(_Custom() if pg.rank == 0 else None, src=0)
        custom = "ok"
    except TypeError as exc:
        custom = str(exc)
    x = np.ones(3)
    pg.all_reduce(x)
    mode = pg.transport.auth_mode
    pg.close()
    return mode, plain, custom


def test_without_a_secret_one_host_uses_a_private_key_file():
    results = collectives.spawn(_job_auth_mode, 2, backend="zmq", timeout=20,
                                env={"COLLECTIVES_SECRET": ""})
    assert [m for m, _, _ in results] == ["file", "file"]
    assert results[1][2] == "ok"  # authenticated peers: any picklable object


def test_trust_on_first_use_decodes_plain_data_only():
    results = collectives.spawn(_job_auth_mode, 2, backend="zmq", timeout=20,
                                env={"COLLECTIVES_SECRET": "", "LOCAL_WORLD_SIZE": "1"})
    assert [m for m, _, _ in results] == ["open", "open"]
    assert results[1][1] == {"a": [1, 2.5, "x", None, (True,)]}
    assert "refusing to unpickle" in results[1][2] and "_Custom" in results[1][2], results[1][2]


def _job_wrong_secret():
    if int(os.environ["RANK"]) == 1:
        os.environ["COLLECTIVES_SECRET"] = "another-secret-0123456789"
    collectives.init_process_group()


def test_a_rank_with_another_secret_is_refused_quickly():
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        collectives.spawn(_job_wrong_secret, 2, backend="zmq", timeout=30)
    assert time.monotonic() - t0 < 15
    assert "AuthenticationError" in str(info.value) and "could not prove" in str(info.value)


def test_a_forged_proof_is_refused_and_start_up_times_out_naming_the_missing_rank():
    """Rank 0 of a world of two waits at the rendezvous; a client that claims rank 1 but
    does not know the secret gets a challenge, fails it, and is refused; rank 0 reports
    the rank that never joined."""
    from backends.zeromq.engine import Engine
    port = free_port()
    rdzv = Rendezvous(rank=0, world_size=2, local_rank=0, local_world_size=1,
                      master_addr="127.0.0.1", master_port=port, job_id="t", launcher="torchrun")
    env = {"COLLECTIVES_SECRET": os.urandom(16).hex(), "COLLECTIVES_ZMQ_INIT_TIMEOUT": "3",
           "COLLECTIVES_ZMQ_MALLOC": "system"}  # this test's process is pytest's own
    outcome = {}

    def rank0():
        try:
            Engine(rdzv, 3.0, env)
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome["error"] = exc

    t = threading.Thread(target=rank0)
    t.start()
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send_multipart([wire.pack(wire.Kind.HELLO, 1, 0),
                          bytes([auth.PURPOSE_RENDEZVOUS, 1]) + os.urandom(32)])
        assert d.poll(5000), "no challenge"
        challenge = d.recv_multipart()
        assert wire.parse(challenge[0]).kind == wire.Kind.CHALLENGE
        d.send_multipart([wire.pack(wire.Kind.PROOF, 1, 0), os.urandom(32),
                          json.dumps({"rank": 1, "host": "h", "tcp": "tcp://1.2.3.4:5",
                                      "ipc": ""}).encode()])
        assert d.poll(5000), "no answer to a forged proof"
        answer = d.recv_multipart()
        assert wire.parse(answer[0]).kind == wire.Kind.REFUSED
        assert answer[1] == b"authentication failed"
    finally:
        ctx.destroy(0)
        t.join(10)
    error = outcome.get("error")
    assert isinstance(error, CollectiveTimeout) and list(error.missing) == [1], repr(error)
    assert "ranks [1] did not join the rendezvous" in str(error)


def test_stale_ipc_directories_are_swept_live_ones_kept(tmp_path):
    from backends.zeromq.addresses import sweep_stale_ipc_dirs
    dead, live, other = tmp_path / "czmq-dead", tmp_path / "czmq-live", tmp_path / "keep-me"
    for d in (dead, live, other):
        d.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live / "r0"))
    listener.listen()
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(dead / "r3"))  # bound, never listening: refuses like a killed rank's
    gone.close()
    try:
        assert sweep_stale_ipc_dirs(str(tmp_path)) == 1
    finally:
        listener.close()
    assert not dead.exists() and live.exists() and other.exists()


def test_configuration_errors():
    rdzv = Rendezvous(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr=None,
                      master_port=None, job_id="x", launcher="explicit")
    from backends.zeromq import create
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        create(rdzv, 5.0)
    with pytest.raises(ValueError, match="at least 16"):
        auth.choose_mode(rdzv, {"COLLECTIVES_SECRET": "short"})
    with pytest.raises(ValueError, match="REQUIRE_SECRET"):
        auth.choose_mode(rdzv, {"COLLECTIVES_ZMQ_REQUIRE_SECRET": "1"})
    with pytest.raises(pickle.UnpicklingError):
        auth.plain_loads(pickle.dumps(_Evil()))
    assert auth.plain_loads(pickle.dumps({"x": (1, 2.0, "s", None, {3}, b"b")})) == \
        {"x": (1, 2.0, "s", None, {3}, b"b")}
    assert wire.parse(b"garbage") is None and wire.parse(b"\x00" * wire.HEADER.size) is None


# ----------------------------------------------------------------- two hosts (netns)
NETNS_ADDRS = ("10.213.0.1", "10.213.0.2")


def _netns_unavailable() -> str:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"czmq-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def netns_worker() -> None:
    """One rank of the two-host test, started by `ip netns exec` (prints JSON)."""
    pg = collectives.init_process_group("zmq")
    r, n = pg.rank, pg.size
    x = np.full(5, r + 1.0)
    pg.all_reduce(x)
    big = np.arange(1_500_001, dtype=np.float32) * (r + 1)
    pg.all_reduce(big)
    b = np.full(4, r, np.int64)
    pg.broadcast(b, src=3)
    out = np.empty(2 * n, np.int32)
    pg.all_gather(out, np.full(2, r, np.int32))
    host = pg.new_group([0, 1] if r < 2 else [2, 3])  # the ranks of one "host"
    y = np.full(3, r + 1.0)
    host.all_reduce(y)
    pg.barrier()
    ok = (x == 10).all() and np.array_equal(big, np.arange(1_500_001, dtype=np.float32) * 10) \
        and (b == 3).all() and np.array_equal(out, np.repeat(np.arange(n, dtype=np.int32), 2)) \
        and (y == (3 if r < 2 else 7)).all()
    print(json.dumps({"rank": r, "ok": bool(ok), "auth": pg.transport.auth_mode,
                      "endpoints": pg.transport.endpoints, "connections": pg.transport.connections}), flush=True)
    pg.close()


def test_four_ranks_on_two_hosts_over_tcp():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    spaces = [f"czmq-a-{tag}", f"czmq-b-{tag}"]
    veths = [f"czv{tag}a", f"czv{tag}b"]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    procs = []
    try:
        for ns in spaces:
            ip("netns", "add", ns)
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns, veth, addr in zip(spaces, veths, NETNS_ADDRS):
            ip("link", "set", veth, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "COLLECTIVES_"))}
        env.update(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR=NETNS_ADDRS[0],
                   MASTER_PORT="29517", COLLECTIVES_SECRET=os.urandom(16).hex(),
                   COLLECTIVES_TIMEOUT="30", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
        code = "import test_zmq_backend as t; t.netns_worker()"
        for rank in range(4):
            ns = spaces[rank // 2]
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", code], cwd=ROOT,
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank % 2)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outputs = []
        for rank, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=90)
            assert p.returncode == 0, f"rank {rank} failed:\n{stderr.decode()[-3000:]}"
            outputs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for ns in spaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for rank, res in enumerate(outputs):
        assert res["ok"] and res["auth"] == "secret", res
        assert res["endpoints"]["tcp"].startswith(f"tcp://{NETNS_ADDRS[rank // 2]}:"), res
        for peer, endpoint in res["connections"].items():
            same_host = int(peer) // 2 == rank // 2
            want = "ipc://" if same_host else f"tcp://{NETNS_ADDRS[int(peer) // 2]}:"
            assert endpoint.startswith(want), (rank, peer, endpoint)
