"""Where shm ranks run: one core each when they outnumber the cores (placement.py), the
choice undone when the world group closes, and the wait policy that follows it."""

from __future__ import annotations

import os
import threading

import pytest

import collectives
from collectives import settings as variables
from backends.shm import native, placement

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs at least 2 cores")


def test_the_choice_follows_the_mode_the_ranks_and_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    assert [placement.chosen_core(r, 4, "auto") for r in range(4)] == [3, 5, 3, 5]
    assert placement.chosen_core(1, 2, "auto") is None          # a core per rank
    assert [placement.chosen_core(r, 2, "core") for r in range(2)] == [3, 5]
    assert placement.chosen_core(2, 4, "none") is None
    assert placement.chosen_core(0, 1, "core") is None          # one rank
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7}, raising=False)
    assert placement.chosen_core(1, 4, "auto") is None          # placed by a launcher
    monkeypatch.setenv(placement.BIND_ENV, "sockets")
    with pytest.raises(ValueError, match="COLLECTIVES_SHM_BIND='sockets'"):
        placement.chosen_core(0, 4)


def test_the_wait_policy_counts_the_worlds_ranks_on_the_host(monkeypatch):
    monkeypatch.delenv(variables.SHM_SPIN_US.name, raising=False)
    monkeypatch.delenv(variables.SHM_YIELD_US.name, raising=False)
    monkeypatch.setenv(placement.BIND_ENV, "none")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    dedicated = tuple(x * 1e-6 for x in native.DEDICATED_WAIT_US)
    over = tuple(x * 1e-6 for x in native.OVERSUBSCRIBED_WAIT_US)
    assert native.wait_policy(2) == dedicated
    world = placement.Placement(0, 4)           # a world of 4 on these 2 cores
    try:
        assert world.core is None and native.wait_policy(2) == over
    finally:
        world.release()
    assert native.wait_policy(2) == dedicated


def _placed_job() -> dict:
    # A thread started before the group: it must be bound too (Linux binds per thread).
    started, stop = threading.Event(), threading.Event()

    def idle() -> None:
        started.set()
        stop.wait(60)
    thread = threading.Thread(target=idle, daemon=True)
    thread.start()
    started.wait(10)
    before = sorted(os.sched_getaffinity(0))
    pg = collectives.init_process_group()
    res = {"core": pg.transport.bound_core, "before": before,
           "during": sorted(os.sched_getaffinity(0)),
           "thread": sorted(os.sched_getaffinity(thread.native_id))}
    sub = pg.new_group(list(range(pg.size)))
    res["sub_core"], res["sub_spin"] = sub.transport.bound_core, sub.transport.phases.spin_s
    sub.close()
    pg.barrier()
    pg.close()
    res["after"] = sorted(os.sched_getaffinity(0))
    res["thread_after"] = sorted(os.sched_getaffinity(thread.native_id))
    stop.set()
    return res


@needs_two_cores
@pytest.mark.parametrize("nproc", [2, 3])
def test_ranks_outnumbering_the_cores_are_bound_one_each_and_let_go_at_close(nproc):
    two = set(CORES[:2])
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, two)     # the ranks inherit 2 cores
    try:
        results = collectives.spawn(_placed_job, nproc, backend="shm",
                                    env={placement.BIND_ENV: "auto"}, timeout=30,
                                    join_timeout=120)
    finally:
        os.sched_setaffinity(0, saved)
    for rank, res in enumerate(results):
        assert res["before"] == res["after"] == res["thread_after"] == sorted(two), res
        assert res["sub_core"] is None, res
        if nproc == 2:                # a core per rank: left alone
            assert res["core"] is None and res["during"] == sorted(two), res
            assert res["sub_spin"] == native.DEDICATED_WAIT_US[0] * 1e-6, res
        else:                         # 3 on 2: round robin, every thread
            core = sorted(two)[rank % 2]
            assert res["core"] == core and res["during"] == res["thread"] == [core], res
            assert res["sub_spin"] == native.OVERSUBSCRIBED_WAIT_US[0] * 1e-6, res


@needs_two_cores
def test_the_environment_turns_binding_off_and_on():
    off = collectives.spawn(_placed_job, 2, backend="shm",
                            env={placement.BIND_ENV: "none", "COLLECTIVES_SHM_SPIN_US": "3"},
                            timeout=30, join_timeout=120)
    assert [r["core"] for r in off] == [None, None]
    assert all(r["sub_spin"] == 3e-6 for r in off), off
    on = collectives.spawn(_placed_job, 2, backend="shm",
                           env={placement.BIND_ENV: "core"}, timeout=30, join_timeout=120)
    assert [r["core"] for r in on] == CORES[:2] and [r["during"] for r in on] == \
        [[c] for c in CORES[:2]], on
    assert all(r["after"] == r["before"] for r in on), on
