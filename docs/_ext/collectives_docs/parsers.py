"""Read every command line's argparse parser, without running the command.

Run as a script (``python parsers.py ROOT``) it prints one JSON list: for each command,
its ``command`` (how it is typed), ``group``, ``prog``, ``description``, ``usage`` and
``arguments`` (flags, default, choices, help with ``%(default)s`` filled in), or an
``error`` saying why its parser could not be read.

How: the command is started as it would be from a shell (a script run as ``__main__``,
a subcommand through ``collectives.cli.main``), with ``ArgumentParser.parse_known_args``
(which ``parse_args`` calls) replaced by one that raises with the parser in hand. The
command stops there, before it does any work: the reference shows the parser the
command really builds, and never a copy of it. A script that builds no parser is left
out; one that would start working before parsing is stopped by a 30 s alarm.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

#: seconds a command may take to reach its parser (its imports: torch, the first time)
PATIENCE_S = 30


class _Captured(BaseException):
    """Raised from ``parse_known_args``: the command's parser, caught in the act."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _capture(*_: Any, **__: Any) -> None:
    raise _Captured(_[0])


def _timeout(*_: Any) -> None:
    raise TimeoutError(f"built no parser within {PATIENCE_S} s")


def capture_parser(start: Callable[[], Any]) -> argparse.ArgumentParser:
    """The first parser ``start()`` parses its arguments with; ``LookupError`` if it
    returns without parsing any."""
    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = _capture   # type: ignore[method-assign]
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(PATIENCE_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            start()
    except _Captured as caught:
        return caught.parser
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise LookupError("parsed no arguments")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    # The formatter fills in %(default)s, %(prog)s and the like as --help does.
    return parser._get_formatter()._expand_help(action)


def describe(parser: argparse.ArgumentParser) -> dict:
    """The parser as plain data (see the module's doc)."""
    arguments = []
    subcommands = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            subcommands = [dict(describe(sub), name=name)
                           for name, sub in action.choices.items()]
            continue
        metavar = action.metavar
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
        default = action.default
        arguments.append({
            "flags": list(action.option_strings) or [metavar or action.dest],
            "metavar": None if action.nargs == 0 else metavar or (
                action.dest.upper() if action.option_strings else None),
            "default": None if default in (None, argparse.SUPPRESS) or action.nargs == 0
            else repr(default) if not isinstance(default, (str, int, float)) else
            str(default),
            "choices": [str(c) for c in action.choices] if action.choices else None,
            "required": bool(action.required),
            "help": "" if action.help == argparse.SUPPRESS else _help(parser, action),
        })
    return {"prog": parser.prog, "description": parser.description or "",
            "usage": parser.format_usage().strip(), "arguments": arguments,
            "subcommands": subcommands}


def _script(path: Path) -> Callable[[], Any]:
    def start() -> Any:
        sys.argv = [str(path)]
        return runpy.run_path(str(path), run_name="__main__")
    return start


def _subcommand(name: str) -> Callable[[], Any]:
    def start() -> Any:
        from collectives import cli
        return cli.main([name])
    return start


def _module(name: str) -> Callable[[], Any]:
    def start() -> Any:
        sys.argv = [name]
        return runpy.run_module(name, run_name="__main__", alter_sys=True)
    return start


def has_command_line(source: str) -> bool:
    """Whether a script's ``source`` is a command with options of its own: it has a
    ``__main__`` block and uses argparse (directly or through a shared helper)."""
    return '__name__ == "__main__"' in source and ("argparse" in source
                                                   or "parse_args" in source)


def commands(root: Path) -> list[tuple[str, str, Callable[[], Any]]]:
    """Every command line of the repository: ``(group, command, start)``."""
    from collectives import cli

    found: list[tuple[str, str, Callable[[], Any]]] = [
        ("collectives", f"collectives {name}", _subcommand(name)) for name in cli.COMMANDS]
    found.append(("collectives", "python -m parallel.ft", _module("parallel.ft")))
    for group in ("examples", "benchmarks"):
        for path in sorted((root / group).glob("*.py")):
            if has_command_line(path.read_text()):
                found.append((group, f"{group}/{path.name}", _script(path)))
    return found


def read_all(root: Path) -> list[dict]:
    result = []
    for group, command, start in commands(root):
        entry: dict[str, Any] = {"group": group, "command": command}
        try:
            entry.update(describe(capture_parser(start)))
        except (Exception, SystemExit) as exc:   # reported by the directive, as a warning
            entry["error"] = f"{type(exc).__name__}: {exc}"
        result.append(entry)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    root = Path((argv or sys.argv[1:])[0]).resolve()
    sys.path.insert(0, str(root))
    out = sys.stdout
    out.write(json.dumps(read_all(root), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
