"""The compiled core of the shm backend (backends/shm/_native.c) and its fallback.

In-process: the core's reductions against numpy's (bitwise, every dtype and operator,
float16/bfloat16 over all 65536 bit patterns), the loader (missing core: one warning,
Python path; ``COLLECTIVES_SHM_NATIVE=0``), the wait policy. One spawned job runs both
paths side by side, and a group whose ranks mix them, and checks that a thread of the
rank runs while the core waits and reduces. The build: a wheel with a compiler holds the
core, one without a compiler still builds. The conformance suite runs shm on both paths
(``shm`` and ``shm-py`` in tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import collectives
from collectives import settings as variables
from collectives import ReduceOp
from collectives.reduce_op import reduce_arrays

from backends.shm import native
from backends.shm.codes import DTYPE_CODE as _DTYPE_CODE, REDOP_CODE as _REDOP_CODE

ROOT = Path(__file__).resolve().parents[1]

try:
    from backends.shm import _native
except ImportError:  # the suite still runs; these tests say what is missing
    _native = None

needs_core = pytest.mark.skipif(_native is None, reason="backends.shm._native is not built "
                                "(python setup.py build_ext --inplace)")

FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "uint8", "int16", "int32", "int64"]


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _ops(name: str) -> list[ReduceOp]:
    return [op for op in ReduceOp if not (op is ReduceOp.AVG and name in INTS)]


def _values(dt: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random values of ``dt`` with the awkward ones mixed in (NaN, inf, -0, tiny)."""
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, endpoint=True, dtype=dt)
    x = (rng.standard_normal(n) * rng.choice([1e-6, 1.0, 300.0, 6e4], n)).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-7, 6.5e4], np.float32)
    mask = rng.random(n) < 0.1
    x[mask] = rng.choice(special, int(mask.sum()))
    with np.errstate(over="ignore"):    # to float16: large values become inf, as meant
        return x.astype(dt)


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    """Bitwise equal, except that a NaN may be any NaN (payloads are not specified)."""
    if got.dtype.kind in "iu":
        return got.tobytes() == expected.tobytes()
    g, e = got.astype(np.float64), expected.astype(np.float64)
    nan = np.isnan(g)
    if not np.array_equal(nan, np.isnan(e)):
        return False
    return got[~nan].tobytes() == expected[~nan].tobytes()


def _combine(op: ReduceOp, inputs: list[np.ndarray], out: np.ndarray = None) -> np.ndarray:
    out = np.empty_like(inputs[0]) if out is None else out
    _native.combine(out, inputs, _DTYPE_CODE[inputs[0].dtype], _REDOP_CODE[op], len(inputs))
    return out


# --------------------------------------------------------------------- reductions
@needs_core
@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(FLOATS + INTS), k=st.integers(1, 5), n=st.integers(0, 2600),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_combine_is_numpys_rank_order_reduction(name, k, n, seed, data):
    dt = _dtype(name)
    op = data.draw(st.sampled_from(_ops(name)))
    rng = np.random.default_rng(seed)
    inputs = [_values(dt, n, rng) for _ in range(k)]
    with np.errstate(all="ignore"):
        expected = reduce_arrays(op, inputs)
    assert _same(_combine(op, inputs), expected), (name, op.name, k, n)
    # The output may be the first source (the small reduce's slots are not, but the
    # kernel promises it).
    first = inputs[0].copy()
    assert _same(_combine(op, [first] + inputs[1:], out=first), expected)


@needs_core
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_floats_round_as_numpy_over_every_bit_pattern(name):
    dt = _dtype(name)
    a = np.arange(1 << 16, dtype=np.uint16).view(dt)
    b = np.random.default_rng(7).permutation(a.view(np.uint16)).view(dt)
    with np.errstate(all="ignore"):
        for op in ReduceOp:
            for inputs in ([a, b], [b, a, b]):
                assert _same(_combine(op, inputs), reduce_arrays(op, inputs)), (name, op)


@needs_core
@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_avg_over_a_power_of_two_multiplies_with_the_divisions_bits(name, k):
    """AVG over 2^j ranks multiplies by the exact reciprocal instead of dividing: the
    same bits wherever the quotient lands, the subnormal range (where it rounds) and
    the edges of the normal one included; other counts divide as before."""
    dt = _dtype(name)
    if dt.itemsize == 2:   # every bit pattern
        pool = np.arange(1 << 16, dtype=np.uint16).view(dt)
    else:                  # the subnormals' low bits, the normal range's edges, random
        info = np.finfo(dt)
        u = np.uint32 if dt.itemsize == 4 else np.uint64
        tiny_bits = np.arange(0, 4096, dtype=u)
        edges = np.array([info.tiny, -info.tiny, info.max, -info.max, info.smallest_subnormal,
                          3 * info.smallest_subnormal, np.inf, -np.inf, np.nan, 0.0, -0.0], dt)
        rand = np.random.default_rng(k).standard_normal(4096).astype(dt)
        pool = np.concatenate([tiny_bits.view(dt), -tiny_bits.view(dt), edges, rand])
    rng = np.random.default_rng(100 + k)
    inputs = [pool] + [rng.permutation(pool) for _ in range(k - 1)]
    with np.errstate(all="ignore"):
        expected = reduce_arrays(ReduceOp.AVG, inputs)
        assert _same(_combine(ReduceOp.AVG, inputs), expected), (name, k)
        last = inputs[-1].copy()  # the output may be the last source too
        assert _same(_combine(ReduceOp.AVG, inputs[:-1] + [last], out=last), expected)


@needs_core
def test_combine_refuses_bad_input_with_typed_errors():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="op code"):
        _native.combine(x, [x, x], _DTYPE_CODE[x.dtype], _REDOP_CODE[ReduceOp.AVG] + 10, 2)
    with pytest.raises(ValueError, match="op code"):   # AVG on integers
        i = np.zeros(4, np.int32)
        _native.combine(i, [i, i], _DTYPE_CODE[i.dtype], _REDOP_CODE[ReduceOp.AVG], 2)
    with pytest.raises(TypeError, match="dtype code"):
        b = np.zeros(4, np.bool_)
        _native.combine(b, [b, b], _DTYPE_CODE[b.dtype], _REDOP_CODE[ReduceOp.SUM], 2)
    with pytest.raises(ValueError, match="source 1 has 8 bytes"):
        _native.combine(x, [x, x[:2]], _DTYPE_CODE[x.dtype], 1, 2)
    with pytest.raises(TypeError, match="writable"):
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        _native.combine(ro, [x, x], _DTYPE_CODE[x.dtype], 1, 2)


# ------------------------------------------------------------------ loader, policy
@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader as in a new process (nothing loaded, nothing warned)."""
    for name, value in (("_module", None), ("_load_error", None), ("_loaded", False),
                        ("_warned", False)):
        monkeypatch.setattr(native, name, value)
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    return monkeypatch


def test_a_missing_core_warns_once_and_falls_back(fresh_loader):
    import backends.shm
    fresh_loader.setitem(sys.modules, "backends.shm._native", None)  # import fails
    fresh_loader.delattr(backends.shm, "_native", raising=False)
    with pytest.warns(RuntimeWarning, match="not available .* using the Python path"):
        assert native.native_module() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.native_module() is None      # once per process
    assert "build it with" in native.load_error()


def test_the_environment_variable_forces_the_python_path(fresh_loader):
    fresh_loader.setenv(native.NATIVE_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # chosen, so no warning
        assert native.native_module() is None
    fresh_loader.setenv(native.NATIVE_ENV, "1")
    assert (native.native_module() is None) == (_native is None)


def test_the_wait_policy_follows_the_cores(monkeypatch):
    monkeypatch.delenv(variables.SHM_SPIN_US.name, raising=False)
    monkeypatch.delenv(variables.SHM_YIELD_US.name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    dedicated = tuple(x * 1e-6 for x in native.DEDICATED_WAIT_US)
    over = tuple(x * 1e-6 for x in native.OVERSUBSCRIBED_WAIT_US)
    assert native.wait_policy(2) == dedicated
    assert native.wait_policy(4) == over
    assert over[0] < dedicated[0] and over[1] < dedicated[1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert native.wait_policy(4) == dedicated
    monkeypatch.setenv(variables.SHM_SPIN_US.name, "7")
    monkeypatch.setenv(variables.SHM_YIELD_US.name, "9")
    assert native.wait_policy(4) == (7e-6, 9e-6)


# -------------------------------------------------------------- both paths at once
def _case_inputs(rank: int):
    """(name, op, array) for every dtype and operator, small (one phase) and large
    (pipelined: several 64 KiB slots)."""
    for name in FLOATS + INTS:
        for op in _ops(name):
            for n in (1, 33, 40_000):
                rng = np.random.default_rng([rank, n, len(name), list(ReduceOp).index(op)])
                yield name, op, _values(_dtype(name), n, rng)


def _both_paths_job() -> dict:
    pg = collectives.init_process_group()
    me = pg.rank
    os.environ[native.NATIVE_ENV] = "0"
    python = pg.new_group([0, 1])                     # Python path on both ranks
    os.environ[native.NATIVE_ENV] = "1" if me == 0 else "0"
    mixed = pg.new_group([0, 1])                      # rank 0 native, rank 1 Python
    del os.environ[native.NATIVE_ENV]
    out = {"native": [pg.transport.native, python.transport.native, mixed.transport.native], "bad": []}
    with np.errstate(all="ignore"):
        for name, op, x in _case_inputs(me):
            results = []
            for g in (pg, python, mixed):
                y = x.copy()
                g.all_reduce(y, op=op)
                results.append(y)
            if not all(_same(r, results[0]) for r in results[1:]):
                out["bad"].append(f"all_reduce {name} {op.name} n={x.size}")
            halves = []
            for g in (pg, python, mixed):
                z = np.empty(x.size // 2, x.dtype)
                g.reduce_scatter(z, x[:2 * z.size].copy(), op=op)
                halves.append(z)
            if not all(_same(h, halves[0]) for h in halves[1:]):
                out["bad"].append(f"reduce_scatter {name} {op.name} n={x.size}")
    out["digest"] = [results[0].tobytes().hex()[:32]]
    # The gather and scatter families and all_to_all (one phase: the core's small_move
    # or all_to_all on a native rank, the Python core on a Python one; 40,000 elements of 2 bytes
    # or more take several 64 KiB phases; 32,760 int8s the all_to_all's second phase:
    # its 65,520 bytes fit a slot but not behind the counts). Each root in turn.
    for name in FLOATS + INTS:
        dt = _dtype(name)
        for n in (1, 33, 32_760, 40_000):
            root = (n + len(name)) % 2
            mine = np.arange(n).astype(dt) + np.asarray(10 * me).astype(dt)
            every = np.concatenate([np.arange(n).astype(dt) + np.asarray(10 * r).astype(dt)
                                    for r in (0, 1)])
            for g in (pg, python, mixed):
                got = np.empty(2 * n, dt)
                g.all_gather(got, mine)
                b = mine.copy()
                g.broadcast(b, src=root)
                part = np.empty(n, dt)
                g.scatter(part, every if me == 1 - root else None, src=1 - root)
                at_root = np.zeros(2 * n, dt) if me == root else None
                g.gather(mine, at_root, dst=root)
                swapped = np.empty(2 * n, dt)   # part k of rank j's input: its own, turned k times
                g.all_to_all(swapped, np.concatenate([mine, mine[::-1]]))
                turned = [every[j * n:(j + 1) * n] for j in (0, 1)]
                if me:
                    turned = [t[::-1] for t in turned]
                if not (_same(got, every) and _same(b, every[root * n:(root + 1) * n])
                        and _same(part, every[me * n:(me + 1) * n])
                        and (me != root or _same(at_root, every))
                        and _same(swapped, np.concatenate(turned))):
                    out["bad"].append(f"gather/scatter family {name} n={n} on the group with "
                                      f"native={g.transport.native}")
    # Point to point between every pair of paths: tags out of order (a message set
    # aside as unexpected), one larger than the ring (streamed by the Python engine),
    # and the reply, whose receive is usually posted before the message comes.
    for g in (pg, python, mixed):
        msgs = {1: np.arange(3, dtype=np.float32), 2: np.arange(5000, dtype=np.int64),
                3: np.arange(300_000, dtype=np.float64)}
        if me == 0:
            for tag in (1, 2, 3):
                g.send(msgs[tag], 1, tag=tag)
            back = np.empty(7, np.int16)
            g.recv(back, 1, tag=9)
            ok = np.array_equal(back, np.arange(7, dtype=np.int16) * 3)
        else:
            got = {tag: np.empty_like(m) for tag, m in msgs.items()}
            for tag in (2, 3, 1):
                g.recv(got[tag], 0, tag=tag)
            time.sleep(0.05)
            g.send(np.arange(7, dtype=np.int16) * 3, 0, tag=9)
            ok = all(np.array_equal(got[t], msgs[t]) for t in msgs)
        if not ok:
            out["bad"].append(f"point to point on the group with native={g.transport.native}")
    # A thread of this rank runs while the core waits (the peer comes 0.3 s late) and
    # while it moves a large message: the GIL is released in both.
    # The large case runs on a group of 1 MiB slots (a few phases per call, not the 200
    # of the job's 64 KiB ones) five times over, with a short switch interval: a thread
    # must get a core and the GIL within the call's releases, one pipelined 8 MiB
    # all_reduce on the core can be over in half a millisecond, and at each phase the
    # main thread takes the GIL back.
    chunk = os.environ["COLLECTIVES_SHM_CHUNK_BYTES"]
    os.environ["COLLECTIVES_SHM_CHUNK_BYTES"] = str(1 << 20)
    wide = pg.new_group([0, 1])
    os.environ["COLLECTIVES_SHM_CHUNK_BYTES"] = chunk
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    counts = []
    for group, size, late, calls in ((pg, 1, 0.3, 1), (wide, 8 << 20, 0.0, 5)):
        stop, ticks = threading.Event(), [0]

        def spin():
            while not stop.is_set():
                ticks[0] += 1
        t = threading.Thread(target=spin)
        x = np.ones(size, np.float32)
        group.barrier()
        if me == 1:
            time.sleep(late)
        t.start()
        time.sleep(0.01)
        before = ticks[0]
        for _ in range(calls):
            group.all_reduce(x)
        counts.append(ticks[0] - before)
        stop.set()
        t.join()
        want = 2.0 ** calls
        out["bad"] += [] if x[0] == want else [f"all_reduce of {size} gave {x[0]}, not {want}"]
    sys.setswitchinterval(interval)
    wide.close()
    out["ticks"] = counts
    for g in (mixed, python):
        g.close()
    pg.close()
    return out


def _capped_pieces_job() -> dict:
    """The default 1 MiB slot, whose pipelined pieces are capped at PIECE_MAX_BYTES: the
    native, Python and mixed groups cut a large all_reduce (and reduce) alike."""
    from backends.shm.reduce import PIECE_MAX_BYTES, piece_layout
    pg = collectives.init_process_group()
    me = pg.rank
    os.environ[native.NATIVE_ENV] = "0"
    python = pg.new_group([0, 1])
    os.environ[native.NATIVE_ENV] = "1" if me == 0 else "0"
    mixed = pg.new_group([0, 1])
    del os.environ[native.NATIVE_ENV]
    os.environ["COLLECTIVES_SHM_CMA"] = "0"   # (the staged path at every size)
    chunk = piece_layout(pg.transport.phases, 4)[1] * 4
    bad = []
    for count in (chunk // 4 - 3, 5 * chunk // 4 + 17, 300_001):
        x = np.random.default_rng([me, count]).standard_normal(count).astype(np.float32)
        for what in ("all_reduce", "reduce"):
            outs = []
            for g in (pg, python, mixed):
                y = x.copy()
                if what == "all_reduce":
                    g.all_reduce(y)
                else:
                    g.reduce(y, dst=1)
                outs.append(y)
            if not all(_same(o, outs[0]) for o in outs[1:]):
                bad.append(f"{what} n={count}")
    out = {"bad": bad, "capped": piece_layout(pg.transport.phases, 1)[0] == PIECE_MAX_BYTES
           < pg.transport.phases.S // 3,
           "native": [pg.transport.native, python.transport.native, mixed.transport.native]}
    for g in (mixed, python, pg):
        g.close()
    return out


@needs_core
def test_capped_pieces_agree_on_every_path():
    results = collectives.spawn(_capped_pieces_job, 2, backend="shm", timeout=60)
    for r, res in enumerate(results):
        assert res["capped"] and not res["bad"], (r, res)
    assert results[0]["native"] == [True, False, True], results


@needs_core
def test_native_python_and_mixed_groups_agree_bitwise_and_talk():
    results = collectives.spawn(_both_paths_job, 2, backend="shm", timeout=60,
                                env={"COLLECTIVES_SHM_CHUNK_BYTES": "65536"})
    assert results[0]["native"] == [True, False, True]
    assert results[1]["native"] == [True, False, False]
    for r, res in enumerate(results):
        assert not res["bad"], f"rank {r}: {res['bad']}"
    assert results[0]["digest"] == results[1]["digest"]
    # rank 0 waited 0.3 s for rank 1: its thread ran meanwhile (a held GIL would give it
    # a few switch intervals at most)
    assert results[0]["ticks"][0] > 10_000, results[0]["ticks"]
    assert all(res["ticks"][1] > 0 for res in results), [res["ticks"] for res in results]


def _late_pipelined_job() -> list:
    """Pipelined all_reduces and reduces (several chunks) where a rank comes late and
    the core gives up on every first wait at once (``wait_budget`` 0): Python waits
    phases out between the core's calls, which go on from the next step."""
    pg = collectives.init_process_group()
    pg.transport.core.wait_budget = 0.0
    n, me = pg.size, pg.rank
    a = np.empty(300_001, np.float32)   # about 19 chunks of 64 KiB slots
    right = []
    for i in range(8):
        a[:] = me + i
        if (i + me) % 3 == 0:
            time.sleep(0.002 * (i % 4))
        if i % 2:
            pg.reduce(a, dst=i % n)
            want = sum(r + i for r in range(n)) if me == i % n else me + i
        else:
            pg.all_reduce(a)
            want = sum(r + i for r in range(n))
        right.append(bool((a == want).all()))
    pg.close()
    return right


@needs_core
@pytest.mark.parametrize("nproc", [2, 3])
def test_the_pipelined_path_survives_late_ranks_and_short_waits(nproc):
    assert collectives.spawn(_late_pipelined_job, nproc, backend="shm", timeout=30,
                             join_timeout=120, env={"COLLECTIVES_SHM_CHUNK_BYTES": "65536"}
                             ) == [[True] * 8] * nproc


def _small_hook_job() -> dict:
    """The one-phase all_reduce in one call of the core (small_all_reduce), against
    Python's one-phase path (NativeCore.small_reduce, counted): taken on the hot path, left
    to Python with a send in flight, and waited out by Python when a rank comes later
    than the core waits."""
    pg = collectives.init_process_group()
    me, n = pg.rank, pg.size
    cls = type(pg.transport.core)
    real = cls.small_reduce
    python_calls = []

    def counted(self, *args):
        python_calls.append(args[2])
        return real(self, *args)

    cls.small_reduce = counted
    out = {"counters_agree": []}

    def agree() -> None:   # the core's counter is the phase this rank last published
        ph = pg.transport.phases
        out["counters_agree"].append(pg.transport.core.group.phase == int(ph.u64[ph.me_arrived]))

    try:
        a = np.empty(5, np.float32)
        for op, want in ((ReduceOp.SUM, n * (n - 1) / 2), (ReduceOp.MAX, n - 1)):
            a[:] = me
            pg.all_reduce(a, op)
            out.setdefault("hot", []).append(bool((a == want).all()))
            agree()
        out["hot_python_calls"] = len(python_calls)
        late = []
        for i in range(2):   # a rank 0.25 s late: past the core's 0.1 s wait
            a[:] = me + i
            if me == i % n:
                time.sleep(0.25)
            pg.all_reduce(a)
            late.append(bool((a == sum(r + i for r in range(n))).all()))
            agree()
        out["late"] = late
        big = np.arange(300_000, dtype=np.float64)   # larger than a ring: still in flight
        got = np.empty_like(big)
        sent = pg.isend(big, (me + 1) % n, tag=5)
        received = pg.irecv(got, (me - 1) % n, tag=5)
        before = len(python_calls)
        a[:] = 1.0
        pg.all_reduce(a)
        sent.wait()
        received.wait()
        agree()
        out["pending"] = (bool((a == n).all()) and np.array_equal(got, big),
                          len(python_calls) - before)
        phase = pg.transport.phases.phase
        pg.barrier()   # (a phase of the Python wrapper: the counters are one)
        agree()
        out["phase"] = pg.transport.phases.phase - phase
        last = pg.transport.phases.phase
    finally:
        cls.small_reduce = real
        pg.close()
    out["after_close"] = pg.transport.phases.phase == last   # the counter is intact after close
    return out


def _read_only_reduce_job() -> list:
    """reduce() only reads the input of a rank that is not the root: a read-only array
    there is fine, at the one-phase size and past it (the core's pipelined path)."""
    pg = collectives.init_process_group()
    n, me = pg.size, pg.rank
    out = []
    for count in (7, 300_001):
        a = np.full(count, me + 1.0, np.float32)
        if me != 0:
            a.flags.writeable = False
        pg.reduce(a, dst=0)
        out.append(bool((a == (n * (n + 1) / 2 if me == 0 else me + 1.0)).all()))
    b = np.ones(3, np.float32)
    pg.all_reduce(b)   # the group goes on
    out.append(bool((b == n).all()))
    pg.close()
    return out


@needs_core
def test_a_read_only_input_to_reduce_on_a_non_root_rank():
    assert collectives.spawn(_read_only_reduce_job, 3, backend="shm", timeout=30,
                             join_timeout=120) == [[True] * 3] * 3


@needs_core
@pytest.mark.parametrize("nproc", [2, 3])
def test_the_one_phase_all_reduce_is_one_call_of_the_core(nproc):
    for res in collectives.spawn(_small_hook_job, nproc, backend="shm", timeout=30,
                                 join_timeout=120):
        assert res["hot"] == [True, True] and res["hot_python_calls"] == 0, res
        assert res["late"] == [True, True], res
        assert res["pending"] == (True, 1), res
        assert res["phase"] == 1 and res["after_close"], res
        assert res["counters_agree"] == [True] * 6, res


def _small_moves_job() -> dict:
    """The gather and scatter families' one-phase messages, a small all_to_all and a
    barrier: each
    straight from the group's fast path (its general path, counted, never taken)
    into one call of the core (moves.py's phase loops, counted, never run), also when a
    rank comes later than the core waits before each call (Python waits the phase out,
    the core finishes it), and a mismatch raises on every rank, naming the other call."""
    from backends.shm import moves
    pg = collectives.init_process_group()
    me, n = pg.rank, pg.size
    python_calls = []
    originals = {}
    for name in ("broadcast", "gather", "scatter", "all_to_all", "all_to_all_rest"):
        originals[name] = getattr(moves, name)

        def counted(*args, _name=name):
            python_calls.append(_name)
            return originals[_name](*args)
        setattr(moves, name, counted)
    general = []
    from collectives import running
    real_dispatch = running.dispatch
    running.dispatch = lambda g, op, *a, **k: (general.append(op),
                                               real_dispatch(g, op, *a, **k))[1]
    core = pg.transport.core
    real_exchange = core.exchange   # a phase Python enters (the Python barrier's, for one)
    core.exchange = lambda q: (python_calls.append("exchange"), real_exchange(q))[1]
    mine = np.arange(6, dtype=np.float32) + 10 * me
    every = np.concatenate([np.arange(6, dtype=np.float32) + 10 * r for r in range(n)])
    sums = sum(every[r * 6:(r + 1) * 6] for r in range(n))

    def round_(late: int) -> list:
        def wait() -> None:   # past the core's 0.1 s wait: _settle resumes the call
            if me == late:
                time.sleep(0.25)
        got, b, part = np.empty(6 * n, np.float32), mine.copy(), np.empty(6, np.float32)
        wait()
        pg.all_gather(got, mine)
        wait()
        pg.broadcast(b, src=n - 1)
        wait()
        pg.scatter(part, every if me == 0 else None, src=0)
        at_root = np.zeros(6 * n, np.float32) if me == 1 else None
        wait()
        pg.gather(mine, at_root, dst=1)
        whole = np.concatenate([mine] * n)
        out = np.empty(6, np.float32)
        wait()
        pg.reduce_scatter(out, whole)
        swapped = np.empty(6 * n, np.float32)   # rank j sends rank k its `mine` + k
        wait()
        pg.all_to_all(swapped, np.concatenate([mine + k for k in range(n)]))
        wait()
        pg.barrier()
        return [bool(np.array_equal(got, every)), bool(np.array_equal(b, every[-6:])),
                bool(np.array_equal(part, every[me * 6:(me + 1) * 6])),
                me != 1 or bool(np.array_equal(at_root, every)),
                bool(np.array_equal(out, sums)), bool(np.array_equal(swapped, every + me))]

    try:
        res = {"hot": round_(-1), "late": round_(n - 1), "native": pg.transport.native}
        res["python_calls"] = list(python_calls)
        res["general"] = list(general)
        # A move the core's `move` did not take (NOT_TAKEN: a dtype or operator it does
        # not know) runs through small_move with the codes Python finds.
        from backends.shm.codes import OP_ALL_GATHER
        got, seq = np.zeros(6 * n, np.float32), pg._seq
        pg._seq += 1
        core._move_waits(core.mod.MOVE_GATHER, OP_ALL_GATHER, mine, got, -1, None,
                         mine.nbytes, seq, core.NOT_TAKEN)
        res["not_taken"] = bool(np.array_equal(got, every))
        spare = pg.new_group(list(range(n)))
        try:   # rank 0 expects 2 elements from rank 1, which sends it 1
            counts = [1 + (k == 1 and me == 0) for k in range(n)]
            spare.all_to_all(np.empty(sum(counts), np.float32), np.zeros(n, np.float32),
                          output_split_sizes=counts, input_split_sizes=[1] * n)
            res["counts"] = "no error"
        except (collectives.CollectiveMismatch, collectives.PeerError) as exc:
            res["counts"] = f"{type(exc).__name__}: {exc}"
        spare.close()
        spare = pg.new_group(list(range(n)))
        try:   # a barrier against an all_reduce: one phase each, told apart
            spare.barrier() if me == 0 else spare.all_reduce(np.zeros(1, np.float32))
            res["barrier"] = "no error"
        except (collectives.CollectiveMismatch, collectives.PeerError) as exc:
            res["barrier"] = f"{type(exc).__name__}: {exc}"
        spare.close()
        try:
            pg.all_gather(np.empty(n * (3 + me), np.float32), np.zeros(3 + me, np.float32))
            res["mismatch"] = "no error"
        except (collectives.CollectiveMismatch, collectives.PeerError) as exc:
            # (a rank that reads the first one's failure mark before the mismatch
            # raises PeerError instead)
            res["mismatch"] = f"{type(exc).__name__}: {exc}"
    finally:
        for name, fn in originals.items():
            setattr(moves, name, fn)
        running.dispatch = real_dispatch
        pg.close()
    return res


@needs_core
@pytest.mark.parametrize("nproc", [2, 3])
def test_the_gather_and_scatter_families_move_in_one_call_of_the_core(nproc):
    results = collectives.spawn(_small_moves_job, nproc, backend="shm", timeout=30,
                                join_timeout=120)
    for res in results:
        assert res["native"] and res["python_calls"] == [] and res["general"] == [], res
        assert res["not_taken"], res
        assert res["hot"] == [True] * 6 and res["late"] == [True] * 6, res
        assert "all_to_all" in res["counts"] and "all_gather" in res["mismatch"], res
        assert res["barrier"] != "no error", res
    assert any(res["barrier"].startswith("CollectiveMismatch") and "barrier" in res["barrier"]
               and "all_reduce" in res["barrier"] for res in results), results
    assert any(res["mismatch"].startswith("CollectiveMismatch") and "called" in res["mismatch"]
               for res in results), results
    assert any(res["counts"].startswith("CollectiveMismatch")
               and "rank 1 sends 1 elements to rank 0, but rank 0 expects 2" in res["counts"]
               for res in results), results


# --------------------------------------------------------------------------- build
def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)


def _wheel(src: Path, out: Path, env: dict) -> tuple[list[str], str]:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                           "--no-build-isolation", "-v", "-w", str(out)],
                          cwd=src, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist(), proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs the git checkout")
def test_the_build_makes_the_core_and_survives_without_a_compiler(tmp_path):
    _copy_tree(tmp_path / "src")
    names, _ = _wheel(tmp_path / "src", tmp_path / "with", {})
    assert any(n.startswith("backends/shm/_native") and n.endswith(".so") for n in names)
    shutil.rmtree(tmp_path / "src" / "build", ignore_errors=True)
    names, log = _wheel(tmp_path / "src", tmp_path / "without", {"CC": "/bin/false"})
    assert not any(n.endswith(".so") for n in names)
    assert "the compiled shm core (backends.shm._native) was not built" in log
