"""Draw a window of a ``--trace`` file as a PNG: one row per rank, the training phases
(forward, backward, step; with a pipeline, each micro-batch's F and B, labelled "1F0":
stage 1, forward, micro-batch 0) as grey bars, every collective and point-to-point
operation below them coloured by its mesh
dimension (the ``dim`` the tracer's ``wrap(group, label)`` recorded), one lane per
dimension (for the pipeline's sends and receives, the time the caller was blocked waiting
for them). A collective's bar runs from its call to the moment its result was available
(for async calls, the return of ``wait()``), as in the trace.

    python examples/mesh.py --dp 2 --tp 2 --fsdp --trace mesh.json
    python examples/plot_trace.py mesh.json mesh.png --step 20 --steps 2

``--step`` is the first training step drawn (counted by rank 0's ``forward`` slices, or
its ``pipeline`` slices with --pp > 1), ``--steps`` how many.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.cli_flags import add_flag, flag_parser, nonnegative_int  # noqa: E402

COLOURS = {"dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "cp": "tab:red",
           None: "tab:grey"}
PHASES = {"forward": "#d0d0d0", "backward": "#a8a8a8", "step": "#707070"}
#: A pipeline's compute actions (``cat == "pp"`` slices, named like "1F0"): by kind.
ACTIONS = {"F": "#d0d0d0", "B": "#a8a8a8", "W": "#888888"}
#: Context parallelism's computation (``cat == "cp"`` slices, "ring forward step 0"...).
CP_STEPS = {"forward": "#9ecae1", "backward": "#4292c6"}


def phase_colour(event: dict):
    """The bar colour of a training-phase slice, or None for other slices."""
    if event.get("ph") != "X":
        return None
    if event.get("cat") == "pp":
        kind = next((c for c in event["name"] if c in ACTIONS), None)
        return ACTIONS.get(kind)
    if event.get("cat") == "cp":
        return next((c for kind, c in CP_STEPS.items() if kind in event["name"]), None)
    return PHASES.get(event["name"])


def comm_slices(events: list) -> list:
    """(rank, name, dim, start_us, end_us) of every collective: its "b" and "e" events."""
    begins, out = {}, []
    for e in events:
        if e.get("cat") != "comm":
            continue
        key = (e["pid"], e["id"])
        if e["ph"] == "b":
            begins[key] = e
        elif e["ph"] == "e" and key in begins:
            b = begins.pop(key)
            out.append((e["pid"], e["name"], b.get("args", {}).get("dim"), b["ts"], e["ts"]))
    return out


def main(argv=None) -> None:
    p = flag_parser("examples/plot_trace.py", __doc__)
    p.add_argument("trace", help="a --trace FILE of an example")
    p.add_argument("png", help="the picture to write")
    p.add_argument("--step", type=nonnegative_int, default=20,
                   help="first step drawn (default: %(default)s)")
    add_flag(p, "--steps", default=2, help="steps drawn")
    args = p.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = json.load(open(args.trace))["traceEvents"]
    forwards = sorted(e["ts"] for e in events
                      if e.get("name") in ("forward", "pipeline") and e["pid"] == 0)
    if len(forwards) < args.step + args.steps + 1:
        raise SystemExit(f"plot_trace: the trace has {len(forwards)} steps; choose an "
                         f"earlier --step")
    t0, t1 = forwards[args.step], forwards[args.step + args.steps]
    ranks = sorted({e["pid"] for e in events if "pid" in e})
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.2))
    for e in events:
        colour = phase_colour(e)
        if colour is not None and t0 <= e["ts"] < t1:
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (e["pid"] - 0.4, 0.35),
                           color=colour, edgecolor="white", linewidth=0.5)
            if e.get("cat") in ("pp", "cp") and args.steps <= 2:
                label = e["name"] if e["cat"] == "pp" else e["name"].rsplit(" ", 1)[-1]
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, e["pid"] - 0.22, label,
                        ha="center", va="center", fontsize=6)
    # One lane per dimension, so overlaps stay visible (cp shares pp's: a ring's
    # transfers are drawn from post to wait; the mesh seldom pictures both).
    lanes = {"dp": 0.0, "tp": 0.2, "pp": 0.4, "cp": 0.4}
    comm = comm_slices(events)
    for rank, name, dim, start, end in comm:
        if t0 <= start < t1 and dim != "pp":
            ax.broken_barh([((start - t0) / 1e3, max(end - start, 1.0) / 1e3)],
                           (rank + lanes.get(dim, 0.4), 0.17),
                           color=COLOURS.get(dim, "tab:grey"))
    # A pipeline's isend/irecv are in flight for most of the step (its sends are waited
    # for at the end), so its lane shows the time the caller was blocked waiting instead.
    for e in events:
        if (e.get("ph") == "X" and e["name"].startswith("wait pp ")
                and t0 <= e["ts"] < t1):
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)],
                           (e["pid"] + lanes["pp"], 0.17), color=COLOURS["pp"])
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the first step drawn")
    ax.set_title(f"{os.path.basename(args.trace)}: steps {args.step}-{args.step + args.steps - 1}")
    handles = [Patch(color=c, label=n) for n, c in PHASES.items()]
    if any(e.get("cat") == "cp" for e in events):
        handles += [Patch(color=c, label=f"ring {n} step") for n, c in CP_STEPS.items()]
    dims = [d for d in ("dp", "tp", "pp", "cp") if any(dim == d for _, _, dim, _, _ in comm)]
    labels = {"pp": "pp send/recv, blocked", "cp": "cp isend/irecv, post to wait"}
    handles += [Patch(color=COLOURS[d], label=labels.get(d, f"{d} collectives"))
                for d in dims]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -1.2 / len(ranks)),
              ncol=6)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
