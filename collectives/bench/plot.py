"""``--plot FILE.png``: busbw against size, one line per implementation, one panel per op.

matplotlib is optional (the ``plot`` extra): it is imported only here, only when a plot is
asked for, and its absence is a one-line message, not a traceback.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Sequence


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def check_available() -> None:
    """:class:`PlotUnavailable` now, before any benchmark runs, if matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'collectives[plot]'")


def plot(rows: list[dict], path: str, impls: Sequence[str],
         title: Optional[str] = None) -> None:
    """Draw busbw (GB/s) against bytes (log-log) for every implementation in ``impls``,
    one panel per op, plus the single-process memory copy where the rows carry it, and
    save the figure to ``path`` (format from its extension)."""
    check_available()
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(len(ops), 1, figsize=(8, 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        for impl in impls:
            mine = sorted((r for r in rows if r["op"] == op and r["impl"] == impl),
                          key=lambda r: r["bytes"])
            if mine:
                ax.plot([r["bytes"] for r in mine], [r["busbw_gbps"] for r in mine],
                        marker="o", markersize=3, label=impl)
        copies = sorted({(r["bytes"], r["memcpy_gbps"]) for r in rows
                         if r["op"] == op and "memcpy_gbps" in r})
        if copies:
            ax.plot(*zip(*copies), linestyle="--", color="gray", label="memcpy (1 process)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
