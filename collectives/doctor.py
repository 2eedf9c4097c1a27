"""``python -m collectives.doctor FILES_OR_DIRS...``: line up the ranks' flight records
(written by :mod:`collectives.flight` when a collective fails) and print the first point
where the ranks diverge.

Every rank numbers its collectives on a group identically, so the records can be
compared by sequence number. The first sequence number at which the ranks' records
differ is where the job went wrong:

- some ranks never reached it (they were stuck earlier, busy elsewhere, or dead);
- the ranks called different collectives there, or the same one with different
  shapes, dtypes, roots or reduce ops;
- every rank made the same call but some failed or never finished it.

Example, after a two-rank job timed out::

    $ python -m collectives.doctor /tmp/collectives-flight/8f3c01d2e9a4
    group world (shm, 2 ranks): records from ranks 0, 1
      seq 0..6 agree (7 collectives: all_reduce x6, barrier x1)
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
from .flight import FORMAT


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


def diagnose_group(documents: Sequence[dict]) -> list[str]:
    """The report for the records of one group (one document per rank)."""
    first = documents[0]
    size = int(first["size"])
    by_rank = {int(d["rank"]): d for d in documents}
    lines = [f"group {first['group']} ({first['backend']}, {size} ranks): records from "
             f"ranks {', '.join(map(str, sorted(by_rank)))}"]
    absent = sorted(set(range(size)) - set(by_rank))
    if absent:
        lines.append(f"  no record from ranks {absent} (a rank writes its record when one "
                     f"of its collectives fails; a killed or still-waiting rank writes none)")
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
        lines.extend(_agreed_summary(agreed, seq))
        lines.extend(_divergence(seq, present, missing, sigs, calls, by_rank))
        return lines
    lines.extend(_agreed_summary(agreed, None))
    lines.append("  no divergence: every recorded collective matches and finished on every "
                 "rank that wrote a record")
    return lines


def _agreed_summary(agreed: list[str], upto: Optional[int]) -> list[str]:
    if not agreed:
        return []
    counts = collections.Counter(agreed)
    ops = ", ".join(f"{op} x{n}" for op, n in counts.most_common())
    where = "" if upto is None else f" before seq {upto}"
    return [f"  {len(agreed)} collectives agree on every recorded rank{where} ({ops})"]


def _divergence(seq: int, present: dict, missing: list[int], sigs: dict,
                calls: dict, by_rank: dict) -> list[str]:
    if len(set(sigs.values())) > 1:
        why = "the ranks made different calls"
    elif missing:
        why = f"ranks {missing} never made this call"
    elif len(present) < int(next(iter(by_rank.values()))["size"]):
        why = ("the recorded ranks made the same call and did not finish it; the ranks "
               "without a record are the suspects (stuck elsewhere or dead)")
    else:
        why = "every rank made the same call, but it did not finish everywhere"
    lines = [f"  FIRST DIVERGENCE at seq {seq}: {why}"]
    width = max(len(s) for s in sigs.values()) if sigs else 0
    for r in sorted(by_rank):
        written = by_rank[r].get("written")
        if r in present:
            lines.append(f"    rank {r}: {sigs[r]:<{width}}  {_outcome(present[r], written)}")
        else:
            earlier = [s for s in calls[r] if s < seq]
            if earlier:
                last = calls[r][max(earlier)]
                lines.append(f"    rank {r}: (no call at seq {seq}) its last was seq "
                             f"{last['seq']} {signature(last)}, {_outcome(last, written)}")
            else:
                lines.append(f"    rank {r}: (no call at seq {seq}) and none recorded before")
    for r in sorted(by_rank):
        if by_rank[r].get("error"):
            lines.append(f"    rank {r} raised: {by_rank[r]['error'].splitlines()[0]}")
    return lines


def diagnose(documents: Sequence[dict]) -> str:
    """The whole report: one section per (job, group)."""
    groups: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for d in documents:
        groups[(d.get("job", "?"), d["group"])].append(d)
    sections = []
    for (job, _), docs in sorted(groups.items()):
        latest = {}
        for d in docs:  # several files for one rank: keep the latest
            if d["rank"] not in latest or d["written"] > latest[d["rank"]]["written"]:
                latest[d["rank"]] = d
        sections.append(f"job {job}\n" + "\n".join(diagnose_group(list(latest.values()))))
    return "\n\n".join(sections)


def main(argv: Optional[Sequence[str]] = None, *,
         prog: str = "python -m collectives.doctor") -> int:
    """The command line; returns the exit status (see the module docstring). ``prog``
    names the command in its help (``collectives doctor`` from :mod:`collectives.cli`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Show where the ranks of a failed job diverged, from their flight "
                    f"records ({settings.FLIGHT_DIR.name}, default <tmp>/collectives-flight).")
    parser.add_argument("paths", nargs="+", metavar="FILE_OR_DIR",
                        help="flight-record files, or directories holding them")
    args = parser.parse_args(argv)
    try:
        documents = load(args.paths)
    except (OSError, ValueError) as exc:
        print(f"collectives.doctor: {exc}", file=sys.stderr)
        return 2
    if not documents:
        print(f"collectives.doctor: no flight records in {' '.join(args.paths)}",
              file=sys.stderr)
        return 2
    print(diagnose(documents))
    return 0


if __name__ == "__main__":
    sys.exit(main())
