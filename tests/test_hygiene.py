"""Resource hygiene: creating, using and closing a group many times leaks nothing.

Each rank of a running world (a :class:`~collectives.testing.WorldPool`) builds a fresh
world group of the backend under test ``cycles`` times, exactly as a launcher's ranks do
(``init_process_group(backend=...)`` with a new meeting point and job id each time: a new
TCP port for zmq and gloo, new segment names for shm, a new duplicate of
``MPI.COMM_WORLD`` for mpi, which can be initialised only once per process), runs a few
collectives on it (blocking and ``async_op=True``, so the group's own thread is started
too) and closes it. After a few warm-up cycles (lazy imports, caches, torch's and MPI's
one-time allocations) it counts what the process holds; after the cycles it counts again:

- open file descriptors (``/proc/self/fd``) and threads (Python's and the OS's,
  ``/proc/self/task``) must be exactly equal;
- shared-memory files the process has mapped or open (``/dev/shm/...`` in
  ``/proc/self/maps`` and ``/proc/self/fd``) must be equal, and none of the job ids used
  may have a segment left in ``/dev/shm`` (checked by the parent too);
- private resident memory (``RssAnon``: the heap, where a leaked buffer or object
  lands) may grow by at most :data:`RSS_SLACK_KIB` (see there). Not ``VmRSS``: that also
  counts pages of shared segments and libraries, which come and go without a leak (a
  world segment's rings touched further along, a library's pages evicted and faulted
  back in; CI once saw VmRSS grow 9.8 MiB on one rank in 0.13 s with nothing else
  grown); a segment left mapped is caught by name instead. Growth past the slack is
  confirmed by a second batch of cycles before it fails: a leak grows in every batch, a
  one-time cost does not.

The parent checks that no segment of the test's jobs is left in /dev/shm; at the end of
the session ``tests/conftest.py`` checks that no worker process and no segment is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import secrets
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest

import collectives
from collectives.shm_names import PREFIX, SHM_DIR, job_digest
from collectives.spawn import free_port
from collectives.warm_start import environment as _environment
from collectives.testing.pool import WorldPool

#: The backends whose groups are created and destroyed (``p2p:shm`` shares shm's).
BACKENDS = ("shm", "zmq", "gloo", "mpi")
#: Ranks per world: two keep the two-core test machine responsive.
WORLD_SIZE = 2
#: Cycles after the warm-up, in the default run (``COLLECTIVES_HYGIENE_CYCLES`` overrides).
CYCLES = int(os.environ.get("COLLECTIVES_HYGIENE_CYCLES", "100"))
#: Cycles before the first count: the first groups pay for one-time allocations.
WARMUP = 5
#: Private resident memory a rank may gain over the measured cycles, in KiB. Measured
#: after the warm-up (2 ranks, 3 for sub-groups), 100 cycles grow RssAnon by 0..190 KiB
#: (shm, p2p:shm, zmq, mpi worlds and sub-groups) and up to 600 KiB (gloo); 300 gloo
#: sub-groups by 1.5 MiB (gloo's own C++ state: Python's heap grows by 10 KiB). So a
#: leak of 40 KiB or more per cycle (a 64 KiB buffer: 6.4 MiB) fails here (checked by
#: adding one); smaller ones are left to fds/threads (a socket, a thread, a mapping is
#: caught exactly) and the soak test.
RSS_SLACK_KIB = 4096


# ------------------------------------------------------------------- measuring (ranks)
def _shm_files(fd_targets: list[str]) -> list[str]:
    """The /dev/shm files this process maps, or holds open (``fd_targets``: what its fds
    point at), any library's."""
    names = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if path.startswith(SHM_DIR + "/"):
                names.add(path.removesuffix(" (deleted)"))
    names.update(t.removesuffix(" (deleted)") for t in fd_targets
                 if t.startswith(SHM_DIR + "/"))
    return sorted(names)


def _fd_targets() -> list[str]:
    """What each open fd points at (``socket:[inode]``, a path, ``pipe:[...]``), so that a
    count that changed can say which fd it was."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(targets)


def _rss_kib() -> int:
    """This process's private resident memory (``RssAnon``; ``VmRSS`` on a kernel
    before 4.5, which has no split)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "VmRSS"):
                found[key] = int(line.split()[1])
    if not found:
        raise RuntimeError("no RssAnon or VmRSS in /proc/self/status")
    return found.get("RssAnon", found.get("VmRSS"))


def _trim_heap() -> None:
    """Hand the heap's free memory back to the kernel (glibc's ``malloc_trim``), so that
    the count is of memory in use rather than what the allocator keeps for reuse after
    large messages (tens of MiB after a soak, none of it reachable)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _counts() -> tuple[int, int, int]:
    return (len(os.listdir("/proc/self/fd")), threading.active_count(),
            len(os.listdir("/proc/self/task")))


def _counts_back_to(target: tuple, limit: float = 10.0) -> tuple[int, int, int]:
    """Open fds, Python threads and OS threads once they equal ``target`` (the counts
    before the cycles), or after ``limit`` seconds: a thread that lets its socket go
    after a longer pause (see :func:`_settled_counts`) is waited for too; a leak does not
    go away by waiting, so waiting costs no sensitivity."""
    deadline = time.monotonic() + limit
    counts = _counts()
    while counts != target and time.monotonic() < deadline:
        time.sleep(0.02)
        counts = _counts()
    return counts


def _settled_counts(quiet: float = 0.3, limit: float = 5.0) -> tuple[int, int, int]:
    """Open fds, Python threads and OS threads, once they have stayed the same for
    ``quiet`` seconds (at most ``limit``): a closed group's last sockets may be let go
    by threads that are not ours (gloo's store server, a C++ thread, closes a client's
    connection when it notices the hang-up, just after ``close()`` returned). A leak does
    not go away by waiting, so waiting costs no sensitivity."""
    counts, since, deadline = _counts(), time.monotonic(), time.monotonic() + limit
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.02)
        now = _counts()
        if now != counts:
            counts, since = now, time.monotonic()
    return counts


def resources(before: Optional[dict] = None) -> dict[str, Any]:
    """What this process holds now: open fds, Python and OS threads (once they have settled;
    given the resources ``before``, once they are back to those counts, for at most 10
    s), /dev/shm files mapped or open, private resident memory in KiB (after a garbage
    collection and a trim of the heap)."""
    gc.collect()
    _trim_heap()
    fds, threads, os_threads = (_settled_counts() if before is None else _counts_back_to(
        (before["fds"], before["threads"], before["os_threads"])))
    fd_targets = _fd_targets()
    return {"fds": fds, "threads": threads, "os_threads": os_threads,
            "fd_targets": fd_targets,
            "shm_files": _shm_files(fd_targets),
            "rss_kib": _rss_kib()}


def leaks(before: dict[str, Any], after: dict[str, Any], rss_slack_kib: int) -> list[str]:
    """What grew from ``before`` to ``after`` beyond the bounds (empty: nothing): the
    exact counts (:func:`count_leaks`), then memory (:func:`memory_leak`)."""
    return count_leaks(before, after) + memory_leak(before, after, rss_slack_kib)


def count_leaks(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The fds, threads and /dev/shm files that differ from ``before`` to ``after``."""
    problems = [f"{key}: {before[key]} -> {after[key]}"
                for key in ("fds", "threads", "os_threads", "shm_files")
                if before[key] != after[key]]
    if before["fds"] != after["fds"]:
        gone = sorted(set(before["fd_targets"]) - set(after["fd_targets"]))
        new = sorted(set(after["fd_targets"]) - set(before["fd_targets"]))
        problems.append(f"fds closed: {gone}, opened: {new}")
    return problems


def memory_leak(before: dict[str, Any], after: dict[str, Any], slack_kib: int) -> list[str]:
    """Private memory grown by more than ``slack_kib`` (a list of one, or empty)."""
    grown = after["rss_kib"] - before["rss_kib"]
    if grown <= slack_kib:
        return []
    return [f"rss grew by {grown} KiB (> {slack_kib} KiB): "
            f"{before['rss_kib']} -> {after['rss_kib']} KiB"]


def fresh_world(world: Any, backend: str, job_id: str, port: int) -> Any:
    """A new world group of ``backend`` over the ranks of ``world`` (call on every rank):
    the launcher's path, ``init_process_group``, with meeting point ``port`` and a new
    job id."""
    with _environment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "COLLECTIVES_JOB_ID": job_id}):
        # rank and size from the launcher's variables (as a launched rank does), so the
        # backend sees the launcher it would see in a real job (zmq trusts a one-host
        # spawn job through a key file, for instance)
        return collectives.init_process_group(backend, timeout=world.timeout)


def _agreed_port(world: Any) -> int:
    return world.broadcast_object(free_port() if world.rank == 0 else None)


def _use(group: Any) -> None:
    """A few collectives with checked results, one of them asynchronous."""
    n, r = group.size, group.rank
    a = np.full(1024, r + 1.0, np.float32)
    group.all_reduce(a)
    assert (a == n * (n + 1) / 2).all(), a[:4]
    out = np.empty(n * 16, np.int64)
    work = group.all_gather(out, np.full(16, r, np.int64), async_op=True)
    work.wait()
    assert (out == np.repeat(np.arange(n), 16)).all(), out
    b = np.full(8, r, np.int32)
    group.broadcast(b, src=n - 1)
    assert (b == n - 1).all(), b
    group.barrier()


def cycle_on_rank(world: Any, backend: str, stem: str, warmup: int, cycles: int,
                  how: str = "same port") -> dict[str, Any]:
    """Run ``warmup`` then ``cycles`` create-use-close cycles of groups on this rank of
    ``world``; return the resources before and after the measured cycles, the seconds
    they took, and the /dev/shm segments of their jobs still present.

    ``how``: ``"same port"``, new world groups of ``backend`` that all meet at one port,
    as successive jobs under one launcher do (for the torch backends, a rank connects
    for the next world while rank 0 stops the last world's server); ``"fresh port"``,
    each at a port of its own; ``"subgroup"``, ``world.new_group`` over all ranks but
    the last (all ranks in a world of one)."""
    port = _agreed_port(world)
    members = list(range(max(1, world.size - 1)))

    def one(i: int) -> None:
        if how == "subgroup":
            if world.rank in members:
                group = world.new_group(members)
            else:
                return
        else:
            group = fresh_world(world, backend, f"{stem}-{i}",
                                _agreed_port(world) if how == "fresh port" else port)
        try:
            _use(group)
        finally:
            group.close()

    for i in range(warmup):
        one(i)
    before = resources()
    start = time.perf_counter()
    for i in range(warmup, warmup + cycles):
        one(i)
    seconds = time.perf_counter() - start
    after = resources(before)
    return {"before": before, "after": after, "seconds": seconds,
            "segments": job_segments(stem, warmup + cycles)}


def job_segments(stem: str, count: int) -> list[str]:
    """Segments in /dev/shm of the jobs ``stem-0`` .. ``stem-(count-1)``."""
    digests = {job_digest(f"COLLECTIVES_JOB_ID={stem}-{i}") for i in range(count)}
    digests |= {job_digest(f"{stem}-{i}") for i in range(count)}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(PREFIX)
                  and n[len(PREFIX):].split("-", 1)[0] in digests)


# ------------------------------------------------------------------------------- tests
def _backends(names: tuple[str, ...]) -> list[Any]:
    """The conformance suite's parameters for ``names`` (with its skips, for a backend
    that cannot run here)."""
    from conftest import backend_params
    return [p for p in backend_params() if p.values[0] in names]


def _batch(pool: WorldPool, how: str, warmup: int, cycles: int) -> tuple[list, list, list]:
    """One batch of cycles on every rank: the results, and what grew, split into
    resident memory (``rss``) and the rest (exact counts and segments)."""
    stem = f"hygiene-{secrets.token_hex(4)}"
    results = pool.call(cycle_on_rank, pool.backend, stem, warmup, cycles, how,
                        timeout=pool.timeout + 30.0 + cycles * 2.0)
    exact = [f"rank {rank}: {p}" for rank, res in enumerate(results)
             for p in count_leaks(res["before"], res["after"])]
    exact += [f"rank {rank}: segments left: {res['segments']}"
              for rank, res in enumerate(results) if res["segments"]]
    left = job_segments(stem, warmup + cycles)  # the parent's view
    if left:
        exact.append(f"segments left in {SHM_DIR}: {left}")
    rss = [f"rank {rank}: {p}" for rank, res in enumerate(results)
           for p in memory_leak(res["before"], res["after"], RSS_SLACK_KIB)]
    return results, rss, exact


def _check(pool: WorldPool, how: str, cycles: int = CYCLES) -> None:
    results, rss, problems = _batch(pool, how, WARMUP, cycles)
    if rss and not problems:
        # Memory grew and nothing else did: a leak grows again in a second batch, a
        # one-time cost (a new allocator arena, a cache filled once) does not.
        first = rss
        results, rss, problems = _batch(pool, how, 0, cycles)
        rss += [f"(the batch before: {p})" for p in first] if rss else []
    problems += rss
    assert not problems, (f"{pool.backend} ({how}): {cycles} cycles leaked:\n  "
                          + "\n  ".join(problems) + f"\n  {results}")
    seconds = max(res["seconds"] for res in results)
    print(f"{pool.backend} {how}: {cycles} cycles in {seconds:.2f} s, rss delta "
          f"{[r['after']['rss_kib'] - r['before']['rss_kib'] for r in results]} KiB")


@pytest.mark.parametrize("world_size", [WORLD_SIZE], ids=[f"n{WORLD_SIZE}"])
@pytest.mark.parametrize("backend", _backends(BACKENDS))
def test_create_use_close_cycles_leak_nothing(pool: WorldPool) -> None:
    """``init_process_group`` + collectives + ``close`` of a world group, ``CYCLES``
    times: each at a port of its own (cheapest for zmq, whose rebinding of one port costs
    ~0.2 s), except gloo's, which all meet at one port (the path where a rank connects
    for the next world while rank 0 stops the last one's server: see `_Meeting` in
    backends/torchdist/meeting.py; fresh ports: test_gloo_store_of_a_closed_world_is_released)."""
    _check(pool, "same port" if pool.backend == "gloo" else "fresh port")


@pytest.mark.parametrize("world_size", [3], ids=["n3"])
@pytest.mark.parametrize("backend", _backends(BACKENDS + ("p2p:shm",)))
def test_subgroup_create_use_close_cycles_leak_nothing(pool: WorldPool) -> None:
    """``new_group`` + collectives + ``close`` of a sub-group, ``CYCLES`` times (three
    ranks: the last one is left out, so members and a non-member interleave)."""
    _check(pool, "subgroup")


@pytest.mark.parametrize("world_size", [WORLD_SIZE], ids=[f"n{WORLD_SIZE}"])
@pytest.mark.parametrize("backend", _backends(("gloo",)))
def test_gloo_store_of_a_closed_world_is_released(pool: WorldPool) -> None:
    """Worlds of gloo at a new port each: every world's store (rank 0's server with its
    thread and ~10 fds, a client's socket) is released when the world closes."""
    _check(pool, "fresh port", cycles=10)
