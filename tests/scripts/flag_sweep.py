"""Every example's and benchmark's flags, seen from inside (tests/test_flags.py):
``python tests/scripts/flag_sweep.py OUT.json TARGET...``, a TARGET being a script's path
or ``-m MODULE``.

Each script runs in this one process (``runpy``, as ``__main__``, with no arguments)
until it first parses its command line: ``ArgumentParser.parse_known_args`` is patched to
stop it there and hand over the parser. The parser is then asked for ``--help`` and given
``--backend foo``, as a user would, and described: its class, and for every option its
strings, ``type`` (module and name of the callable), metavar and whether it is required.
Whether the script had imported torch by then is noted too (a bad flag must be refused
before torch loads). OUT.json gets one object per target, in order.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
import traceback


class Captured(BaseException):
    """The script reached its parse: stop it (no script catches a BaseException)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


_original = argparse.ArgumentParser.parse_known_args


def _capture(self, args=None, namespace=None):
    raise Captured(self)


def _name(callable_) -> str | None:
    if callable_ is None:
        return None
    return f"{getattr(callable_, '__module__', '?')}.{getattr(callable_, '__qualname__', '?')}"


def _ask(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """Parse ``argv`` as a user's command line: the exit status and what was said."""
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def capture(target: str) -> tuple[argparse.ArgumentParser | None, dict]:
    """Run ``target`` up to its parse (parse_known_args patched): its parser, or None and
    why not; and whether it imported torch on the way."""
    torch_before = "torch" in sys.modules
    argv, sys.argv = sys.argv, [target]
    found: dict = {"target": target}
    parser = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if target.startswith("-m "):
                runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        found["error"] = "the script ended without parsing a command line"
    except Captured as captured:
        parser = captured.parser
    except BaseException:   # noqa: BLE001 - the failure is the finding
        found["error"] = traceback.format_exc()[-3000:]
    finally:
        sys.argv = argv
    found["torch_imported"] = not torch_before and "torch" in sys.modules
    return parser, found


def describe(parser: argparse.ArgumentParser, found: dict) -> dict:
    """What ``parser`` is and says (the real parse functions in place)."""
    from collectives.cli_flags import FlagParser
    return dict(
        found,
        flag_parser=isinstance(parser, FlagParser),
        options=[{"strings": a.option_strings, "dest": a.dest, "type": _name(a.type),
                  "metavar": a.metavar, "hidden": a.help == argparse.SUPPRESS}
                 for a in parser._actions if a.option_strings],
        required=any(a.required for a in parser._actions),
        help=_ask(parser, ["--help"]),
        bad_backend=_ask(parser, ["--backend", "foo"]))


def main(out: str, targets: list[str]) -> None:
    argparse.ArgumentParser.parse_known_args = _capture
    try:
        captured = [capture(t) for t in targets]
    finally:
        argparse.ArgumentParser.parse_known_args = _original
    results = [found if parser is None else describe(parser, found)
               for parser, found in captured]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
