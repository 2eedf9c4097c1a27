"""End-to-end start-up time: a job that only joins and leaves, and the README's main job.

    python benchmarks/startup.py                      # 2 and 4 ranks, every launcher, 5 runs
    python benchmarks/startup.py --nproc 2 --repeat 3 --json startup.json

Times, from the command to its exit, the median of ``--repeat`` runs (the launchers
interleaved run by run, so that load hits them alike) of:

- a job whose ranks call ``collectives.init_process_group()`` and ``close()`` and nothing
  else, started by ``collectives.spawn`` with each start method (``forkserver``, the
  default, and ``spawn``: ``COLLECTIVES_START_METHOD``), by ``mpiexec -n N`` and by
  ``torchrun --nproc-per-node N``; each once as a bare program and once as a training
  program would run: it imports torch and its ranks use it (under collectives.spawn it
  first asks the fork server to import torch too, as the examples do:
  ``warm_start.prewarm``);
- ``python examples/ddp.py`` (two ranks, the README's quick start): its end-to-end time
  beside the ``wall_s`` (training) and ``total_s`` its summary reports;
- ``python -c "import numpy"`` and ``python -c "import collectives"``: what the library
  adds to a program's start; and ``python examples/ddp.py --backend foo``, refused.

Every command runs this interpreter (``sys.executable``), not a ``python`` found on
``PATH`` (a version manager's shim there adds its own start-up to every command).
A launcher missing here is reported as such, not timed. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives.cli_flags import (FlagParser, add_flag, comma_choices,  # noqa: E402
                                   flag_parser)

METHODS = ("forkserver", "spawn", "mpiexec", "torchrun")


def _join_and_leave(with_torch: bool = False) -> None:
    import collectives
    if with_torch:   # a training program's rank uses torch
        import torch
        torch.zeros(1)
    pg = collectives.init_process_group()
    pg.close()


def _job_command(method: str, nproc: int, torch: bool) -> list[str] | None:
    """The command line of one join-and-leave job, or None where its launcher is missing."""
    me = [str(Path(__file__).resolve())]
    flags = ["--torch"] if torch else []
    if method in ("forkserver", "spawn"):
        return [sys.executable, *me, "--job-spawn", str(nproc), *flags]
    if method == "mpiexec":
        mpiexec = shutil.which("mpiexec")
        return None if mpiexec is None else [mpiexec, "-n", str(nproc), sys.executable,
                                             *me, "--job-rank", *flags]
    runner = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or \
        shutil.which("torchrun")
    return None if runner is None else [runner, "--nproc-per-node", str(nproc), *me,
                                        "--job-rank", *flags]


def _timed(argv: list[str], env: dict, timeout: float,
           expect: int = 0) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    if done.returncode != expect:
        raise RuntimeError(f"startup: {' '.join(argv)} exited with {done.returncode}:\n"
                           f"{done.stderr[-2000:]}")
    return seconds, done.stdout


def _env(method: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if method in ("forkserver", "spawn"):
        env["COLLECTIVES_START_METHOD"] = method
    env.setdefault("OMP_NUM_THREADS", "1")  # as spawn and torchrun set it for N ranks
    return env


def measure(nprocs: list[int], methods: list[str], repeat: int, ddp: bool,
            timeout: float) -> list[dict]:
    """One row per (what, launcher, ranks): the runs in order and their median."""
    cases = [(f"join+leave{' +torch' if torch else ''}", m, n, _job_command(m, n, torch))
             for torch in (False, True) for n in nprocs for m in methods]
    rows = {(what, m, n): {"job": what, "launcher": m, "nproc": n, "runs_s": []}
            for what, m, n, argv in cases}
    for what, m, n, argv in cases:
        if argv is None:
            rows[(what, m, n)]["missing"] = f"{m} not found"
    imports = [(f"import {m}", [sys.executable, "-c", f"import {m}"]) for m in
               ("numpy", "collectives")]
    refused = [sys.executable, "examples/ddp.py", "--backend", "foo"]   # exits 2
    for what, argv in imports + [("examples/ddp.py --backend foo", refused)]:
        rows[(what, "-", 1)] = {"job": what, "launcher": "-", "nproc": 1, "runs_s": []}
    if ddp:
        rows[("examples/ddp.py", "forkserver", 2)] = {
            "job": "examples/ddp.py", "launcher": "forkserver", "nproc": 2, "runs_s": [],
            "wall_s": [], "total_s": []}
    for i in range(repeat):
        for what, argv in imports:
            rows[(what, "-", 1)]["runs_s"].append(round(_timed(argv, _env("-"), timeout)[0], 3))
        rows[("examples/ddp.py --backend foo", "-", 1)]["runs_s"].append(
            round(_timed(refused, _env("-"), timeout, expect=2)[0], 3))
        for what, m, n, argv in cases:
            if argv is not None:
                rows[(what, m, n)]["runs_s"].append(round(_timed(argv, _env(m), timeout)[0], 3))
        if ddp:
            seconds, out = _timed([sys.executable, "examples/ddp.py"], _env("forkserver"),
                                  timeout)
            summary = json.loads(out.strip().splitlines()[-1])
            row = rows[("examples/ddp.py", "forkserver", 2)]
            row["runs_s"].append(round(seconds, 3))
            row["wall_s"].append(summary["wall_s"])
            row["total_s"].append(summary.get("total_s"))
        print(f"# run {i + 1}/{repeat} done", file=sys.stderr, flush=True)
    out = []
    for row in rows.values():
        if row["runs_s"]:
            row["median_s"] = round(statistics.median(row["runs_s"]), 3)
        if row.get("wall_s"):
            row["median_wall_s"] = statistics.median(row["wall_s"])
            row["median_beyond_wall_s"] = round(statistics.median(
                t - w for t, w in zip(row["runs_s"], row["wall_s"])), 3)
        out.append(row)
    return out


def _table(rows: list[dict]) -> str:
    lines = ["| job | launcher | ranks | median s | runs s |", "|---|---|---|---|---|"]
    for r in rows:
        runs = r.get("missing") or ", ".join(f"{s:.2f}" for s in r["runs_s"])
        extra = ""
        if r.get("wall_s"):
            extra = (f" (wall_s median {r['median_wall_s']:.2f}; end to end minus wall_s "
                     f"{r['median_beyond_wall_s']:.2f})")
        median = f"{r['median_s']:.2f}" if "median_s" in r else "-"
        lines.append(f"| {r['job']} | {r['launcher']} | {r['nproc']} | {median}{extra} | "
                     f"{runs} |")
    return "\n".join(lines)


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__, defaults_in_help=True)
    add_flag(p, "--nproc", default="2,4", several=True, help="comma list of ranks per job")
    p.add_argument("--launchers", type=comma_choices(*METHODS), default=",".join(METHODS),
                   metavar="LIST", help=f"comma list of {', '.join(METHODS)}")
    add_flag(p, "--repeat", default=5, help="runs of each job")
    p.add_argument("--no-ddp", action="store_true", help="leave out examples/ddp.py")
    add_flag(p, "--job-timeout", default=600.0, help="seconds one command may take")
    add_flag(p, "--json")
    # the jobs themselves (this script runs itself)
    p.add_argument("--job-spawn", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    if a.job_spawn is not None:
        import collectives
        if a.torch:
            try:   # as the examples do: the fork server imports torch beside this process
                from collectives.warm_start import prewarm
                prewarm(["torch", "parallel"])
            except ImportError:   # a checkout from before the fork server
                pass
            import torch  # noqa: F401 - the program imports torch, as training scripts do
        collectives.spawn(_join_and_leave, a.job_spawn, args=(a.torch,))
        return 0
    if a.job_rank:
        _join_and_leave(a.torch)
        return 0
    rows = measure(a.nproc, a.launchers, a.repeat, not a.no_ddp, a.job_timeout)
    print(_table(rows))
    if a.json:
        from collectives.bench.report import write_json   # (not in the timed jobs)
        write_json(rows, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
