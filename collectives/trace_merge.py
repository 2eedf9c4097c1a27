"""``collectives trace merge DIR [-o FILE]``: the ranks' streamed trace files
(``DIR/rank<r>.jsonl``, written by :mod:`collectives.trace`) as one Chrome/Perfetto JSON
trace, one row (a process named ``rank r``) per rank.

Clocks: each file's events carry its rank's wall clock. Ranks on one host share that
clock and are left as they are. A rank on another host is shifted by the difference
between rank 0's first ``clock sync`` mark and the first such mark of the first rank on
its own host: the marks are taken right after one barrier on every rank, so they happened
at nearly the same moment (within the barrier's release, microseconds to a millisecond),
whatever the hosts' clocks say. A host without a mark keeps its wall clock (NTP's
accuracy). The offsets applied are in ``otherData.clock_offsets_us``.

A file cut short (a rank killed mid-line) loses only its last line; a collective that
began and never ended (the rank hung or died in it) ends at the rank's last event, with
``args.unfinished`` true.

    collectives trace merge traces/ -o job.json    # then open job.json in ui.perfetto.dev

Exit status 0 when written, 2 when ``DIR`` holds no trace file.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Optional, Sequence

from . import settings

__all__ = ["read_rank_file", "merge", "write_merged", "main"]

#: The format of the per-rank files (written by collectives.trace).
FORMAT = 1

_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")
SYNC = "clock sync"


def read_rank_file(path: str) -> tuple[dict, list[dict]]:
    """The header and the events of one rank's file; an unreadable last line (the rank
    was killed while writing it) is dropped."""
    with open(path) as f:
        lines = f.read().split("\n")
    header: Optional[dict] = None
    events = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            if number >= len(lines) - 2:   # the last line, cut short
                break
            raise ValueError(f"{path}:{number + 1}: not a JSON line") from None
        if header is None:
            if not isinstance(item, dict) or item.get("collectives_trace") != FORMAT:
                raise ValueError(f"{path}: not a collectives trace (format {FORMAT})")
            header = item
        else:
            events.append(item)
    if header is None:
        raise ValueError(f"{path}: empty")
    return header, events


def _first_sync(events: list[dict]) -> Optional[float]:
    return next((e["ts"] for e in events if e.get("ph") == "i" and e.get("name") == SYNC),
                None)


def clock_offsets(ranks: dict[int, tuple[dict, list[dict]]]) -> dict[int, float]:
    """Microseconds to add to each rank's timestamps (see the module docstring)."""
    if not ranks:
        return {}
    reference = min(ranks)
    ref_host = ranks[reference][0].get("host")
    ref_sync = _first_sync(ranks[reference][1])
    per_host: dict[str, float] = {}
    for rank in sorted(ranks):
        header, events = ranks[rank]
        host = header.get("host")
        if host == ref_host or host in per_host:
            continue
        mark = _first_sync(events)
        per_host[host] = 0.0 if mark is None or ref_sync is None else ref_sync - mark
    return {rank: 0.0 if h.get("host") == ref_host else per_host.get(h.get("host"), 0.0)
            for rank, (h, _) in ranks.items()}


def _close_unfinished(events: list[dict]) -> list[dict]:
    """An ``e`` event, at the rank's last timestamp, for every ``b`` without one."""
    open_: dict = {}
    last = 0.0
    for e in events:
        last = max(last, e.get("ts", 0.0) + e.get("dur", 0.0))
        key = (e.get("cat"), e.get("id"))
        if e.get("ph") == "b":
            open_[key] = e
        elif e.get("ph") == "e":
            open_.pop(key, None)
    return [{"name": b["name"], "cat": b.get("cat"), "ph": "e", "id": b["id"],
             "pid": b["pid"], "tid": b.get("tid", 0), "ts": last,
             "args": {"unfinished": True}} for b in open_.values()]


def rank_files(directory: str) -> dict[int, str]:
    """The ``rank<r>.jsonl`` files in ``directory`` (none if it is no folder), by rank."""
    if not os.path.isdir(directory):
        return {}
    found = ((_RANK_FILE.fullmatch(name), name) for name in os.listdir(directory))
    return {int(m.group(1)): os.path.join(directory, name) for m, name in found if m}


def merge(directory: str) -> dict:
    """Every ``rank<r>.jsonl`` under ``directory`` as one Chrome trace (a dict to dump as
    JSON). ``ValueError`` when there is none.

    Two ranks traced into ``traces/``: ``merge("traces/")["traceEvents"]`` holds both
    ranks' events, rows named ``rank 0`` and ``rank 1``.
    """
    ranks = {rank: read_rank_file(path) for rank, path in rank_files(directory).items()}
    if not ranks:
        raise ValueError(f"no trace files (rank<r>.jsonl) in {directory}")
    offsets = clock_offsets(ranks)
    out: list[dict] = []
    for rank in sorted(ranks):
        header, events = ranks[rank]
        events = events + _close_unfinished(events)
        shift = offsets[rank]
        for e in events:
            e = dict(e, pid=rank)
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
            out.append(e)
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        out.append({"name": "process_labels", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"labels": f"{header.get('host')} pid {header.get('pid')}"}})
    size = max(int(h.get("size", 0)) for h, _ in ranks.values())
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"ranks": sorted(ranks), "world_size": size,
                          "missing_ranks": sorted(set(range(size)) - set(ranks)),
                          "clock_offsets_us": {str(r): o for r, o in offsets.items()}}}


def write_merged(directory: str, path: str) -> dict:
    """:func:`merge` ``directory`` into the file ``path`` (written whole, then renamed);
    returns the trace."""
    merged = merge(directory)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(merged, f)
    os.replace(tmp, path)
    return merged


def main(argv: Optional[Sequence[str]] = None, *,
         prog: str = "python -m collectives.trace_merge") -> int:
    """The command line (``collectives trace merge DIR [-o FILE]``); returns the exit
    status."""
    import argparse   # (not at the top: collectives.trace, imported by every group, imports
    #                     this module for the merge)
    parser = argparse.ArgumentParser(prog=prog, description="Tools for the traces that "
                                     f"{settings.TRACE.name}=DIR (or collectives.trace) "
                                     "writes.")
    commands = parser.add_subparsers(dest="command", metavar="merge", required=True)
    m = commands.add_parser("merge", help="the ranks' files as one Chrome/Perfetto trace",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("directory", metavar="DIR", help="the folder of rank<r>.jsonl files")
    m.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="the merged trace (default: DIR/trace.json)")
    args = parser.parse_args(argv)
    output = args.output or os.path.join(args.directory, "trace.json")
    try:
        merged = write_merged(args.directory, output)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    other = merged["otherData"]
    missing = f"; no file from ranks {other['missing_ranks']}" if other["missing_ranks"] \
        else ""
    print(f"{output}: {len(merged['traceEvents'])} events from ranks "
          f"{', '.join(map(str, other['ranks']))}{missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
