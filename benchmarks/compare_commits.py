"""One benchmark, two checkouts of this repository, side by side in one session.

    git worktree add ../old <commit> && (cd ../old && python setup.py build_ext --inplace)
    python benchmarks/compare_commits.py --old ../old --repeat 5 --key op,tensor,path \\
        --metric us_per_call -- python benchmarks/base_overhead.py --json {json}

Runs the command after ``--`` in each checkout in turn (old, new, then new, old, ...: the
order alternates so that neither side always runs first), each run with the checkout as
its working directory and first on ``PYTHONPATH``, and ``{json}`` replaced by a fresh file
the benchmark writes its rows to (a JSON list of objects, or an object with ``rows``).
Rows are matched across runs by the ``--key`` fields; for each, the table shows the
median of each ``--metric`` on each side, new/old, and every run's value in run order, so a
row that is bimodal shows both of its modes instead of one misleading median.

It measures; it does not judge: the ratio is printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.cli_flags import add_flag, flag_parser  # noqa: E402


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data


def _run(tree: str, command: list[str], timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        argv = [out if a == "{json}" else a.replace("{json}", out) for a in command]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
        done = subprocess.run(argv, cwd=tree, env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            sys.exit(f"compare_commits: {' '.join(argv)} in {tree} exited with "
                     f"{done.returncode}:\n{done.stdout[-3000:]}")
        return _rows(out)


def _key(row: dict, fields: list[str]) -> tuple:
    return tuple(row.get(f) for f in fields)


def compare(old: str, new: str, command: list[str], runs: int, key: list[str],
            metrics: list[str], timeout: float) -> list[dict[str, Any]]:
    """``runs`` alternating runs of ``command`` in ``old`` and ``new``: one summary per
    row key and metric (both sides' values in run order, their medians, new/old)."""
    values: dict[tuple, dict[str, list]] = {}
    for i in range(runs):
        order = (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old))
        for side, tree in order:
            start = time.monotonic()
            for row in _run(tree, command, timeout):
                for metric in metrics:
                    if row.get(metric) is not None:
                        values.setdefault(_key(row, key) + (metric,),
                                          {"old": [], "new": []})[side].append(row[metric])
            print(f"# run {i + 1}/{runs} {side}: {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
    summary = []
    for k, sides in values.items():
        o = statistics.median(sides["old"]) if sides["old"] else float("nan")
        n = statistics.median(sides["new"]) if sides["new"] else float("nan")
        summary.append({"key": dict(zip(key + ["metric"], k)), "old_median": o,
                        "new_median": n,
                        "new_over_old": n / o if o else float("nan"),
                        "old": sides["old"], "new": sides["new"]})
    return summary


def _format(summary: list[dict]) -> str:
    def num(x: float) -> str:
        return f"{x:.4g}"

    lines = [f"| {' | '.join(summary[0]['key']) if summary else 'row'} | old median | "
             f"new median | new/old | old runs | new runs |",
             "|" + "---|" * (len(summary[0]["key"]) + 5 if summary else 6)]
    for s in summary:
        lines.append("| " + " | ".join(str(v) for v in s["key"].values()) +
                     f" | {num(s['old_median'])} | {num(s['new_median'])} | "
                     f"{s['new_over_old']:.3f} | {', '.join(map(num, s['old']))} | "
                     f"{', '.join(map(num, s['new']))} |")
    return "medians over alternating runs:\n" + "\n".join(lines)


def main() -> None:
    parser = flag_parser(description=__doc__, defaults_in_help=True)
    parser.add_argument("--old", required=True, help="checkout of the old commit")
    parser.add_argument("--new", default=".", help="checkout of the new commit")
    add_flag(parser, "--repeat", default=5, help="runs of each side")
    parser.add_argument("--key", required=True, help="comma list of the fields naming a row")
    parser.add_argument("--metric", required=True,
                        help="the field compared (a comma list: each in turn)")
    add_flag(parser, "--job-timeout", default=1800.0, help="seconds one run may take")
    add_flag(parser, "--json", help="also write the summary to FILE as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the benchmark, with {json} where it writes its rows")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not any("{json}" in a for a in command):
        parser.error("give the benchmark after --, with {json} where its rows go")
    summary = compare(os.path.abspath(args.old), os.path.abspath(args.new), command,
                      args.repeat, args.key.split(","), args.metric.split(","),
                      args.job_timeout)
    print(_format(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
