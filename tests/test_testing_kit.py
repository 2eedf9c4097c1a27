"""The testing kit itself: the reference against hand-computed examples, the strategies'
promises, the verdict catching broken collectives, and the worker pool's failure modes."""

from __future__ import annotations

import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives
from collectives import ReduceOp
from collectives.reduce_op import reduce_arrays
from collectives.testing import (CollectiveCase, LauncherUnavailable, PoolError, RemoteError,
                                 RemoteErrors, WorldPool, check_backend, collective_cases,
                                 compare, expected_outputs, launcher_for, make_input,
                                 reference, run_case, spawn_launcher)
from collectives.testing.execution import SENTINEL, CaseResult, _Tensor, array_diff
from collectives.testing.strategies import DTYPES, FLOAT_DTYPES, OPS, REDUCING_OPS, ROOT_ARG
from collectives.testing.threads import ThreadBackend, ThreadWorld, run_threads

A, B = np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])


def _eq(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            np.testing.assert_array_equal(g, e)
            assert g.shape == np.shape(e)


# ------------------------------------------------------------------------- reference
def test_reference_broadcast():
    _eq(reference.broadcast([A, B], src=0), [A, A])
    _eq(reference.broadcast([A, B], src=1), [B, B])


@pytest.mark.parametrize("op,result", [
    (ReduceOp.SUM, [11, 22, 33, 44]), (ReduceOp.PRODUCT, [10, 40, 90, 160]),
    (ReduceOp.MIN, [1, 2, 3, 4]), (ReduceOp.MAX, [10, 20, 30, 40])])
def test_reference_all_reduce(op, result):
    _eq(reference.all_reduce([A, B], op), [result, result])


def test_reference_avg_divides_the_sum():
    _eq(reference.all_reduce([np.array([1.0, 2.0]), np.array([2.0, 5.0])], ReduceOp.AVG),
        [[1.5, 3.5]] * 2)


def test_reference_reduce_leaves_other_ranks_alone():
    _eq(reference.reduce([A, B], dst=1), [A, [11, 22, 33, 44]])
    _eq(reference.reduce([A, B], dst=0, op=ReduceOp.MAX), [[10, 20, 30, 40], B])


def test_reference_reduces_in_rank_order():
    big = np.float32(1e8)
    inputs = [np.array([big]), np.array([np.float32(1)]), np.array([-big])]
    # (1e8 + 1) rounds to 1e8 in float32, so left to right gives 0; other orders give 1
    _eq(reference.all_reduce(inputs), [[0.0]] * 3)
    assert reference.all_reduce(inputs[::-1])[0][0] == 0.0
    assert reference.all_reduce([inputs[0], inputs[2], inputs[1]])[0][0] == 1.0


def test_reference_all_gather_and_gather():
    _eq(reference.all_gather([A, B]), [[*A, *B]] * 2)
    _eq(reference.gather([A, B], dst=0), [[*A, *B], None])
    two_d = [np.array([[1, 2]]), np.array([[3, 4]])]
    _eq(reference.all_gather(two_d), [[[1, 2], [3, 4]]] * 2)
    _eq(reference.all_gather([np.array(5), np.array(6)]), [[5, 6]] * 2)   # 0-d inputs
    _eq(reference.all_gather([np.empty((0, 3)), np.empty((0, 3))]), [np.empty((0, 3))] * 2)


def test_reference_scatter():
    _eq(reference.scatter([A, None], src=0), [[1, 2], [3, 4]])
    _eq(reference.scatter([None, np.array([10, 20])], src=1, shape=()),
        [np.array(10), np.array(20)])
    _eq(reference.scatter([A.reshape(2, 2), None], src=0), [[[1, 2]], [[3, 4]]])


def test_reference_reduce_scatter():
    _eq(reference.reduce_scatter([A, B]), [[11, 22], [33, 44]])
    _eq(reference.reduce_scatter([A, B], ReduceOp.MIN, shape=(2, 1)), [[[1], [2]], [[3], [4]]])


def test_reference_all_to_all():
    _eq(reference.all_to_all([A, B]), [[1, 2, 10, 20], [3, 4, 30, 40]])
    splits = [[1, 3], [2, 2]]
    _eq(reference.all_to_all([A, B], splits), [[1, 10, 20], [2, 3, 4, 30, 40]])
    assert reference.output_split_sizes(splits) == [[1, 2], [3, 2]]
    rows = [np.arange(6).reshape(3, 2), np.arange(6, 10).reshape(2, 2)]
    _eq(reference.all_to_all(rows, [[0, 3], [2, 0]]),
        [[[6, 7], [8, 9]], [[0, 1], [2, 3], [4, 5]]])
    with pytest.raises(ValueError, match="do not sum"):
        reference.all_to_all([A, B], [[1, 1], [2, 2]])


def test_reference_three_ranks_all_to_all_equal_parts():
    inputs = [np.arange(3) + 10 * r for r in range(3)]
    _eq(reference.all_to_all(inputs), [[0, 10, 20], [1, 11, 21], [2, 12, 22]])


def test_reference_barrier_and_shapes():
    assert reference.barrier(3) == [None] * 3
    assert reference.stacked_shape((2, 3), 4) == (8, 3)
    assert reference.stacked_shape((), 4) == (4,)


# ------------------------------------------------------------------------ strategies
@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data(), world_size=st.integers(1, 8))
def test_cases_are_valid_for_their_world(data, world_size):
    case = data.draw(collective_cases(world_size))
    assert case.op in OPS and case.dtype in DTYPES
    if case.op in REDUCING_OPS:
        assert case.dtype != "bool"
        assert case.reduce_op != "AVG" or case.dtype in FLOAT_DTYPES
    if case.op in ROOT_ARG:
        assert 0 <= case.root < world_size
    if case.splits is not None:
        assert len(case.splits) == world_size and all(len(r) == world_size for r in case.splits)
    outputs = expected_outputs(case, world_size)
    assert len(outputs) == world_size


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data(), world_size=st.integers(1, 12))
def test_inputs_make_reductions_exact_in_any_order(data, world_size):
    """The values make_input chooses give the same SUM/PRODUCT/MIN/MAX whatever order a
    backend combines the ranks in (no rounding, no overflow)."""
    case = data.draw(collective_cases(world_size, ops=["all_reduce"]))
    if case.reduce_op == "AVG":
        return
    inputs = [make_input(case, r, world_size) for r in range(world_size)]
    order = data.draw(st.permutations(range(world_size)))
    ours = reduce_arrays(case.reduction, inputs)
    theirs = reduce_arrays(case.reduction, [inputs[r] for r in order])
    assert ours.tobytes() == theirs.tobytes()
    wide = reduce_arrays(case.reduction, [x.astype(np.float64) for x in inputs])
    np.testing.assert_array_equal(ours.astype(np.float64), wide)  # nothing overflowed


def test_make_input_depends_on_seed_and_rank_only():
    case = CollectiveCase("all_gather", (50,), "int32", seed=5)
    assert make_input(case, 1, 4).tolist() == make_input(case, 1, 4).tolist()
    assert make_input(case, 1, 4).tolist() != make_input(case, 2, 4).tolist()
    assert make_input(case, 1, 4).tolist() != make_input(case.replace(seed=6), 1, 4).tolist()
    assert make_input(CollectiveCase("barrier"), 0, 2) is None
    assert make_input(CollectiveCase("scatter", (2,), root=1), 0, 2) is None
    bf = make_input(CollectiveCase("broadcast", (3,), "bfloat16", root=0), 0, 2)
    assert bf.dtype == np.dtype(ml_dtypes.bfloat16)


def test_strategy_filters():
    @settings(max_examples=50, deadline=None, database=None)
    @given(collective_cases(3, ops=["reduce", "gather"], dtypes=["int8", "bool"],
                            kinds=["numpy"], layouts=["strided"], async_op=True))
    def check(case):
        assert case.op in ("reduce", "gather") and case.kind == "numpy"
        assert case.layout == "strided" and case.async_op
        assert case.dtype == ("int8" if case.op == "reduce" else case.dtype)

    check()
    with pytest.raises(ValueError, match="no dtype"):
        collective_cases(2, ops=["all_reduce"], dtypes=["bool"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(op="nope"), "unknown op"), (dict(op="all_reduce"), "needs reduce_op"),
    (dict(op="broadcast"), "needs root"), (dict(op="barrier", reduce_op="SUM"), "takes no"),
    (dict(op="all_to_all", shape=()), "at least one dimension"),
    (dict(op="gather", root=0, splits=((1,),)), "all_to_all only"),
    (dict(op="barrier", dtype="complex64"), "unknown dtype")])
def test_invalid_cases_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CollectiveCase(**kwargs)


# --------------------------------------------------------------- running and judging
def _threads(case, n):
    return run_threads(lambda g: run_case(g, case), n, timeout=10)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_run_case_on_a_thread_world_matches_the_reference(world_size):
    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(collective_cases(world_size))
    def conforms(case):
        assert compare(case, world_size, _threads(case, world_size)) == []

    conforms()


class _Broken(ThreadBackend):
    """A thread rank with one deliberate bug, chosen by ``bug``."""

    bug = ""

    def all_gather(self, out, inp, seq):
        super().all_gather(out, inp, seq)
        if self.bug == "reversed":
            parts = out.reshape(self.size, -1)
            parts[:] = parts[::-1].copy()
        if self.bug == "scribble":
            inp[...] = 0

    def reduce(self, a, root, op, seq):
        super().reduce(a, root, op, seq)
        if self.bug == "non-root" and self.rank != root:
            a[...] = 0

    def all_reduce(self, a, op, seq):
        super().all_reduce(a, op, seq)
        if self.bug == "drift" and self.rank == 1:
            a.view(np.uint8)[:1] ^= 1  # one bit of rank 1's result

    def broadcast(self, a, root, seq):
        if self.bug != "raise":
            super().broadcast(a, root, seq)
        else:
            raise RuntimeError("broken broadcast")


def _run_broken(bug: str, case: CollectiveCase, n: int = 2) -> list[CaseResult]:
    """``case`` on a thread world of :class:`_Broken` ranks."""
    world = ThreadWorld(n, timeout=5)
    world.groups = [collectives.ProcessGroup(_Broken(world, r)) for r in range(n)]
    for g in world.groups:
        g.transport.bug = bug
    results: list = [None] * n

    def rank_main(r: int) -> None:
        try:
            results[r] = run_case(world.groups[r], case)
        except Exception as exc:  # noqa: BLE001 - judged by compare
            world.fail(r, exc)
            results[r] = CaseResult(r, error=RemoteError(r, type(exc).__name__, str(exc), ""))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("bug,case,found", [
    ("", CollectiveCase("all_gather", (3,), "int32", seed=1), None),
    ("reversed", CollectiveCase("all_gather", (3,), "int32", seed=1), "rank 0: output differs"),
    ("scribble", CollectiveCase("all_gather", (3,), "int32", seed=1), "input was modified"),
    ("non-root", CollectiveCase("reduce", (4,), "int64", "SUM", root=0, seed=2),
     "rank 1: output differs"),
    ("drift", CollectiveCase("all_reduce", (4,), "float32", "AVG", seed=3),
     "not bitwise identical"),
    ("raise", CollectiveCase("broadcast", (2,), "int8", root=0), "RuntimeError: broken broadcast"),
])
def test_compare_finds_broken_collectives(bug, case, found):
    problems = compare(case, 2, _run_broken(bug, case))
    if found is None:
        assert problems == []
    else:
        assert any(found in p for p in problems), problems


def test_writes_outside_a_strided_view_are_caught():
    t = _Tensor(np.arange(6, dtype=np.int16), CollectiveCase("all_gather", (6,), "int16",
                                                             layout="strided", seed=0))
    assert not t.view.flags.c_contiguous and t.gaps_untouched()
    t.base[1] = 0
    assert not t.gaps_untouched()
    transposed = _Tensor(np.arange(6.0).reshape(2, 3),
                         CollectiveCase("broadcast", (2, 3), root=0, layout="strided", seed=1))
    assert transposed.view.shape == (2, 3) and not transposed.view.flags.c_contiguous
    torch = pytest.importorskip("torch")
    tt = _Tensor(np.arange(4, dtype=ml_dtypes.bfloat16),
                 CollectiveCase("all_gather", (4,), "bfloat16", layout="strided", kind="torch"))
    assert tt.view.dtype == torch.bfloat16 and not tt.view.is_contiguous()
    assert (tt.base[1::2] == SENTINEL).all()


def test_array_diff_describes_the_difference():
    assert array_diff(np.arange(3), np.arange(3), None) == ""
    text = array_diff(np.array([0, 5, 2]), np.arange(3), None)
    assert "1 of 3 elements" in text and "[1] got" in text
    assert "expected int64[4]" in array_diff(np.arange(3), np.arange(4), None)
    assert array_diff(np.array([1.0001]), np.array([1.0]), 1e-3) == ""
    assert array_diff(np.array([-0.0]), np.array([0.0]), None) == ""
    assert "missing" in array_diff(None, np.arange(2), None)


# ------------------------------------------------------------------------------ pool
def _available(backend: str) -> bool:
    return backend in collectives.available_backends()


needs_shm = pytest.mark.skipif(not _available("shm"), reason="the shm backend is not here")


def _rank_and_size(group, extra):
    return (group.rank, group.size, extra, os.environ["OMP_NUM_THREADS"])


def _raise_on(group, rank, error):
    if group.rank == rank:
        raise error("on purpose")
    return group.rank


def _die_on(group, rank):
    if group.rank == rank:
        os._exit(3)
    time.sleep(0.5)
    return group.rank


def _hang_on(group, rank):
    if group.rank == rank:
        time.sleep(60)
    return group.rank


def _register_backends():
    collectives.register_backend("kit-broken", _create_broken, replace=True)


def _create_broken(rendezvous, timeout):
    """An shm backend whose all_gather zeroes the first element of its output."""
    backend = collectives.get_backend("shm")(rendezvous, timeout)
    all_gather = backend.all_gather

    def broken(out, inp, seq):
        all_gather(out, inp, seq)
        out[0] = 0 if out.size and out[0] else 1

    backend.all_gather = broken
    return backend


@pytest.fixture(scope="module")
def pair():
    with WorldPool("shm", 2, timeout=4) as pool:
        yield pool


@needs_shm
def test_call_runs_on_every_rank(pair):
    assert pair.call(_rank_and_size, "x") == [(0, 2, "x", "1"), (1, 2, "x", "1")]
    assert pair.call("test_testing_kit:_rank_and_size", 7)[1] == (1, 2, 7, "1")


@needs_shm
def test_call_reports_remote_errors_and_keeps_the_world_after_argument_errors(pair):
    starts = pair.starts
    with pytest.raises(RemoteErrors) as info:
        pair.call(_raise_on, 1, ValueError)
    errors = info.value.errors
    assert errors[0] is None and info.value.results[0] == 0
    assert errors[1].type_name == "ValueError" and "on purpose" in errors[1].message
    assert "_raise_on" in errors[1].remote_traceback
    assert pair.starts == starts
    outcomes = pair.call(_raise_on, 0, RuntimeError, raise_errors=False)
    assert isinstance(outcomes[0], RemoteError) and outcomes[1] == 1
    assert not pair.running  # an unexpected error: the world was stopped...
    assert pair.call(_rank_and_size, 0)[0][0] == 0  # ...and the next call starts a new one
    assert pair.starts == starts + 1


@needs_shm
def test_a_dead_worker_is_reported_and_the_world_restarts(pair):
    starts = pair.starts
    with pytest.raises(PoolError, match=r"rank 1 died \(exited with code 3\)"):
        pair.call(_die_on, 1)
    assert pair.call(_rank_and_size, 1)[1][:2] == (1, 2)
    assert pair.starts == starts + 1


@needs_shm
def test_a_hung_worker_is_reported_and_the_world_restarts(pair):
    t0 = time.monotonic()
    with pytest.raises(PoolError, match=r"no reply within .* from ranks \[0\]"):
        pair.call(_hang_on, 0, timeout=1)
    assert time.monotonic() - t0 < 20
    assert pair.call(_rank_and_size, 1)[0][:2] == (0, 2)


@needs_shm
def test_a_world_that_cannot_start_breaks_the_pool():
    pool = WorldPool("no-such-backend", 2, timeout=5)
    with pytest.raises(PoolError, match="unknown backend 'no-such-backend'"):
        pool.start()
    t0 = time.monotonic()
    with pytest.raises(PoolError, match="could not start"):
        pool.call(_rank_and_size, 0)
    assert time.monotonic() - t0 < 1
    pool.close()


@needs_shm
def test_initializer_launcher_and_the_failure_report():
    """A backend of the test's own (registered by the initializer, started by a custom
    launcher) whose all_gather is wrong: check() names the case and every problem."""
    launched = []

    def launcher(envs, initializer):
        launched.append([e["RANK"] for e in envs])
        return spawn_launcher(envs, initializer)

    case = CollectiveCase("all_gather", (3,), "int16", seed=1)
    with WorldPool("kit-broken", 2, timeout=5, launcher=launcher,
                   initializer=_register_backends) as pool:
        with pytest.raises(AssertionError) as info:
            pool.check(case)
        pool.check(CollectiveCase("all_reduce", (3,), "int16", "SUM"))  # only all_gather is broken
    assert launched == [["0", "1"]]
    text = str(info.value)
    assert "all_gather on backend 'kit-broken' with 2 ranks: 2 problem(s)" in text
    assert repr(case) in text and "rank 0: output differs in 1 of 6" in text
    assert "reproduce: WorldPool('kit-broken', 2).check(case)" in text


def _marked_variables(group, names):
    return {n: os.environ.get(n) for n in names}


@needs_shm
def test_forked_workers_take_the_callers_environment_not_the_servers(monkeypatch):
    # A fork server keeps the environment it started with; a worker forked from it must
    # see what the caller has now (a variable set since, one removed since), as a spawned
    # worker does: else a test's COLLECTIVES_HOST outlives it in every later forked world.
    # (KIT_MARK_NEW, set after the server started, tells in any case; KIT_MARK_GONE only
    # where this test started the server.)
    from collectives import warm_start
    monkeypatch.setenv("KIT_MARK_GONE", "1")
    warm_start.context("forkserver")            # the server runs (with KIT_MARK_GONE, if new)
    monkeypatch.delenv("KIT_MARK_GONE")
    monkeypatch.setenv("KIT_MARK_NEW", "2")

    def forked(envs, initializer):
        return spawn_launcher(envs, initializer, start_method="forkserver")

    with WorldPool("shm", 2, timeout=5, launcher=forked) as pool:
        seen = pool.call(_marked_variables, ["KIT_MARK_GONE", "KIT_MARK_NEW"])
    assert seen == [{"KIT_MARK_GONE": None, "KIT_MARK_NEW": "2"}] * 2


def test_mpi_workers_are_started_by_mpiexec():
    try:
        launcher = launcher_for("p2p:mpi")
    except LauncherUnavailable as exc:  # no mpiexec or mpi4py here: a clear reason
        assert "mpi" in str(exc)
    else:
        assert launcher.__name__ == "mpiexec_launcher"
    assert launcher_for("shm") is spawn_launcher


@needs_shm
def test_check_backend_in_one_call():
    check_backend("shm", world_sizes=(2,), max_examples=15, timeout=10, kinds=["numpy"])
