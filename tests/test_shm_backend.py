"""Backend-specific tests of the shm backend (the generic conformance suite lives
elsewhere): chunking, bitwise identity, point to point matching, errors (mismatch,
timeout, a SIGKILLed peer), sub-groups, async, wait modes and /dev/shm hygiene.

Each spawned job starts fresh interpreters (about a second), so each job runs many checks.
"""

from __future__ import annotations

import gc
import hashlib
import mmap
import multiprocessing
import os
import signal
import threading
import time
import traceback

import ml_dtypes
import numpy as np
import pytest

import collectives
from collectives import CollectiveMismatch, CollectiveTimeout, PeerError, ReduceOp
from collectives.reduce_op import reduce_arrays
from collectives.shm_names import PREFIX, SHM_DIR, remove_job_segments


def _torch():
    """torch, imported only by the jobs that use it (every spawned rank imports this
    module; importing torch there would cost each of them a second)."""
    import torch
    return torch


SMALL_CHUNK = {"COLLECTIVES_SHM_CHUNK_BYTES": "4096", "COLLECTIVES_SHM_RING_BYTES": "8192"}


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test leaves /dev/shm as it found it (no ``collectives-`` entries of ours)."""
    before = _shm_entries()
    yield
    for _ in range(20):  # a peer may still be unlinking a segment of another test's job
        new = _shm_entries() - before
        if not new:
            return
        time.sleep(0.05)
    pytest.fail(f"shared-memory segments left behind in {SHM_DIR}: {sorted(new)}")


def _inputs(n, shape, dtype, seed, kind="float"):
    """Every rank's input (identical on all ranks, so each can build the reference)."""
    out = []
    for r in range(n):
        rng = np.random.default_rng(seed * 1000 + r)
        if kind == "int":
            a = rng.integers(-50, 50, size=shape).astype(dtype)
        else:
            a = rng.standard_normal(size=shape).astype(np.float32).astype(dtype)
        out.append(a)
    return out


# ------------------------------------------------------------------ collectives
def _collectives_job(default_chunk=False, with_torch=False):
    pg = collectives.init_process_group()
    r, n = pg.rank, pg.size
    assert pg.backend == "shm"
    chunk = pg.transport.chunk_bytes
    f32 = np.dtype(np.float32)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    if default_chunk:
        # one phase; the pipelined path with one chunk and with two (f32)
        reduce_cases = [(dt, size) for dt in (f32, bf16) for size in (5, 9000, 300_000)]
        move_cases = [(dt, size) for dt in (f32, np.dtype(np.bool_)) for size in (3, 300_000)]
    else:
        # sizes below, at and above one slot (chunk) and the one-phase threshold
        sizes = [0, 1, 7, chunk // 4 + 3, 3 * chunk // 4 + 5]
        reduce_cases = [(np.dtype(dt), size) for dt in (np.float32, np.float64, np.int32)
                        for size in sizes]
        reduce_cases += [(f32, 5003), (np.dtype(np.float16), 7), (bf16, 0),
                         (np.dtype(np.float16), 3 * chunk // 4 + 5), (bf16, 1500)]
        move_cases = [(np.dtype(dt), size) for dt in (np.float32, ml_dtypes.bfloat16,
                                                      np.int64, np.bool_, np.uint8)
                      for size in (0, 3, chunk // 3, 2 * chunk + 17)]
    seed = 1
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.PRODUCT]
    for case, (dtype, size) in enumerate(reduce_cases):
        kind = "int" if dtype.kind == "i" else "float"
        # SUM always, plus one other operator in turn (the conformance suite does the
        # full matrix; here the point is chunking, phases and bitwise equality)
        for op in (ReduceOp.SUM, ops[1 + case % 4]):
            if op is ReduceOp.AVG and kind == "int":
                op = ReduceOp.MIN
            if op is ReduceOp.PRODUCT and size > 100:
                op = ReduceOp.MAX
            seed += 1
            ins = _inputs(n, (size,), dtype, seed, kind)
            ref = reduce_arrays(op, ins)
            a = ins[r].copy()
            pg.all_reduce(a, op=op)
            assert a.tobytes() == ref.tobytes(), (dtype, size, op)
            # reduce: only dst changes
            dst = seed % n
            a = ins[r].copy()
            pg.reduce(a, dst=dst, op=op)
            expect = ref if r == dst else ins[r]
            assert a.tobytes() == expect.tobytes(), ("reduce", dtype, size, op)
    for dtype, size in move_cases:
        seed += 1
        if dtype == np.bool_:
            ins = [np.random.default_rng(seed + q).integers(0, 2, size).astype(bool)
                   for q in range(n)]
        else:
            ins = _inputs(n, (size,), dtype, seed, "int" if dtype.kind in "iu" else "float")
        # broadcast from every root
        for root in range(n):
            a = ins[r].copy()
            pg.broadcast(a, src=root)
            assert a.tobytes() == ins[root].tobytes()
        # all_gather / gather
        out = np.empty(n * size, dtype)
        pg.all_gather(out, ins[r])
        assert out.tobytes() == np.concatenate(ins).tobytes()
        dst = seed % n
        out = np.empty(n * size, dtype) if r == dst else None
        pg.gather(ins[r], out, dst=dst)
        if r == dst:
            assert out.tobytes() == np.concatenate(ins).tobytes()
        # scatter
        src = (seed + 1) % n
        full = np.concatenate(ins)
        part = np.empty(size, dtype)
        pg.scatter(part, full if r == src else None, src=src)
        assert part.tobytes() == full[r * size:(r + 1) * size].tobytes()
        # all_to_all, equal splits: part k of rank j's input is ins[j] shifted by k
        parts = [np.roll(ins[r], k) for k in range(n)]
        out = np.empty(n * size, dtype)
        pg.all_to_all(out, np.concatenate(parts))
        expect = np.concatenate([np.roll(ins[j], r) for j in range(n)])
        assert out.tobytes() == expect.tobytes(), ("all_to_all", dtype, size)
        if dtype != np.bool_:
            # reduce_scatter: inp is n x out
            big = _inputs(n, (n * size,), dtype, seed + 7,
                          "int" if dtype.kind in "iu" else "float")
            out = np.empty(size, dtype)
            pg.reduce_scatter(out, big[r], op=ReduceOp.SUM)
            ref = reduce_arrays(ReduceOp.SUM, big)[r * size:(r + 1) * size]
            assert out.tobytes() == ref.tobytes(), ("reduce_scatter", dtype, size)
    # all_to_all with uneven splits: rank j sends (j + k) % 3 * scale rows to rank k.
    for scale in (1, chunk // 8 + 1):
        cnt = [[((j + k) % 3) * scale for k in range(n)] for j in range(n)]
        inp = np.concatenate([np.full(cnt[r][k], 100 * r + k, np.int64) for k in range(n)]
                             or [np.empty(0, np.int64)])
        out = np.empty(sum(cnt[j][r] for j in range(n)), np.int64)
        pg.all_to_all(out, inp, output_split_sizes=[cnt[j][r] for j in range(n)],
                      input_split_sizes=cnt[r])
        expect = np.concatenate([np.full(cnt[j][r], 100 * j + r, np.int64) for j in range(n)]
                                or [np.empty(0, np.int64)])
        assert np.array_equal(out, expect)
    # non-contiguous numpy views are staged and written back
    base = np.zeros((6, 8), np.float32)
    view = base[:, ::2]
    view[...] = r + 1
    pg.all_reduce(view)
    assert (view == n * (n + 1) / 2).all() and (base[:, 1::2] == 0).all()
    src = np.arange(12.0).reshape(3, 4).T if r == 0 else np.zeros((4, 3)).T.copy().T
    pg.broadcast(src, src=0)
    assert (src == np.arange(12.0).reshape(3, 4).T).all()
    if with_torch:
        _torch_checks(pg)
    for _ in range(3):
        pg.barrier()
    pg.close()
    pg.close()  # idempotent
    return "ok"


def _torch_checks(pg):
    """torch: non-contiguous views, bfloat16, float16, empty tensors."""
    r, n = pg.rank, pg.size
    torch = _torch()
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        base = torch.zeros(6, 8, dtype=dt)
        view = base[:, ::2]                      # non-contiguous
        view.copy_(torch.full((6, 4), float(r + 1), dtype=dt))
        pg.all_reduce(view)
        assert torch.equal(view, torch.full((6, 4), n * (n + 1) / 2, dtype=dt))
        assert torch.equal(base[:, 1::2], torch.zeros(6, 4, dtype=dt))
        t = torch.arange(10, dtype=dt).reshape(2, 5).t()      # non-contiguous
        if r != 0:
            t.zero_()
        pg.broadcast(t, src=0)
        assert torch.equal(t, torch.arange(10, dtype=dt).reshape(2, 5).t())
        out = torch.empty(2 * n, 3, dtype=dt)
        pg.all_gather(out, torch.full((2, 3), float(r), dtype=dt))
        assert torch.equal(out, torch.arange(n, dtype=dt).repeat_interleave(2)[:, None]
                           .expand(2 * n, 3))
        out = torch.empty(3, dtype=dt)
        pg.reduce_scatter(out, torch.ones(3 * n, dtype=dt))
        assert torch.equal(out, torch.full((3,), float(n), dtype=dt))
        empty = torch.empty(0, dtype=dt)
        pg.all_reduce(empty)
        pg.broadcast(empty, src=n - 1)
        pg.all_gather(torch.empty(0, dtype=dt), empty)
        pg.reduce_scatter(torch.empty(0, dtype=dt), empty)
    # point to point of tensors; a non-contiguous receive buffer
    if r == 0:
        pg.send(torch.arange(6.0, dtype=torch.bfloat16), dst=n - 1, tag=10)
    elif r == n - 1:
        t = torch.zeros(6, 2, dtype=torch.bfloat16)[:, 0]
        pg.recv(t, src=0, tag=10)
        assert torch.equal(t, torch.arange(6.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_collectives_small_chunk(nproc, monkeypatch):
    """Every collective, many dtypes and sizes (incl. empty, and several chunks of a
    4 KiB slot), against the numpy reference, bitwise."""
    if nproc == 1:  # a world of one runs right here
        for name, value in SMALL_CHUNK.items():
            monkeypatch.setenv(name, value)
        assert _collectives_job() == "ok"
        return
    # torch (staging of non-contiguous, bfloat16, float16 tensors) in one of the jobs:
    # importing it costs each spawned rank a second or more
    assert collectives.spawn(_collectives_job, nproc, args=(False, nproc == 2),
                             backend="shm", timeout=60, env=SMALL_CHUNK) == ["ok"] * nproc


def test_collectives_default_chunk():
    """The same with the default 1 MiB slot: single-chunk two-phase all_reduce, the
    count-exchange all_to_all, ..."""
    assert collectives.spawn(_collectives_job, 3, args=(True,), backend="shm",
                             timeout=60) == ["ok"] * 3


# ------------------------------------------------------------- bitwise identity
def _bitwise_job(sizes):
    pg = collectives.init_process_group()
    digests = []
    for i, size in enumerate(sizes):
        ins = []
        for q in range(pg.size):  # values over 6 decades: rounding depends on the order
            rng = np.random.default_rng(1000 * i + q)
            ins.append((rng.standard_normal(size) * 10 ** rng.uniform(-3, 3, size))
                       .astype(np.float32))
        a = ins[pg.rank].copy()
        pg.all_reduce(a)
        assert a.tobytes() == reduce_arrays(ReduceOp.SUM, ins).tobytes()
        digests.append(hashlib.sha256(a.tobytes()).hexdigest())
    pg.close()
    return digests


def test_all_reduce_bitwise_identical_across_ranks():
    sizes = [5, 1000, 70_000, 300_003]
    results = collectives.spawn(_bitwise_job, 4, args=(sizes,), backend="shm", timeout=60,
                                env={"COLLECTIVES_SHM_CHUNK_BYTES": str(256 << 10)})
    assert all(r == results[0] for r in results)


# ---------------------------------------------------------------- point to point
def _p2p_job():
    pg = collectives.init_process_group()
    r, n = pg.rank, pg.size
    ring = 8192  # SMALL_CHUNK's ring: messages below are larger than it
    if r == 0:
        # tags out of order: the receiver asks for them in reverse
        for tag in range(5):
            pg.send(np.full(3 + tag, tag, np.int32), dst=1, tag=tag)
        # a large message while the receiver first waits for a later small one
        pg.send(np.arange(10 * ring, dtype=np.uint8), dst=1, tag=100)
        pg.send(np.array([7.0]), dst=1, tag=101)
    elif r == 1:
        for tag in reversed(range(5)):
            x = np.empty(3 + tag, np.int32)
            pg.recv(x, src=0, tag=tag)
            assert (x == tag).all()
        small = np.empty(1)
        pg.recv(small, src=0, tag=101)   # the large one goes to the unexpected queue
        assert small[0] == 7.0
        big = np.empty(10 * ring, np.uint8)
        pg.recv(big, src=0, tag=100)
        assert np.array_equal(big, np.arange(10 * ring, dtype=np.uint8))
    pg.barrier()
    # large messages both directions at once, around a ring, with isend/irecv
    size = 12 * ring // 8 + 3
    nxt, prv = (r + 1) % n, (r - 1) % n
    out = np.full(size, r, np.float64)
    inn = np.empty(size, np.float64)
    works = [pg.isend(out, nxt, tag=5), pg.irecv(inn, prv, tag=5)]
    for w in works:
        w.wait()
    assert (inn == prv).all() and all(w.is_completed() for w in works)
    # blocking sends of large messages to each other (both block in send)
    if r < 2:
        other = 1 - r
        pg.send(np.full(size, r, np.float64), dst=other, tag=6)
        got = np.empty(size, np.float64)
        pg.recv(got, src=other, tag=6)
        assert (got == other).all()
    # same (src, tag) stays in order; a non-contiguous receive buffer
    if r == 0:
        for i in range(4):
            pg.send(np.full(4, float(i)), dst=n - 1, tag=9)
        pg.send(np.arange(6.0), dst=n - 1, tag=10)
    elif r == n - 1:
        for i in range(4):
            t = np.empty(4)
            pg.recv(t, src=0, tag=9)
            assert (t == i).all()
        t = np.zeros((6, 2))[:, 0]
        pg.recv(t, src=0, tag=10)
        assert (t == np.arange(6.0)).all()
    # a receive of the wrong size is a CollectiveMismatch naming both sizes
    message = None
    if r == 0:
        pg.send(np.zeros(4, np.float32), dst=1, tag=11)
        pg.send(np.ones(2, np.float32), dst=1, tag=12)
    elif r == 1:
        try:
            pg.recv(np.empty(5, np.float32), src=0, tag=11)
        except CollectiveMismatch as exc:
            message = str(exc)
        x = np.empty(2, np.float32)
        pg.recv(x, src=0, tag=12)  # the channel goes on working
        assert (x == 1).all()
    pg.barrier()
    pg.close()
    return message


def test_point_to_point():
    results = collectives.spawn(_p2p_job, 3, backend="shm", timeout=60, env=SMALL_CHUNK)
    assert "16 bytes" in results[1] and "20 bytes" in results[1], results[1]


def _p2p_threads_job():
    """The user thread does point to point while async collectives run on the group's
    thread, and an async all_reduce overlaps with compute."""
    pg = collectives.init_process_group()
    r, n = pg.rank, pg.size
    a = np.full(300_000, r + 1.0, np.float32)
    work = pg.all_reduce(a, async_op=True)
    m = np.random.default_rng(r).standard_normal((200, 200))
    for _ in range(5):
        m = np.tanh(m @ m)      # compute meanwhile
    nxt, prv = (r + 1) % n, (r - 1) % n
    works = []
    for i in range(10):
        g = np.empty(1000, np.int64)
        works.append(pg.irecv(g, prv, tag=i))
        pg.send(np.full(1000, i * 10 + r, np.int64), nxt, tag=i)
        works[-1].wait()
        assert (g == i * 10 + prv).all()
        pg.all_reduce(np.ones(3), async_op=True)
    work.wait()
    assert (a == n * (n + 1) / 2).all()
    b = np.ones((5, 2))[:, 1]      # staged: written back by the wait
    w = pg.all_reduce(b, async_op=True)
    w.wait()
    assert (b == n).all()
    pg.close()
    return "ok"


def test_async_and_threads():
    assert collectives.spawn(_p2p_threads_job, 3, backend="shm", timeout=60,
                             env={"COLLECTIVES_SHM_RING_BYTES": "8192"}) == ["ok"] * 3


# -------------------------------------------------------------------- sub-groups
def _subgroup_job():
    pg = collectives.init_process_group()
    r = pg.rank
    pair = pg.new_group([0, 1]) if r < 2 else pg.new_group([2, 3])
    assert pair.size == 2 and pair.rank == r % 2 and pair.backend == "shm"
    t = np.array([float(r)])
    pair.all_reduce(t)
    assert t[0] == (1.0 if r < 2 else 5.0)
    evens = pg.new_group([0, 2]) if r % 2 == 0 else pg.new_group([1, 3])
    t = np.array([float(r)])
    evens.all_reduce(t)
    assert t[0] == (2.0 if r % 2 == 0 else 4.0)
    # a sub-group of a sub-group; and the same members again (a new instance)
    trio = pg.new_group([1, 2, 3]) if r > 0 else None
    if trio is not None:
        if trio.rank in (0, 2):
            sub = trio.new_group([0, 2])  # world ranks 1 and 3
            t = np.array([float(r)])
            sub.all_reduce(t)
            assert t[0] == 4.0
            x = np.empty(1)
            if sub.rank == 0:
                sub.send(np.array([42.0]), dst=1)
            else:
                sub.recv(x, src=0)
                assert x[0] == 42.0
            sub.close()
        out = np.empty(3)
        trio.all_gather(out, np.array([float(r)]))
        assert out.tolist() == [1.0, 2.0, 3.0]
        trio.close()
    again = pg.new_group([0, 1]) if r < 2 else pg.new_group([2, 3])
    t = np.array([1.0])
    again.all_reduce(t)
    assert t[0] == 2.0
    single = pg.new_group([r])
    t = np.array([3.0])
    single.all_reduce(t)
    single.barrier()
    assert t[0] == 3.0
    # closing a sub-group leaves the world working
    for g in (pair, evens, again, single):
        g.close()
    t = np.array([1.0])
    pg.all_reduce(t)
    assert t[0] == 4.0
    pg.close()
    return "ok"


def test_subgroups():
    assert collectives.spawn(_subgroup_job, 4, backend="shm", timeout=60) == ["ok"] * 4


# ------------------------------------------------------------------------ errors
def _mismatch_job():
    results = []
    for kind in ("op", "size", "root"):
        pg = collectives.init_process_group()   # a fresh world: a mismatch breaks one
        try:
            if kind == "op":
                if pg.rank == 0:
                    pg.all_reduce(np.zeros(8, np.float32))
                else:
                    pg.broadcast(np.zeros(4, np.float32), src=0)
            elif kind == "size":
                pg.all_reduce(np.zeros(8 if pg.rank == 0 else 9, np.float32))
            else:  # both think they are the root: nobody would read anything
                pg.broadcast(np.zeros(2), src=pg.rank)
            results.append(None)
        except CollectiveMismatch as exc:
            results.append(("mismatch", str(exc)))
        except PeerError as exc:
            results.append(("peer", str(exc)))
        pg.close()
    return results


def test_mismatch():
    results = collectives.spawn(_mismatch_job, 2, backend="shm", timeout=20)
    for i, kind in enumerate(("op", "size", "root")):
        mismatches = [m[1] for m in (results[0][i], results[1][i]) if m and m[0] == "mismatch"]
        assert mismatches, (kind, results)
        text = mismatches[0]
        if kind == "op":
            assert "all_reduce" in text and "broadcast" in text and "seq 0" in text, text
            assert "32 bytes of float32" in text and "16 bytes of float32" in text, text
        elif kind == "size":
            assert "32 bytes" in text and "36 bytes" in text, text
        else:
            assert "root 0" in text and "root 1" in text, text


def _timeout_job():
    # Met with the launcher's long timeout (two fresh interpreters may start seconds
    # apart on a loaded machine); the collective then waits at most 1 s.
    pg = collectives.init_process_group()
    pg.barrier()
    pg.timeout = 1.0
    result = None
    if pg.rank == 1:
        time.sleep(2.5)
        try:
            pg.all_reduce(np.ones(2))
        except PeerError as exc:
            result = ("peer", str(exc))
    else:
        start = time.monotonic()
        try:
            pg.all_reduce(np.ones(2))
        except CollectiveTimeout as exc:
            result = ("timeout", str(exc), exc.op, exc.seq, list(exc.missing),
                      time.monotonic() - start)
    pg.close()
    return result


def test_timeout_names_op_seq_and_missing_rank():
    results = collectives.spawn(_timeout_job, 2, backend="shm", timeout=30.0,
                                join_timeout=60.0)
    kind, text, op, seq, missing, elapsed = results[0]
    assert kind == "timeout" and op == "all_reduce" and seq == 1 and missing == [1]
    assert "all_reduce" in text and "seq 1" in text and "[1]" in text, text
    assert 1.0 <= elapsed < 3.0, elapsed
    # The late rank is told that rank 0 gave up, instead of waiting for its timeout.
    assert results[1][0] == "peer" and "rank 0" in results[1][1], results[1]


def _rank_entry(fn, args, env, queue):
    os.environ.update(env)
    try:
        queue.put((int(env["RANK"]), "ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001
        queue.put((int(env["RANK"]), "error", f"{type(exc).__name__}: {exc}\n"
                   f"{traceback.format_exc()}"))


def _run_ranks(fn, nproc, args=(), env=None, wait=30.0):
    """Start ranks like collectives.spawn does, but let the survivors of a killed rank
    finish and report (spawn stops them a second after the first death)."""
    ctx = multiprocessing.get_context("spawn")
    job = os.urandom(6).hex()
    queue = ctx.Queue()
    procs = []
    for rank in range(nproc):
        rank_env = {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(nproc), "COLLECTIVES_JOB_ID": job,
                    "COLLECTIVES_BACKEND": "shm", "COLLECTIVES_SPAWNED": "1",
                    "OMP_NUM_THREADS": "1", **(env or {})}
        p = ctx.Process(target=_rank_entry, args=(fn, args, rank_env, queue))
        p.start()
        procs.append(p)
    results = {}
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline and \
                (any(p.is_alive() for p in procs) or not queue.empty()):
            try:
                rank, status, value = queue.get(timeout=0.2)
                results[rank] = (status, value)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        remove_job_segments(job)  # what collectives.spawn does after a job
    return results, [p.exitcode for p in procs]


def _killed_during_p2p_job():
    pg = collectives.init_process_group(timeout=60)
    if pg.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        pg.recv(np.empty(4), src=1)
        return ("no error",)
    except PeerError as exc:
        return ("peer", exc.peer, str(exc))
    finally:
        pg.close()


def test_sigkilled_peer_during_recv():
    results, codes = _run_ranks(_killed_during_p2p_job, 2)
    status, value = results[0]
    assert status == "ok" and value[0] == "peer" and value[1] == 1, results


# ------------------------------------------------------------ set-up and lifetime
def _rendezvous(rank, size, job):
    return collectives.Rendezvous(rank=rank, world_size=size, local_rank=rank,
                                  local_world_size=size, master_addr=None, master_port=None,
                                  job_id=job, launcher="explicit")


def test_missing_job_id_is_a_clear_error():
    from backends.shm import create
    with pytest.raises(ValueError, match="COLLECTIVES_JOB_ID"):
        create(_rendezvous(0, 2, None), 5.0)
    pg = collectives.ProcessGroup(create(_rendezvous(0, 1, None), 5.0))   # no name needed
    t = np.ones(2)
    pg.all_reduce(t, op=ReduceOp.AVG)
    assert t.tolist() == [1.0, 1.0]
    pg.close()


def test_rendezvous_timeout_names_absent_ranks():
    from backends.shm import create
    job = "test-" + os.urandom(4).hex()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        create(_rendezvous(0, 3, job), 0.5)
    assert time.monotonic() - start < 3
    assert info.value.missing == (1, 2) and "[1, 2]" in str(info.value)
    with pytest.raises(CollectiveTimeout) as info:
        create(_rendezvous(2, 3, job), 0.3)
    assert info.value.missing == (0,)


def test_stale_segment_of_a_dead_job_is_replaced():
    """A segment left by a crashed job with the same id (its creator is dead) does not
    stop a new job."""
    from backends.shm import segment as sg
    from collectives.shm_names import segment_name
    job = "stale-" + os.urandom(4).hex()
    path = os.path.join(SHM_DIR, segment_name(job, "world"))
    dead = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    lay = sg.Layout(2, 4096, 4096)
    with open(path, "wb") as f:
        f.truncate(lay.total)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, lay.total)
    os.close(fd)
    seg = sg.Segment(mm, lay, None, None)
    seg.write_header(dead.pid, 1)
    seg.close()
    try:
        results = collectives.spawn(_stale_job, 2, backend="shm", timeout=20,
                                    env={"COLLECTIVES_JOB_ID": job})
        assert results == [3.0, 3.0]
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _stale_job():
    pg = collectives.init_process_group()
    t = np.array([pg.rank + 1.0])
    pg.all_reduce(t)
    pg.close()
    return float(t[0])


def _gc_job():
    pg = collectives.init_process_group()
    # A forked child (a data-loader worker, say) that closes or drops its copy of the
    # group must not close this rank's membership.
    child = os.fork()
    if child == 0:
        try:
            pg.close()
            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    if pg.rank == 0:
        time.sleep(0.3)  # rank 1 waits for rank 0, looking at its state meanwhile
    pg.all_reduce(np.ones(3), async_op=True).wait()
    t = np.ones(2)
    pg.all_reduce(t)
    del pg, t
    gc.collect()
    pg2 = collectives.init_process_group()   # a second world of the same job
    t = np.ones(2)
    pg2.all_reduce(t)
    pg2.close()
    # The executor's thread ends once its group is collected, soon but not at once (on a
    # loaded machine, after this line has run): a leak is a thread that stays.
    deadline = time.monotonic() + 5.0
    while True:
        left = [th.name for th in threading.enumerate() if th.name.startswith("collectives")]
        if not left or time.monotonic() > deadline:
            return float(t[0]), left
        time.sleep(0.01)


def test_garbage_collected_group_fork_and_second_world():
    results = collectives.spawn(_gc_job, 2, backend="shm", timeout=20)
    assert results == [(2.0, []), (2.0, [])]


# ------------------------------------------------------------------- wait modes
def _modes_job():
    results = []
    for mode in ("futex", "sleep"):
        os.environ["COLLECTIVES_SHM_WAIT"] = mode
        pg = collectives.init_process_group()
        r = pg.rank
        # The peer sleeps 0.3 s before arriving: the waiter must sleep, not spin.
        t = np.full(100_000, r + 1.0)
        cpu = time.process_time()
        if r == 1:
            time.sleep(0.3)
        pg.all_reduce(t)
        cpu = time.process_time() - cpu
        assert (t == 3.0).all()
        x = np.empty(10)
        cpu_p2p = time.process_time()
        if r == 0:
            pg.recv(x, src=1)
        else:
            time.sleep(0.3)
            pg.send(np.ones(10), dst=0)
        cpu_p2p = time.process_time() - cpu_p2p
        for _ in range(50):
            pg.all_reduce(np.ones(4))
        results.append((pg.transport.wait_mode, cpu, cpu_p2p))
        pg.close()
    return results


def test_wait_modes_do_not_burn_a_core():
    """futex (default) and the portable sleep fallback: 0.3 s of waiting costs little
    CPU in both."""
    results = collectives.spawn(_modes_job, 2, backend="shm", timeout=20)
    (futex, cpu_f, p2p_f), (sleep, cpu_s, p2p_s) = results[0]
    assert (futex, sleep) == ("futex", "sleep")
    assert max(cpu_f, p2p_f, cpu_s, p2p_s) < 0.15, results[0]
