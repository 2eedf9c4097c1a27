"""Step time of the tensor-parallel MNIST MLP (examples/tp.py) at 1, 2 and 4 ranks, on
shm and mpi side by side, and how much of a step is communication.

    python benchmarks/tp_step.py                         # shm and mpi, 1, 2 and 4 ranks
    python benchmarks/tp_step.py --nproc 2,4 --backend shm --epochs 2 --json tp.json

Each (backend, ranks) pair is one run of ``examples/tp.py --trace FILE`` (mpi: under
``mpiexec -n N``), one after another in this one invocation. From the trace, per rank and
per training step: the step time, from the start of its ``forward`` span to the end of its
``step`` span (the optimizer), and the communication, the summed durations of the
collectives issued inside that window (call to result). A row reports the median over the
steps, averaged over the ranks. With one rank the layers send nothing (a group of one is
the identity), so its communication is 0 by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _command(backend: str, n: int, args: argparse.Namespace, trace: str) -> list:
    example = [str(ROOT / "examples" / "tp.py"), "--epochs", str(args.epochs),
               "--batch-size", str(args.batch_size), "--trace", trace]
    if backend == "mpi":
        mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
        if mpiexec is None:
            raise SystemExit("tp_step.py: no mpiexec on PATH (pip install mpich)")
        return [mpiexec, "-n", str(n), sys.executable, *example]
    return [sys.executable, *example, "--backend", backend, "--nproc", str(n)]


def _per_rank(events: list) -> dict:
    """rank -> (median step ms, median communication ms per step, steps)."""
    out = {}
    for rank in sorted({e["pid"] for e in events if e.get("ph") == "X"}):
        spans = sorted((e for e in events if e["pid"] == rank and e.get("ph") == "X"
                        and e["name"] in ("forward", "step")), key=lambda e: e["ts"])
        begins = {e["id"]: e["ts"] for e in events
                  if e["pid"] == rank and e.get("cat") == "comm" and e["ph"] == "b"}
        comm = sorted((begins[e["id"]], e["ts"] - begins[e["id"]]) for e in events
                      if e["pid"] == rank and e.get("cat") == "comm" and e["ph"] == "e")
        steps, comms = [], []
        forward = None
        for e in spans:
            if e["name"] == "forward":
                forward = e["ts"]
            elif forward is not None:
                end = e["ts"] + e["dur"]
                steps.append((end - forward) / 1e3)
                comms.append(sum(d for ts, d in comm if forward <= ts < end) / 1e3)
                forward = None
        out[rank] = (statistics.median(steps), statistics.median(comms), len(steps))
    return out


def measure(backend: str, n: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "COLLECTIVES_BACKEND"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        proc = subprocess.run(_command(backend, n, args, trace), cwd=ROOT, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"tp_step.py: {backend} x {n} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        with open(trace) as f:
            ranks = _per_rank(json.load(f)["traceEvents"])
    step = statistics.mean(r[0] for r in ranks.values())
    comm = statistics.mean(r[1] for r in ranks.values())
    return {"backend": summary["backend"], "world_size": n, "step_ms": round(step, 3),
            "comm_ms": round(comm, 3), "comm_share": round(comm / step, 3) if step else None,
            "steps": min(r[2] for r in ranks.values()), "final_acc": summary["final_acc"],
            "samples_per_s": summary["samples_per_s"]}


def main(argv=None) -> None:
    p = flag_parser(description=__doc__)
    add_flag(p, "--nproc", default="1,2,4", several=True)
    add_flag(p, "--backend", default="shm,mpi", several=True)
    add_flag(p, "--epochs", default=1)
    add_flag(p, "--batch-size", default=32,
             help="samples per step (examples/tp.py: every rank sees the same batch)")
    add_flag(p, "--json")
    args = p.parse_args(argv)
    sizes = args.nproc
    rows = [measure(b, n, args) for n in sizes for b in args.backend]

    print(f"TP MLP step (examples/tp.py, batch {args.batch_size}, {args.epochs} epoch(s)), "
          f"median over steps; comm = collectives inside the step")
    print(f"{'ranks':>5} " + " ".join(f"{b + ' step ms':>12} {b + ' comm ms':>12} {'comm %':>7}"
                                      for b in args.backend))
    for n in sizes:
        cells = []
        for row in (r for r in rows if r["world_size"] == n):
            cells.append(f"{row['step_ms']:>12.3f} {row['comm_ms']:>12.3f} "
                         f"{100 * (row['comm_share'] or 0):>6.1f}%")
        print(f"{n:>5} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
