"""Property tests of every send/recv algorithm in ``collectives.algorithms``, run on
in-process thread worlds (``collectives.testing.threads``) of 1 to 5 ranks.

Hypothesis draws in the driver only (world size, length, dtype, op, root, seed); each rank
derives its input from ``(seed, rank)``. Values are small integers, so every order of
reduction gives the exact reference (``reduce_arrays`` in rank order); AVG is compared
with a tolerance. Besides the result, each test checks that inputs are untouched (they
are read-only arrays, and compared with copies) and that no message is left unreceived.

    python -m pytest -q tests/test_algorithms.py
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives.algorithms import (Links, dispatch, dissemination, pairwise,
                                    recursive_doubling, ring, tree, two_phase)
from collectives.errors import (CollectiveError, CollectiveMismatch, CollectiveTimeout,
                                PeerError)
from collectives.reduce_op import ReduceOp, reduce_arrays
from collectives.testing.threads import ThreadBackend, run_threads

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(d) for d in (np.float32, np.float64, np.float16)] + [BF16]
INTS = [np.dtype(d) for d in (np.int32, np.int64, np.uint8, np.int8)]
REDUCIBLE = FLOATS + INTS
MOVABLE = REDUCIBLE + [np.dtype(np.bool_)]
OPS = list(ReduceOp)
MAX_WORLD = 5

EXAMPLES = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- drawing
@dataclass(frozen=True)
class Case:
    n: int
    length: int       # elements per rank (or per part, for the gather family)
    dtype: np.dtype
    op: ReduceOp
    root: int
    seed: int


@st.composite
def cases(draw, dtypes=MOVABLE, ops=(ReduceOp.SUM,), max_length=40) -> Case:
    dtype = draw(st.sampled_from(dtypes))
    ops = [op for op in ops if not (op is ReduceOp.AVG and dtype.kind in "iu")]
    n = draw(st.integers(1, MAX_WORLD))
    return Case(n=n, length=draw(st.integers(0, max_length)), dtype=dtype,
                op=draw(st.sampled_from(ops)), root=draw(st.integers(0, n - 1)),
                seed=draw(st.integers(0, 2**32 - 1)))


def rank_data(case: Case, rank: int, length: int | None = None) -> np.ndarray:
    """Rank ``rank``'s input: small integers whose every reduction is exact."""
    rng = np.random.default_rng([case.seed, rank])
    length = case.length if length is None else length
    if case.dtype == np.bool_:
        return rng.integers(0, 2, length).astype(np.bool_)
    low = 0 if case.dtype.kind == "u" else -2
    high = 3 if case.op is ReduceOp.PRODUCT else 4
    return rng.integers(low, high, length).astype(case.dtype)


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def assert_same(got: np.ndarray, want: np.ndarray, op: ReduceOp | None = None) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if op is ReduceOp.AVG:
        rtol = 1e-2 if got.dtype.itemsize == 2 else 1e-6
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol)
    else:
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


def bits(a: np.ndarray) -> bytes:
    return a.tobytes()


@contextlib.contextmanager
def no_thresholds():
    """Make dispatch pick its large-message algorithms at every size."""
    with mock.patch.multiple(dispatch, ALL_REDUCE_RING_BYTES=0, BROADCAST_LARGE_BYTES=0,
                             REDUCE_LARGE_BYTES=0):
        yield


def run(case: Case, body: Callable[[Links, int], object], *, large: bool = False) -> list:
    """Run ``body(links, rank)`` on every rank of a thread world of ``case.n``."""
    with no_thresholds() if large else contextlib.nullcontext():
        return run_threads(lambda g: body(Links(g, 0), g.rank), case.n, timeout=20)


def algos(*fns: Callable, large_dispatch: bool = False) -> list:
    """pytest params ``(function, large)``; with ``large_dispatch`` also the dispatcher
    forced onto its large-message algorithms."""
    params = [pytest.param((f, False), id=f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}")
              for f in fns]
    if large_dispatch:
        params.append(pytest.param((fns[-1], True), id="dispatch-large"))
    return params


# ------------------------------------------------------------------------- broadcast
@pytest.mark.parametrize("algo", algos(tree.broadcast, two_phase.broadcast,
                                       dispatch.broadcast, large_dispatch=True))
@EXAMPLES
@given(case=cases())
def test_broadcast(algo, case):
    fn, large = algo
    inputs = [rank_data(case, r) for r in range(case.n)]

    def body(links, rank):
        a = read_only(inputs[rank]) if rank == case.root else inputs[rank].copy()
        fn(links, a, case.root)
        return a

    for got in run(case, body, large=large):
        assert_same(got, inputs[case.root])


# ------------------------------------------------------------------------ all_reduce
@pytest.mark.parametrize("algo", algos(ring.all_reduce, recursive_doubling.all_reduce,
                                       dispatch.all_reduce, large_dispatch=True))
@EXAMPLES
@given(case=cases(REDUCIBLE, OPS))
def test_all_reduce(algo, case):
    fn, large = algo
    inputs = [rank_data(case, r) for r in range(case.n)]
    want = reduce_arrays(case.op, inputs)

    def body(links, rank):
        a = inputs[rank].copy()
        fn(links, a, case.op)
        return a

    results = run(case, body, large=large)
    for got in results:
        assert_same(got, want, case.op)
        assert bits(got) == bits(results[0])


@pytest.mark.parametrize("algo", algos(ring.all_reduce, recursive_doubling.all_reduce,
                                       dispatch.all_reduce, large_dispatch=True))
@EXAMPLES
@given(case=cases(FLOATS, OPS, max_length=200))
def test_all_reduce_bitwise_identical_on_random_floats(algo, case):
    """Non-integer data: the order of reduction matters, yet every rank gets the same bits.
    Signed zeros sprinkled in make MIN/MAX depend on operand order too."""
    fn, large = algo
    inputs = []
    for r in range(case.n):
        rng = np.random.default_rng([case.seed, r])
        x = rng.standard_normal(case.length)
        x[rng.random(case.length) < 0.2] = 0.0
        x[rng.random(case.length) < 0.2] = -0.0
        inputs.append(x.astype(case.dtype))

    def body(links, rank):
        a = inputs[rank].copy()
        fn(links, a, case.op)
        return a

    results = run(case, body, large=large)
    for rank, got in enumerate(results):
        assert bits(got) == bits(results[0]), f"rank {rank} differs from rank 0"
    want = reduce_arrays(case.op, [x.astype(np.float64) for x in inputs])
    rtol = 0.1 if case.dtype.itemsize == 2 else 1e-4
    if case.op is ReduceOp.PRODUCT:
        rtol *= 4
    np.testing.assert_allclose(results[0].astype(np.float64), want, rtol=rtol, atol=rtol)


# ---------------------------------------------------------------------------- reduce
@pytest.mark.parametrize("algo", algos(tree.reduce, two_phase.reduce, dispatch.reduce,
                                       large_dispatch=True))
@EXAMPLES
@given(case=cases(REDUCIBLE, OPS))
def test_reduce(algo, case):
    fn, large = algo
    inputs = [rank_data(case, r) for r in range(case.n)]

    def body(links, rank):
        # Off the root the buffer is only an input: read-only proves it is not written.
        a = inputs[rank].copy() if rank == case.root else read_only(inputs[rank])
        fn(links, a, case.root, case.op)
        return a

    results = run(case, body, large=large)
    assert_same(results[case.root], reduce_arrays(case.op, inputs), case.op)
    for rank, got in enumerate(results):
        if rank != case.root:
            assert bits(got) == bits(inputs[rank])


# ------------------------------------------------------------------------ all_gather
@pytest.mark.parametrize("algo", algos(ring.all_gather, dispatch.all_gather))
@EXAMPLES
@given(case=cases(max_length=12))
def test_all_gather(algo, case):
    fn, _ = algo
    inputs = [rank_data(case, r) for r in range(case.n)]

    def body(links, rank):
        out = np.empty(case.n * case.length, case.dtype)
        fn(links, out, read_only(inputs[rank]))
        return out

    for got in run(case, body):
        assert_same(got, np.concatenate(inputs))


# ---------------------------------------------------------------------------- gather
@pytest.mark.parametrize("algo", algos(tree.gather, dispatch.gather))
@EXAMPLES
@given(case=cases(max_length=12))
def test_gather(algo, case):
    fn, _ = algo
    inputs = [rank_data(case, r) for r in range(case.n)]

    def body(links, rank):
        out = np.empty(case.n * case.length, case.dtype) if rank == case.root else None
        fn(links, read_only(inputs[rank]), out, case.root)
        return out

    results = run(case, body)
    assert_same(results[case.root], np.concatenate(inputs))


# --------------------------------------------------------------------------- scatter
@pytest.mark.parametrize("algo", algos(tree.scatter, dispatch.scatter))
@EXAMPLES
@given(case=cases(max_length=12))
def test_scatter(algo, case):
    fn, _ = algo
    k = case.length
    source = rank_data(case, case.root, case.n * k)

    def body(links, rank):
        out = np.empty(k, case.dtype)
        fn(links, out, read_only(source) if rank == case.root else None, case.root)
        return out

    for rank, got in enumerate(run(case, body)):
        assert_same(got, source[rank * k:(rank + 1) * k])


# -------------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("algo", algos(ring.reduce_scatter, dispatch.reduce_scatter))
@EXAMPLES
@given(case=cases(REDUCIBLE, OPS, max_length=12))
def test_reduce_scatter(algo, case):
    fn, _ = algo
    k = case.length
    inputs = [rank_data(case, r, case.n * k) for r in range(case.n)]
    want = reduce_arrays(case.op, inputs)

    def body(links, rank):
        out = np.empty(k, case.dtype)
        fn(links, out, read_only(inputs[rank]), case.op)
        return out

    for rank, got in enumerate(run(case, body)):
        assert_same(got, want[rank * k:(rank + 1) * k], case.op)


# ------------------------------------------------------------------------ all_to_all
@pytest.mark.parametrize("algo", algos(pairwise.all_to_all, dispatch.all_to_all))
@EXAMPLES
@given(case=cases(), counts=st.lists(st.integers(0, 5), min_size=MAX_WORLD**2,
                                     max_size=MAX_WORLD**2))
def test_all_to_all(algo, case, counts):
    fn, _ = algo
    n = case.n
    sent = [counts[i * MAX_WORLD:i * MAX_WORLD + n] for i in range(n)]   # sent[i][j]: i -> j
    inputs = [rank_data(case, i, sum(sent[i])) for i in range(n)]
    at = [[0, *accumulate(row)] for row in sent]

    def body(links, rank):
        out_counts = [sent[i][rank] for i in range(n)]
        out = np.empty(sum(out_counts), case.dtype)
        fn(links, out, read_only(inputs[rank]), out_counts, sent[rank])
        return out

    for rank, got in enumerate(run(case, body)):
        want = np.concatenate([inputs[i][at[i][rank]:at[i][rank + 1]] for i in range(n)])
        assert_same(got, want.astype(case.dtype))


# --------------------------------------------------------------------------- barrier
@pytest.mark.parametrize("algo", algos(dissemination.barrier, dispatch.barrier))
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, MAX_WORLD), late=st.integers(0, MAX_WORLD - 1))
def test_barrier_waits_for_everyone(algo, n, late):
    fn, _ = algo
    late %= n
    arrived = []

    def body(links, rank):
        if rank == late:
            time.sleep(0.01)
            arrived.append(rank)
        fn(links)
        return len(arrived)

    assert run_threads(lambda g: body(Links(g, 0), g.rank), n) == [1] * n


# ------------------------------------------------------------------ message counts
def _count_messages(n: int, call: Callable[[Links, int], None]) -> int:
    """Messages sent by all ranks during ``call(links, rank)`` (the alpha terms)."""
    def fn(g):
        call(Links(g, 0), g.rank)
        return g.transport.world

    return run_threads(fn, n)[0].messages_sent


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_message_counts_match_the_documented_costs(n):
    m = 11
    p = 1 << (n.bit_length() - 1)
    log2_n = (n - 1).bit_length()
    sum_ = ReduceOp.SUM
    assert _count_messages(n, lambda ln, r: ring.all_reduce(ln, np.ones(m), sum_)) \
        == n * 2 * (n - 1)
    assert _count_messages(n, lambda ln, r: recursive_doubling.all_reduce(
        ln, np.ones(m), sum_)) == p * (p.bit_length() - 1) + 2 * (n - p)
    assert _count_messages(n, lambda ln, r: tree.broadcast(ln, np.ones(m), n - 1)) == n - 1
    assert _count_messages(n, lambda ln, r: tree.reduce(ln, np.ones(m), 0, sum_)) == n - 1
    assert _count_messages(n, lambda ln, r: pairwise.all_to_all(
        ln, np.ones(n), np.ones(n), [1] * n, [1] * n)) == n * (n - 1)
    assert _count_messages(n, lambda ln, r: dissemination.barrier(ln)) == n * log2_n


@pytest.mark.parametrize("n", [2, 3, 5])
def test_empty_and_short_messages_post_nothing_empty(n):
    """Both ends skip an empty message: a collective on empty arrays sends nothing, and a
    ring over fewer elements than ranks moves only the non-empty chunks."""
    sum_ = ReduceOp.SUM
    for fn in (ring.all_reduce, recursive_doubling.all_reduce, dispatch.all_reduce):
        assert _count_messages(n, lambda ln, r: fn(ln, np.ones(0), sum_)) == 0
    assert _count_messages(n, lambda ln, r: two_phase.broadcast(ln, np.ones(0), 1)) == 0
    assert _count_messages(n, lambda ln, r: tree.gather(
        ln, np.ones(0), np.ones(0) if r == 0 else None, 0)) == 0
    # One element over n ranks: chunk 0 travels n-1 hops each way.
    assert _count_messages(n, lambda ln, r: ring.all_reduce(ln, np.ones(1), sum_)) \
        == 2 * (n - 1)


# ------------------------------------------------ dispatch at real thresholds
@pytest.mark.parametrize("n", [3, 4])
def test_dispatch_large_messages_at_real_thresholds(n):
    """Sizes just past each threshold (odd, not divisible by n) take the large paths."""
    m = dispatch.BROADCAST_LARGE_BYTES // 4 + 3
    inputs = [np.random.default_rng([7, r]).integers(-3, 4, m).astype(np.float32)
              for r in range(n)]
    want = reduce_arrays(ReduceOp.SUM, inputs)

    def body(pg):
        links = Links(pg, 0)
        a = inputs[pg.rank].copy()
        dispatch.all_reduce(links, a, ReduceOp.SUM)
        b = inputs[pg.rank].copy()
        dispatch.reduce(Links(pg, 1), b, n - 1, ReduceOp.SUM)
        c = inputs[pg.rank].copy()
        dispatch.broadcast(Links(pg, 2), c, 1)
        return a, b, c

    for rank, (a, b, c) in enumerate(run_threads(body, n)):
        assert_same(a, want)
        assert_same(b, want if rank == n - 1 else inputs[rank])
        assert_same(c, inputs[1])


# ----------------------------------------------- the public API over ThreadBackend
def test_process_group_api_on_threads():
    """Every public collective of ProcessGroup on torch tensors, through the default
    algorithms, plus sub-groups and async_op."""
    n = 4

    def fn(pg):
        assert isinstance(pg.transport, ThreadBackend) and pg.backend == "threads"
        r = pg.rank
        t = torch.full((3, 2), float(r + 1))
        pg.all_reduce(t)
        assert torch.equal(t, torch.full((3, 2), 10.0))

        b = torch.full((5,), float(r + 1), dtype=torch.bfloat16)
        pg.all_reduce(b, op=ReduceOp.MAX)
        assert torch.equal(b, torch.full((5,), 4.0, dtype=torch.bfloat16))

        m = torch.arange(12.0).reshape(3, 4) * (r + 1)
        pg.all_reduce(m.t())                     # a non-contiguous view, in place
        assert torch.equal(m, torch.arange(12.0).reshape(3, 4) * 10)

        w = pg.all_reduce(a := torch.ones(7, dtype=torch.int64), async_op=True)
        w2 = pg.broadcast(c := torch.full((2,), r), src=2, async_op=True)
        w.wait()
        w2.wait()
        assert a.tolist() == [4] * 7 and c.tolist() == [2, 2]

        red = torch.full((2,), float(r))
        pg.reduce(red, dst=1, op=ReduceOp.SUM)
        assert red.tolist() == ([6.0, 6.0] if r == 1 else [float(r)] * 2)

        out = torch.empty(n, 2, dtype=torch.int32)
        pg.all_gather(out, torch.full((1, 2), r, dtype=torch.int32))
        assert out[:, 0].tolist() == list(range(n))

        g = torch.empty(n * 2, dtype=torch.bool) if r == 3 else None
        pg.gather(torch.tensor([True, r % 2 == 0]), g, dst=3)
        if r == 3:
            assert g.tolist() == [True, True, True, False] * 2

        s = torch.empty(2)
        pg.scatter(s, torch.arange(2.0 * n) if r == 0 else None, src=0)
        assert s.tolist() == [2.0 * r, 2.0 * r + 1]

        rs = torch.empty(1)
        pg.reduce_scatter(rs, torch.arange(float(n)) + r, op=ReduceOp.AVG)
        assert rs.tolist() == [r + 1.5]

        # Rank i sends i+1 rows to everyone; rank r receives (i+1) rows from each i.
        inp = torch.full((n * (r + 1),), float(r))
        outp = torch.empty(sum(i + 1 for i in range(n)))
        pg.all_to_all(outp, inp, output_split_sizes=[i + 1 for i in range(n)],
                      input_split_sizes=[r + 1] * n)
        assert outp.tolist() == [float(i) for i in range(n) for _ in range(i + 1)]

        assert pg.broadcast_object({"r": r}, src=3) == {"r": 3}
        assert pg.all_gather_object(r * r) == [0, 1, 4, 9]
        pg.barrier()

        ring_buf = torch.empty(3)
        recv = pg.irecv(ring_buf, src=(r - 1) % n, tag=5)
        pg.send(torch.full((3,), float(r)), dst=(r + 1) % n, tag=5)
        recv.wait()
        assert ring_buf.tolist() == [float((r - 1) % n)] * 3

        sub = pg.new_group([0, 2] if r % 2 == 0 else [1, 3])
        assert (sub.rank, sub.size) == (r // 2, 2)
        x = torch.tensor([float(r)])
        sub.all_reduce(x)
        assert x.item() == (2.0 if r % 2 == 0 else 4.0)
        sw = sub.broadcast(y := torch.tensor([r]), src=1, async_op=True)
        sub.barrier()
        sw.wait()
        assert y.item() == (2 if r % 2 == 0 else 3)
        trio = pg.new_group([1, 2, 3]) if r > 0 else None
        if trio is not None:
            z = torch.tensor([r])
            trio.all_reduce(z, op=ReduceOp.PRODUCT)
            assert z.item() == 6
            trio.close()
        sub.close()
        return r

    assert run_threads(fn, n) == list(range(n))


# -------------------------------------------------------------- the thread world
def test_run_threads_returns_in_rank_order_and_world_of_one():
    assert run_threads(lambda g: (g.rank, g.size), 3) == [(0, 3), (1, 3), (2, 3)]
    a = np.arange(5.0)
    assert bits(run_threads(lambda g: (g.all_reduce(a, op=ReduceOp.AVG), a)[1], 1)[0]) \
        == bits(np.arange(5.0))


def test_size_mismatch_is_collective_mismatch_naming_the_rank():
    def fn(g):
        if g.rank == 0:
            g.send(np.zeros(3, np.float32), dst=1)
        else:
            g.recv(np.zeros(4, np.float32), src=0)

    with pytest.raises(CollectiveMismatch, match="sent 3 x float32") as info:
        run_threads(fn, 2)
    assert any("rank 1 of 2" in note for note in info.value.__notes__)


def test_recv_timeout_names_the_missing_rank():
    def fn(g):
        if g.rank == 1:
            g.recv(np.zeros(1), src=0, tag=3)

    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="recv from rank 0") as info:
        run_threads(fn, 2, timeout=0.2)
    assert info.value.missing == (0,)
    assert time.monotonic() - start < 5


def test_barrier_timeout_names_the_missing_rank():
    def fn(g):
        if g.rank != 2:
            g.barrier()

    with pytest.raises(CollectiveTimeout) as info:
        run_threads(fn, 3, timeout=0.2)
    assert info.value.missing == (2,) or info.value.missing == [2]


def test_a_failing_rank_wakes_the_others_at_once():
    def fn(g):
        if g.rank == 0:
            raise KeyError("boom")
        g.all_reduce(np.zeros(4))          # would wait for rank 0 until the timeout

    start = time.monotonic()
    with pytest.raises(KeyError, match="boom") as info:
        run_threads(fn, 3, timeout=30)
    assert time.monotonic() - start < 5
    assert any("rank 0 of 3" in note for note in info.value.__notes__)


def test_peer_error_reaches_ranks_waiting_on_async_work():
    seen = []

    def fn(g):
        if g.rank == 1:
            raise RuntimeError("died")
        w = g.all_reduce(np.zeros(2), async_op=True)
        try:
            w.wait()
        except PeerError as exc:
            seen.append(exc)

    with pytest.raises(RuntimeError, match="died"):
        run_threads(fn, 2, timeout=30)
    assert len(seen) == 1 and seen[0].peer == 1 and "rank 1 failed" in str(seen[0])


def test_unreceived_message_is_an_error():
    def fn(g):
        if g.rank == 0:
            g.isend(np.zeros(2), dst=1, tag=9).wait()

    with pytest.raises(CollectiveError, match="never received"):
        run_threads(fn, 2)


def test_receives_match_sends_in_posting_order():
    """The n-th receive posted on a (source, tag) gets the n-th message, whatever order
    the receives are waited in."""

    def fn(g):
        if g.rank == 0:
            for v in range(3):
                g.send(np.full(1, v), dst=1)
            return None
        bufs = [np.empty(1, np.int64) for _ in range(3)]
        works = [g.irecv(b, src=0) for b in bufs]
        for w in reversed(works):
            w.wait()
        return [int(b[0]) for b in bufs]

    assert run_threads(fn, 2)[1] == [0, 1, 2]
