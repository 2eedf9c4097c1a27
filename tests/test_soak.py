"""Soak: four ranks of each backend run random collectives for a long time (default 600 s,
``COLLECTIVES_SOAK_SECONDS``) with every result checked and nothing leaked. The seed is
printed (and in a failure's message); ``COLLECTIVES_SOAK_SEED`` replays one.

Slow (``pytest -m slow tests/test_soak.py``). Every rank draws the same sequence of
operations from one seeded RNG (op, size up to 256 Ki elements, dtype, reduction, root,
layout, numpy or torch, blocking or ``async_op``, all_to_all splits; now and then a
ring of sends, an object collective or a sub-group created, used and closed), runs it
through :func:`collectives.testing.execution.run_case` and compares its own output with
the reference (:func:`collectives.testing.strategies.expected_outputs`). Rank 0's clock
decides when to stop (broadcast every few operations, so no rank stops alone). At the end
the ranks compare a digest of every all_reduce result (bitwise identical everywhere), and
resources are compared with those after a warm-up, as in ``test_hygiene``; after the
world is closed, no file it created may be left in /dev/shm unused (MPICH's included).
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
import zlib
from typing import Any

import numpy as np
import pytest

from collectives.shm_names import SHM_DIR
from collectives.testing.execution import array_diff, run_case
from collectives.testing.pool import WorldPool
from collectives.testing.strategies import (DTYPES, FLOAT_DTYPES, OPS, REDUCING_OPS, ROOT_ARG,
                                            CollectiveCase, all_inputs, expected_outputs,
                                            tolerance)
from test_hygiene import leaks, resources

pytestmark = pytest.mark.slow

#: How long each backend is soaked, in seconds.
SECONDS = float(os.environ.get("COLLECTIVES_SOAK_SECONDS", "600"))
WORLD_SIZE = 4
BACKENDS = ("shm", "zmq", "gloo", "mpi")
#: Operations between two "keep going?" broadcasts of rank 0.
STRIDE = 16
#: Operations before the resources are first counted (lazy start-up, caches, pools).
WARMUP_OPS = 200
#: Resident memory a rank may gain between the warm-up and the end, in KiB: the largest
#: message is 2 MiB, staged copies and torch/numpy allocator caches hold a few of them.
RSS_SLACK_KIB = 32 * 1024
#: Operations between two samples of resident memory (reported, to tell a leak's steady
#: growth from the allocator's plateau).
RSS_EVERY = 1000
#: The largest tensor drawn, in elements.
MAX_ELEMENTS = 1 << 18


def _draw_shape(rng: np.random.Generator, op: str, n: int) -> tuple[int, ...]:
    """Mostly small, sometimes empty, 0-d or 2-d, now and then large."""
    p = rng.random()
    if p < 0.05:
        return () if op != "all_to_all" else (1,)
    if p < 0.10:
        return (0,)
    if p < 0.25:
        return (int(rng.integers(1, 8)), int(rng.integers(1, 8)))
    limit = MAX_ELEMENTS if p > 0.95 else 4096
    length = int(np.exp(rng.uniform(0, np.log(limit))))
    if op in ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all"):
        length = max(1, length // n)
    return (length,)


def draw_case(rng: np.random.Generator, n: int, index: int) -> CollectiveCase:
    """One random collective for a world of ``n`` (the same on every rank for the same
    RNG state)."""
    op = str(rng.choice(OPS))
    async_op = bool(rng.random() < 0.3)
    if op == "barrier":
        return CollectiveCase("barrier", async_op=async_op)
    dtypes = [d for d in DTYPES if not (op in REDUCING_OPS and d == "bool")]
    dtype = str(rng.choice(dtypes))
    reduce_op = None
    if op in REDUCING_OPS:
        ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (["AVG"] if dtype in FLOAT_DTYPES else [])
        reduce_op = str(rng.choice(ops))
    root = int(rng.integers(0, n)) if op in ROOT_ARG else None
    splits = None
    if op == "all_to_all" and rng.random() < 0.5:
        splits = tuple(tuple(int(x) for x in rng.integers(0, 4, n)) for _ in range(n))
    return CollectiveCase(op, _draw_shape(rng, op, n), dtype, reduce_op=reduce_op, root=root,
                          layout=str(rng.choice(["contiguous", "strided"])),
                          kind=str(rng.choice(["numpy", "torch"])), seed=index,
                          splits=splits, async_op=async_op)


def _check_case(group: Any, case: CollectiveCase, digest: int) -> int:
    """Run ``case`` and check this rank's result; return the all_reduce digest updated."""
    rank, n = group.rank, group.size
    result = run_case(group, case)
    assert not result.problems, result.problems
    expected = expected_outputs(case, n)[rank]
    if expected is not None:
        diff = array_diff(result.output, expected, tolerance(case))
        assert not diff, f"rank {rank}: {case!r}: output {diff}"
    if result.input_after is not None:
        diff = array_diff(result.input_after, all_inputs(case, n)[rank], None)
        assert not diff, f"rank {rank}: {case!r}: the input was modified: {diff}"
    if case.op == "all_reduce":
        digest = zlib.crc32(result.output.tobytes(), digest)
    return digest


def _extras(group: Any, rng: np.random.Generator, index: int) -> None:
    """Point to point, object collectives and a short-lived sub-group."""
    n, r = group.size, group.rank
    what = rng.integers(0, 3)
    if what == 0 and n > 1:
        got = np.empty(3, np.int64)
        work = group.irecv(got, src=(r - 1) % n, tag=index % 1000)
        group.send(np.full(3, r * 1000 + index, np.int64), dst=(r + 1) % n, tag=index % 1000)
        work.wait()
        assert (got == ((r - 1) % n) * 1000 + index).all(), got
    elif what == 1:
        assert group.all_gather_object((r, index)) == [(q, index) for q in range(n)]
        root = int(rng.integers(0, n))
        assert group.broadcast_object({"i": index, "from": r}, src=root) == \
            {"i": index, "from": root}
    else:
        members = sorted(int(x) for x in rng.choice(n, int(rng.integers(1, n + 1)),
                                                    replace=False))
        if r in members:
            sub = group.new_group(members)
            try:
                a = np.full(5, float(r), np.float64)
                sub.all_reduce(a)
                assert (a == float(sum(members))).all(), a
            finally:
                sub.close()


def _warm_large_messages(group: Any) -> None:
    """Take every rank's large-message path once before counting: some of it starts on
    first use and stays for the process's life (pyzmq's garbage-collector thread and
    context for zero-copy frames: a thread, 3 OS threads, 7 fds), which the random draw
    of large sizes may otherwise reach only after the warm-up."""
    a = np.ones(MAX_ELEMENTS, np.float32)
    group.all_reduce(a)
    assert (a == group.size).all(), a[:4]


def soak_on_rank(group: Any, seed: int, seconds: float) -> dict[str, Any]:
    """Random checked operations until rank 0 says stop (after ``seconds``); return
    counts, the all_reduce digest and the resources after warm-up and at the end."""
    rng = np.random.default_rng(seed)
    start = time.monotonic()
    digest, done, extras = 0, 0, 0
    before = None
    rss: list[tuple[int, int]] = []  # (operations done, RssAnon KiB) now and then
    keep_going = np.ones(1, np.int64)
    while True:
        if done % STRIDE == 0:
            keep_going[0] = int(time.monotonic() - start < seconds) if group.rank == 0 else 0
            group.broadcast(keep_going, src=0)
            if not keep_going[0]:
                break
        if done == WARMUP_OPS:
            _warm_large_messages(group)
            before = resources()
        if done % RSS_EVERY == 0:
            rss.append((done, resources()["rss_kib"]))
        if rng.random() < 0.05:
            _extras(group, rng, done)
            extras += 1
        digest = _check_case(group, draw_case(rng, group.size, done), digest)
        done += 1
    group.barrier()
    after = resources()
    return {"ops": done, "extras": extras, "digest": digest, "rss": rss,
            "seconds": time.monotonic() - start, "before": before, "after": after}


def orphaned_segments() -> set[str]:
    """Files in /dev/shm that no process maps or holds open (any library's: MPICH's
    ``mpich_shm_*`` too), i.e. left behind by a job that ended."""
    names = set(os.listdir(SHM_DIR))
    in_use = set()
    for path in glob.glob("/proc/[0-9]*/maps") + glob.glob("/proc/[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if path.endswith("/maps"):
                with open(path) as maps:
                    text = maps.read()
                in_use |= {n for n in names if f"{SHM_DIR}/{n}" in text}
            else:
                target = os.readlink(path)
                if target.startswith(SHM_DIR + "/"):
                    in_use.add(target[len(SHM_DIR) + 1:].removesuffix(" (deleted)"))
    return names - in_use


def _left_behind(before: set[str], wait: float = 10.0) -> set[str]:
    """Files created in /dev/shm since ``before`` that nobody uses any more, once the
    world's processes had ``wait`` seconds to exit (an exiting rank still maps them;
    another job's live segment stays in use and is not counted)."""
    deadline = time.monotonic() + wait
    while True:
        new = set(os.listdir(SHM_DIR)) - before
        orphans = new & orphaned_segments()
        if orphans == new or time.monotonic() > deadline:
            return orphans
        time.sleep(0.2)


def _thinned(samples: list, keep: int = 12) -> list:
    """About ``keep`` of ``samples``, evenly spaced, the first and the last included."""
    if len(samples) <= keep:
        return samples
    step = (len(samples) - 1) / (keep - 1)
    return [samples[round(i * step)] for i in range(keep)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak(backend: str) -> None:
    from conftest import backend_params
    for param in backend_params():
        if param.values[0] == backend and param.marks:
            pytest.skip(param.marks[0].kwargs.get("reason", "unavailable"))
    seed = int(os.environ.get("COLLECTIVES_SOAK_SEED") or int.from_bytes(os.urandom(4), "little"))
    shm_before = set(os.listdir(SHM_DIR))
    with WorldPool(backend, WORLD_SIZE, timeout=60.0, preload=("torch",)) as pool:
        results = pool.call(soak_on_rank, seed, SECONDS, timeout=SECONDS + 180.0)
    # (leaving the with block closed the world and checked: no worker left, no segment)
    ops = {res["ops"] for res in results}
    assert len(ops) == 1, f"ranks did different numbers of operations: {ops}"
    assert len({res["digest"] for res in results}) == 1, \
        f"all_reduce results differ between ranks (seed {seed})"
    problems = []
    for rank, res in enumerate(results):
        if res["before"] is None:
            continue  # too short to measure past the warm-up
        problems += [f"rank {rank}: {p}" for p in leaks(res["before"], res["after"],
                                                         RSS_SLACK_KIB)]
    rss = [None if r["before"] is None else r["after"]["rss_kib"] - r["before"]["rss_kib"]
           for r in results]
    print(f"soak {backend}: seed {seed}, {results[0]['ops']} ops + {results[0]['extras']} "
          f"extras in {results[0]['seconds']:.0f} s; rss delta KiB {rss}; fds "
          f"{[r['after']['fds'] for r in results]}; rank 0 rss (ops, KiB) "
          f"{_thinned(results[0]['rss'])}")
    orphans = _left_behind(shm_before)
    assert not orphans, f"{backend}: segments left in {SHM_DIR} by the world: {orphans}"
    assert not problems, f"{backend} (seed {seed}) leaked:\n  " + "\n  ".join(problems)
