"""The launcher of ``examples/elastic.py``: it runs the fault-tolerance coordinator
(:class:`parallel.ft.Coordinator`, on a thread of this process), starts the ranks,
watches them, and, unlike ``collectives.spawn``, lets the others go on when one dies:
it tells the coordinator at once (so the next quorum does not wait for the heartbeat to
expire) and, with ``respawn``, starts a replacement with the same ``RANK``, which heals
from a live replica and joins. It returns what every rank that finished returned, and
counts.

Also unlike ``collectives.spawn``, each rank is a fresh interpreter
(``multiprocessing``'s ``spawn``), executed with its ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... in its
environment: a chaos tool outside the job finds rank k by reading
``/proc/PID/environ``, which for a rank forked from the warm fork server would show the
server's environment (no ``RANK``). The price is an import of torch per rank (about
1.5 s on one core), at the start and in every replacement, which the recovery benchmark
counts. Each rank is also named ``coll-rank<k>`` (``/proc/PID/comm``).

Two ranks::

    outcome = run_elastic(main, args, nproc=2, backend="shm", respawn=True)
    outcome.results       # each finished rank's return value
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import secrets
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from collectives import settings, warm_start
from collectives.spawn import describe_exit, die_with_parent, free_port, name_rank_process
from collectives.shm_names import remove_job_segments
from parallel.ft import Coordinator

__all__ = ["ElasticOutcome", "run_elastic"]


@dataclass
class ElasticOutcome:
    """What a run left: each finished rank's result, the ranks that died (and how),
    the processes started in all, and the coordinator's history."""

    results: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    deaths: list[tuple[int, str, float]] = field(default_factory=list)
    started: int = 0
    history: list[dict] = field(default_factory=list)


def _rank_process(setup: Any, main: Callable[[Any], Any], args: Any,
                  conn: multiprocessing.connection.Connection) -> None:
    # `setup` became the start method when this process unpickled it (environment set).
    die_with_parent()
    name_rank_process(int(os.environ["RANK"]))
    try:
        message: tuple = ("ok", main(args))
    except BaseException:  # noqa: BLE001 - reported by the launcher
        message = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(message))
    conn.close()
    warm_start.run_exit_handlers(setup)


class _Ranks:
    """The running rank processes: start, watch, stop."""

    def __init__(self, main: Callable, args: Any, base_env: dict) -> None:
        self.main, self.args, self.base_env = main, args, base_env
        # Executed, not forked: RANK must be in the environment the kernel shows
        # (/proc/PID/environ), which a fork of the warm server cannot change.
        self.method = "spawn"
        self.ctx = warm_start.context(self.method)
        self.running: dict[int, tuple[Any, Any, int]] = {}   # pid -> (process, conn, rank)

    def start(self, rank: int) -> int:
        reader, writer = self.ctx.Pipe(duplex=False)
        env = dict(self.base_env, RANK=str(rank), LOCAL_RANK=str(rank))
        setup = warm_start.RankSetup(dict(os.environ, **env), self.method)
        p = self.ctx.Process(target=_rank_process, args=(setup, self.main, self.args, writer),
                             name=f"elastic-rank{rank}", daemon=False)
        with warm_start.environment(env):   # what the new interpreter is executed with
            p.start()
        writer.close()
        self.running[p.pid] = (p, reader, rank)
        return p.pid

    def stop(self) -> None:
        for p, conn, _ in self.running.values():
            if p.is_alive():
                p.kill()
            p.join(5.0)
            conn.close()
        self.running.clear()


def _report(history: list, said: int) -> int:
    """Say on stderr each quorum the coordinator formed since event ``said``."""
    for event in history[said:]:
        if event["event"] == "quorum":
            print(f"elastic: quorum {event['quorum_id']}: {event['size']} replicas at step "
                  f"{event['step']}" + (f", {event['healers']} healing"
                                        if event["healers"] else ""),
                  file=sys.stderr, flush=True)
    return len(history)


def run_elastic(main: Callable[[Any], Any], args: Any, *, nproc: int, backend: Optional[str],
                respawn: bool, min_replicas: int = 1, heartbeat_timeout: float = 2.0,
                group_timeout: float = 10.0, limit_s: float = 900.0,
                on_start: Optional[Callable[[int, int], None]] = None,
                coordinator: Optional[Coordinator] = None) -> ElasticOutcome:
    """Run ``main(args)`` on ``nproc`` ranks that survive each other's deaths (see the
    module docstring); ``on_start(rank, pid)`` hears of every process started and
    ``coordinator`` (made here when None; closed here either way) may be watched (the
    benchmark's chaos does both). Every wait is bounded by ``limit_s``."""
    if coordinator is None:
        coordinator = Coordinator(min_replicas=min_replicas, first_quorum=nproc,
                                  heartbeat_timeout=heartbeat_timeout)
    coordinator.start()
    job_id = secrets.token_hex(6)
    base_env = {
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), settings.JOB_ID.name: job_id,
        settings.SPAWNED.name: "1", settings.SECRET.name: secrets.token_hex(32),
        settings.FT_COORDINATOR.name: coordinator.address_text,
        settings.TIMEOUT.name: str(group_timeout), "OMP_NUM_THREADS": "1",
    }
    if backend:
        base_env[settings.BACKEND.name] = backend
    ranks = _Ranks(main, args, base_env)
    outcome = ElasticOutcome()
    start = time.monotonic()
    said = 0   # coordinator events already reported on stderr
    try:
        for rank in range(nproc):
            pid = ranks.start(rank)
            outcome.started += 1
            if on_start is not None:
                on_start(rank, pid)
        while ranks.running and time.monotonic() - start < limit_s:
            waitables = [w for p, c, _ in ranks.running.values() for w in (c, p.sentinel)]
            multiprocessing.connection.wait(waitables, timeout=0.5)
            said = _report(coordinator.history, said)
            for pid, (p, conn, rank) in list(ranks.running.items()):
                reply = None
                if conn.poll():
                    try:
                        reply = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        reply = None
                if reply is None and p.is_alive():
                    continue
                p.join(5.0)
                conn.close()
                del ranks.running[pid]
                coordinator.forget(f"{rank}:{pid}")
                if reply is not None and reply[0] == "ok":
                    outcome.results.append(reply[1])
                    continue
                if reply is not None:
                    outcome.errors.append(f"rank {rank} (pid {pid}): {reply[1]}")
                    continue
                outcome.deaths.append((rank, describe_exit(p.exitcode), time.time()))
                print(f"elastic: rank {rank} (pid {pid}) {outcome.deaths[-1][1]}"
                      f"{'; starting a replacement' if respawn and not outcome.results else ''}",
                      file=sys.stderr, flush=True)
                if respawn and not outcome.results:
                    new_pid = ranks.start(rank)
                    outcome.started += 1
                    if on_start is not None:
                        on_start(rank, new_pid)
        if ranks.running:
            outcome.errors.append(f"{len(ranks.running)} ranks still running after "
                                  f"{limit_s:g} s")
    finally:
        ranks.stop()
        coordinator.close()
        remove_job_segments(job_id)
        outcome.history = list(coordinator.history)
    return outcome
