"""Symmetric memory (collectives/symmetric.py; shm's in backends/shm/symmetric.py).

One spawned shm job per world size checks, on every rank: what ``alloc_symmetric``
returns (zeros, aligned, writable, nothing left in /dev/shm, still valid after close);
that an all_reduce of an array in a buffer, at one offset on every rank, takes the
in-place path and gives bitwise what the other paths give, for several dtypes,
operators, sizes and offsets, blocking and persistent; that an array at different
offsets, or outside every buffer, takes the usual paths with the same results; that
ranks asking for different sizes all get a ValueError and the group goes on; and that
DDP's buckets live there. World 3 runs the Python path (``COLLECTIVES_SHM_NATIVE=0``).
Late ranks and waits longer than the core's own budget take the Python waits between the
core's calls. A buffer nothing refers to any more is let go (model after model on one
group maps only the live buffers), and a rank that let go of its copy declines. No rank
pushes its piece into the buffer of a rank that failed (on the core and in Python). The
base class's default (plain memory) runs in a thread world. Its
faults (a rank killed in it, one that never comes, ranks whose operators differ) are in
test_faults.py (``all_reduce_symmetric``, ``symmetric op``).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import collectives
from collectives import ReduceOp
from collectives.testing import run_threads

from backends.shm.native import native_module

#: (dtype, operator, elements, byte offset in the buffer): past the one-phase size (32
#: KiB), odd counts (pieces of unequal length), offsets that are not a piece multiple.
CASES = [
    ("float32", ReduceOp.SUM, 218_000, 0),
    ("float32", ReduceOp.AVG, 262_147, 4096),
    ("float64", ReduceOp.MAX, 9_001, 64),
    ("float16", ReduceOp.SUM, 100_003, 192),
    ("bfloat16", ReduceOp.AVG, 70_000, 0),
    ("int32", ReduceOp.MIN, 300_001, 128),
    ("int64", ReduceOp.PRODUCT, 5_000, 0),
    ("float32", ReduceOp.SUM, 400_003, 64),  # 1.6 MB: the plain call reads in place at 2
]
BUFFER_BYTES = 3 << 20


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _values(dt: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    if dt.kind == "i":
        return rng.integers(-3, 4, n).astype(dt)  # small: PROD stays in range
    return rng.standard_normal(n).astype(dt)


def _spy_in_place(cls, taken: list, bound: list) -> tuple:
    """Make the backend class ``cls`` (and its symmetric heap) note in ``taken`` whether
    each large all_reduce went in place (True) or past a declined vote (False), by either
    way there: the plain path (``SymmetricHeap.all_reduce``) or a persistent request's
    round bound on the core (``SymmetricHeap.round``, whose uses are also counted in
    ``bound``). Returns what to put back."""
    from backends.shm.symmetric import SymmetricHeap
    real, real_round, real_rest = (SymmetricHeap.all_reduce, SymmetricHeap.round,
                                   cls.unplaced_all_reduce)
    declined = []

    def spy(self, a, op, seq):
        went = real(self, a, op, seq)
        taken.append(went)
        return went

    def rest(self, *args):
        declined.append(True)
        return real_rest(self, *args)

    def round_spy(self, a, op, large, rest):
        round_ = real_round(self, a, op, large, rest)
        if round_ is None:
            return None

        def counted(seq):
            before = len(declined)
            round_(seq)
            bound.append(True)
            taken.append(len(declined) == before)
        return counted

    SymmetricHeap.all_reduce, SymmetricHeap.round = spy, round_spy
    cls.unplaced_all_reduce = rest
    return real, real_round, real_rest


def _unspy(cls, saved: tuple) -> None:
    from backends.shm.symmetric import SymmetricHeap
    SymmetricHeap.all_reduce, SymmetricHeap.round, cls.unplaced_all_reduce = saved


def _job() -> dict:
    pg = collectives.init_process_group()
    cls = type(pg.transport)
    taken, bound = [], []
    saved = _spy_in_place(cls, taken, bound)
    out: dict = {"rank": pg.rank}
    try:
        rng = np.random.default_rng(pg.rank)
        buf = pg.alloc_symmetric(BUFFER_BYTES)
        out["fresh"] = (buf.dtype == np.uint8 and buf.nbytes == BUFFER_BYTES
                        and not buf.any() and buf.ctypes.data % 64 == 0
                        and buf.flags.writeable)
        pg.barrier()  # every rank unlinked its name once its own alloc returned
        out["linked"] = [r for r in range(pg.size) if os.path.exists(pg.transport.heap._path(0, r))]

        results = []
        for name, op, count, offset in CASES:
            dt = _dtype(name)
            for where in ("same offset", "offset by rank", "outside"):
                if where == "outside":
                    a = np.empty(count, dt)
                else:
                    at = offset + (pg.rank * 64 if where == "offset by rank" else 0)
                    a = buf[at:at + count * dt.itemsize].view(dt)
                a[:] = _values(dt, count, rng)
                plain = a.copy()
                taken.clear()
                pg.all_reduce(a, op)
                pg.all_reduce(plain, op)
                every = pg.all_gather_object(a.tobytes())
                results.append({"case": (name, op.name, count, offset, where),
                                "in_place": taken[:1] == [True],
                                "as_plain": a.tobytes() == plain.tobytes(),
                                "same_everywhere": all(b == every[0] for b in every)})
        out["results"] = results

        flat = torch.frombuffer(buf, dtype=torch.float32, count=50_000, offset=8192)
        req = pg.all_reduce_init(flat, ReduceOp.AVG)
        rounds = []
        for i in range(3):
            flat.fill_(pg.rank + i)
            taken.clear()
            req.start()
            req.wait()
            rounds.append(taken == [True] and bool((flat == i + (pg.size - 1) / 2).all()))
        flat.fill_(pg.rank)
        taken.clear()
        req.run()
        rounds.append(taken == [True] and bool((flat == (pg.size - 1) / 2).all()))
        out["persistent"] = rounds
        out["bound"] = len(bound) == 4   # the rounds ran the round bound on the core

        # Ranks that mix the ways in one call: rank 0 by its persistent round, the others
        # by a plain all_reduce of the same place; then a round whose vote declines (the
        # last rank's array lies one element further on): the other paths, still right.
        flat.fill_(pg.rank + 1)
        taken.clear()
        if pg.rank == 0:
            req.run()
        else:
            pg.all_reduce(flat, ReduceOp.AVG)
        mixed = taken == [True] and bool((flat == (pg.size + 1) / 2).all())
        shifted = 4 if pg.rank == pg.size - 1 else 0
        other = torch.frombuffer(buf, dtype=torch.float32, count=50_000,
                                 offset=(1 << 20) + shifted)
        other_req = pg.all_reduce_init(other, ReduceOp.SUM)
        other.fill_(pg.rank + 1)
        taken.clear()
        other_req.run()
        out["mixed"] = [mixed, taken == [False],
                        bool((other == pg.size * (pg.size + 1) / 2).all())]

        try:
            pg.alloc_symmetric(4096 + 64 * pg.rank)
            out["mismatch"] = "no error"
        except ValueError as exc:
            out["mismatch"] = str(exc)
        out["after_mismatch"] = pg.all_gather_object(pg.rank) == list(range(pg.size))
        out["empty"] = pg.alloc_symmetric(0).nbytes == 0
        try:
            pg.alloc_symmetric(0 if pg.rank == 0 else 4096)  # 0 still takes part
            out["zero_mismatch"] = "no error"
        except ValueError as exc:
            out["zero_mismatch"] = str(exc)

        # The last rank cannot reserve its pages (a full /dev/shm): plain memory on every
        # rank, a warning on it and on the lowest other rank, the all_reduce still right.
        before = len(pg.transport.heap.table)
        real_fallocate = os.posix_fallocate

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        if pg.rank == pg.size - 1:
            os.posix_fallocate = full
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plain_buf = pg.alloc_symmetric(1 << 16)
        finally:
            os.posix_fallocate = real_fallocate
        b = plain_buf.view(np.float32)
        b[:] = pg.rank + 1
        taken.clear()
        pg.all_reduce(b)
        pg.barrier()
        out["fallback"] = {
            "kept": len(pg.transport.heap.table) == before and plain_buf.ctypes.data % 64 == 0,
            "sum": bool((b == pg.size * (pg.size + 1) / 2).all()),
            "in_place": taken[:1] == [True],
            "warnings": [str(w.message) for w in caught],
            "linked": [r for r in range(pg.size)
                       if os.path.exists(pg.transport.heap._path(pg.transport.heap.count - 1, r))]}

        from parallel import DDP
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 4)), pg)
        out["ddp_buckets_shared"] = all(
            pg.transport.heap.place(b.flat.numpy())[0] > 0 for b in ddp.buckets)
        taken.clear()
        ddp(torch.randn(8, 64)).sum().backward()
        out["ddp_in_place"] = taken == [True] * len(ddp.buckets)

        pg.barrier()
    finally:
        _unspy(cls, saved)
        pg.close()
    buf[:4] = 7  # still this rank's memory after close
    out["after_close"] = buf[:4].tolist() == [7] * 4
    return out


@pytest.mark.parametrize("nproc, native", [(2, "1"), (3, "0"), (4, "1")])
def test_all_reduce_in_symmetric_memory(nproc, native):
    results = collectives.spawn(_job, nproc, backend="shm", timeout=60, join_timeout=240,
                                env={"COLLECTIVES_SHM_NATIVE": native})
    for out in results:
        assert out["fresh"] and out["linked"] == [] and out["after_close"]
        for res in out["results"]:
            assert res["as_plain"] and res["same_everywhere"], res
            assert res["in_place"] == (res["case"][-1] == "same offset"), res
        assert out["persistent"] == [True] * 4
        assert out["bound"] == (native == "1") and out["mixed"] == [True] * 3
        assert "same `nbytes`" in out["mismatch"] and "alloc_symmetric" in out["mismatch"]
        assert f"rank {out['rank']}/{nproc}" in out["mismatch"] and out["after_mismatch"]
        assert out["ddp_buckets_shared"] and out["ddp_in_place"]
        assert out["empty"] and "same `nbytes`" in out["zero_mismatch"]
        fb = out["fallback"]
        assert fb["kept"] and fb["sum"] and not fb["in_place"] and fb["linked"] == []
        if out["rank"] == nproc - 1:
            assert len(fb["warnings"]) == 1 and "reserving 65536 bytes" in fb["warnings"][0]
        elif out["rank"] == 0:
            assert len(fb["warnings"]) == 1
            assert f"rank(s) [{nproc - 1}] could not share" in fb["warnings"][0]
        else:
            assert fb["warnings"] == []


def _late_job() -> list:
    """Symmetric all_reduces where a rank comes late and the core gives up on every
    first wait at once (``wait_budget`` 0): Python waits the vote phase and the last one
    out, and the core resumes after the vote."""
    pg = collectives.init_process_group()
    pg.transport.core.wait_budget = 0.0
    cls = type(pg.transport)
    core_cls = type(pg.transport.core)
    real_settle = core_cls.settle
    settled, in_place, bound = [], [], []

    def settle(self, q, again, status):
        settled.append(q)
        return real_settle(self, q, again, status)

    core_cls.settle = settle
    saved = _spy_in_place(cls, in_place, bound)
    try:
        a = pg.alloc_symmetric(1 << 20).view(np.float32)
        req = pg.all_reduce_init(a)   # (every other call: its round bound on the core)
        right = []
        for i in range(12):
            a[:] = pg.rank + i
            if (i + pg.rank) % 3 == 0:
                time.sleep(0.002 * (i % 4))
            if i % 2:
                req.run()
            else:
                pg.all_reduce(a)
            right.append(bool((a == sum(r + i for r in range(pg.size))).all()))
    finally:
        core_cls.settle = real_settle
        _unspy(cls, saved)
        native = pg.transport.native
        pg.close()
    return {"right": right, "native": native, "settled": len(settled) > 0,
            "in_place": in_place == [True] * 12, "bound": len(bound)}


@pytest.mark.skipif(native_module() is None, reason="backends.shm._native is not built")
@pytest.mark.parametrize("nproc", [2, 3])
def test_late_ranks_and_waits_past_the_core_budget(nproc):
    for res in collectives.spawn(_late_job, nproc, backend="shm", timeout=30,
                                 join_timeout=120):
        assert res == {"right": [True] * 12, "native": True, "settled": True,
                       "in_place": True, "bound": 6}, res


def _sym_mappings(pg) -> list:
    """The indexes of the symmetric buffers of ``pg`` that this process maps (its own or
    a peer's), one entry per mapping, sorted."""
    stem = os.path.basename(pg.transport.heap._path(0, 0)).rsplit(".sym", 1)[0] + ".sym"
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = os.path.basename(line.split()[-1] if " (deleted)" not in line
                                    else line.rsplit(" (deleted)", 1)[0].split()[-1])
            if name.startswith(stem):
                found.append(int(name[len(stem):].split(".r", 1)[0]))
    return sorted(found)


def _released_job() -> dict:
    """Model after model on one group, each with its own buffer: a buffer nothing refers
    to any more is let go (the table keeps an empty entry), the live ones still reduce
    in place; a rank whose buffer is gone while a peer still uses its copy declines, and
    the call is right."""
    pg = collectives.init_process_group()
    cls = type(pg.transport)
    taken, bound = [], []
    saved = _spy_in_place(cls, taken, bound)
    out: dict = {}
    try:
        right, in_place = [], []
        a = None
        for i in range(12):
            a = pg.alloc_symmetric(1 << 20).view(np.float32)   # the last one goes here
            req = pg.all_reduce_init(a)                         # (holds `a` while it lives)
            a[:] = pg.rank + i
            taken.clear()
            req.run() if i % 2 else pg.all_reduce(a)
            right.append(bool((a == sum(r + i for r in range(pg.size))).all()))
            in_place.append(taken == [True])
            del req
        out["right"], out["in_place"] = right, in_place
        out["mapped"] = _sym_mappings(pg)          # this one's and the last one's
        out["table"] = (len(pg.transport.heap.table), sum(1 for e in pg.transport.heap.table if e[1]))
        # Every rank lets a buffer go and maps plain memory at once: the kernel hands out
        # the same range, and an array there is in no buffer (it was taken for one in
        # the old buffer, and reduced with the peers' old copies, before entries were
        # forgotten on placing). No alloc_symmetric in between.
        gone = pg.alloc_symmetric(1 << 20)
        address = gone.ctypes.data
        del gone
        plain = mmap.mmap(-1, 1 << 20)
        x = np.frombuffer(plain, np.float32)
        x[:] = pg.rank + 1
        pg.all_reduce(x)
        out["reused"] = (x.ctypes.data == address, pg.transport.heap.place(x),
                         bool((x == sum(range(1, pg.size + 1))).all()))
        del x
        # Rank 0 lets its copy of the last buffer go; the others still reduce in it.
        kept = a
        if pg.rank == 0:
            kept = np.zeros(a.size, np.float32)
            del a
        pg.alloc_symmetric(4096)   # (rank 0 forgets the peers' copies here)
        kept[:] = pg.rank + 1
        taken.clear()
        pg.all_reduce(kept)
        out["declined"] = (taken == [False],
                           bool((kept == pg.size * (pg.size + 1) / 2).all()))
    finally:
        _unspy(cls, saved)
        pg.close()
    return out


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_buffer_nothing_refers_to_is_let_go(native):
    results = collectives.spawn(_released_job, 2, backend="shm", timeout=30,
                                env={"COLLECTIVES_SHM_NATIVE": native})
    for out in results:
        assert out["right"] == [True] * 12 and out["in_place"] == [True] * 12, out
        # Buffer 11 only, its own copy and the peer's (this rank's copy of 10 went when
        # `a` moved on, and the group forgot the peer's as it placed the next array):
        # not 24 mappings (as before buffers were let go). Twelve entries, eleven empty.
        assert out["mapped"] == [11, 11] and out["table"] == (12, 1), out
        assert out["declined"] == (True, True), out
        # (the range came back: Linux hands out the last freed one of that size first)
        assert out["reused"] == (True, (0, 0), True), out


def _two_groups_job() -> dict:
    """Two groups with buffers at the same index and offset, 2-D arrays (a new flat view
    every call): each group's plans are its own, found again by place, and right."""
    pg = collectives.init_process_group()
    pair = pg.new_group([0, 1])
    a = pg.alloc_symmetric(1 << 20).view(np.float32).reshape(512, 512)
    b = pair.alloc_symmetric(1 << 20).view(np.float32).reshape(512, 512)
    right = []
    for i in range(3):
        a[:] = pg.rank + i
        b[:] = 10.0 * (pg.rank + 1)
        pg.all_reduce(a)
        pair.all_reduce(b)
        right += [bool((a == 1 + 2 * i).all()), bool((b == 30.0).all())]
    out = {"right": right, "places": (len(pg.transport.heap.places), len(pair.transport.heap.places)),
           "shared": pg.transport.heap.places is pair.transport.heap.places
           or pg.transport.heap.plans is pair.transport.heap.plans}
    pair.close()
    pg.close()
    return out


def test_each_group_keeps_its_own_plans_by_place():
    for res in collectives.spawn(_two_groups_job, 2, backend="shm", timeout=30):
        assert res == {"right": [True] * 6, "places": (1, 1), "shared": False}, res


def _one_rank() -> tuple:
    pg = collectives.init_process_group()
    buf = pg.alloc_symmetric(1 << 16)
    a = buf.view(np.float32)
    a[:] = 2.0
    pg.all_reduce(a)
    result = (buf.ctypes.data % 64, float(a[0]), pg.alloc_symmetric(0).nbytes, pg.backend)
    pg.close()
    return result


def test_a_world_of_one_gets_aligned_plain_memory():
    assert collectives.spawn(_one_rank, 1, backend="shm", timeout=30) == [(0, 2.0, 0, "shm")]


def test_default_is_plain_aligned_memory():
    def body(pg):
        buf = pg.alloc_symmetric(100)
        a = buf[:64].view(np.float32)
        a[:] = pg.rank + 1
        pg.all_reduce(a)
        errors = []
        for bad in (-1, 1.5, True, "8"):
            try:
                pg.alloc_symmetric(bad)
            except ValueError as exc:
                errors.append(str(exc))
        return (buf.nbytes, buf.ctypes.data % 64, float(a[0]), errors,
                pg.alloc_symmetric(0).nbytes)

    for rank, (nbytes, misalign, value, errors, empty) in enumerate(run_threads(body, 2)):
        assert (nbytes, misalign, value, empty) == (100, 0, 3.0, 0)
        assert len(errors) == 4
        assert all("alloc_symmetric" in e and "`nbytes`" in e and f"rank {rank}/2" in e
                   for e in errors)


def _refused_push_job() -> dict:
    """Rank 0 has (as far as its state word says) left the call with an error after it
    voted: rank 1 must not push its reduced piece into rank 0's buffer, and raises a
    PeerError naming rank 0 (Phases.push_into)."""
    from backends.shm import segment as sg
    from collectives import CollectiveError
    pg = collectives.init_process_group()
    g = pg.new_group([0, 1])
    a = g.alloc_symmetric(1 << 20).view(np.float32)
    a[:] = 1.0
    g.all_reduce(a)                       # plans made, the vote known to pass
    a[:] = pg.rank + 1.0
    pg.barrier()
    out = {"native": g.transport.native}
    if pg.rank == 0:
        g.transport.phases.u64[g.transport.phases.state_idx[0]] = sg.STATE_FAILED
    else:
        time.sleep(0.3)                   # rank 0 votes first, rank 1 sees it arrived
    try:
        g.all_reduce(a)
        out["error"] = None
    except CollectiveError as exc:
        out["error"] = (type(exc).__name__, getattr(exc, "peer", None))
    half = a.size // 2
    out["mine"] = float(a[:half].max()) if pg.rank == 0 else None
    out["theirs"] = sorted({float(x) for x in a[half:]}) if pg.rank == 0 else None
    pg.barrier()
    g.close()
    pg.close()
    return out


@pytest.mark.parametrize("native", ["1", "0"])
def test_no_push_into_a_rank_that_failed(native):
    if native == "1" and native_module() is None:
        pytest.skip("backends.shm._native is not built")
    r0, r1 = collectives.spawn(_refused_push_job, 2, backend="shm", timeout=30,
                               join_timeout=120, env={"COLLECTIVES_SHM_NATIVE": native})
    assert r0["native"] == (native == "1")
    assert r1["error"] == ("PeerError", 0), r1
    assert r0["theirs"] == [1.0], r0      # rank 1's piece of rank 0's buffer: untouched
