"""The conformance suite: every backend, every world size, one contract.

Each test takes the ``pool`` fixture (tests/conftest.py), so it runs once per backend and
world size (1..4) on a world of worker processes started once per session. Hypothesis
draws collectives and compares them with the numpy reference of ``collectives.testing``;
the other tests pin down the contract's errors, sub-groups, async work, objects and point
to point. The ``_on_ranks`` functions run inside the workers (``pool.call``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from collectives import ReduceOp, Work
from collectives.testing import CollectiveCase, RemoteError, WorldPool, collective_cases, reference
from collectives.testing.strategies import REDUCING_OPS, ROOT_ARG, numpy_dtype, shape_of
from collectives.thresholds import boundary_sizes

ROOT = Path(__file__).resolve().parent.parent

#: Examples per (backend, world size); override with COLLECTIVES_MAX_EXAMPLES.
MAX_EXAMPLES = int(os.environ.get("COLLECTIVES_MAX_EXAMPLES", "200"))


#: Examples per (backend, world size) of the skewed-arrival sweep, each up to 2 s long;
#: override with COLLECTIVES_SKEW_EXAMPLES.
SKEW_EXAMPLES = int(os.environ.get("COLLECTIVES_SKEW_EXAMPLES", "5"))


def _size_thresholds(group) -> tuple:
    return tuple(group.size_thresholds())


# ----------------------------------------------------------------------- the sweep
@pytest.mark.timeout(900)
def test_collectives_match_the_reference(pool: WorldPool, backend: str, world_size: int):
    thresholds = pool.call(_size_thresholds)[0]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=collective_cases(world_size, thresholds=thresholds))
    def conforms(case: CollectiveCase) -> None:
        pool.check(case)

    conforms()


@pytest.mark.timeout(600)
def test_skewed_arrival(pool: WorldPool, backend: str, world_size: int):
    """Per example a drawn rank arrives 0-2 s late (longer than gloo's 0.5 s watch, shm's
    0.2 s sleeps, zmq's 0.1 s slices): the others wait for it, and get the right result."""
    if world_size == 1:
        pytest.skip("a world of one waits for nobody")
    thresholds = pool.call(_size_thresholds)[0]

    @settings(max_examples=SKEW_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=collective_cases(world_size, thresholds=thresholds, skew=True))
    def conforms(case: CollectiveCase) -> None:
        pool.check(case)

    conforms()


# ------------------------------------------------------------- every size threshold
def boundary_cases(thresholds, world_size: int) -> list[CollectiveCase]:
    """For every line of ``thresholds`` and every collective it governs at this world
    size: a float32 case just below it and one just above it (1-D, and 3-D strided)."""
    cases = []
    for t in thresholds:
        for op in t.ops:
            if op == "send" or not t.applies(op, world_size):
                continue
            below, _, above = boundary_sizes(t, 4)
            for i, count in enumerate((below, above)):
                cases.append(CollectiveCase(
                    op, (count,) if i == 0 else shape_of(count, 3), "float32",
                    reduce_op="SUM" if op in REDUCING_OPS else None,
                    root=world_size - 1 if op in ROOT_ARG else None,
                    layout="contiguous" if i == 0 else "strided", kind="torch",
                    seed=count))
    return cases


def crossings(thresholds, cases, world_size: int) -> dict:
    """``{(threshold name, op): {"below": k, "above": m}}``: how many of ``cases`` lie on
    each side of each line that applies to their op (contribution bytes)."""
    counts = {(t.name, op): {"below": 0, "above": 0} for t in thresholds for op in t.ops
              if op != "send" and t.applies(op, world_size)}
    for case in cases:
        nbytes = int(np.prod(case.shape, dtype=np.int64)) * numpy_dtype(case.dtype).itemsize
        for t in thresholds:
            side = t.side(nbytes)
            if side and t.applies(case.op, world_size) and (t.name, case.op) in counts:
                counts[(t.name, case.op)][side] += 1
    return counts


@pytest.mark.timeout(600)
def test_every_size_threshold_is_crossed(pool: WorldPool, world_size: int):
    """Every line the group's implementation draws (``size_thresholds()``: the send/recv
    defaults', shm's, zmq's) is run from both sides and matches the reference; the count
    of cases per side proves no line was left out."""
    thresholds = pool.call(_size_thresholds)[0]
    cases = boundary_cases(thresholds, world_size)
    for case in cases:
        pool.check(case)
    counts = crossings(thresholds, cases, world_size)
    missed = {k: v for k, v in counts.items() if not (v["below"] and v["above"])}
    assert not missed, f"size thresholds not crossed from both sides: {missed}"
    print(f"{pool.backend} x{world_size}: {len(counts)} (threshold, op) lines crossed by "
          f"{len(cases)} cases")


_SIZE_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*(_BYTES|_MIN|_MAX)$")
#: Module-level size constants that are not a switch between paths of a collective.
_NOT_A_SWITCH = {
    "backends.shm.channels.HEADER_BYTES", "backends.shm.segment.HEADER_BYTES",
    "backends.zeromq.native.SCRATCH_KEEP_BYTES", "backends.zeromq.auth.NONCE_BYTES",
    "backends.zeromq.auth.MAC_BYTES", "backends.zeromq.sockets.RECONNECT_IVL_MS",
    "backends.zeromq.wire.MAX_DIMS", "backends.zeromq.sockets.RECONNECT_IVL_MAX_MS",
    "backends.shm.segment.BELL_BYTE", "backends.shm.futex._WAKE_ALL",
    "collectives.thresholds.MARGIN", "collectives.testing.strategies.LARGE_BYTES",
    # whether the fast path keeps a tensor's host view for the next call (the same
    # zero-copy view either way)
    "collectives.fast_path.CACHE_STORAGE_BYTES",
    # how much the single-copy path's speed check copies first (once per process); the
    # lines its larger rungs (cma.SPEED_LADDER) may set apply only with
    # COLLECTIVES_SHM_CMA unset (this suite sets it to 1): test_shm_cma crosses them
    "backends.shm.cma._PROBE_BYTES",
}


def test_every_size_constant_is_a_registered_threshold():
    """A new size constant in a dispatch module fails here until it is listed in a
    backend's path table (``Backend.paths()``, so the suite crosses it) or named as no
    switch above."""
    import importlib
    import pkgutil

    import backends
    import collectives
    registered = " ".join(t.name for t in collectives.algorithms.dispatch.PATHS.thresholds())
    for path in ("backends/shm/backend.py", "backends/zeromq/group.py",
                 "backends/zeromq/native.py"):
        registered += (ROOT / path).read_text()
    unlisted = []
    for pkg in (collectives, backends):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.startswith(("backends.mpi", "backends.torchdist")) or \
                    info.name.endswith("__main__") or ".bench" in info.name:
                continue  # no size switches of ours (the libraries choose), or tooling
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                full = f"{info.name}.{name}"
                if (_SIZE_CONSTANT.match(name) and isinstance(value, int)
                        and not isinstance(value, bool) and value >= 1024
                        and full not in _NOT_A_SWITCH and name.lstrip("_") not in registered
                        and getattr(module, "__name__", "") == info.name):
                    unlisted.append(full)
    assert not unlisted, (f"size constants neither in a path table nor in "
                          f"_NOT_A_SWITCH: {sorted(set(unlisted))}")


# ---------------------------------------------------------------------------- errors
def _still_usable(pool: WorldPool, starts: int) -> None:
    """The world that raised is the same one (not restarted) and computes correctly."""
    pool.check(CollectiveCase("all_reduce", (5,), "float32", reduce_op="SUM", seed=11))
    pool.check(CollectiveCase("broadcast", (3,), "int64", root=pool.world_size - 1, seed=12))
    assert pool.starts == starts, "the world had to be restarted after an argument error"


def _expect(pool: WorldPool, error: type, task, *args, ranks=None) -> None:
    """``task(group, *args)`` raises ``error`` on ``ranks`` (default: all) and nothing
    elsewhere; afterwards the group is still usable."""
    starts = pool.starts
    outcomes = pool.call(task, *args, raise_errors=False)
    ranks = range(pool.world_size) if ranks is None else ranks
    for r, outcome in enumerate(outcomes):
        if r in ranks:
            assert isinstance(outcome, RemoteError), \
                f"rank {r}: expected {error.__name__}, nothing was raised ({outcome!r})"
            assert outcome.type_name == error.__name__, \
                f"expected {error.__name__}, got {outcome.describe()}"
            assert f"rank {r}/" in outcome.message, f"the message does not name the rank: " \
                                                     f"{outcome.message}"
        else:
            assert not isinstance(outcome, RemoteError), outcome.describe()
    _still_usable(pool, starts)


def _rooted_on_ranks(group, op: str, root) -> None:
    """Call the rooted ``op`` with ``root`` on every rank, with valid buffers."""
    n = group.size
    a, big = np.ones(2, np.float32), np.ones(2 * n, np.float32)
    if op == "broadcast":
        group.broadcast(a, src=root)
    elif op == "reduce":
        group.reduce(a, dst=root)
    elif op == "gather":
        group.gather(a, big, dst=root)
    else:
        group.scatter(a, big, src=root)


ROOTED = ["broadcast", "reduce", "gather", "scatter"]


@pytest.mark.parametrize("op", ROOTED)
def test_a_root_outside_the_group_is_a_value_error(pool, op):
    _expect(pool, ValueError, _rooted_on_ranks, op, pool.world_size)
    _expect(pool, ValueError, _rooted_on_ranks, op, -1)


@pytest.mark.parametrize("op", ROOTED)
def test_a_root_that_is_not_an_int_is_a_type_error(pool, op):
    _expect(pool, TypeError, _rooted_on_ranks, op, "0")
    _expect(pool, TypeError, _rooted_on_ranks, op, 0.0)


def _mismatched_on_ranks(group, op: str) -> None:
    """``op`` with an output (or input) one element too long; for gather and scatter
    only the root (rank 0) passes the bad buffer, the others do not call."""
    n = group.size
    small, wrong = np.ones(3, np.int32), np.ones(3 * n + 1, np.int32)
    if op == "all_gather":
        group.all_gather(wrong, small)
    elif op == "reduce_scatter":
        group.reduce_scatter(small, wrong)
    elif group.rank == 0 and op == "gather":
        group.gather(small, wrong, dst=0)
    elif group.rank == 0:
        group.scatter(small, wrong, src=0)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "gather", "scatter"])
def test_a_size_mismatch_is_a_value_error(pool, op):
    ranks = [0] if op in ("gather", "scatter") else None
    _expect(pool, ValueError, _mismatched_on_ranks, op, ranks=ranks)


def _reduce_on_ranks(group, dtype: str, op: str, kind: str) -> None:
    a = np.ones(4, dtype)
    if kind == "torch":
        import torch
        a = torch.from_numpy(a)
    group.all_reduce(a, op=ReduceOp[op])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_avg_on_integers_is_a_value_error(pool, kind):
    _expect(pool, ValueError, _reduce_on_ranks, "int32", "AVG", kind)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_reducing_bools_is_a_type_error(pool, kind):
    _expect(pool, TypeError, _reduce_on_ranks, "bool", "SUM", kind)
    _expect(pool, TypeError, _reduce_on_ranks, "bool", "MAX", kind)


def _complex_on_ranks(group, op: str) -> None:
    a = np.ones(4, np.complex64)
    if op == "all_reduce":
        group.all_reduce(a)
    else:
        group.broadcast(a, src=0)


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_an_unsupported_dtype_is_a_type_error(pool, op):
    _expect(pool, TypeError, _complex_on_ranks, op)


def _new_group_on_ranks(group, how: str):
    if how == "outside":
        return group.new_group([0, group.size])
    return group.new_group([r for r in range(group.size) if r != group.rank])


def test_new_group_with_a_rank_outside_the_group_is_a_value_error(pool):
    _expect(pool, ValueError, _new_group_on_ranks, "outside")


def test_new_group_from_a_rank_not_in_it_is_a_value_error(pool):
    _expect(pool, ValueError, _new_group_on_ranks, "not a member")


def _bad_p2p_on_ranks(group, what: str) -> None:
    a = np.ones(2)
    if what == "self":
        group.send(a, dst=group.rank)
    elif what == "tag":
        group.send(a, dst=(group.rank + 1) % group.size, tag=-1)
    else:
        group.send(a, dst=(group.rank + 1) % group.size, tag="1")


@pytest.mark.parametrize("what,error", [("self", ValueError), ("tag", ValueError),
                                        ("tag type", TypeError)])
def test_bad_point_to_point_arguments(pool, world_size, what, error):
    if world_size == 1 and what != "self":
        pytest.skip("a world of one has no peer to send to")
    _expect(pool, error, _bad_p2p_on_ranks, what)


# ------------------------------------------------------------------------ sub-groups
def _rank_input(rank: int, length: int = 6) -> np.ndarray:
    return np.arange(length, dtype=np.float64) + 10.0 * rank


def _subgroups_on_ranks(group) -> dict:
    """Evens and odds, each its own group: collectives inside them, and world
    collectives in between (their messages must not mix)."""
    n, rank = group.size, group.rank
    members = [r for r in range(n) if r % 2 == rank % 2]
    sub = group.new_group(members)
    out: dict = {"rank": sub.rank, "size": sub.size}
    x = _rank_input(rank)
    sub.all_reduce(x)
    out["all_reduce"] = x
    world = np.full(3, rank + 1.0)
    group.all_reduce(world)  # the world in between
    out["world"] = world
    b = _rank_input(rank)
    sub.broadcast(b, src=sub.size - 1)
    out["broadcast"] = b
    gathered = np.empty(6 * sub.size)
    sub.all_gather(gathered, _rank_input(rank))
    out["all_gather"] = gathered
    part = np.empty(2)
    sub.reduce_scatter(part, _rank_input(rank, 2 * sub.size))
    out["reduce_scatter"] = part
    sub.barrier()
    whole = group.new_group(list(reversed(range(n))))  # all ranks, given in any order
    out["whole"] = (whole.rank, whole.size, whole.all_gather_object(rank))
    solo = sub.new_group([sub.rank])  # a group of one, inside a sub-group
    y = _rank_input(rank)
    solo.all_reduce(y)
    out["solo"] = (solo.size, y)
    return out


def test_subgroups(pool, world_size):
    results = pool.call(_subgroups_on_ranks)
    for rank, got in enumerate(results):
        members = [r for r in range(world_size) if r % 2 == rank % 2]
        inputs = [_rank_input(r) for r in members]
        assert (got["rank"], got["size"]) == (members.index(rank), len(members))
        np.testing.assert_array_equal(got["all_reduce"], reference.all_reduce(inputs)[0])
        np.testing.assert_array_equal(got["world"], np.full(3, world_size * (world_size + 1) / 2))
        np.testing.assert_array_equal(got["broadcast"], inputs[-1])
        np.testing.assert_array_equal(got["all_gather"], reference.all_gather(inputs)[0])
        wide = [_rank_input(r, 2 * len(members)) for r in members]
        np.testing.assert_array_equal(got["reduce_scatter"],
                                      reference.reduce_scatter(wide)[members.index(rank)])
        assert got["whole"] == (rank, world_size, list(range(world_size)))
        assert got["solo"][0] == 1
        np.testing.assert_array_equal(got["solo"][1], _rank_input(rank))


# ---------------------------------------------------------------------------- async
def _async_on_ranks(group) -> dict:
    n, rank = group.size, group.rank
    a = np.full(1000, rank + 1.0, np.float32)
    b = np.full(7, rank, np.int64)
    out = np.empty(3 * n, np.int16)
    works = [group.all_reduce(a, async_op=True), group.broadcast(b, src=n - 1, async_op=True),
             group.all_gather(out, np.full(3, rank, np.int16), async_op=True),
             group.barrier(async_op=True)]
    kinds = [isinstance(w, Work) for w in works]
    for w in reversed(works):  # wait in any order
        w.wait(timeout=60)
    done = [w.is_completed() for w in works]
    works[0].wait()  # waiting again is harmless
    sync = np.full(2, rank + 1.0)
    group.all_reduce(sync)  # a blocking op after async ones
    return {"kinds": kinds, "done": done, "a": a, "b": b, "out": out, "sync": sync}


def test_async_ops_return_work(pool, world_size):
    n = world_size
    for got in pool.call(_async_on_ranks):
        assert got["kinds"] == [True] * 4, "async_op=True must return a Work"
        assert got["done"] == [True] * 4, "is_completed() must be True after wait()"
        np.testing.assert_array_equal(got["a"], np.full(1000, n * (n + 1) / 2, np.float32))
        np.testing.assert_array_equal(got["b"], np.full(7, n - 1))
        np.testing.assert_array_equal(got["out"], np.repeat(np.arange(n, dtype=np.int16), 3))
        np.testing.assert_array_equal(got["sync"], np.full(2, n * (n + 1) / 2))


def _splits(n: int) -> list[list[int]]:
    """Rows rank i sends rank j; the last rank sends and receives nothing (its split sizes
    are all 0: equal, as if no splits were given, while the others' differ)."""
    return [[0 if n - 1 in (i, j) else (i + j) % 2 + 1 for j in range(n)] for i in range(n)]


def _uneven_all_to_all_on_ranks(group) -> list:
    rank, n = group.rank, group.size
    S = _splits(n)
    results = []
    for _ in range(2):  # and the collectives after it still match up
        inp = np.concatenate([np.full(S[rank][j], rank * 100 + j, np.int64)
                              for j in range(n)])
        out = np.empty(sum(S[j][rank] for j in range(n)), np.int64)
        group.all_to_all(out, inp, output_split_sizes=[S[j][rank] for j in range(n)],
                         input_split_sizes=S[rank])
        group.barrier()
        total = np.ones(1)
        group.all_reduce(total)
        results.append((out.tolist(), float(total[0])))
    return results


def test_all_to_all_where_one_rank_moves_nothing(pool, world_size):
    """One rank's split sizes are all 0 (so they look like no splits at all) while the
    others' are not: every rank must still run the same collective (MPI once ran
    Ialltoall on that rank and Ialltoallv on the others; the next barrier hung)."""
    n, S = world_size, _splits(world_size)
    for rank, got in enumerate(pool.call(_uneven_all_to_all_on_ranks)):
        expected = [j * 100 + rank for j in range(n) for _ in range(S[j][rank])]
        assert got == [(expected, float(n))] * 2, f"rank {rank}"


# --------------------------------------------------------------------------- objects
def _objects_on_ranks(group) -> tuple:
    rank, n = group.rank, group.size
    config = {"lr": 0.1, "layers": [rank] * 3, "name": "x" * rank} if rank == n - 1 else None
    return (group.broadcast_object(config, src=n - 1),
            group.all_gather_object(("rank", rank, "y" * (5 * rank))),
            group.all_gather_object(None))


def test_object_collectives(pool, world_size):
    n = world_size
    expected = ({"lr": 0.1, "layers": [n - 1] * 3, "name": "x" * (n - 1)},
                [("rank", r, "y" * (5 * r)) for r in range(n)], [None] * n)
    assert pool.call(_objects_on_ranks) == [expected] * n


# ---------------------------------------------------------------------- point to point
def _p2p_on_ranks(group) -> dict:
    """Every rank sends three messages to the next rank (tags 7, 3, then an empty one
    with tag 9) and receives them from the previous one in another order; then two more
    on one tag, in order, into a torch tensor and a strided view."""
    import torch
    n, rank = group.size, group.rank
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    sends = [group.isend(np.full(4, 70.0 + rank), nxt, tag=7),
             group.isend(np.full(5, 30 + rank, np.int32), nxt, tag=3),
             group.isend(np.empty(0, np.float32), nxt, tag=9)]
    three, seven = np.empty(5, np.int32), np.empty(4)
    group.recv(np.empty(0, np.float32), prv, tag=9)
    group.recv(three, prv, tag=3)
    group.irecv(seven, prv, tag=7).wait()
    for w in sends:
        w.wait()
    first, second = torch.empty(6, dtype=torch.bfloat16), np.zeros(12, np.float32)
    if rank % 2 == 0:  # even ranks send first, odd ranks receive first
        group.send(torch.full((6,), float(rank), dtype=torch.bfloat16), nxt, tag=1)
        group.send(np.arange(6, dtype=np.float32) + rank, nxt, tag=1)
    recvs = [group.irecv(first, prv, tag=1), group.irecv(second[::2], prv, tag=1)]
    for w in recvs:
        w.wait()
    if rank % 2 == 1:
        group.send(torch.full((6,), float(rank), dtype=torch.bfloat16), nxt, tag=1)
        group.send(np.arange(6, dtype=np.float32) + rank, nxt, tag=1)
    return {"three": three, "seven": seven, "first": first.float().numpy(), "second": second}


def test_send_and_recv_match_by_tag(pool, world_size):
    if world_size == 1:
        pytest.skip("point to point needs two ranks")
    for rank, got in enumerate(pool.call(_p2p_on_ranks)):
        prv = (rank - 1) % world_size
        np.testing.assert_array_equal(got["three"], np.full(5, 30 + prv))
        np.testing.assert_array_equal(got["seven"], np.full(4, 70.0 + prv))
        np.testing.assert_array_equal(got["first"], np.full(6, float(prv)))
        second = np.zeros(12, np.float32)
        second[::2] = np.arange(6) + prv
        np.testing.assert_array_equal(got["second"], second)


def _p2p_sizes_on_ranks(group, counts: list, late: list) -> list:
    """For each element count: every rank sends a shaped float32 tensor of that many
    elements to the next rank and receives one from the previous; rank ``late[i]`` sleeps
    ``late[i + 1]`` seconds before the i-th send (a receiver waits longer than every
    internal poll). Returns how many elements arrived wrong, per count."""
    import time

    import torch
    n, rank = group.size, group.rank
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    wrong = []
    for i, count in enumerate(counts):
        shape = shape_of(count, 1 + i % 4)
        got = torch.zeros(shape)
        recv = group.irecv(got, prv, tag=i)
        if rank == late[0] % n and i % 2 == 0:
            time.sleep(late[1])
        value = torch.arange(count, dtype=torch.float32).reshape(shape) + 1000 * rank
        group.send(value, nxt, tag=i)
        recv.wait()
        want = torch.arange(count, dtype=torch.float32).reshape(shape) + 1000 * prv
        wrong.append(int((got != want).sum()))
    return wrong


def test_point_to_point_across_every_size_threshold(pool, world_size):
    """Sends just below and just above each of the group's point-to-point lines (shm's
    ring, zmq's inline, zero-copy and multi-frame messages), every other one with a rank
    arriving 0.7 s late."""
    if world_size == 1:
        pytest.skip("point to point needs two ranks")
    thresholds = [t for t in pool.call(_size_thresholds)[0] if t.applies("send", world_size)]
    counts = [c for t in thresholds for c in boundary_sizes(t, 4)] or [1, 100_000]
    wrong = pool.call(_p2p_sizes_on_ranks, counts, [world_size - 1, 0.7],
                      timeout=pool.timeout + 2 * len(counts))
    assert wrong == [[0] * len(counts)] * world_size, (counts, wrong)
