"""The README's fenced code blocks and the commands of ours in them, for
tests/test_readme_blocks.py.

``readme_blocks()`` splits README.md into its fenced blocks (language, line, nearest
heading, the prose after each); ``readme_commands()`` finds, in the shell and unlabelled
blocks (and in `spans` of the prose), every command that starts a script of ours, the way
a reader would type it: ``VAR=value`` prefixes, ``mpiexec -n N`` or ``torchrun ...`` in
front, ``\\`` continuations joined, ``for`` loops expanded over their values, ``$(...)``,
pipes and redirections taken apart, ``pip``/``pytest`` lines and output left out::

    >>> [c.target for c in readme_commands([Block("bash", 1, "# x",
    ...     "mpiexec -n 2 python examples/ddp.py --epochs 1  # two ranks\\n")])]
    ['examples/ddp.py']
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
KIT_TEST = ROOT / "tests" / "test_readme_kit.py"
#: Folders whose scripts are "ours": a command naming a script there must find it.
OUR_FOLDERS = ("examples", "benchmarks", "tests", "collectives", "parallel", "backends")

@dataclass
class Block:
    """One fenced block: its language tag, its first content line (1-based), the nearest
    heading above it, its text, and the prose between it and the next block."""
    lang: str
    line: int
    heading: str
    text: str
    after: str = ""
    next_block: Optional["Block"] = None

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lstrip("#").lower()).strip("-")
        return f"{slug[:40].rstrip('-')}-L{self.line}"


def readme_blocks(text: str = README) -> list[Block]:
    """The fenced blocks of `text` in order, each with the prose that follows it."""
    lines = text.split("\n")
    blocks: list[Block] = []
    heading, i, prose_start = "(top)", 0, 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```(\w*)\s*$", line)
        if line.startswith("#"):
            heading = line.strip()
        elif fence:
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            if blocks:
                blocks[-1].after = "\n".join(lines[prose_start:i])
            blocks.append(Block(fence.group(1), i + 2, heading,
                                "\n".join(lines[i + 1:end]) + "\n"))
            i, prose_start = end, end + 1
        i += 1
    if blocks:
        blocks[-1].after = "\n".join(lines[prose_start:])
    for first, second in zip(blocks, blocks[1:]):
        first.next_block = second
    return blocks


def kit_blocks(text: str = README) -> set[int]:
    """The README lines of the blocks tests/test_readme_kit.py runs: it finds a block as
    the first fenced block after the first mention of a `file name`, as here."""
    names = set(re.findall(r'(?:run_script|readme_block)\("([\w.]+)"', KIT_TEST.read_text()))
    found = set()
    for name in names:
        at = text.find(f"`{name}`")
        if at < 0:
            continue
        fence = re.compile(r"^```\w*\n", re.M).search(text, at)
        if fence:
            found.add(text.count("\n", 0, fence.end()) + 1)
    return found


BLOCKS = readme_blocks()
KIT_LINES = kit_blocks()
#: The python blocks tests/test_readme_blocks.py runs: all but the kit test's.
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python" and b.line not in KIT_LINES]


# ------------------------------------------------------------------ shell commands

SHELL_LANGS = ("", "bash", "sh", "shell", "console")
#: Separators between commands on one line; the bootstrap checks each command alone.
_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}


@dataclass
class Command:
    """One command of ours from a README shell block: ``env`` prefix, the launcher
    (``""``, ``mpiexec``/``mpirun`` or ``torchrun``) and its options, and the script (a
    path) or module with its arguments."""
    line: int
    source: str
    kind: str                       # "path" or "module"
    target: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = ""
    launcher_args: list[str] = field(default_factory=list)
    #: From a `span` of the prose. One without arguments names the script in passing
    #: ("`python -m collectives.doctor` shows ..."): it must exist, and is not parsed.
    inline: bool = False

    @property
    def id(self) -> str:
        words = [self.launcher, *self.launcher_args, self.target, *self.argv]
        return f"L{self.line}:" + " ".join(w for w in words if w)[:90]


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with ``\\`` continuations joined, each with its README line."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for offset, line in enumerate(block.text.splitlines()):
        if not pending:
            start = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _loop_values(text: str) -> dict[str, list[str]]:
    """``for VAR in A B C; do``: VAR -> [A, B, C], for every loop of the block."""
    return {var: values.split() for var, values in
            re.findall(r"\bfor\s+(\w+)\s+in\s+([^;\n]+?)\s*;\s*do\b", text)}


def _expand(text: str, loops: dict[str, list[str]]) -> list[str]:
    """`text` once per combination of the values of the loop variables it uses."""
    used = [v for v in loops if re.search(r"\$\{?" + v + r"\b", text)]
    expanded = []
    for values in itertools.product(*(loops[v] for v in used)):
        t = text
        for var, value in zip(used, values):
            t = re.sub(r"\$\{" + var + r"\}|\$" + var + r"\b", value, t)
        expanded.append(t)
    return expanded


def _segments(text: str) -> list[list[str]]:
    """The simple commands of one shell line: subshells ``$(...)`` taken out as
    commands of their own, ``for ... do``/``done`` and redirections dropped, split at
    ``&&``, ``;``, ``|``; ``#`` comments removed."""
    inner = re.findall(r"\$\(([^()]*)\)", text)
    text = re.sub(r"\$\([^()]*\)", " ", text)
    text = re.sub(r"\bfor\s+\w+\s+in\s+[^;\n]*;\s*do\b|\bdone\b|\bdo\b", " ", text)
    segments: list[list[str]] = []
    for part in [text, *inner]:
        part = re.sub(r"(?<!\S)\d*>>?\s*\S+", " ", part)          # 2>/dev/null, > out
        lexer = shlex.shlex(part, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in _SEPARATORS:
                segments.append(current)
                current = []
            else:
                current.append(token)
        segments.append(current)
    return [s for s in segments if s]


def _command(line: int, source: str, words: list[str], env=None, launcher: str = "",
             launcher_args=None) -> Optional[Command]:
    """The Command that `words` start, or None when it is not a script of ours."""
    env = dict(env or {})
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):           # VAR=value prefix
        name, value = words[0].split("=", 1)
        env[name], words = value, words[1:]
    if not words:
        return None
    head = os.path.basename(words[0])
    if head in ("mpiexec", "mpirun") and not launcher:
        at = next((i for i, w in enumerate(words) if re.match(r"python[\d.]*$", w)), None)
        if at is None:
            return None
        return _command(line, source, words[at:], env, head, words[1:at])
    if head == "torchrun" and not launcher:
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if at is None:
            return None
        return Command(line, source, "path", words[at], words[at + 1:], env, head,
                       words[1:at])
    if not re.match(r"python[\d.]*$", head) or len(words) < 2:
        return None
    if words[1] == "-m":
        if len(words) < 3 or not words[2].startswith("collectives"):
            return None                                   # pip, pytest: not ours
        return Command(line, source, "module", words[2], words[3:], env, launcher,
                       list(launcher_args or []))
    script = words[1]
    if not script.endswith(".py") or script.split("/")[0] not in OUR_FOLDERS:
        return None                                       # a file the reader writes
    return Command(line, source, "path", script, words[2:], env, launcher,
                   list(launcher_args or []))


#: How a line that runs something starts: env assignments, then a launcher, python or a
#: for loop (output lines, such as a traceback's, never do).
_COMMAND_START = re.compile(r"^\s*([A-Za-z_]\w*=\S*\s+)*(python[\d.]*|mpiexec|mpirun|torchrun|for)\s")

_SUBSHELL_START = re.compile(r"\$\(\s*([A-Za-z_]\w*=\S*\s+)*(python[\d.]*|mpiexec|mpirun|torchrun)\s")


def inline_commands(text: str = README) -> list[tuple[int, str]]:
    """`python benchmarks/X.py --flag` written in the prose (outside fenced blocks, also
    across a line break): (README line, command) for each such `span`."""
    blanked = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                     flags=re.S | re.M)
    return [(blanked.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", blanked)
            if _COMMAND_START.match(" ".join(m.group(1).split()) + " ")]


def readme_commands(blocks: list[Block] = BLOCKS,
                    inline: Optional[list[tuple[int, str]]] = None) -> list[Command]:
    """Every command of ours in the shell and unlabelled blocks (and `inline` ones from
    the prose), loops expanded, each distinct command once."""
    found: dict[tuple, Command] = {}
    sources = [(b.text, _logical_lines(b), False) for b in blocks if b.lang in SHELL_LANGS]
    # A span of the prose may be a synopsis with placeholders (`--nproc N`, `DIR`): each
    # stands for a value, here "1", which every int, float or str option takes.
    sources += [(text, [(line, re.sub(r"(?<!\S)[A-Z][A-Z_]*(?!\S)", "1", text))], True)
                for line, text in inline or []]
    for whole, lines, in_prose in sources:
        loops = _loop_values(whole)
        for line, text in lines:
            if not (_COMMAND_START.match(text) or _SUBSHELL_START.search(text)):
                continue                          # output, a file tree, prose
            for variant in _expand(text, loops):
                for words in _segments(variant):
                    cmd = _command(line, text.strip(), words)
                    if cmd is not None:
                        cmd.inline = in_prose
                        key = (cmd.launcher, tuple(cmd.launcher_args), cmd.target,
                               tuple(cmd.argv), tuple(sorted(cmd.env.items())))
                        found.setdefault(key, cmd)
    return list(found.values())
