"""Persistent collectives (``collectives.persistent``) and the base class's fast path
(``collectives.fast_path``).

The checks are functions of a process group, run in the in-process thread world (fast,
world sizes 1-3) and in one spawned job per backend (shm, zmq, gloo) and one ``mpiexec``
job (mpi, whose requests are MPI-4's own). Every persistent round is compared, bitwise,
with the plain collective on the same contents: the data are small integers, so every
reduction order gives the same floats and the comparison can be exact on any backend.

Run this file as a script under ``mpiexec`` to get one JSON line per rank::

    mpiexec -n 2 python tests/test_persistent.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402
from collectives import CollectiveError, CollectiveMismatch, CollectiveTimeout, ReduceOp  # noqa: E402
from collectives import running  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402

ROUNDS = 4
#: Element counts: tiny, odd, past shm's one-phase reduce (32 KiB of float32) and past
#: one shm slot (1 MiB) so that every path of a native round is crossed.
COUNTS = (1, 7, 9000, 300_000)


def _data(shape, dtype, rank: int, round_: int, seed: int) -> np.ndarray:
    """Small integers (exact in every dtype and every reduction order), new each round."""
    rng = np.random.default_rng([seed, rank, round_])
    values = rng.integers(1, 4, size=shape)
    return values.astype(dtype)


def _tensor_like(array: np.ndarray, kind: str):
    if kind == "numpy":
        return array.copy()
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _as_numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.copy()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def _fill(t, array: np.ndarray) -> None:
    if isinstance(t, np.ndarray):
        t[...] = array
    else:
        t.copy_(_tensor_like(array, "torch"))


# ------------------------------------------------------------------ checks (per rank)
def _round(request, q: int) -> None:
    """One round: ``start(); wait()``, or every other round ``run()`` (the blocking one)."""
    if q % 2:
        request.run()
    else:
        request.start()
        request.wait()


def check_rounds(pg, counts=COUNTS) -> dict:
    """Each persistent op against its plain call over ROUNDS rounds with new contents:
    the number of rounds that differ (0 expected) and whether rounds ran natively."""
    n, r = pg.size, pg.rank
    cases = [("torch", np.float32, ReduceOp.SUM), ("numpy", np.float64, ReduceOp.MAX),
             ("torch", np.int32, ReduceOp.PRODUCT), ("torch", ml_dtypes.bfloat16, ReduceOp.AVG),
             ("numpy", np.float16, ReduceOp.MIN)]
    wrong, native, rounds = [], set(), 0
    for count in counts:
        for seed, (kind, dt, op) in enumerate(cases):
            if count > 10_000 and seed % 2:  # large messages: fewer dtypes, same paths
                continue
            dt = np.dtype(dt)
            if op is ReduceOp.PRODUCT:  # keep products small: ones and twos
                make = lambda shape, q, s=seed: np.minimum(_data(shape, dt, r, q, s), 2)
            else:
                make = lambda shape, q, s=seed: _data(shape, dt, r, q, s)
            t = _tensor_like(make((count,), 0), kind)
            out = _tensor_like(np.zeros(count, dt), kind)
            inp = _tensor_like(np.zeros(count * n, dt), kind)
            ag_out = _tensor_like(np.zeros(count * n, dt), kind)
            ag_in = _tensor_like(np.zeros(count, dt), kind)
            requests = {"all_reduce": pg.all_reduce_init(t, op),
                        "reduce_scatter": pg.reduce_scatter_init(out, inp, op),
                        "all_gather": pg.all_gather_init(ag_out, ag_in)}
            native |= {name for name, req in requests.items() if req.native}
            for q in range(ROUNDS):
                a = make((count,), q)
                _fill(t, a)
                _round(requests["all_reduce"], q)
                ref = _tensor_like(a, kind)
                pg.all_reduce(ref, op)
                b = make((count * n,), q + 100)
                _fill(inp, b)
                _round(requests["reduce_scatter"], q)
                ref_out = _tensor_like(np.zeros(count, dt), kind)
                pg.reduce_scatter(ref_out, _tensor_like(b, kind), op)
                c = make((count,), q + 200)
                _fill(ag_in, c)
                _round(requests["all_gather"], q)
                ref_ag = _tensor_like(np.zeros(count * n, dt), kind)
                pg.all_gather(ref_ag, _tensor_like(c, kind))
                for name, got, want in (("all_reduce", t, ref), ("reduce_scatter", out, ref_out),
                                        ("all_gather", ag_out, ref_ag)):
                    rounds += 1
                    if not np.array_equal(_as_numpy(got), _as_numpy(want)):
                        wrong.append(f"{name} {kind} {dt} {op.name} x{count} round {q}")
            for req in requests.values():
                req.free()
    return {"wrong": wrong, "rounds": rounds, "native": sorted(native)}


def check_staged_and_moved(pg) -> dict:
    """A non-contiguous view is staged every round; a tensor whose memory moved (``set_``;
    FSDP re-allocates its storage) is bound again; both give the plain call's results."""
    base = torch.zeros(6, 4)
    view = base[:, 1]                      # non-contiguous: staged
    req = pg.all_reduce_init(view)
    ok = []
    for q in range(3):
        view.copy_(torch.full((6,), float(pg.rank + q)))
        req.start()
        req.wait()
        ok.append(torch.equal(view, torch.full((6,), float(sum(range(pg.size)) + q * pg.size))))
    ok.append(torch.equal(base[:, 0], torch.zeros(6)))      # the neighbours untouched
    t = torch.zeros(64)
    req = pg.all_reduce_init(t)
    for q in range(3):
        t.set_(torch.empty(64))            # new memory under the same tensor
        t.fill_(pg.rank + 1.0)
        req.start()
        req.wait()
        ok.append(torch.equal(t, torch.full((64,), n_sum(pg.size))))
    return {"staged_and_moved": ok}


def n_sum(n: int) -> float:
    return n * (n + 1) / 2.0


def check_nonblocking(pg) -> dict:
    """``start()`` returns before the peers arrive: rank 0 starts, then sends rank 1 the
    token that rank 1 waits for before it starts (a start that blocked would hang). A
    bounded wait that runs out leaves the request active."""
    if pg.size < 2:
        return {"nonblocking": True, "timed_out": True}
    t = torch.full((5,), float(pg.rank))
    token = np.zeros(1, np.int64)
    req = pg.all_reduce_init(t)
    timed_out = False
    if pg.rank == 0:
        req.start()
        try:
            req.wait(timeout=0.2)          # rank 1 cannot have started: it needs the token
        except CollectiveTimeout:
            timed_out = req.active
        pg.send(token, dst=1)
        req.wait()
    else:
        if pg.rank == 1:
            pg.recv(token, src=0)
        req.start()
        req.wait()
        timed_out = True
    overlap = []                           # a persistent round between async plain ones
    a, b = torch.ones(3), torch.ones(3)
    work = pg.all_reduce(a, async_op=True)
    t.fill_(1.0)
    req.start()
    work2 = pg.all_reduce(b, async_op=True)
    req.wait()
    work.wait()
    work2.wait()
    overlap = [float(x[0]) for x in (a, t, b)]
    return {"nonblocking": bool(torch.equal(t, torch.full((5,), float(pg.size)))),
            "timed_out": timed_out, "overlap": overlap}


def _all_checks(pg, counts=COUNTS) -> dict:
    return {**check_rounds(pg, counts), **check_staged_and_moved(pg),
            **check_nonblocking(pg), "backend": pg.backend, "rank": pg.rank}


def _assert_results(results: list, *, native: bool) -> None:
    n = len(results)
    for res in results:
        assert res["wrong"] == [], res["wrong"]
        assert res["rounds"] > 0
        assert all(res["staged_and_moved"]), res["staged_and_moved"]
        assert res["nonblocking"] and res["timed_out"]
        if n > 1:
            assert res["overlap"] == [float(n)] * 3
        if native:
            assert res["native"] == ["all_gather", "all_reduce", "reduce_scatter"], res
        else:
            assert res["native"] == [], res


def _spawned_job() -> dict:
    pg = collectives.init_process_group()
    try:
        return _all_checks(pg, counts=(1, 9000, 300_000))
    finally:
        pg.close()


# ------------------------------------------------------------------ thread world
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_persistent_rounds_in_thread_world(nproc):
    _assert_results(run_threads(lambda pg: _all_checks(pg, (1, 7, 9000)), nproc, timeout=60),
                    native=False)


def test_errors_are_typed_and_name_the_call():
    def body(pg):
        t = torch.zeros(4)
        with pytest.raises(TypeError, match=rf"\[rank {pg.rank}/2\] all_reduce_init: argument `tensor`"):
            pg.all_reduce_init([1.0])
        with pytest.raises(TypeError, match="all_reduce_init.*bool"):
            pg.all_reduce_init(np.zeros(2, bool))
        with pytest.raises(ValueError, match="all_reduce_init.*AVG"):
            pg.all_reduce_init(np.zeros(2, np.int32), ReduceOp.AVG)
        with pytest.raises(TypeError, match="all_reduce_init.*`op`"):
            pg.all_reduce_init(t, "mean")
        with pytest.raises(ValueError, match="all_gather_init: `output` has 3 elements"):
            pg.all_gather_init(torch.zeros(3), torch.zeros(2))
        with pytest.raises(TypeError, match="all_gather_init.*same dtype"):
            pg.all_gather_init(torch.zeros(4), torch.zeros(2, dtype=torch.float64))
        with pytest.raises(ValueError, match="reduce_scatter_init: `input` has 3 elements"):
            pg.reduce_scatter_init(torch.zeros(2), torch.zeros(3))
        read_only = np.zeros(4, np.float32)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="all_reduce_init.*read-only"):
            pg.all_reduce_init(read_only)
        req = pg.all_reduce_init(t)
        assert req.wait() is None and req.is_completed() and not req.active  # not started
        req.start()
        with pytest.raises(RuntimeError, match="all_reduce_init: start\\(\\) called on a "
                                               "request that is still active"):
            req.start()
        with pytest.raises(RuntimeError, match="all_reduce_init: run\\(\\) called on a "
                                               "request that is still active"):
            req.run()
        req.wait()
        t.resize_(2, 2)
        with pytest.raises(ValueError, match="argument `tensor` changed from shape"):
            req.start()
        a = np.zeros(4, np.float32)
        numpy_req = pg.all_reduce_init(a)
        a.dtype = np.int32                               # reassigned in place
        with pytest.raises(ValueError, match="changed from shape \\(4,\\) float32 to "
                                             "\\(4,\\) int32"):
            numpy_req.start()
        req.free()
        with pytest.raises(RuntimeError, match="freed"):
            req.start()
        with pytest.raises(RuntimeError, match="run\\(\\) called on a freed request"):
            req.run()
        req2 = pg.all_reduce_init(torch.zeros(3))
        pg.barrier()
        pg.close()
        with pytest.raises(CollectiveError, match="all_reduce_init: the group is closed"):
            req2.start()
        with pytest.raises(CollectiveError, match="all_reduce_init: the group is closed"):
            req2.run()
        with pytest.raises(CollectiveError, match="all_gather_init: the group is closed"):
            pg.all_gather_init(torch.zeros(4), torch.zeros(2))
        return True

    assert run_threads(body, 2) == [True, True]


def test_rounds_go_into_the_flight_record_and_the_debug_check(monkeypatch):
    def body(pg):
        t = torch.zeros(4)
        req = pg.all_reduce_init(t, ReduceOp.MAX)
        for _ in range(3):
            req.start()
            req.wait()
        return [(d["op"], d["seq"], d["shape"], d["dtype"], d["reduce_op"], d["state"])
                for d in pg._recorder.records()]

    records = run_threads(body, 2)
    assert records[0] == records[1] == [("all_reduce", s, [4], "float32", "MAX", "ok")
                                        for s in range(3)]
    monkeypatch.setenv("COLLECTIVES_DEBUG", "1")

    def mismatched(pg):
        req = pg.all_reduce_init(torch.zeros(4 + pg.rank))
        req.start()
        req.wait()

    with pytest.raises(CollectiveMismatch, match="shape=\\(4,\\).*shape=\\(5,\\)|"
                                                 "shape=\\(5,\\).*shape=\\(4,\\)"):
        run_threads(mismatched, 2)


# ------------------------------------------------------------------ DDP and FSDP
class _PlainOnly:
    """A group without persistent requests: the strategies fall back to plain calls."""

    def __init__(self, pg) -> None:
        self._pg = pg

    def __getattr__(self, name):
        if name.endswith("_init"):
            raise AttributeError(name)
        return getattr(self._pg, name)


def _train(pg, wrap_kind: str, **kwargs) -> list:
    from torch import nn
    from parallel import DDP, FSDP

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 3))
    init = torch.Generator().manual_seed(3)  # (the thread ranks share torch's global one)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.5)
    wrapped = DDP(model, pg, bucket_cap_mb=1e-4) if wrap_kind == "ddp" else \
        FSDP(model, pg, wrap=nn.Linear, **kwargs)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(11 + pg.rank)
    for _ in range(3):
        opt.zero_grad()
        wrapped(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
    if wrap_kind == "ddp":
        used = {"all_reduce": sum(b._request is not None for b in wrapped.buckets)}
    else:
        used = {"all_gather": sum(u._gather_request is not None for u in wrapped.units),
                "reduce": sum(u._reduce_req is not None for u in wrapped.units)}
    return [p.detach().clone() for p in wrapped.parameters()], used


@pytest.mark.parametrize("wrap_kind, kwargs", [
    ("ddp", {}), ("fsdp", {"strategy": "zero3"}), ("fsdp", {"strategy": "zero2"}),
    ("fsdp", {"strategy": "zero3", "reduce_dtype": torch.bfloat16}),
    ("fsdp", {"strategy": "zero1", "reduce_dtype": torch.bfloat16}),
    ("fsdp", {"strategy": "zero3", "param_dtype": torch.bfloat16})])
def test_strategies_train_bitwise_alike_with_and_without_requests(wrap_kind, kwargs):
    """DDP's buckets and FSDP's units through persistent requests give exactly the
    plain calls' parameters (same ops, same order, same rounding)."""
    def body(pg):
        return _train(pg, wrap_kind, **kwargs), _train(_PlainOnly(pg), wrap_kind, **kwargs)

    for (persistent, used), (plain, unused) in run_threads(body, 2, timeout=60):
        assert all(torch.equal(a, b) for a, b in zip(persistent, plain))
        assert not any(unused.values())
        if wrap_kind == "ddp":
            assert used["all_reduce"] >= 3                 # every bucket
        else:
            assert used["all_gather"] == 3                 # the 3 Linear units
            # the gradient's reduction binds only where it is cast anyway
            assert used["reduce"] == (3 if "reduce_dtype" in kwargs else 0)


# ------------------------------------------------------------------ the fast path
def test_fast_path_follows_tensors_that_change_in_place():
    """The cached host view is dropped when a tensor's memory, shape or dtype changes."""
    def body(pg):
        assert pg._fast
        out = []
        t = torch.ones(4)
        pg.all_reduce(t)                                 # fills the cache
        out.append(t.tolist())
        t.resize_(2, 2)                                  # same memory, new shape
        t.fill_(1.0)
        pg.all_reduce(t)
        out.append(t.reshape(-1).tolist())
        t.set_(torch.ones(6))                            # another storage, bigger
        pg.all_reduce(t)
        out.append(t.tolist())
        t.set_(torch.full((3,), 2.0))                    # another storage
        pg.all_reduce(t)
        out.append(t.tolist())
        m = torch.arange(4.0).reshape(2, 2)
        pg.all_reduce(m)
        m.t_()                                           # same memory, now transposed
        pg.broadcast(m, src=0)
        out.append(m.tolist())
        d = torch.ones(2)
        pg.all_reduce(d)
        d.data = torch.ones(2, dtype=torch.float64)      # same object, other dtype
        pg.all_reduce(d, ReduceOp.AVG)
        out.append([d.dtype == torch.float64, d.tolist()])
        a = np.ones(4, np.float32)
        a.shape = (2, 2)
        pg.all_reduce(a)
        out.append(a.tolist())
        return out

    got = run_threads(body, 2)
    assert got[0] == got[1] == [[2.0] * 4, [2.0] * 4, [2.0] * 6, [4.0] * 3, [[0.0, 4.0], [2.0, 6.0]],
                                [True, [1.0, 1.0]], [[2.0, 2.0], [2.0, 2.0]]]


def test_fast_path_records_and_keeps_the_argument_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_FLIGHT_DIR", str(tmp_path))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from base_overhead import NoOpBackend, NoOpGroup

    class Failing(NoOpBackend):
        def all_reduce(self, a, op, seq):
            raise CollectiveTimeout("[rank 0/1] all_reduce (seq 1): test", op="all_reduce")

    pg = NoOpGroup()
    pg.all_reduce(torch.ones(3, dtype=torch.bfloat16))
    pg.broadcast(np.ones((2, 2), np.int8), 0)
    assert [(d["op"], d["shape"], d["dtype"], d["state"]) for d in pg._recorder.records()] \
        == [("all_reduce", [3], "bfloat16", "ok"), ("broadcast", [2, 2], "int8", "ok")]
    with pytest.raises(TypeError, match=r"\[rank 0/1\] all_reduce: argument `op`"):
        pg.all_reduce(torch.ones(3), "mean")
    with pytest.raises(ValueError, match="AVG is not defined on integer"):
        pg.all_reduce(np.ones(3, np.int64), ReduceOp.AVG)
    with pytest.raises(ValueError, match="`src`=1 is not a rank"):
        pg.broadcast(torch.ones(3), 1)
    pg.close()
    with pytest.raises(CollectiveError, match="all_reduce: the group is closed"):
        pg.all_reduce(torch.ones(3))
    bad = collectives.ProcessGroup(Failing())
    with pytest.raises(CollectiveTimeout) as info:
        bad.all_reduce(np.ones(2, np.float32))
    assert "flight record" in "\n".join(getattr(info.value, "__notes__", []))
    assert bad._recorder.records()[-1]["state"].startswith("CollectiveTimeout")
    bad.close()


def test_fast_path_takes_the_two_array_collectives_and_leaves_bad_pairs_to_the_general_path(
        tmp_path, monkeypatch):
    """all_gather, gather, scatter, reduce_scatter, reduce and all_to_all on contiguous
    memory go straight to their hooks, recorded as the general path records them; a pair
    whose dtypes or sizes disagree, or a reduction the dtype lacks, gets the general
    path's typed error, and a closed group the fast path's own. (A world of one: that
    the path is taken at two and three ranks is tests/test_shm_native.py's
    _small_moves_job.)"""
    monkeypatch.setenv("COLLECTIVES_FLIGHT_DIR", str(tmp_path))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from base_overhead import NoOpBackend

    hooked = []

    class Pairs(NoOpBackend):
        def all_gather(self, out, inp, seq):
            hooked.append(("all_gather", out.shape, inp.shape, seq))

        def gather(self, inp, out, root, seq):
            hooked.append(("gather", out.shape, inp.shape, seq))

        def scatter(self, out, inp, root, seq):
            hooked.append(("scatter", out.shape, inp.shape, seq))

        def reduce_scatter(self, out, inp, op, seq):
            hooked.append(("reduce_scatter", out.shape, inp.shape, seq))

        def reduce(self, a, root, op, seq):
            hooked.append(("reduce", a.shape, op, seq))

        def all_to_all(self, out, inp, out_counts, in_counts, seq):
            hooked.append(("all_to_all", out_counts, in_counts, seq))

    pg = collectives.ProcessGroup(Pairs())
    general = []
    real = running.dispatch
    monkeypatch.setattr(running, "dispatch", lambda g, op, *a, **k: (general.append(op),
                                                                      real(g, op, *a, **k))[1])
    t = torch.ones(2, 3)
    pg.all_gather(torch.empty(2, 3), t)
    pg.gather(np.ones(4, np.int8), np.empty(4, np.int8), dst=0)
    pg.scatter(np.empty(4), np.ones(4), src=0)
    pg.reduce_scatter(torch.empty(6), t, ReduceOp.MAX)
    pg.reduce(t, dst=0, op=ReduceOp.AVG)
    pg.all_to_all(np.empty((3, 2), np.int16), np.ones(6, np.int16))
    assert general == []
    assert hooked == [("all_gather", (6,), (6,), 0), ("gather", (4,), (4,), 1),
                      ("scatter", (4,), (4,), 2), ("reduce_scatter", (6,), (6,), 3),
                      ("reduce", (6,), ReduceOp.AVG, 4), ("all_to_all", [6], [6], 5)]
    assert [(d["op"], d["shape"], d["dtype"], d["root"], d["state"])
            for d in pg._recorder.records()] == [
        ("all_gather", [2, 3], "float32", -1, "ok"), ("gather", [4], "int8", 0, "ok"),
        ("scatter", [4], "float64", 0, "ok"), ("reduce_scatter", [6], "float32", -1, "ok"),
        ("reduce", [2, 3], "float32", 0, "ok"), ("all_to_all", None, "int16", -1, "ok")]
    pg.all_to_all(np.empty(4, np.int16), np.ones(4, np.int16), input_split_sizes=[4],
                  output_split_sizes=[4])   # (split sizes of plain ints: the fast path too)
    assert general == [] and hooked[-1] == ("all_to_all", [4], [4], 6)
    pg.all_to_all(np.empty(4, np.int16), np.ones(4, np.int16), input_split_sizes=[np.int64(4)],
                  output_split_sizes=[4])   # (a numpy split size: the general path)
    assert general == ["all_to_all"] and hooked[-1] == ("all_to_all", [4], [4], 7)
    read_only = np.ones(2, np.float32)
    read_only.flags.writeable = False
    pg.all_gather(np.empty(2, np.float32), read_only)     # (an input may be read-only)
    pg.gather(np.ones(2), np.empty(2), dst=np.int64(0))   # (a numpy root)
    assert general == ["all_to_all", "all_gather", "gather"] and len(hooked) == 10
    general.clear()
    with pytest.raises(ValueError, match=r"scatter: argument `input` must be given"):
        pg.scatter(np.empty(2), None, src=0)
    with pytest.raises(TypeError, match=r"all_gather: .*dtype"):
        pg.all_gather(np.empty(6, np.float64), np.ones(6, np.float32))
    with pytest.raises(ValueError, match=r"reduce_scatter: `input` has 6 elements, expected"):
        pg.reduce_scatter(np.empty(5, np.float32), np.ones(6, np.float32))
    with pytest.raises(ValueError, match="AVG is not defined on integer"):
        pg.reduce_scatter(np.empty(2, np.int32), np.ones(2, np.int32), ReduceOp.AVG)
    with pytest.raises(ValueError, match=r"gather: argument `output` must be given"):
        pg.gather(np.ones(2), None, dst=0)
    with pytest.raises(TypeError, match=r"all_to_all: .*dtype"):
        pg.all_to_all(np.empty(2, np.float64), np.ones(2, np.float32))
    assert len(hooked) == 10  # (the general path's checks raised before any hook)
    pg.close()
    with pytest.raises(CollectiveError, match=r"all_gather: the group is closed"):
        pg.all_gather(np.empty(2), np.ones(2))
    with pytest.raises(CollectiveError, match=r"scatter: the group is closed"):
        pg.scatter(np.empty(2), np.ones(2), src=0)


def test_fast_path_hands_hooks_plain_arrays_only():
    """An object that only claims to be an ndarray (``weakref.proxy`` forwards
    ``__class__``) takes the general path, which hands the hook a real array."""
    import weakref
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from base_overhead import NoOpBackend

    seen = []

    class Checking(NoOpBackend):
        def all_reduce(self, a, op, seq):
            seen.append(type(a))

        def broadcast(self, a, root, seq):
            seen.append(type(a))

    pg = collectives.ProcessGroup(Checking())
    a = np.ones(3, np.float32)
    pg.all_reduce(weakref.proxy(a))
    pg.broadcast(weakref.proxy(a), 0)
    pg.all_reduce(a)
    assert seen == [np.ndarray] * 3
    pg.close()


def test_fast_path_leaves_unaligned_and_read_only_arrays_to_the_general_path(monkeypatch):
    """The fast path takes what ``flags.carray`` says (C-contiguous, aligned, writeable):
    an aligned array goes the fast way, an unaligned one the general way (and still
    reduces: the hook gets it), a read-only one the general path's ValueError."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from base_overhead import NoOpGroup

    pg = NoOpGroup()
    general = []
    real = running.dispatch

    def spy(group, op, *args, **kwargs):
        general.append(op)
        return real(group, op, *args, **kwargs)

    monkeypatch.setattr(running, "dispatch", spy)
    pg.all_reduce(np.ones(4, np.float32))
    assert general == []
    unaligned = np.zeros(17, np.uint8)[1:].view(np.float32)
    assert not unaligned.flags.aligned and unaligned.flags.c_contiguous
    pg.all_reduce(unaligned)
    assert general == ["all_reduce"]
    read_only = np.ones(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="all_reduce.*read-only"):
        pg.all_reduce(read_only)
    pg.close()

    def body(group):
        a = np.zeros(17, np.uint8)[1:].view(np.float32)
        a[:] = group.rank + 1
        group.all_reduce(a)
        return a.tolist()

    assert run_threads(body, 2) == [[3.0] * 4] * 2


def test_base_overhead_benchmark_runs_and_the_fast_path_is_faster():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "base_overhead.py"),
                           "--iters", "500", "--repeat", "5"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.splitlines()[-1])["rows"]
    by = {(r["op"], r["tensor"], r["path"]): r["us_per_call"] for r in rows}
    for tensor in ("torch", "numpy"):
        # a wide margin: other processes share the machine
        assert by[("all_reduce", tensor, "fast")] < by[("all_reduce", tensor, "general")]
    assert ("all_reduce_init start+wait", "torch", "persistent") in by


def test_bench_persistent_mode(tmp_path):
    """``python -m collectives.bench --persistent``: our rows time requests (and say so),
    results checked as ever, ops without a persistent form skipped with the reason."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "collectives.bench", "--backend", "shm", "--nproc", "2",
         "--sizes", "4,65536", "--ops", "all_reduce,all_gather,reduce_scatter,broadcast",
         "--iters", "3", "--warmup", "1", "--memcpy", "--persistent", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    ours = [r for r in rows if r["impl"] == "shm"]
    assert sorted({r["op"] for r in ours}) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(r["persistent"] and r["wrong"] == 0 and "memcpy_gbps" in r for r in ours)
    assert "broadcast float32 skipped: no persistent form" in proc.stdout
    assert "through persistent requests" in proc.stdout


def test_docs_example_prints_what_the_page_says(tmp_path):
    """docs/persistent.md's script, saved and run as a user would."""
    import re

    readme = (ROOT / "docs" / "persistent.md").read_text()
    at = readme.index("`persistent_allreduce.py`")
    blocks = re.compile(r"```(\w*)\n(.*?)\n```", re.S)
    script = blocks.search(readme, at)
    printed = blocks.search(readme, script.end())
    (tmp_path / "persistent_allreduce.py").write_text(script.group(2) + "\n")
    proc = subprocess.run([sys.executable, "persistent_allreduce.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == printed.group(2).strip()


# ------------------------------------------------------------------ real processes
def _spawnable() -> list:
    return [b for b in ("shm", "zmq", "gloo") if b in collectives.available_backends()]


@pytest.mark.parametrize("backend", _spawnable())
def test_spawned(backend):
    try:
        collectives.get_backend(backend)
    except ImportError as exc:
        pytest.skip(f"backend {backend} does not import: {exc}")
    results = collectives.spawn(_spawned_job, 2, backend=backend, timeout=60, join_timeout=120)
    _assert_results(results, native=backend == "shm")


MPIEXEC = shutil.which("mpiexec") or shutil.which("mpirun")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec/mpirun on PATH (pip install mpich)")
def test_under_mpiexec_with_mpi4_persistent_requests(tmp_path):
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "COLLECTIVES_BACKEND", "COLLECTIVES_JOB_ID")}
    # each rank writes a file: mpiexec may interleave the ranks' output within a line
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PERSISTENT_TEST_OUT=str(tmp_path))
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, __file__], cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")),
                     key=lambda d: d["rank"])
    assert [d["backend"] for d in results] == ["mpi", "mpi"], proc.stdout + proc.stderr
    _assert_results(results, native=True)


if __name__ == "__main__":  # one rank of the mpiexec job
    report = _spawned_job()
    folder = os.environ.get("PERSISTENT_TEST_OUT")
    if folder:
        Path(folder, f"rank{report['rank']}.json").write_text(json.dumps(report))
    else:
        print(json.dumps(report), flush=True)
