"""``collectives-command-lines``: every command line's options, from its own parser.

``parsers.py`` runs in a child process (the commands import torch and set up their own
``sys.path``; the build's process stays clean) and reads each command's argparse parser;
this directive lays them out: a section per command with its description's first
paragraph, its usage line and a table of its arguments. A command whose parser cannot be
read is a build warning (so an error, with ``-W``), never a silently missing section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from .tables import table

log = logging.getLogger(__name__)

GROUPS = {
    "collectives": "The collectives command",
    "examples": "Examples",
    "benchmarks": "Benchmarks",
}
READ_TIMEOUT_S = 300


def read_parsers(root: Path) -> list[dict]:
    """``parsers.py``'s report on the repository at ``root``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("parsers.py")),
                           str(root)], env=env, cwd=root, capture_output=True, text=True,
                          timeout=READ_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"parsers.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


class CommandLines(SphinxDirective):
    """A section per command (see the module's doc)."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_reread()   # the commands live outside docs/: read them every build
        root = Path(self.env.srcdir).parent
        commands = read_parsers(root)
        result: list[nodes.Node] = []
        for group, title in GROUPS.items():
            members = [c for c in commands if c["group"] == group]
            if members:
                section = self._section(title)
                for command in members:
                    section += self._command(command)
                result.append(section)
        return result

    def _section(self, title: str) -> nodes.section:
        section = nodes.section(ids=[nodes.make_id(title)], names=[nodes.fully_normalize_name(title)])
        section += nodes.title(text=title)
        self.state.document.note_implicit_target(section, section)
        return section

    def _command(self, command: dict) -> nodes.section:
        section = self._section(command["command"])
        if "error" in command:
            log.warning("command line %s: its parser could not be read: %s",
                        command["command"], command["error"], location=self.get_location())
            return section
        if command["description"]:
            section += nodes.paragraph(text=first_paragraph(command["description"]))
        section += nodes.literal_block(text=command["usage"], language="text")
        section += self._arguments(command["arguments"])
        for sub in command["subcommands"]:
            sub = dict(sub, command=f"{command['command']} {sub['name']}")
            section += self._command(sub)
        return section

    def _arguments(self, arguments: list[dict]) -> nodes.Node:
        if not arguments:
            return nodes.paragraph(text="No arguments.")
        rows = []
        for arg in arguments:
            flags = ", ".join(arg["flags"])
            if arg["metavar"] and arg["flags"][0].startswith("-"):
                flags += f" {arg['metavar']}"
            what = arg["help"]
            if arg["choices"]:
                what += f" (one of: {', '.join(arg['choices'])})"
            default = "required" if arg["required"] else (arg["default"] or "")
            rows.append([nodes.literal(text=flags), default, what])
        return table(["argument", "default", "meaning"], rows, widths=[30, 15, 55])
