"""Run README commands through their scripts' argument parsers only, never their work
(tests/test_readme_blocks.py): ``python tests/scripts/parse_only.py CHECKS.json OUT.json``.

CHECKS.json is a list of ``{"kind": "path"|"module", "target", "argv", "env",
"seconds"}``; each is run in this process in turn (torch and the scripts' imports load
once) with ``argparse.ArgumentParser.parse_args`` patched. A script that parses with the
examples' command line stops in ``examples.common.cli.launch`` (so its own checks after
the parse run first, e.g. mesh.py's ``--nproc`` = dp*tp*pp); any other stops as soon as a
parser accepted all its arguments (``parse_args``, or ``parse_known_args`` with nothing
left over). Abbreviated options are refused: a README flag must be the option's whole
name. A script still running after ``seconds`` ran past its parser: a failure, not a
hang. OUT.json gets one ``{"outcome", "code", "stderr", "stdout"}`` per check, outcome
``accepted`` (status 0), ``exit`` (argparse's 2 for a bad flag), ``returned``, ``error``
or ``ran past its parser``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import signal
import sys
import traceback


#: The patched parse functions and the alarm report by raising these, which no script
#: catches (BaseException, not SystemExit): the outcome is known to come from here.


class Accepted(BaseException):
    """The arguments were accepted: stop before the script does any work."""


class RanPastParser(BaseException):
    """The script went on past its parser (or has none): its alarm rang."""


#: ``defer``: this script stops in cli.launch, not at its parse; ``depth``: inside a
#: parse_args call (which calls parse_known_args itself).
state = {"defer": False, "depth": 0}
original_parse = argparse.ArgumentParser.parse_args
original_known = argparse.ArgumentParser.parse_known_args


def parse_args(self, args=None, namespace=None):
    self.allow_abbrev = False         # a README flag must be the option's whole name
    state["depth"] += 1
    try:
        ns = original_parse(self, args, namespace)
    finally:
        state["depth"] -= 1
    if not state["defer"]:
        raise Accepted()
    return ns


def parse_known_args(self, args=None, namespace=None):
    # Called directly (fsdp.py parses its own two options first, then the rest with the
    # examples' command line): done only when nothing is left over for a later parser.
    self.allow_abbrev = False
    ns, extras = original_known(self, args, namespace)
    if state["depth"] == 0 and not extras and not state["defer"]:
        raise Accepted()
    return ns, extras


def launch(main, args):
    raise Accepted()


def alarm(signum, frame):
    raise RanPastParser()


def install() -> None:
    """Patch the parsers and the examples' launch; the alarm ends a script's check."""
    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    import examples.common.cli as cli
    cli.launch = launch
    signal.signal(signal.SIGALRM, alarm)


def main(todo: str, done: str) -> None:
    results = []
    for check in json.load(open(todo)):
        results.append(run(check))
    json.dump(results, open(done, "w"))


def run(check: dict) -> dict:
    env, argv = dict(os.environ), sys.argv
    os.environ.update(check["env"])
    out, err = io.StringIO(), io.StringIO()
    target = check["target"]
    outcome, code = "returned", None
    signal.alarm(check["seconds"])
    try:
        source = open(target).read() if check["kind"] == "path" else ""
        state["defer"] = bool("examples.common.cli import" in source
                              and re.search(r"\blaunch\(", source))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            sys.argv = [target, *check["argv"]]
            if check["kind"] == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except Accepted:
        outcome, code = "accepted", 0
    except SystemExit as exc:
        outcome = "exit"
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            err.write(exc.code)
    except RanPastParser:
        outcome = "ran past its parser"
    except BaseException:
        outcome = "error"
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = argv
    return {"outcome": outcome, "code": code, "stderr": err.getvalue()[-2000:],
            "stdout": out.getvalue()[-1000:]}


if __name__ == "__main__":
    install()
    main(sys.argv[1], sys.argv[2])
