"""The single-copy all_reduce of the shm backend (backends/shm/cma.py): the ranks read
each other's arrays with process_vm_readv and write the reduced pieces into them with
process_vm_writev. It must give bitwise what the staged, pipelined path gives (every
dtype and operator, uneven pieces, 2 and 3 ranks), and the ranks must always agree on
the path: a rank that votes against it (``COLLECTIVES_SHM_CMA=0``, or a kernel whose
copy between processes it measured as too slow) or that cannot read its peers or write
through the kernel turns it off for the whole group, which still computes the right
result; a rank that measured it paying only for larger messages sets the group's line,
agreed by every rank at the first large call. Nothing may be written into a rank's array
once its call returned with an error.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import collectives
from collectives import ReduceOp

from backends.shm import cma, native
from backends.shm.cma import CMA_ENV

from test_shm_native import FLOATS, INTS, _dtype, _ops, _same, _values

#: The largest line the speed check may set (its last rung's).
_BIG_LINE = cma.SPEED_LADDER[-1][2]

needs_core = pytest.mark.skipif(native.native_module() is None,
                                reason="backends.shm._native is not built")


def _staged_group(pg):
    """A group over the same ranks whose first large all_reduce decides, with every
    rank voting against it, that it stages through shared memory."""
    g = pg.new_group(list(range(pg.size)))
    os.environ[CMA_ENV] = "0"
    g.all_reduce(np.zeros(pg.transport.single_copy.min_bytes // 4, np.float32))
    os.environ[CMA_ENV] = "1"
    return g


def _agree_job() -> dict:
    # Voting for the path whatever the kernel's speed here (unset, a rank votes for it
    # only where the kernel copies about as fast as memcpy: cma.cma_from_bytes).
    os.environ[CMA_ENV] = "1"
    pg = collectives.init_process_group()
    me, n = pg.rank, pg.size
    staged = _staged_group(pg)
    bad = []
    with np.errstate(all="ignore"):
        for name in FLOATS + INTS:
            dt = _dtype(name)
            # just at the line, an odd count above it (uneven, unaligned pieces)
            for count in (pg.transport.single_copy.min_bytes // dt.itemsize,
                          pg.transport.single_copy.min_bytes // dt.itemsize + 2 * n + 1):
                for op in _ops(name)[:3] if count % 2 else _ops(name):
                    rng = np.random.default_rng([me, count, len(name), list(ReduceOp).index(op)])
                    x = _values(dt, count, rng)
                    y, z = x.copy(), x.copy()
                    pg.all_reduce(y, op=op)
                    staged.all_reduce(z, op=op)
                    if not _same(y, z):
                        bad.append(f"{name} {op.name} n={count}")
    digest = y.tobytes()[:64].hex() + y.tobytes()[-64:].hex()

    # One rank votes against: the whole group stages, on every rank, and is right.
    if me == n - 1:
        os.environ[CMA_ENV] = "0"
    vote = pg.new_group(list(range(n)))
    a = np.full(pg.transport.single_copy.min_bytes // 4 + 3, me + 1.0, np.float32)
    vote.all_reduce(a)
    os.environ[CMA_ENV] = "1"
    voted = (vote.transport.single_copy.decided, bool(np.all(a == n * (n + 1) / 2)))

    # Left to measure (the variable unset), one rank finds the kernel's copy too slow:
    # the whole group stages, and is right.
    del os.environ[CMA_ENV]
    cma._from_bytes = 0 if me == 0 else cma.CMA_ALL_REDUCE_BYTES
    slow = pg.new_group(list(range(n)))
    c = np.full(pg.transport.single_copy.min_bytes // 4 + 5, me + 1.0, np.float32)
    slow.all_reduce(c)
    measured = (slow.transport.single_copy.decided, bool(np.all(c == n * (n + 1) / 2)))

    # One rank finds it pays only from 8 MiB: the group agrees on that line at its first
    # large call (which stages, as does every later one below the line, without asking
    # again); a message at the line reads in place; the results are those of staging.
    cma._from_bytes = _BIG_LINE if me == n - 1 else cma.CMA_ALL_REDUCE_BYTES
    late = pg.new_group(list(range(n)))
    line_results = []
    asked = []
    real_vote = type(late.transport.single_copy).line
    type(late.transport.single_copy).line = lambda self: asked.append(1) or real_vote(self)
    try:
        for count in (pg.transport.single_copy.min_bytes // 4 + 7, pg.transport.single_copy.min_bytes // 4 + 9,
                      _BIG_LINE // 4 - 1, _BIG_LINE // 4):
            x = np.random.default_rng([me, count]).standard_normal(count).astype(np.float32)
            y, z = x.copy(), x.copy()
            late.all_reduce(y)
            staged.all_reduce(z)
            line_results.append((late.transport.single_copy.decided, late.transport.single_copy.min_bytes, len(asked), _same(y, z)))
    finally:
        type(late.transport.single_copy).line = real_vote
    cma._from_bytes = None
    os.environ[CMA_ENV] = "1"

    # One rank cannot read its peers, or can read but not write (the kernel says EPERM):
    # the probe turns the path off.
    probed = []
    probes = []
    for forbidden in ("cma_read", "cma_write"):
        probe = pg.new_group(list(range(n)))
        probes.append(probe)
        if me == 0:
            real = probe.transport.single_copy.mod
            stub = type("Forbidden", (), {
                name: staticmethod(getattr(real, name))
                for name in ("cma_read", "cma_write")})
            setattr(stub, forbidden, staticmethod(lambda *args: -1))   # -EPERM
            probe.transport.single_copy.mod = stub
        b = np.full(pg.transport.single_copy.min_bytes // 4, me + 1.0, np.float32)
        probe.all_reduce(b)
        probed.append((probe.transport.single_copy.decided, bool(np.all(b == n * (n + 1) / 2))))

    out = {"bad": bad, "digest": digest, "cma": (pg.transport.single_copy.decided, staged.transport.single_copy.decided), "voted": voted,
           "probed": probed, "measured": measured, "line": line_results}
    for g in (*probes, vote, staged, slow, late):
        g.close()
    pg.close()
    return out


@needs_core
@pytest.mark.parametrize("nproc", [2, 3])
def test_single_copy_all_reduce_is_bitwise_the_staged_one_and_agreed(nproc):
    results = collectives.spawn(_agree_job, nproc, backend="shm", timeout=120,
                                join_timeout=600)
    for r, res in enumerate(results):
        assert not res["bad"], f"rank {r}: {res['bad']}"
        assert res["cma"][1] is False, (r, res["cma"])          # the staged group
        assert res["voted"] == (False, True), (r, res["voted"])
        assert res["probed"] == [(False, True)] * 2, (r, res["probed"])
        assert res["measured"] == (False, True), (r, res["measured"])
        # Asked once (the first call), the line agreed; below it staged without asking;
        # at it asked again and read in place (False where the kernel forbids the read:
        # the probe's, checked below).
        big = _BIG_LINE
        assert res["line"][:3] == [(None, big, 1, True)] * 3, (r, res["line"])
        assert res["line"][3] == (res["cma"][0], big, 2, True), (r, res["line"])
    assert len({res["digest"] for res in results}) == 1
    assert len({res["cma"] for res in results}) == 1           # the world: one decision
    if results[0]["cma"][0] is not True:   # every rank could, but the probe failed
        pytest.skip("this kernel forbids process_vm_readv between the ranks (ptrace "
                    "rules or seccomp): only the staged path ran; the agreement held")


class _Kernel:
    """A stand-in for the core's ``cma_read``: a copy of ``addr`` at memcpy speed, or the
    same made slow, as a slow kernel's would be."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def cma_read(self, out, pid, addr):
        import ctypes
        import time
        ctypes.memmove(out.ctypes.data, addr, out.nbytes)
        if self.delay:
            time.sleep(self.delay)
        return 0


def test_the_speed_check_tells_a_slow_kernel_copy_from_a_fast_one():
    assert cma.cma_cost_ratio(_Kernel(0.005), rounds=2) > 2 * cma.CMA_MAX_COST
    assert cma.cma_cost_ratio(_Kernel(0.0), rounds=5) < 2.0   # memcpy against memcpy


@needs_core
def test_the_speed_check_runs_on_the_real_kernel_copy():
    """A smoke test: this kernel's copy is measured (whatever it costs here)."""
    ratio = cma.cma_cost_ratio(native.native_module())
    assert 0.0 < ratio < float("inf")


@pytest.mark.parametrize("ratios, line", [
    ({1: 1.1}, cma.CMA_ALL_REDUCE_BYTES),             # pays at 1 MiB: from 1.5 MiB
    ({1: 1.5, 2: 1.3}, 2 << 20),                      # from 2 MiB
    ({1: 1.5, 2: 1.45, 4: 1.45}, 4 << 20),
    ({1: 1.5, 2: 1.6, 4: 1.55, 8: 1.45}, 8 << 20),
    ({1: 3.0, 2: 2.5, 4: 2.0, 8: 1.8}, 0),            # never
])
def test_the_speed_check_climbs_to_the_first_size_where_the_copy_pays(
        monkeypatch, ratios, line):
    timed = []

    def ratio(mod, nbytes=cma._PROBE_BYTES, rounds=cma.PROBE_ROUNDS):
        timed.append(nbytes >> 20)
        return ratios[nbytes >> 20]

    monkeypatch.setattr(cma, "cma_cost_ratio", ratio)
    monkeypatch.setattr(cma, "_from_bytes", None)
    assert cma.cma_from_bytes(None) == line
    assert timed == sorted(ratios)                    # no rung past the one that paid
    assert cma.cma_from_bytes(None) == line and len(timed) == len(ratios)   # once


class _LateCore:
    """The group's core with ``cma_reduce`` started ``delay`` s late (a rank descheduled
    or stopped between the phases); everything else is the core's."""

    def __init__(self, core, delay: float) -> None:
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "_delay", delay)

    def __getattr__(self, name):
        return getattr(self._core, name)

    def __setattr__(self, name, value):   # (the phase counter lives in the core)
        setattr(self._core, name, value)

    def cma_reduce(self, *args):
        import time
        time.sleep(self._delay)
        return self._core.cma_reduce(*args)


def _nothing_written_after_an_error_job() -> dict:
    """After a single-copy all_reduce raised on a rank, no peer writes into its array
    (a peer checks that the rank has not failed before every block it writes, and the
    rank waits for a block in flight: Phases.await_pushers)."""
    import time

    from backends.shm import segment as sg
    os.environ[CMA_ENV] = "1"
    pg = collectives.init_process_group()
    me = pg.rank
    late, flagged, stuck = (pg.new_group([0, 1]) for _ in range(3))
    count = pg.transport.single_copy.min_bytes // 4
    for g in (late, flagged, stuck):   # the first call votes and probes
        g.all_reduce(np.ones(count, np.float32))
    out = {}

    # 1. Rank 1 reaches its writes 2.5 s late; rank 0 times out at 1 s, hands its
    # array back and overwrites it; rank 1 must not write there (it raises instead).
    late.timeout = 1.0
    a = np.full(count, me + 1.0, np.float32)
    if me == 1:
        late.transport.core.group = _LateCore(late.transport.core.group, 2.5)
    try:
        late.all_reduce(a)
        out["late"] = "returned"
    except collectives.CollectiveError as exc:
        out["late"] = type(exc).__name__
    if me == 0:
        a[:] = -7.0
        time.sleep(3.0)
        out["late_untouched"] = bool(np.all(a == -7.0))
    pg.barrier()

    # 2. Rank 1 is in the middle of a block for rank 0 (its W_PUSHING word says so) when
    # rank 0 times out: rank 0 raises only once rank 1 is done (1.3 s after the start),
    # or, where rank 1 never is, after waiting the group's timeout again, naming it.
    for g, clear_after, timeout in ((flagged, 1.3, 1.0), (stuck, None, 0.3)):
        word = g.transport.phases.layout.ctrl_word(1, sg.W_PUSHING)
        if me == 1:
            g.transport.phases.u64[word] = 1          # "writing into rank 0"
        pg.barrier()
        if me == 0:
            g.timeout = timeout
            t0 = time.monotonic()
            try:
                g.all_reduce(np.ones(count, np.float32))   # rank 1 never calls it
            except collectives.CollectiveError as exc:
                out[f"raised_{clear_after}"] = (time.monotonic() - t0,
                                                "ranks [1]" in "".join(exc.__notes__))
        elif clear_after is not None:
            time.sleep(clear_after)
            g.transport.phases.u64[word] = 0
        pg.barrier()
        if me == 1:
            g.transport.phases.u64[word] = 0
    for g in (late, flagged, stuck):
        g.close()
    pg.close()
    return out


@needs_core
def test_no_rank_writes_into_an_array_handed_back_with_an_error():
    results = collectives.spawn(_nothing_written_after_an_error_job, 2, backend="shm",
                                timeout=60, join_timeout=300)
    r0, r1 = results
    if r0["late"] == "returned":
        pytest.skip("this kernel forbids process_vm_readv between the ranks")
    assert r0["late"] == "CollectiveTimeout" and r1["late"] == "PeerError", results
    assert r0["late_untouched"], "rank 1 wrote into rank 0's array after rank 0 raised"
    waited, _ = r0["raised_1.3"]
    assert 1.25 <= waited < 2.0, waited   # after the write (50 ms of clock slack), not before
    waited, named = r0["raised_None"]
    assert waited >= 0.6 and named, r0["raised_None"]   # the timeout, then the timeout again
