"""Pictures of a schedule: a text grid (rank by step) and a PNG timeline.

Both draw either a schedule (unit steps, from :mod:`parallel.pp.schedules`) or a
measured run: per rank, a list of ``(action, start_s, end_s)`` (what
:attr:`parallel.pp.runtime.PipelineSchedule.timeline` records, or
:func:`timeline_from_trace` reads back from an example's ``--trace`` file)::

    >>> from parallel.pp import draw_png, gpipe, text_grid
    >>> print(text_grid(gpipe(2, 2)))
    rank 0 | 0F0  0F1   .    .   0B0  0B1
    rank 1 |  .   1F0  1F1  1B0  1B1   .
    >>> draw_png(gpipe(4, 8), "gpipe.png", title="GPipe, P=4, M=8")   # needs matplotlib
"""

from __future__ import annotations

import json
from typing import Iterable, Optional, Sequence, Union

from .actions import B, F, W, Action, parse_action

__all__ = ["COLOURS", "draw_png", "text_grid", "timeline_from_trace"]

#: Forward blue, backward (input gradient) green, weight gradient orange.
COLOURS = {F: "#4c78a8", B: "#54a24b", W: "#f58518"}

Timeline = Sequence[Sequence[tuple]]


def text_grid(schedule: Sequence[Sequence[Optional[Action]]],
              mark: Iterable[tuple[int, int]] = ()) -> str:
    """One line per rank, one column per step, ``.`` for idle; the cells in ``mark``
    (``(rank, step)`` pairs) are drawn ``[like this]``."""
    marked = set(mark)
    width = max((len(str(a)) for row in schedule for a in row if a is not None), default=1)
    lines = []
    for r, row in enumerate(schedule):
        cells = []
        for i, action in enumerate(row):
            text = "." if action is None else str(action)
            cells.append(f"[{text:^{width}}]" if (r, i) in marked else f" {text:^{width}} ")
        lines.append(f"rank {r} |" + "".join(cells).rstrip())
    return "\n".join(lines)


def _bars(source) -> list[list[tuple[Action, float, float]]]:
    """Either form as per-rank ``(action, start, end)`` bars."""
    rows = []
    for row in source:
        bars = []
        for i, item in enumerate(row):
            if item is None:
                continue
            if isinstance(item, Action):
                bars.append((item, float(i), float(i + 1)))
            else:
                action, start, end = item
                bars.append((action, float(start), float(end)))
        rows.append(bars)
    return rows


def draw_png(source, path: str, *, title: str = "", unit: str = "step") -> None:
    """Draw a schedule or a measured timeline to ``path`` (PNG): one row per rank (rank 0
    on top), F / B / W blocks coloured, white where the rank idles, labels when they fit.

    Raises ``ImportError`` with a clear message where matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - matplotlib is optional
        raise ImportError("pp.draw_png: needs matplotlib (pip install matplotlib)") from exc
    rows = _bars(source)
    starts = [s for bars in rows for _, s, _ in bars]
    origin = min(starts, default=0.0)
    span = max((e for bars in rows for _, _, e in bars), default=1.0) - origin
    fig, ax = plt.subplots(figsize=(max(6.0, min(18.0, 0.35 * len(starts) / max(1, len(rows))
                                                  + 4)), 0.6 * len(rows) + 1.2))
    for r, bars in enumerate(rows):
        for action, start, end in bars:
            ax.broken_barh([(start - origin, end - start)], (r - 0.4, 0.8),
                           facecolors=COLOURS[action.kind], edgecolor="white", linewidth=0.5)
            if (end - start) / span > 0.022:
                ax.text((start + end) / 2 - origin, r, f"{action.stage}{action.kind}"
                        f"{action.microbatch}" if len(rows) < 3 else
                        f"{action.microbatch}", ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s)" if unit == "s" else "time step")
    ax.set_title(title, loc="left")
    present = {action.kind for bars in rows for action, _, _ in bars}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k in present],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, frameon=False,
              fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_from_trace(path: str, step: Union[int, str, None] = None) -> list[list[tuple]]:
    """Read back the per-rank ``(action, start_s, end_s)`` bars of one pipeline step from
    a Chrome trace written by an example's ``--trace`` (slices named like ``2F0`` with
    ``args.step``). ``step``: a step number, ``None`` for the last one recorded, or
    ``"fastest"`` for the one with the shortest span (the least disturbed by other
    processes on a shared machine)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    slices = [e for e in events if e.get("ph") == "X" and e.get("cat") == "pp"]
    if not slices:
        raise ValueError(f"pp.timeline_from_trace: {path} holds no pipeline slices (was it "
                         f"written by examples/pp.py --trace?)")
    if step is None:
        step = max(e["args"]["step"] for e in slices)
    elif step == "fastest":
        spans: dict[int, list[float]] = {}
        for e in slices:
            lo, hi = spans.setdefault(e["args"]["step"], [float("inf"), float("-inf")])
            spans[e["args"]["step"]] = [min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])]
        step = min(spans, key=lambda k: spans[k][1] - spans[k][0])
    ranks = max(e["pid"] for e in slices) + 1
    rows: list[list[tuple]] = [[] for _ in range(ranks)]
    for e in sorted(slices, key=lambda e: e["ts"]):
        if e["args"]["step"] == step:
            rows[e["pid"]].append((parse_action(e["name"]), e["ts"] / 1e6,
                                   (e["ts"] + e["dur"]) / 1e6))
    return rows
