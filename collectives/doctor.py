"""``collectives doctor [FILES_OR_DIRS...] [--json]`` (or ``python -m collectives.doctor``):
line up the ranks' flight records (written by :mod:`collectives.flight` when a collective
fails, and on SIGTERM and SIGUSR1) and print the first point where the ranks diverge.

With no argument it reads the latest job in the flight folder
(``COLLECTIVES_FLIGHT_DIR``, default ``<tmp>/collectives-flight``); given that folder, the
same; given a job's folder or files, those. ``--json`` prints the same analysis as JSON:
``{"paths": [...], "groups": [{"job", "group", "backend", "size", "ranks", "absent",
"reasons", "errors", "agreed", "agreed_count", "divergence": null or {"seq", "why",
"ranks": {rank: {"seq", "call", "state", "outcome"}}}}]}``.

Every rank numbers its collectives on a group identically, so the records can be
compared by sequence number. The first sequence number at which the ranks' records
differ is where the job went wrong:

- some ranks never reached it (they were stuck earlier, busy elsewhere, or dead);
- the ranks called different collectives there, or the same one with different
  shapes, dtypes, roots or reduce ops;
- every rank made the same call but some failed or never finished it.

Example, after a two-rank job timed out::

    $ collectives doctor /tmp/collectives-flight/8f3c01d2e9a4
    job 8f3c01d2e9a4
    group world (shm, 2 ranks): records from ranks 0, 1
      7 collectives agree on every recorded rank before seq 7 (all_reduce x6, barrier x1)
      FIRST DIVERGENCE at seq 7: the ranks made different calls
        rank 0: all_reduce(shape=(4,), dtype=float32, op=SUM)  still running, started 12:01:03.512
        rank 1: barrier()                                       still running, started 12:01:03.514

Exit status: 0 when the records were read (whether or not they diverge), 2 when no
record could be read.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import sys
from typing import Iterable, Optional, Sequence

from . import settings
from .flight import FORMAT, flight_dir, job_folders


def load(paths: Iterable[str]) -> list[dict]:
    """Read flight-record files; a directory stands for the ``*.json`` files in it."""
    documents = []
    for path in paths:
        files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) \
            else [path]
        for name in files:
            with open(name) as f:
                document = json.load(f)
            if not isinstance(document, dict) or document.get("format") != FORMAT:
                raise ValueError(f"{name}: not a collectives flight record (format "
                                 f"{FORMAT})")
            document["path"] = name
            documents.append(document)
    return documents


def signature(record: dict) -> str:
    """The call a record describes, as the ranks must agree on it."""
    parts = []
    if record.get("shape") is not None:
        parts.append(f"shape={tuple(record['shape'])}")
    if record.get("dtype"):
        parts.append(f"dtype={record['dtype']}")
    if record.get("root", -1) >= 0:
        parts.append(f"root={record['root']}")
    if record.get("reduce_op"):
        parts.append(f"op={record['reduce_op']}")
    return f"{record['op']}({', '.join(parts)})"


def _clock(t: Optional[float]) -> str:
    if t is None:
        return "?"
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _outcome(record: dict, written: Optional[float]) -> str:
    state = record.get("state", "?")
    if state == "ok":
        return f"finished in {1e3 * (record['end'] - record['start']):.3f} ms"
    if state == "running":
        how_long = "" if written is None else \
            f" for {written - record['start']:.1f} s when the record was written"
        return f"still running{how_long}, started {_clock(record['start'])}"
    return f"failed after {record['end'] - record['start']:.3f} s ({state.split(':')[0]})"


def analyse_group(documents: Sequence[dict]) -> dict:
    """What the records of one group (one document per rank) say, as data: the ranks
    recorded and absent, the collectives every rank agrees on, and the first divergence
    (None when there is none) with each rank's call there and its outcome."""
    first = documents[0]
    size = int(first["size"])
    by_rank = {int(d["rank"]): d for d in documents}
    result: dict = {
        "job": first.get("job"), "group": first["group"], "backend": first["backend"],
        "size": size, "ranks": sorted(by_rank),
        "absent": sorted(set(range(size)) - set(by_rank)),
        "reasons": {str(r): d.get("reason") for r, d in sorted(by_rank.items())},
        "errors": {str(r): d["error"].splitlines()[0] for r, d in sorted(by_rank.items())
                   if d.get("error")},
        "agreed": {}, "agreed_count": 0, "divergence": None,
    }
    calls = {r: {rec["seq"]: rec for rec in d["records"] if rec["seq"] >= 0}
             for r, d in by_rank.items()}
    # Each rank keeps only its last N calls: compare from where every record begins.
    start = max((min(c) for c in calls.values() if c), default=0)
    seqs = sorted({s for c in calls.values() for s in c if s >= start})
    agreed: list[str] = []
    for seq in seqs:
        present = {r: c[seq] for r, c in calls.items() if seq in c}
        missing = sorted(set(calls) - set(present))
        sigs = {r: signature(rec) for r, rec in present.items()}
        unfinished = {r: rec for r, rec in present.items() if rec["state"] != "ok"}
        if not missing and len(set(sigs.values())) == 1 and not unfinished:
            agreed.append(present[min(present)]["op"])
            continue
        result["divergence"] = _divergence(seq, present, missing, sigs, calls, by_rank)
        break
    result["agreed"] = dict(collections.Counter(agreed).most_common())
    result["agreed_count"] = len(agreed)
    return result


def _divergence(seq: int, present: dict, missing: list[int], sigs: dict,
                calls: dict, by_rank: dict) -> dict:
    if len(set(sigs.values())) > 1:
        why = "the ranks made different calls"
    elif missing:
        why = f"ranks {missing} never made this call"
    elif len(present) < int(next(iter(by_rank.values()))["size"]):
        why = ("the recorded ranks made the same call and did not finish it; the ranks "
               "without a record are the suspects (stuck elsewhere or dead)")
    else:
        why = "every rank made the same call, but it did not finish everywhere"
    ranks: dict[str, dict] = {}
    for r in sorted(by_rank):
        written = by_rank[r].get("written")
        if r in present:
            ranks[str(r)] = {"seq": seq, "call": sigs[r], "state": present[r]["state"],
                             "outcome": _outcome(present[r], written)}
        else:
            earlier = [s for s in calls[r] if s < seq]
            last = calls[r][max(earlier)] if earlier else None
            ranks[str(r)] = {"seq": None if last is None else last["seq"],
                             "call": None if last is None else signature(last),
                             "state": None if last is None else last["state"],
                             "outcome": None if last is None else _outcome(last, written)}
    return {"seq": seq, "why": why, "ranks": ranks}


def render_group(result: dict) -> list[str]:
    """The text report of :func:`analyse_group`'s result."""
    lines = [f"group {result['group']} ({result['backend']}, {result['size']} ranks): "
             f"records from ranks {', '.join(map(str, result['ranks']))}"]
    if result["absent"]:
        lines.append(f"  no record from ranks {result['absent']} (a rank writes its record "
                     f"when one of its collectives fails, or on SIGTERM or SIGUSR1; a "
                     f"SIGKILLed rank writes none)")
    signalled = {r: why for r, why in result["reasons"].items()
                 if why is not None and why.startswith("SIG")}
    if signalled:
        lines.append("  written on a signal: " + ", ".join(
            f"rank {r} ({why})" for r, why in signalled.items()))
    divergence = result["divergence"]
    if result["agreed_count"]:
        ops = ", ".join(f"{op} x{n}" for op, n in result["agreed"].items())
        where = "" if divergence is None else f" before seq {divergence['seq']}"
        lines.append(f"  {result['agreed_count']} collectives agree on every recorded "
                     f"rank{where} ({ops})")
    if divergence is None:
        lines.append("  no divergence: every recorded collective matches and finished on "
                     "every rank that wrote a record")
        return lines
    seq = divergence["seq"]
    lines.append(f"  FIRST DIVERGENCE at seq {seq}: {divergence['why']}")
    at_seq = {r: d for r, d in divergence["ranks"].items() if d["seq"] == seq}
    width = max((len(d["call"]) for d in at_seq.values()), default=0)
    for r, d in divergence["ranks"].items():
        if r in at_seq:
            lines.append(f"    rank {r}: {d['call']:<{width}}  {d['outcome']}")
        elif d["call"] is not None:
            lines.append(f"    rank {r}: (no call at seq {seq}) its last was seq {d['seq']} "
                         f"{d['call']}, {d['outcome']}")
        else:
            lines.append(f"    rank {r}: (no call at seq {seq}) and none recorded before")
    for r, error in result["errors"].items():
        lines.append(f"    rank {r} raised: {error}")
    return lines


def diagnose_group(documents: Sequence[dict]) -> list[str]:
    """The report for the records of one group (one document per rank)."""
    return render_group(analyse_group(documents))


def analyse(documents: Sequence[dict]) -> list[dict]:
    """:func:`analyse_group` for each (job, group), the latest record of each rank."""
    groups: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for d in documents:
        groups[(d.get("job", "?"), d["group"])].append(d)
    results = []
    for (job, _), docs in sorted(groups.items()):
        latest: dict = {}
        for d in docs:  # several files for one rank: keep the latest
            if d["rank"] not in latest or d["written"] > latest[d["rank"]]["written"]:
                latest[d["rank"]] = d
        results.append(dict(analyse_group(list(latest.values())), job=job))
    return results


def diagnose(documents: Sequence[dict]) -> str:
    """The whole report: one section per (job, group)."""
    return "\n\n".join(f"job {r['job']}\n" + "\n".join(render_group(r))
                        for r in analyse(documents))


def resolve(paths: Sequence[str]) -> list[str]:
    """The record files and folders to read: ``paths`` as given, except that a folder
    holding job folders (the flight folder) stands for its latest job; no path at all
    stands for the latest job of :func:`collectives.flight.flight_dir`."""
    if not paths:
        paths = [flight_dir()]
    out = []
    for path in paths:
        if os.path.isdir(path) and not glob.glob(os.path.join(path, "*.json")):
            jobs = job_folders(path)
            if jobs:
                out.append(jobs[-1])
                continue
        out.append(path)
    return out


def main(argv: Optional[Sequence[str]] = None, *,
         prog: str = "python -m collectives.doctor") -> int:
    """The command line; returns the exit status (see the module docstring). ``prog``
    names the command in its help (``collectives doctor`` from :mod:`collectives.cli`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Show where the ranks of a failed job diverged, from their flight "
                    f"records ({settings.FLIGHT_DIR.name}, default <tmp>/collectives-flight).")
    parser.add_argument("paths", nargs="*", metavar="FILE_OR_DIR",
                        help="flight-record files, a job's folder of them, or the flight "
                             "folder (its latest job); default: the latest job in "
                             f"{flight_dir()}")
    parser.add_argument("--json", action="store_true",
                        help="print the analysis as JSON (one object per job and group)")
    args = parser.parse_args(argv)
    paths = resolve(args.paths)
    try:
        documents = load(paths)
    except (OSError, ValueError) as exc:
        print(f"collectives.doctor: {exc}", file=sys.stderr)
        return 2
    if not documents:
        print(f"collectives.doctor: no flight records in {' '.join(paths)}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"paths": paths, "groups": analyse(documents)}, indent=1))
    else:
        print(diagnose(documents))
    return 0


if __name__ == "__main__":
    sys.exit(main())
