"""The single-copy all_reduce of the shm backend (backends/shm/cma.py): the ranks read
each other's arrays with process_vm_readv. It must give bitwise what the staged,
pipelined path gives (every dtype and operator, uneven pieces, 2 and 3 ranks), and the
ranks must always agree on the path: a rank that votes against it (``COLLECTIVES_SHM_CMA=0``)
or that cannot read its peers turns it off for the whole group, which still computes
the right result.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import collectives
from collectives import ReduceOp

from backends.shm import native
from backends.shm.cma import CMA_ENV

from test_shm_native import FLOATS, INTS, _dtype, _ops, _same, _values

needs_core = pytest.mark.skipif(native.native_module() is None,
                                reason="backends.shm._native is not built")


def _staged_group(pg):
    """A group over the same ranks whose first large all_reduce decides, with every
    rank voting against it, that it stages through shared memory."""
    g = pg.new_group(list(range(pg.size)))
    os.environ[CMA_ENV] = "0"
    g.all_reduce(np.zeros(pg._cma_bytes // 4, np.float32))
    del os.environ[CMA_ENV]
    return g


def _agree_job() -> dict:
    pg = collectives.init_process_group()
    me, n = pg.rank, pg.size
    staged = _staged_group(pg)
    bad = []
    with np.errstate(all="ignore"):
        for name in FLOATS + INTS:
            dt = _dtype(name)
            # just at the line, an odd count above it (uneven, unaligned pieces)
            for count in (pg._cma_bytes // dt.itemsize,
                          pg._cma_bytes // dt.itemsize + 2 * n + 1):
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
    a = np.full(pg._cma_bytes // 4 + 3, me + 1.0, np.float32)
    vote.all_reduce(a)
    os.environ.pop(CMA_ENV, None)
    voted = (vote._cma, bool(np.all(a == n * (n + 1) / 2)))

    # One rank cannot read its peers (the kernel says EPERM): the probe turns it off.
    probe = pg.new_group(list(range(n)))
    if me == 0:
        real = probe._native_module

        class Forbidden:
            cma_reduce = real.cma_reduce

            @staticmethod
            def cma_read(out, pid, addr):
                return -1   # -EPERM
        probe._native_module = Forbidden
    b = np.full(pg._cma_bytes // 4, me + 1.0, np.float32)
    probe.all_reduce(b)
    probed = (probe._cma, bool(np.all(b == n * (n + 1) / 2)))

    out = {"bad": bad, "digest": digest, "cma": (pg._cma, staged._cma), "voted": voted,
           "probed": probed}
    for g in (probe, vote, staged):
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
        assert res["probed"] == (False, True), (r, res["probed"])
    assert len({res["digest"] for res in results}) == 1
    assert len({res["cma"] for res in results}) == 1           # the world: one decision
    if results[0]["cma"][0] is not True:   # every rank could, but the probe failed
        pytest.skip("this kernel forbids process_vm_readv between the ranks (ptrace "
                    "rules or seccomp): only the staged path ran; the agreement held")
