"""``collectives``: the command line, one command with a subcommand per tool.

    collectives env [--json]           # the report for a bug report (collectives.env_report)
    collectives bench --nproc 2 --sizes 4K,1M   # microbenchmarks (collectives.bench)
    collectives doctor [DIR] [--json]  # the ranks' flight records lined up (collectives.doctor)
    collectives trace merge DIR        # the ranks' streamed traces as one Perfetto file
    python -m collectives ...          # the same, without the installed script

Each subcommand hands its arguments over to its tool's own ``main`` (which still runs as
``python -m collectives.bench`` and ``python -m collectives.doctor``), so their options
and exit statuses are the tools' own. A tool is imported only when it is asked for.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

from ._version import __version__

__all__ = ["COMMANDS", "main"]

#: subcommand -> (module whose ``main(argv, prog=...)`` runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("collectives.bench.__main__",
              "nccl-tests style benchmarks of a backend, peers side by side"),
    "doctor": ("collectives.doctor",
               "line up the ranks' flight records and show where they diverge"),
    "env": ("collectives.env_report",
            "versions, transports, launcher, variables, cores: for a bug report"),
    "trace": ("collectives.trace_merge",
              "merge the ranks' streamed trace files into one Chrome/Perfetto file"),
}


def usage(prog: str) -> str:
    """The help text: the subcommands, one line each.

    >>> "env" in usage("collectives")
    True
    """
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    return (f"usage: {prog} {{{','.join(COMMANDS)}}} [ARGS...]\n\n"
            f"collectives {__version__}: one collective-communication interface, many "
            f"transports.\n\ncommands:\n{rows}\n\n"
            f"`{prog} COMMAND --help` shows a command's options; `{prog} --version` the "
            f"version.")


def main(argv: Optional[Sequence[str]] = None, *, prog: str = "collectives") -> int:
    """Run subcommand ``argv[0]`` with the rest of ``argv``; returns the exit status (2
    for a missing or unknown subcommand, as argparse does for a usage error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(prog), file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    if command in ("-h", "--help"):
        print(usage(prog))
        return 0
    if command == "--version":
        print(f"collectives {__version__}")
        return 0
    if command not in COMMANDS:
        print(f"{prog}: error: unknown command {command!r}; choose from "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest, prog=f"{prog} {command}")
