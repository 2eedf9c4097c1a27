"""Backend-specific tests of ``backends/torchdist.py`` (gloo; nccl where CUDA is present).
The generic conformance suite picks ``gloo`` up through ``available_backends()``; this
file pins down what is particular to torch.distributed: the fallbacks (int16, AVG,
reduce's scratch inputs, reduce_scatter without ``_reduce_scatter_base``), raw-byte data
movement, torch's async work, tags, sub-groups over the store, error mapping, torchrun,
and clean exits.

A rank imports torch (several seconds on a small machine), so one spawned job per world
size runs every check, and the tests read its report (``job2``/``job3`` fixtures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import collectives
from collectives import CollectiveError, CollectiveTimeout, PeerError, ReduceOp
from collectives.reduce_op import reduce_arrays
from collectives.spawn import free_port

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("this torch build has no gloo", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(d) for d in (np.float32, np.float64, np.float16)] + [BF16]
INTS = [np.dtype(d) for d in (np.int8, np.uint8, np.int16, np.int32, np.int64)]
JOB_TIMEOUT = 60.0


# ----------------------------------------------------------------- rank-side helpers
def _inputs(n, shape, dtype, seed, exact=True):
    """Every rank's input, built identically on every rank. ``exact``: small integers, so
    that every reduction order gives the same (exact) result."""
    dtype = np.dtype(dtype)
    out = []
    for r in range(n):
        rng = np.random.default_rng(seed * 100 + r)
        if dtype == np.bool_:
            a = rng.integers(0, 2, size=shape).astype(bool)
        elif exact or dtype.kind in "iu":
            low = 0 if dtype.kind == "u" else -3
            a = rng.integers(low, 4, size=shape).astype(dtype)
        else:
            a = rng.standard_normal(size=shape).astype(np.float32).astype(dtype)
        out.append(a)
    return out


#: What the running check found wrong on this rank. A check records failures instead of
#: raising, so that every rank goes through the same collectives whatever it found.
_FAILED: list = []


def expect(condition, message="") -> None:
    if not condition:
        where = traceback.extract_stack(limit=2)[0]
        _FAILED.append(f"line {where.lineno}: {message or where.line}")


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    expect(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(),
           f"{what}: got {a.ravel()[:6]} ({a.dtype}, {a.shape}), expected {b.ravel()[:6]} "
           f"({b.dtype}, {b.shape})")


def _identical_everywhere(pg, a, what):
    """``a`` is bitwise identical on every rank."""
    raw = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8)
    everyone = np.empty(pg.size * raw.size, np.uint8)
    pg.all_gather(everyone, raw)
    for q, part in enumerate(np.split(everyone, pg.size)):
        expect(part.tobytes() == raw.tobytes(), f"{what}: rank {q} holds different bits")


def _tensor_of(a):
    """A torch tensor with the values of numpy ``a`` (bfloat16 included)."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _numpy_of(t):
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy().view(BF16)
    return t.contiguous().numpy()


# ------------------------------------------------------------------------ the checks
def check_all_reduce(pg):
    n, r = pg.size, pg.rank
    seed = 0
    for dtype in FLOATS + INTS:
        ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
        ops += [ReduceOp.AVG] if dtype.kind == "f" or dtype == BF16 else []
        for op in ops:
            seed += 1
            ins = _inputs(n, (37,), dtype, seed)
            a = ins[r].copy()
            pg.all_reduce(a, op=op)
            _same(a, reduce_arrays(op, ins), f"all_reduce {dtype} {op.name}")
    # int16 wraps around exactly like numpy's int16 arithmetic (reduced in int32)
    ins = [np.array([32000, -32000, 7], np.int16) for _ in range(n)]
    a = ins[r].copy()
    pg.all_reduce(a)
    _same(a, reduce_arrays(ReduceOp.SUM, ins), "int16 overflow wraps")
    # random floats: close to the reference, bitwise identical on every rank
    for dtype in (np.dtype(np.float32), np.dtype(np.float16), BF16):
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            seed += 1
            ins = _inputs(n, (10_007,), dtype, seed, exact=False)
            a = ins[r].copy()
            pg.all_reduce(a, op=op)
            ref = reduce_arrays(op, ins).astype(np.float64)
            tol = 1e-5 if dtype == np.float32 else 5e-2
            expect(np.allclose(a.astype(np.float64), ref, rtol=tol, atol=tol * n),
                   f"all_reduce random {dtype} {op.name}")
            _identical_everywhere(pg, a, f"all_reduce random {dtype} {op.name}")
    # torch tensors: bfloat16 AVG, a non-contiguous view (staged), 0-d and empty
    t = torch.full((4, 6), float(r + 1), dtype=torch.bfloat16)
    pg.all_reduce(t, op=ReduceOp.AVG)
    expect(torch.equal(t, torch.full((4, 6), (n + 1) / 2, dtype=torch.bfloat16)), "bf16 AVG")
    base = torch.zeros(6, 4)
    view = base[:, 1]
    view.fill_(r + 1.0)
    pg.all_reduce(view)
    expect((base[:, 1] == n * (n + 1) / 2).all() and (base[:, 0] == 0).all(), "strided view")
    z = np.array(r + 1.0, np.float32)
    pg.all_reduce(z)
    expect(float(z) == n * (n + 1) / 2, "0-d")
    e = np.empty(0, np.float16)
    pg.all_reduce(e)


def check_reduce(pg):
    n, r = pg.size, pg.rank
    for seed, dtype in enumerate((np.dtype(np.float32), np.dtype(np.int16), BF16,
                                  np.dtype(np.uint8)), start=100):
        for op in (ReduceOp.SUM, ReduceOp.MAX) + ((ReduceOp.AVG,) if dtype.kind == "V"
                                                  or dtype.kind == "f" else ()):
            dst = seed % n
            ins = _inputs(n, (2, 9), dtype, seed)
            a = ins[r].copy()
            pg.reduce(a, dst=dst, op=op)
            wanted = reduce_arrays(op, ins) if r == dst else ins[r]
            _same(a, wanted, f"reduce {dtype} {op.name} dst={dst} (non-roots unchanged)")
    # a read-only input on a non-root rank is fine (it is only read)
    a = np.ones(3)
    a.setflags(write=r == 0)
    pg.reduce(a, dst=0)
    expect(r != 0 or (a == n).all())


def check_broadcast(pg):
    n, r = pg.size, pg.rank
    for seed, dtype in enumerate((np.dtype(np.float32), np.dtype(np.bool_), np.dtype(np.int16),
                                  BF16, np.dtype(np.int8)), start=200):
        ins = _inputs(n, (3, 5), dtype, seed)
        for src in range(n):
            a = ins[r].copy()
            pg.broadcast(a, src=src)
            _same(a, ins[src], f"broadcast {dtype} src={src}")
    t = torch.arange(12.0).reshape(3, 4).t() * (r + 1)  # non-contiguous
    pg.broadcast(t, src=n - 1)
    expect(torch.equal(t, torch.arange(12.0).reshape(3, 4).t() * n), "non-contiguous broadcast")
    z = np.array(r, np.int64)
    pg.broadcast(z, src=n - 1)
    expect(int(z) == n - 1)


def check_gathers_and_scatter(pg):
    n, r = pg.size, pg.rank
    for seed, dtype in enumerate((np.dtype(np.float64), np.dtype(np.bool_), np.dtype(np.int16),
                                  BF16, np.dtype(np.float16)), start=300):
        for shape in ((3,), (2, 3), (0,)):
            ins = _inputs(n, shape, dtype, seed)
            whole = np.concatenate(ins)
            inp = ins[r].copy()
            inp.setflags(write=False)  # inputs are only read
            out = np.empty(whole.shape, dtype)
            pg.all_gather(out, inp)
            _same(out, whole, f"all_gather {dtype} {shape}")
            dst = seed % n
            out = np.empty(whole.shape, dtype) if r == dst else None
            pg.gather(inp, out, dst=dst)
            if r == dst:
                _same(out, whole, f"gather {dtype} {shape}")
            src = (seed + 1) % n
            part = np.empty(ins[r].shape, dtype)
            pg.scatter(part, whole if r == src else None, src=src)
            _same(part, ins[r], f"scatter {dtype} {shape} src={src}")
    # torch tensors, output a non-contiguous view
    out = torch.zeros(2 * n, 2)[:, 0]
    pg.all_gather(out, torch.full((2,), float(r)))
    expect(out.tolist() == [float(q) for q in range(n) for _ in range(2)], "all_gather view")


def check_reduce_scatter(pg):
    n, r = pg.size, pg.rank
    cases = [(np.dtype(np.float32), op) for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX,
                                                   ReduceOp.PRODUCT)]
    cases += [(np.dtype(np.int16), ReduceOp.SUM), (BF16, ReduceOp.SUM), (BF16, ReduceOp.AVG),
              (np.dtype(np.float16), ReduceOp.MIN), (np.dtype(np.int64), ReduceOp.SUM)]
    default = pg.transport.native_reduce_scatter  # False on gloo: all_reduce + slice
    for native in (True, False):  # torch's _reduce_scatter_base, then the fallback
        pg.transport.native_reduce_scatter = native
        for seed, (dtype, op) in enumerate(cases, start=400):
            ins = _inputs(n, (n * 4, 3), dtype, seed)
            inp = ins[r].copy()
            out = np.empty((4, 3), dtype)
            pg.reduce_scatter(out, inp, op=op)
            ref = reduce_arrays(op, ins)
            _same(out, ref[4 * r:4 * (r + 1)],
                  f"reduce_scatter {dtype} {op.name} ({'native' if native else 'fallback'})")
            _same(inp, ins[r], "reduce_scatter leaves its input alone")
        big = _inputs(n, (n * 5000,), np.float32, 499, exact=False)
        out = np.empty(5000, np.float32)
        pg.reduce_scatter(out, big[r])
        ref = reduce_arrays(ReduceOp.SUM, big)[5000 * r:5000 * (r + 1)]
        expect(np.allclose(out, ref, rtol=1e-5, atol=1e-5), "reduce_scatter random")
    pg.transport.native_reduce_scatter = default


def check_all_to_all(pg):
    n, r = pg.size, pg.rank
    for dtype in (np.dtype(np.int64), BF16, np.dtype(np.bool_), np.dtype(np.int16)):
        # equal splits: part k of rank j goes to rank k
        ins = _inputs(n, (2 * n, 3), dtype, 500)
        out = np.empty((2 * n, 3), dtype)
        pg.all_to_all(out, ins[r])
        wanted = np.concatenate([ins[j][2 * r:2 * r + 2] for j in range(n)])
        _same(out, wanted, f"all_to_all {dtype}")
        # uneven splits, zero-row parts included: rank j sends rows[j][k] rows to rank k
        rows = [[(j + 2 * k) % 3 for k in range(n)] for j in range(n)]
        ins = [_inputs(n, (sum(rows[j]), 3), dtype, 510 + j)[j] for j in range(n)]
        out = np.empty((sum(rows[j][r] for j in range(n)), 3), dtype)
        pg.all_to_all(out, ins[r], input_split_sizes=rows[r],
                      output_split_sizes=[rows[j][r] for j in range(n)])
        parts = []
        for j in range(n):
            start = sum(rows[j][:r])
            parts.append(ins[j][start:start + rows[j][r]])
        _same(out, np.concatenate(parts), f"all_to_all with splits {dtype}")


def check_async(pg):
    n, r = pg.size, pg.rank
    # several in flight on one array: they run in issue order
    a = np.ones(1000, np.float32)
    works = [pg.all_reduce(a, async_op=True) for _ in range(3)]
    expect(all(isinstance(w, collectives.Work) for w in works))
    for w in works:
        w.wait()
    expect((a == n ** 3).all(), f"three async all_reduces in order: {a[:3]}")
    # staged write-back happens when the work is seen to complete
    base = torch.zeros(8, 2)
    view = base[:, 1]
    view.fill_(1.0)
    w = pg.all_reduce(view, async_op=True)
    deadline = time.monotonic() + 30
    while not w.is_completed():
        if time.monotonic() > deadline:
            expect(False, "is_completed() never became True")
            break
        time.sleep(0.001)
    expect((base[:, 1] == n).all(), "write-back after is_completed()")
    w.wait()
    # every collective has an async form
    b = np.full(4, float(r))
    outs = np.empty(4 * n)
    ws = [pg.broadcast(b, src=0, async_op=True), pg.all_gather(outs, np.full(4, 1.0),
                                                               async_op=True),
          pg.barrier(async_op=True)]
    for w in ws:
        w.wait()
    expect((b == 0).all() and (outs == 1).all())
    # wait(timeout) expires while a peer is late; the operation goes on
    late = np.full(3, 1.0)
    if r == n - 1:
        time.sleep(0.5)
    w = pg.all_reduce(late, async_op=True)
    if r == 0 and n > 1:
        try:
            w.wait(timeout=0.05)
        except CollectiveTimeout as exc:
            expect("rank 0/" in str(exc) and "all_reduce" in str(exc), str(exc))
        else:
            expect(False, "wait(timeout=0.05) did not time out with a late peer")
    w.wait()
    w.wait()  # waiting twice is fine
    expect((late == n).all())
    # reduce_scatter too (gloo's own reduce-scatter work reported neither before a plain
    # wait(): its async form never completed, its wait(timeout) could not expire)
    out = np.zeros(2)
    if r == n - 1:
        time.sleep(0.5)
    w = pg.reduce_scatter(out, np.arange(2.0 * n) + r, async_op=True)
    if r == 0 and n > 1:
        try:
            w.wait(timeout=0.05)
        except CollectiveTimeout as exc:
            expect("reduce_scatter" in str(exc), str(exc))
        else:
            expect(False, "reduce_scatter wait(timeout=0.05) did not time out with a late peer")
    deadline = time.monotonic() + 30
    while not w.is_completed():
        if time.monotonic() > deadline:
            expect(False, "reduce_scatter is_completed() never became True")
            break
        time.sleep(0.001)
    expect(out.tolist() == [float(sum(2 * r + k + q for q in range(n))) for k in range(2)],
           f"async reduce_scatter: {out}")
    w.wait()


def check_point_to_point(pg):
    n, r = pg.size, pg.rank
    if n == 1:
        return
    # tags keep messages apart: received in the other order than sent
    if r == 0:
        pg.send(np.array([1.0, 1.0]), dst=1, tag=1)
        pg.send(np.array([2.0, 2.0, 2.0]), dst=1, tag=2)
    elif r == 1:
        two, one = np.empty(3), np.empty(2)
        w2 = pg.irecv(two, src=0, tag=2)
        w1 = pg.irecv(one, src=0, tag=1)
        w2.wait()
        w1.wait()
        expect((one == 1).all() and (two == 2).all(), "tags")
    # a ring of bfloat16 tensors and a large message
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.empty(5, dtype=torch.bfloat16)
    ws = pg.isend(torch.full((5,), float(r), dtype=torch.bfloat16), nxt, tag=9)
    pg.recv(got, prv, tag=9)
    ws.wait()
    expect((got == prv).all(), "ring")
    big = np.full(1 << 20, float(r), np.float32)
    recv = np.empty_like(big)
    ws = pg.isend(big, nxt, tag=2 ** 31 - 1)
    pg.irecv(recv, prv, tag=2 ** 31 - 1).wait()
    ws.wait()
    expect((recv == prv).all(), "large message, largest tag")
    # a non-contiguous receive buffer is written when the receive is waited for
    target = torch.zeros(4, 3)
    ws = pg.isend(torch.full((4,), float(r)), nxt)
    w = pg.irecv(target[:, 2], prv)
    w.wait()
    ws.wait()
    expect((target[:, 2] == prv).all() and (target[:, :2] == 0).all(), "staged irecv")


def check_objects(pg):
    n, r = pg.size, pg.rank
    for src in range(n):
        got = pg.broadcast_object({"src": src, "x": [1, 2]} if r == src else None, src=src)
        expect(got == {"src": src, "x": [1, 2]})
    expect(pg.all_gather_object(("r", r)) == [("r", q) for q in range(n)])


def check_sub_groups(pg):
    n, r = pg.size, pg.rank
    evens = list(range(0, n, 2))
    if n == 2:
        mine = [0, 1]
    else:
        mine = evens if r in evens else [q for q in range(n) if q not in evens]
    sub = pg.new_group(mine)
    again = pg.new_group(mine)  # a second group over the same ranks is a different group
    expect(sub.backend == "gloo" and sub.size == len(mine) and sub.rank == mine.index(r))
    a, b = np.array([r + 1.0]), np.array([10.0 * (r + 1)])
    wa = sub.all_reduce(a, async_op=True)
    again.all_reduce(b)
    wa.wait()
    expect(a[0] == sum(q + 1.0 for q in mine) and b[0] == 10 * sum(q + 1.0 for q in mine))
    # a sub-group of a sub-group, over all of its members again, and one of size one
    inner = sub.new_group(list(range(sub.size)))
    g = np.empty(inner.size, np.int64)
    inner.all_gather(g, np.array([r], np.int64))
    expect(g.tolist() == mine)
    alone = sub.new_group([sub.rank])
    c = np.array([5.0])
    alone.all_reduce(c, op=ReduceOp.AVG)
    expect(c[0] == 5.0 and alone.size == 1)
    for group in (alone, inner, again, sub):
        group.close()
    # the parent is unaffected
    d = np.array([1.0])
    pg.all_reduce(d)
    expect(d[0] == n)


def check_errors(pg):
    """Run last: each case uses a world of its own, opened next to ``pg``."""
    n, r = pg.size, pg.rank
    # A closed group says so.
    w1 = collectives.init_process_group("gloo", timeout=30)
    w1.close()
    w1.close()  # idempotent
    try:
        w1.all_reduce(np.ones(1))
    except CollectiveError as exc:
        expect("closed" in str(exc))
    else:
        expect(False, "a closed group accepted an all_reduce")
    if n == 1:
        return
    # A timeout names the op and the rank; the others are held back (on pg) until rank 0
    # timed out, so that it is a timeout and not a hang-up.
    w2 = collectives.init_process_group("gloo", timeout=2.0)
    if r == 0:
        started = time.monotonic()
        try:
            w2.all_reduce(np.ones(2))
        except CollectiveTimeout as exc:
            expect("rank 0/" in str(exc) and "all_reduce" in str(exc), str(exc))
            expect(time.monotonic() - started < 20)
        else:
            expect(False, "all_reduce without peers did not time out")
    pg.barrier()
    w2.close()
    # A peer that closes its group is a PeerError for a receive from it.
    w3 = collectives.init_process_group("gloo", timeout=20)
    pg.barrier()
    if r == 1:
        w3.close()
    pg.barrier()
    if r == 0:
        try:
            w3.recv(np.empty(4), src=1)
        except PeerError as exc:
            expect("rank 0/" in str(exc) and "irecv" in str(exc), str(exc))
        except CollectiveTimeout as exc:  # a hang-up gloo did not notice: still typed
            expect("rank 0/" in str(exc), str(exc))
        else:
            expect(False, "recv from a closed peer succeeded")
    w3.close()


CHECKS = [check_all_reduce, check_reduce, check_broadcast, check_gathers_and_scatter,
          check_reduce_scatter, check_all_to_all, check_async, check_point_to_point,
          check_objects, check_sub_groups, check_errors]


def _job():
    """Every check on one rank; returns {check: None or what it found wrong here}."""
    pg = collectives.init_process_group("gloo")
    report = {}
    for check in CHECKS:
        _FAILED.clear()
        expect(pg.backend == "gloo"
               and type(pg.transport).__module__ == "backends.torchdist.backend")
        check(pg)
        report[check.__name__] = "\n".join(_FAILED) or None
    pg.close()
    return report


@pytest.fixture(scope="module")
def job2():
    return collectives.spawn(_job, 2, backend="gloo", timeout=JOB_TIMEOUT)


@pytest.fixture(scope="module")
def job3():
    return collectives.spawn(_job, 3, backend="gloo", timeout=JOB_TIMEOUT)


def _assert_passed(reports, name):
    failures = [f"rank {r}:\n{rep[name]}" for r, rep in enumerate(reports) if rep[name]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_world_of_two(job2, check):
    _assert_passed(job2, check)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_world_of_three(job3, check):
    _assert_passed(job3, check)


# ------------------------------------------------------------------- in this process
@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "COLLECTIVES_BACKEND", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)


def test_world_of_one_needs_no_network_and_coexists(no_launcher):
    a = collectives.init_process_group("gloo")
    b = collectives.init_process_group("torch")  # gloo without CUDA
    try:
        assert (a.rank, a.size, a.backend) == (0, 1, "gloo")
        if not torch.cuda.is_available():
            assert b.backend == "gloo"
        x = np.arange(4.0)
        a.all_reduce(x, op=ReduceOp.AVG)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
        out = np.empty(4)
        b.all_gather(out, np.arange(4.0))
        sub = a.new_group([0])
        sub.reduce_scatter(out[:2], np.array([1.0, 2.0]))
        assert out[:2].tolist() == [1.0, 2.0]
        sub.close()
    finally:
        a.close()
        b.close()


def test_registry_lists_gloo_and_torch():
    names = collectives.available_backends()
    assert "gloo" in names and "torch" in names
    assert ("nccl" in names) == torch.cuda.is_available()
    from backends.torchdist import backend, nccl
    assert collectives.get_backend("gloo") is backend.create_gloo
    assert collectives.get_backend("torch") is nccl.create_auto


def test_wire_tags_fit_a_c_int():
    from backends.torchdist.tensors import wire_tag as _wire_tag
    from collectives.algorithms.links import COLLECTIVE_TAG_BIT
    assert [_wire_tag(t) for t in (0, 5, 2 ** 31 - 1)] == [0, 5, 2 ** 31 - 1]
    internal = [COLLECTIVE_TAG_BIT | (seq << 12) | step
                for seq in range(300) for step in range(4)]
    internal += [(g << 40) | COLLECTIVE_TAG_BIT | (7 << 12) for g in range(1, 50)]
    folded = [_wire_tag(t) for t in internal]
    assert all(2 ** 30 <= t < 2 ** 31 for t in folded)
    assert len(set(folded)) == len(folded)


def test_torch_errors_become_typed_errors(no_launcher):
    pg = collectives.init_process_group("gloo")
    try:
        gone = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                            "[127.0.0.1]:6302. This is typically caused by a crash.\nmore")
        err = pg.transport.translate(gone, "all_reduce", 4)
        assert isinstance(err, PeerError) and "pair.cc" not in str(err)
        assert str(err).startswith("[rank 0/1] all_reduce (seq 4): ")
        late = RuntimeError("[x/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
        err = pg.transport.translate(late, "irecv(src=1, tag=0)", -1, 1)
        assert isinstance(err, CollectiveTimeout) and err.missing == (1,)
        err = pg.transport.translate(RuntimeError("Application timeout caused pair closure"),
                            "barrier", 9)
        assert isinstance(err, CollectiveTimeout) and "earlier" in str(err)
        assert type(pg.transport.translate(RuntimeError("boom"), "x", 1)) is CollectiveError
    finally:
        pg.close()


# ------------------------------------------------------------------------ processes
def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "COLLECTIVES_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _run_cycles(runs: int, cycles: int) -> None:
    """``runs`` times: two fresh interpreters (ranks) each open, use and close the world
    ``cycles`` times, leaving the last one to the exit hook; all must exit with 0."""
    script = str(SCRIPTS / "torchdist_cycle.py")
    bad = []
    for run in range(runs):
        port = free_port()
        procs = [subprocess.Popen(
            [sys.executable, script, "--cycles", str(cycles), "--leave-open"],
            env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            if p.returncode != 0 or "ok" not in out:
                bad.append(f"run {run} rank {r}: exit code {p.returncode}\n{err[-2000:]}")
    assert not bad, "\n\n".join(bad)


def test_start_collective_close_cycles_exit_cleanly():
    """2 interpreter runs x 2 ranks x 20 cycles of init, collectives (async ones too) and
    close; the last cycle of each leaves async work and no close() to the exit hook."""
    _run_cycles(runs=2, cycles=20)


@pytest.mark.slow
def test_many_interpreters_exit_cleanly():
    """20 separate two-rank runs (gloo's exit-time abort hit about 1 run in 10)."""
    _run_cycles(runs=20, cycles=3)


def _last_json(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in the output:\n{text[-3000:]}"
    return json.loads(lines[-1])


def test_torchrun_gives_the_same_results_as_spawn():
    script = str(SCRIPTS / "torchdist_collectives.py")
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", script, "--backend", "gloo"],
        env=_env(), capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    via_torchrun = _last_json(torchrun.stdout)
    assert (via_torchrun["backend"], via_torchrun["launcher"]) == ("gloo", "torchrun")
    peer = "shm" if "shm" in collectives.available_backends() else "gloo"
    spawned = subprocess.run([sys.executable, script, "--backend", peer, "--nproc", "2"],
                             env=_env(), capture_output=True, text=True, timeout=180)
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    via_spawn = _last_json(spawned.stdout)
    assert via_spawn["launcher"] == "spawn"
    assert via_torchrun["results"] == via_spawn["results"]
    # and a few closed-form values, so that two equal wrong answers do not pass
    r0, r1 = via_torchrun["results"]
    assert r0["all_reduce_SUM"] == [-3.0, -1.0, 1.0, 3.0, 5.0, 7.0]
    assert r1["reduce_scatter"] == [5.0, 7.0] and r0["all_to_all"] == [0, 100]
    assert r0["all_to_all_splits"] == [0.0, 10.0] and r1["ring_send_recv"] == [0, 7]


# ------------------------------------------------------------------------------ NCCL
def _nccl_job():
    _FAILED.clear()
    pg = collectives.init_process_group("nccl")
    n, r = pg.size, pg.rank
    dev = torch.device("cuda", torch.cuda.current_device())
    expect(pg.backend == "nccl")
    t = torch.full((1000,), r + 1.0, device=dev)
    ptr = t.data_ptr()
    pg.all_reduce(t)
    expect(t.data_ptr() == ptr and (t == n * (n + 1) / 2).all(), "in place, not staged")
    t = torch.full((8,), r + 1.0, device=dev, dtype=torch.bfloat16)
    pg.all_reduce(t, op=ReduceOp.AVG)
    expect((t == (n + 1) / 2).all())
    a = (np.arange(6) * 9000 + r).astype(np.int16)  # numpy and int16, staged and widened
    pg.all_reduce(a)
    ins = [(np.arange(6) * 9000 + q).astype(np.int16) for q in range(n)]
    expect(a.tobytes() == reduce_arrays(ReduceOp.SUM, ins).tobytes())
    out = torch.empty(2, device=dev)
    pg.reduce_scatter(out, torch.arange(2.0 * n, device=dev) + r)
    expect(out.tolist() == [float(sum(2 * r + k + q for q in range(n))) for k in range(2)])
    g = torch.empty(2 * n, device=dev)
    w = pg.all_gather(g, torch.full((2,), float(r), device=dev), async_op=True)
    w.wait()
    expect(g.tolist() == [float(q) for q in range(n) for _ in range(2)])
    x = torch.arange(n, device=dev, dtype=torch.int64) + 100 * r
    y = torch.empty(n, device=dev, dtype=torch.int64)
    pg.all_to_all(y, x)
    expect(y.tolist() == [r + 100 * q for q in range(n)])
    view = torch.zeros(4, 2, device=dev)[:, 1]
    view.fill_(1.0)
    pg.all_reduce(view)
    expect((view == n).all())
    pg.barrier()
    if n > 1:
        got = torch.empty(3, device=dev)
        s = pg.isend(torch.full((3,), float(r), device=dev), (r + 1) % n)
        pg.recv(got, (r - 1) % n)
        s.wait()
        expect((got == (r - 1) % n).all())
    sub = pg.new_group(list(range(n)))
    t = torch.ones(2, device=dev)
    sub.all_reduce(t)
    expect((t == n).all())
    sub.close()
    pg.close()
    return list(_FAILED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="nccl needs CUDA; this machine has none (torch.cuda.is_available() "
                           "is False)")
def test_nccl_collectives_on_cuda_tensors():
    nproc = min(2, torch.cuda.device_count())  # NCCL allows one rank per GPU
    failures = collectives.spawn(_nccl_job, nproc, backend="nccl", timeout=JOB_TIMEOUT)
    assert failures == [[]] * nproc, failures
