"""The rows as nccl-tests prints them, with the ratio columns, and as JSON.

One table per op; one line per size; one block of columns per implementation (ours
first, then the peers): ``time`` (us, median of the slowest rank), ``algbw`` and
``busbw`` (GB/s), ``#wrong``, and with ``--memcpy`` ``%cp``, busbw as a percentage of a
single-process memory copy of the same size (timed in turn with ours). Then ``memcpy``
(GB/s: bytes / median time of that copy) and, per peer,
``t:P`` = ours' time / the peer's (below 1: ours is faster) and ``bw:P`` = ours' busbw /
the peer's.
"""

from __future__ import annotations

import json
from typing import Sequence

from .cases import PARTED, REDUCING, ROOT, busbw_factor

_FACTOR_TEXT = {"all_reduce": "2(n-1)/n", "broadcast": "1", "reduce": "1"}


def add_memcpy(rows: list[dict]) -> list[dict]:
    """The rows without those of impl ``memcpy``; each other row gets ``memcpy_gbps`` (the
    single-process copy of its op and size, bytes / median time) and ``busbw_frac_memcpy``
    (its busbw as a fraction of that)."""
    copies = {(r["op"], r["bytes"]): r["algbw_gbps"] for r in rows if r["impl"] == "memcpy"}
    kept = [r for r in rows if r["impl"] != "memcpy"]
    for row in kept:
        gbps = copies.get((row["op"], row["bytes"]))
        if gbps:
            row["memcpy_gbps"] = gbps
            row["busbw_frac_memcpy"] = row["busbw_gbps"] / gbps
    return kept


def add_ratios(rows: list[dict], ours: str, peers: Sequence[str]) -> None:
    """Add ``time_ratio_vs_P`` (ours/peer time) and ``busbw_ratio_vs_P`` (ours/peer busbw)
    to each of ours' rows that a peer P ran too, in place."""
    by_key = {(r["impl"], r["op"], r["bytes"]): r for r in rows}
    for row in rows:
        if row["impl"] != ours:
            continue
        for peer in peers:
            other = by_key.get((peer, row["op"], row["bytes"]))
            if other and other["time_us"] > 0:
                row[f"time_ratio_vs_{peer}"] = row["time_us"] / other["time_us"]
            if other and other["busbw_gbps"] > 0:  # 0 in a world of one
                row[f"busbw_ratio_vs_{peer}"] = row["busbw_gbps"] / other["busbw_gbps"]


def _fmt_time(us: float) -> str:
    return f"{us:.1f}" if us < 1e5 else f"{us:.0f}"


def table(rows: list[dict], ours: str, peers: Sequence[str], world_size: int) -> str:
    """The rows as text, one nccl-tests style table per op (see the module docstring)."""
    impls = [ours] + [p for p in peers if any(r["impl"] == p for r in rows)]
    memcpy = any("memcpy_gbps" in r for r in rows)
    by_key = {(r["impl"], r["op"], r["bytes"]): r for r in rows}
    ops = list(dict.fromkeys(r["op"] for r in rows))
    block_w = 37 + (6 if memcpy else 0)
    lines: list[str] = []
    for op in ops:
        factor = _FACTOR_TEXT.get(op, "(n-1)/n")
        redop = "sum" if op in REDUCING else "none"
        root = str(ROOT) if op in ("reduce", "broadcast", "gather", "scatter") else "-1"
        dtype = next(r["dtype"] for r in rows if r["op"] == op)
        uneven = any(r.get("uneven") for r in rows if r["op"] == op)
        lines.append(f"# {op}: {world_size} ranks, {dtype}, busbw = algbw x {factor} = "
                     f"x {busbw_factor(op, world_size):.3g}; bytes = "
                     f"{'the full n-part buffer' if op in PARTED else 'the buffer'}"
                     f"{'; uneven split sizes (each rank sends bytes in all)' if uneven else ''}")
        head1 = f"#{'':>11} {'':>11} {'':>8} {'':>5} {'':>4} "
        head2 = f"#{'size':>11} {'count':>11} {'type':>8} {'redop':>5} {'root':>4} "
        head3 = f"#{'(B)':>11} {'(elements)':>11} {'':>8} {'':>5} {'':>4} "
        for impl in impls:
            head1 += f"| {impl:^{block_w - 2}} "
            head2 += f"| {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}" + \
                     (f" {'%cp':>5}" if memcpy else "") + " "
            head3 += f"| {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" + \
                     (f" {'':>5}" if memcpy else "") + " "
        extra2 = extra3 = ""
        if memcpy:
            extra2 += f"| {'memcpy':>7} "
            extra3 += f"| {'(GB/s)':>7} "
        for peer in impls[1:]:
            extra2 += f"| {'t:' + peer:>13} {'bw:' + peer:>13} "
            extra3 += f"| {'ours/peer':>13} {'ours/peer':>13} "
        lines += [head1.rstrip(), (head2 + extra2).rstrip(), (head3 + extra3).rstrip()]
        sizes = sorted({r["bytes"] for r in rows if r["op"] == op})
        for nbytes in sizes:
            first = next(r for i in impls if (r := by_key.get((i, op, nbytes))))
            line = (f" {nbytes:>11} {first['count']:>11} {first['dtype']:>8} {redop:>5} "
                    f"{root:>4} ")
            for impl in impls:
                r = by_key.get((impl, op, nbytes))
                if r is None:
                    line += f"| {'n/a':>{block_w - 3}} "
                    continue
                line += (f"| {_fmt_time(r['time_us']):>9} {r['algbw_gbps']:>7.3f} "
                         f"{r['busbw_gbps']:>7.3f} {r['wrong']:>6}")
                if memcpy:
                    frac = r.get("busbw_frac_memcpy")
                    line += f" {100 * frac:>5.1f}" if frac is not None else f" {'':>5}"
                line += " "
            if memcpy:
                gbps = first.get("memcpy_gbps")
                line += f"| {gbps:>7.3g} " if gbps else f"| {'':>7} "
            mine = by_key.get((ours, op, nbytes))
            for peer in impls[1:]:
                t = mine.get(f"time_ratio_vs_{peer}") if mine else None
                b = mine.get(f"busbw_ratio_vs_{peer}") if mine else None
                line += "| " + " ".join(f"{'n/a':>13}" if v is None else f"{v:>13.3f}"
                                        for v in (t, b)) + " "
            lines.append(line.rstrip())
        lines.append("")
    total_wrong = sum(r["wrong"] for r in rows)
    lines.append(f"# wrong elements in total: {total_wrong}"
                 f"{'' if total_wrong == 0 else '  <-- SOME RESULTS ARE WRONG'}")
    return "\n".join(lines)


def write_json(rows: list[dict], path: str) -> None:
    """Write the rows (a JSON list: the contract of :mod:`collectives.bench` plus extra fields) to ``path``."""
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
