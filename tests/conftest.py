"""Shared test set-up: worlds of worker processes per (backend, world size), the list of
backends to test, and a session-end check that nothing was left behind.

A test that takes the ``pool`` fixture runs once per backend and world size::

    def test_something(pool):                 # pool: a running WorldPool
        pool.check(CollectiveCase("all_reduce", (3,), "int32", reduce_op="SUM"))

Each world starts once per session: the tests of one (backend, world size) are run one
after another (``pytest_collection_modifyitems``) and :class:`PoolCache` keeps the last
few worlds running. The backends come from ``collectives.available_backends()`` (plus
``p2p:shm``, the default algorithms over shm's point to point): a new backend is tested
with no change here. Workers import torch while their world starts, not in the first
test that needs it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from typing import Any

import pytest

import collectives
from collectives.shm_names import PREFIX, SHM_DIR
from collectives.testing.pool import LauncherUnavailable, WorldPool, launcher_for, live_pools
from faults.world import mpich_segments, remove_dead_mpich_segments
from hypothesis import settings

#: Property tests draw the same examples on every run (``derandomize``), so that a clean
#: clone's run is repeatable and a rare draw cannot fail one run of many; set
#: ``COLLECTIVES_HYPOTHESIS=explore`` to draw new examples each run (and keep failures in
#: hypothesis's database), as a developer hunting for edge cases would.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("COLLECTIVES_HYPOTHESIS", "repeatable"))

#: World sizes every backend is tested with.
WORLD_SIZES = (1, 2, 3, 4)
#: Seconds a collective may block inside a test world (the group's timeout) before it is
#: reported; generous for 4 ranks on 2 busy cores (torch backends rendezvous within it
#: while 4 interpreters import torch: ~13 s seen under load), short enough that a hang
#: fails within a minute.
POOL_TIMEOUT = 30.0
#: Names that are aliases of others (left out), and backends these tests cannot drive.
_ALIASES = {"torch"}  # gloo or nccl, whichever fits
_NOT_TESTED_HERE = {"nccl": "needs CUDA tensors; this suite passes host tensors"}
#: Test-only variants of a backend: name -> (backend, environment of its workers).
#: ``shm-py`` is shm on its Python path (the compiled core turned off), so that both of
#: shm's paths pass the suite; in the default run at 2 ranks (every op, ~25 s), at 1, 3
#: and 4 in the slow set (a world of one never uses the core anyway).
#: ``shm`` itself votes for its single-copy all_reduce whatever the kernel's speed, so that
#: the path is under test on every machine (left to measure, a rank votes against it
#: where the kernel copies slowly: backends/shm/cma.py).
#: ``hier`` runs on virtual hosts (``COLLECTIVES_HOST``): 1 and 2 ranks on one host, 3
#: ranks as 2 + 1 (uneven hosts), 4 as 2 hosts x 2 ranks.
#: ``collectives`` (our group through torch.distributed's "collectives" backend, shm
#: underneath, which has its own worlds here) at 2 ranks in the default run (~40 s), at
#: 1, 3 and 4 in the slow set (~150 s more).
VARIANTS = {"shm-py": ("shm", {"COLLECTIVES_SHM_NATIVE": "0"}),
            "shm": ("shm", {"COLLECTIVES_SHM_CMA": "1"}),
            "hier": ("hier", {"COLLECTIVES_HOST": "h0,h0,h1,h1"})}
_SLOW_VARIANT_SIZES = {"shm-py": (1, 3, 4), "collectives": (1, 3, 4)}

_close_problems: list[str] = []

# Failing collectives write flight records (collectives.flight); the tests fail many on
# purpose. Keep them in one folder of this session (inherited by every worker) instead of
# the user's <tmp>/collectives-flight, next to pytest's tmp_path folders, and remove the
# whole folder at the end unless a test failed: a passing run leaves nothing in the temp
# directory. Only the process that made the folder owns it: a worker process that imports
# this module (a task of test_soak or test_hygiene does) finds the variable set.
_OWN_SESSION_DIR = "COLLECTIVES_FLIGHT_DIR" not in os.environ
_SESSION_DIR = tempfile.mkdtemp(prefix="collectives-test-") if _OWN_SESSION_DIR else ""
if _OWN_SESSION_DIR:
    os.environ["COLLECTIVES_FLIGHT_DIR"] = os.path.join(_SESSION_DIR, "flight")
_FLIGHT_DIR = os.environ["COLLECTIVES_FLIGHT_DIR"]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """pytest's tmp_path folders go into this session's folder (unless --basetemp)."""
    if _OWN_SESSION_DIR and config.option.basetemp is None:
        config.option.basetemp = os.path.join(_SESSION_DIR, "tmp")


@functools.lru_cache(maxsize=None)
def backend_params() -> tuple[Any, ...]:
    """``pytest.param`` per backend to test: ``shm``, ``p2p:shm`` and every other backend
    ``available_backends()`` reports; one that cannot be used here is a skip, with why."""
    available = collectives.available_backends()
    names = ["shm", "shm-py", "p2p:shm"] + [b for b in available
                                            if b not in _ALIASES | {"shm"}]
    params = []
    for name in names:
        base = VARIANTS.get(name, (name,))[0].rpartition(":")[2]
        reason = _NOT_TESTED_HERE.get(base)
        if reason is None and base not in available:
            reason = f"backend {base!r} is not available here (module or library missing)"
        if reason is None:
            try:
                launcher_for(VARIANTS.get(name, (name,))[0])
                collectives.get_backend(VARIANTS.get(name, (name,))[0])
            except (LauncherUnavailable, ImportError, TypeError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        params.append(pytest.param(name, id=name, marks=marks))
    return tuple(params)


def _parametrized_by_mark(metafunc: pytest.Metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that take ``pool`` run on every backend and world size (unless they
    parametrize ``backend`` or ``world_size`` themselves)."""
    if "pool" not in metafunc.fixturenames:
        return
    if not _parametrized_by_mark(metafunc, "backend"):
        metafunc.parametrize("backend", backend_params())
    if not _parametrized_by_mark(metafunc, "world_size"):
        metafunc.parametrize("world_size", WORLD_SIZES, ids=[f"n{n}" for n in WORLD_SIZES])


def _world_key(item: pytest.Item) -> Any:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "pool" not in getattr(item, "fixturenames", ()):
        return None
    order = [p.values[0] for p in backend_params()]
    backend = str(params.get("backend"))
    rank = order.index(backend) if backend in order else len(order)
    return (rank, backend, params.get("world_size", 0))


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test variant's world sizes outside the default run get the ``slow`` mark."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("world_size") in _SLOW_VARIANT_SIZES.get(params.get("backend"), ()):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests of one world one after another (each world then starts once); tests
    without a pool keep their places."""
    slots = [i for i, item in enumerate(items) if _world_key(item) is not None]
    ordered = sorted((items[i] for i in slots), key=_world_key)
    for i, item in zip(slots, ordered):
        items[i] = item


class PoolCache:
    """Running :class:`WorldPool` per (backend, world size); at most ``max_alive`` at a
    time (the least recently used is closed first). Problems found when closing (a
    worker that did not exit, shared memory left behind) are reported at session end."""

    def __init__(self, max_alive: int = 2) -> None:
        self.max_alive = max_alive
        self._pools: OrderedDict[tuple[str, int], WorldPool] = OrderedDict()

    def get(self, backend: str, world_size: int) -> WorldPool:
        key = (backend, world_size)
        pool = self._pools.pop(key, None)
        if pool is None:
            while len(self._pools) >= self.max_alive:
                self._close(self._pools.popitem(last=False)[1])
            name, env = VARIANTS.get(backend, (backend, None))
            pool = WorldPool(name, world_size, timeout=POOL_TIMEOUT, preload=("torch",),
                             env=env)
        self._pools[key] = pool
        pool.start()  # no-op when running; raises PoolError when broken
        return pool

    def _close(self, pool: WorldPool) -> None:
        try:
            pool.close()
        except Exception as exc:  # noqa: BLE001 - reported at session end
            _close_problems.append(str(exc))

    def close_all(self) -> None:
        while self._pools:
            self._close(self._pools.popitem(last=False)[1])


@pytest.fixture(scope="session")
def pools() -> Any:
    """The session's :class:`PoolCache`."""
    cache = PoolCache()
    yield cache
    cache.close_all()


@pytest.fixture
def pool(pools: PoolCache, backend: str, world_size: int) -> WorldPool:
    """A running world of ``world_size`` workers of ``backend``, shared by every test of
    the session that asks for the same pair."""
    return pools.get(backend, world_size)


def _shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


#: MPICH's own /dev/shm files (``mpich_shm_*``) -> the test during which each appeared.
_MPICH_FILES_SEEN: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _note_mpich_files(request: pytest.FixtureRequest) -> Any:
    """Note which test each new MPICH shared-memory file appeared in: an MPI job that is
    killed cannot remove its own, and the session's end names the test that left one."""
    before = mpich_segments()
    yield
    for name in mpich_segments() - before:
        _MPICH_FILES_SEEN.setdefault(name, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest) -> Any:
    """After the session: no ``collectives-*`` segment in /dev/shm that was not there
    before, no worker process alive, every pool closed cleanly."""
    before = _shm_entries()
    mpich_before = mpich_segments()
    yield
    problems = list(_close_problems)
    deadline = time.monotonic() + 3.0  # let ranks that are exiting finish
    while True:
        children = multiprocessing.active_children()
        left = sorted(_shm_entries() - before)
        if not (children or left) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        problems.append(f"shared-memory segments left in {SHM_DIR}: {left}")
    for name in remove_dead_mpich_segments(mpich_before):
        problems.append(f"MPICH's {SHM_DIR}/{name} left behind (removed now); it appeared "
                        f"during {_MPICH_FILES_SEEN.get(name, 'no test (between tests)')}")
    if children:
        problems.append(f"worker processes still alive: {children}")
        for child in children:
            child.kill()
    running = live_pools()
    if running:
        problems.append(f"pools never closed: {running}")
    if _OWN_SESSION_DIR:
        if request.session.testsfailed:  # keep the evidence: python -m collectives.doctor
            print(f"\nflight records of this session's failures: {_FLIGHT_DIR}")
        else:
            shutil.rmtree(_SESSION_DIR, ignore_errors=True)
    if problems:
        pytest.fail("the test session left things behind:\n" + "\n".join(problems),
                    pytrace=False)
