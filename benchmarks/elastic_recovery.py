"""How fast fault-tolerant training recovers: from a SIGKILL of a random rank at a
random moment to the next committed step (and to the first step committed by a quorum
without the dead rank: see :func:`measure`), and from the start of its replacement to
the replacement's first contribution (its first committed step, after healing), median
and worst over ``--repeat`` chaos runs per transport.

    python benchmarks/elastic_recovery.py                         # shm zmq gloo, 20 runs
    python benchmarks/elastic_recovery.py --backend shm --repeat 5 --json out.json

Each run is ``examples/elastic.py``'s training (``--nproc`` ranks, ``--respawn``,
``--epochs``) started in this process; a chaos thread waits for the first committed
step, then a random 0.2-1.0 s, then SIGKILLs a random rank (any rank: the replicas' ``RANK`` 0
too). Failure detection: the launcher sees its child die and tells the coordinator at
once; the survivors' all_reduce fails as soon as the transport notices the dead peer.
The table says what the detection costs apart (``--heartbeat-timeout`` bounds it where
the launcher cannot see the death, for example a rank on another host).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _args() -> argparse.Namespace:
    from collectives.cli_flags import add_flag, flag_parser, seconds
    p = flag_parser(description=__doc__)
    add_flag(p, "--backend", default="shm,zmq,gloo", several=True)
    add_flag(p, "--repeat", default=20, help="chaos runs per backend")
    add_flag(p, "--nproc", default=3)
    add_flag(p, "--epochs", default=10,
             help="long enough that the replacement joins before the end")
    add_flag(p, "--timeout", default=5.0)
    p.add_argument("--heartbeat-timeout", type=seconds, default=2.0,
                   help="seconds of silence after which the coordinator drops a replica "
                        "(default: %(default)s)")
    add_flag(p, "--seed", default=0, help="which rank dies when")
    add_flag(p, "--json", help="also write every run's times to FILE as JSON")
    return p.parse_args()


def one_run(backend: str, opts: argparse.Namespace, rng: random.Random) -> dict:
    """One chaos run: kill -> next commit, and respawn -> first contribution (seconds)."""
    from examples import elastic
    from examples.common.cli import parse_args
    from examples.common.elastic_launcher import run_elastic
    from parallel.ft import Coordinator

    argv = ["--backend", backend, "--nproc", str(opts.nproc), "--epochs", str(opts.epochs),
            "--respawn", "--timeout", str(opts.timeout)]
    args = parse_args("elastic", argv,
                      epochs=opts.epochs, batch_size=32, lr=0.05,
                      extra=elastic._options)
    coordinator = Coordinator(first_quorum=opts.nproc, heartbeat_timeout=opts.heartbeat_timeout)
    pids: dict[int, int] = {}
    started: dict[int, float] = {}
    kill: dict = {}

    def on_start(rank: int, pid: int) -> None:
        pids[rank] = pid
        started[pid] = time.time()

    def chaos() -> None:
        while not any(h["event"] == "commit" for h in coordinator.history):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.2, 1.0))
        rank = rng.randrange(opts.nproc)
        kill.update(rank=rank, pid=pids[rank], at=time.time())
        os.kill(pids[rank], signal.SIGKILL)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    outcome = run_elastic(elastic.main, args, nproc=opts.nproc, backend=backend, respawn=True,
                          heartbeat_timeout=opts.heartbeat_timeout, group_timeout=opts.timeout,
                          on_start=on_start, coordinator=coordinator, limit_s=300.0)
    thread.join(5.0)
    return measure(backend, outcome, kill, started)


def measure(backend: str, outcome, kill: dict, started: dict[int, float]) -> dict:
    """The times of one run from the coordinator's history. ``kill_to_commit_s``: the
    kill to the next committed step (the first commit after it; it may be a step the
    dead rank had voted for before it died); ``kill_to_reformed_commit_s``: the kill to
    the first step committed by a quorum without the dead rank (detection, the failed
    step, the new quorum, the re-formed group's rendezvous and one step: the recovery
    proper)."""
    at = kill.get("at", float("inf"))
    dead = f"{kill.get('rank')}:{kill.get('pid')}"
    without = {h["quorum_id"] for h in outcome.history
               if h["event"] == "quorum" and dead not in h["members"]}
    commits = [h for h in outcome.history if h["event"] == "commit" and h["time"] > at]
    reformed = [h["time"] for h in commits if h["quorum_id"] in without]
    replacement = [r for r in outcome.results if r["pid"] != kill.get("pid")
                   and started.get(r["pid"], 0) > at]
    contrib = [r["first_contribution"] - started[r["pid"]] for r in replacement
               if r["first_contribution"] is not None]
    return {"backend": backend, "killed_rank": kill.get("rank"),
            "kill_to_commit_s": (commits[0]["time"] - at) if commits else None,
            "kill_to_reformed_commit_s": (reformed[0] - at) if reformed else None,
            "respawn_to_contribution_s": contrib[0] if contrib else None,
            "equal": len({r["digest"] for r in outcome.results if r["finished"]}) == 1,
            "errors": outcome.errors}


def _cell(values: list) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    missing = len(values) - len(vals)
    return f"{statistics.median(vals):.2f} / {max(vals):.2f}" + \
        (f" ({missing} without)" if missing else "")


def table(rows: list[dict], opts: argparse.Namespace) -> str:
    """The Markdown table of ``rows`` (every run's :func:`measure`), per transport."""
    lines = [f"{opts.nproc} ranks, --respawn, {opts.epochs} epochs, heartbeat timeout "
             f"{opts.heartbeat_timeout:g} s, collective timeout {opts.timeout:g} s; "
             f"median / worst in seconds",
             "| transport | runs | kill -> next committed step | kill -> first step committed "
             "without it | respawn -> replacement's first committed step | replicas equal "
             "| errors |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        lines.append(
            f"| {backend} | {len(mine)} | {_cell([r['kill_to_commit_s'] for r in mine])} | "
            f"{_cell([r['kill_to_reformed_commit_s'] for r in mine])} | "
            f"{_cell([r['respawn_to_contribution_s'] for r in mine])} | "
            f"{sum(r['equal'] for r in mine)}/{len(mine)} | "
            f"{sum(bool(r['errors']) for r in mine)} |")
    return "\n".join(lines)


def main() -> None:
    opts = _args()
    rng = random.Random(opts.seed)
    rows = []
    for backend in opts.backend:
        for i in range(opts.repeat):
            row = one_run(backend, opts, rng)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(rows, opts))
    if opts.json:
        from collectives.bench.report import write_json
        write_json(rows, opts.json)


if __name__ == "__main__":
    main()
