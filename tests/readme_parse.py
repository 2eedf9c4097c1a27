"""The fenced code blocks of README.md and of every page in docs/, and the commands of
ours in them, for tests/test_readme_blocks.py.

``readme_blocks()`` splits one page into its fenced blocks (language, line, nearest
heading, the prose after each, a ``not-run`` marker above it); ``readme_commands()``
finds, in the shell and unlabelled blocks (and in `spans` of the prose), every command
that starts a script of ours, the way a reader would type it: ``VAR=value`` prefixes,
``mpiexec -n N``, ``srun ...`` or ``torchrun ...`` in front, ``\\`` continuations joined,
``for`` loops expanded over their values, ``$(...)``, pipes and redirections taken apart,
``pip``/``pytest`` lines and output left out; the ``collectives`` command is ``python -m
collectives``::

    >>> [c.target for c in readme_commands([Block("bash", 1, "# x",
    ...     "mpiexec -n 2 python examples/ddp.py --epochs 1  # two ranks\\n")])]
    ['examples/ddp.py']

A block that cannot run on a CPU-only machine with one host (a GPU, a real cluster) says
so in an HTML comment on the last non-blank line above its fence, with the reason after
the colon, which a rendered page does not show and the tests honour and count::

    <!-- not-run: needs a GPU -->
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
#: Every page whose blocks are checked: the README, then the site's pages (docs/*.md,
#: docs/reference/*.md; not a build's output or the extensions' folder) in name order.
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
    if not {"_build", "_ext"} & set(p.relative_to(ROOT / "docs").parts))
#: Folders whose scripts are "ours": a command naming a script there must find it.
OUR_FOLDERS = ("examples", "benchmarks", "tests", "collectives", "parallel", "backends")
#: The marker that keeps a block from running, and its reason.
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->\s*$")


def page_text(page: str) -> str:
    """The text of `page` (a path relative to the repository root)."""
    return (ROOT / page).read_text()


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
    page: str = "README.md"
    #: The reason of a ``<!-- not-run: ... -->`` marker above the block; "" runs it.
    not_run: str = ""

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lstrip("#").lower()).strip("-")
        return f"{Path(self.page).stem}:{slug[:40].rstrip('-')}-L{self.line}"

    @property
    def where(self) -> str:
        """``docs/x.md line N``: where a failure points the reader."""
        return f"{self.page} line {self.line}"


def _fence(line: str) -> Optional[re.Match]:
    """An opening fence (```` ``` ```` or ``~~~``, three or more) with its info string."""
    return re.match(r"^(`{3,}|~{3,})\s*([^`\s]*)[^`]*$", line)


def readme_blocks(text: str = README, page: str = "README.md") -> list[Block]:
    """The fenced blocks of `text` in order, each with the prose that follows it and the
    reason of a ``not-run`` marker on the last non-blank line above its fence. A block
    closes at a fence of the same character at least as long (so a MyST directive such
    as ```` ```{toctree} ```` is one block, language ``{toctree}``)."""
    lines = text.split("\n")
    blocks: list[Block] = []
    heading, i, prose_start = "(top)", 0, 0
    while i < len(lines):
        line = lines[i]
        fence = _fence(line)
        if line.startswith("#"):
            heading = line.strip()
        elif fence:
            mark, end = fence.group(1), i + 1
            while end < len(lines) and not (lines[end].startswith(mark[0] * len(mark))
                                            and not lines[end].strip(mark[0]).strip()):
                end += 1
            if blocks:
                blocks[-1].after = "\n".join(lines[prose_start:i])
            above = next((l for l in reversed(lines[prose_start:i]) if l.strip()), "")
            marker = NOT_RUN.match(above.strip())
            blocks.append(Block(fence.group(2), i + 2, heading,
                                "\n".join(lines[i + 1:end]) + "\n", page=page,
                                not_run=marker.group(1) if marker else ""))
            i, prose_start = end, end + 1
        i += 1
    if blocks:
        blocks[-1].after = "\n".join(lines[prose_start:])
    for first, second in zip(blocks, blocks[1:]):
        first.next_block = second
    return blocks


def not_run_markers(text: str) -> list[tuple[int, str]]:
    """(line, reason) of every ``not-run`` marker in `text`, block or not."""
    return [(n, m.group(1)) for n, line in enumerate(text.split("\n"), 1)
            for m in [NOT_RUN.match(line.strip())] if m]


def named_block(name: str) -> tuple[str, Block]:
    """The page and the block a script called `name` is in: the first fenced block after
    the first mention of `` `name` `` on the first page (in PAGES order) that mentions
    it, as tests/test_readme_kit.py saves and runs it."""
    for page in PAGES:
        text = page_text(page)
        at = text.find(f"`{name}`")
        if at < 0:
            continue
        line = text.count("\n", 0, at) + 1
        for block in readme_blocks(text, page):
            if block.line > line:
                return page, block
    raise LookupError(f"no page mentions `{name}` before a code block")


def kit_blocks() -> set[tuple[str, int]]:
    """(page, line) of the blocks tests/test_readme_kit.py runs, found by the file names
    it asks for (``run_script("NAME")``/``readme_block("NAME")``)."""
    names = set(re.findall(r'(?:run_script|readme_block)\("([\w.]+)"', KIT_TEST.read_text()))
    found = set()
    for name in names:
        try:
            page, block = named_block(name)
        except LookupError:
            continue
        found.add((page, block.line))
    return found


BLOCKS = [b for page in PAGES for b in readme_blocks(page_text(page), page)]
KIT_BLOCKS = kit_blocks()
#: Pages whose python blocks a test of their own runs (with checks of its own), so the
#: generic test leaves them to it; that test must name the page.
RUN_ELSEWHERE = {"docs/cp.md": "tests/test_cp_docs.py",
                 "docs/expert-parallel.md": "tests/test_ep_docs.py",
                 "docs/hierarchical.md": "tests/test_hier.py"}
#: The python blocks tests/test_readme_blocks.py runs: all but the kit test's, those of
#: RUN_ELSEWHERE's pages, and the ones marked not-run.
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python" and not b.not_run
                 and (b.page, b.line) not in KIT_BLOCKS and b.page not in RUN_ELSEWHERE]


# ------------------------------------------------------------------ shell commands

SHELL_LANGS = ("", "bash", "sh", "shell", "console")
#: Separators between commands on one line; the bootstrap checks each command alone.
_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}


@dataclass
class Command:
    """One command of ours from a page's shell block: ``env`` prefix, the launcher
    (``""``, ``mpiexec``/``mpirun``, ``srun`` or ``torchrun``) and its options, and the
    script (a path) or module with its arguments."""
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
    page: str = "README.md"

    @property
    def id(self) -> str:
        words = [self.launcher, *self.launcher_args, self.target, *self.argv]
        return f"{Path(self.page).stem}:L{self.line}:" + " ".join(w for w in words if w)[:90]

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def _quote_open(text: str) -> bool:
    """True when ``text`` ends inside a quoted string (it goes on on the next line)."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    try:
        list(lexer)
    except ValueError:
        return True
    return False


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with ``\\`` continuations and quoted strings that span lines
    (``python -c "...``) joined, each with its page line."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for offset, line in enumerate(block.text.splitlines()):
        if not pending:
            start = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if _quote_open(pending + line):
            pending += line + "\n"
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


def _take_subshells(text: str) -> tuple[str, list[str]]:
    """``text`` with every ``$(...)`` (parentheses inside balanced, e.g. a
    ``python -c 'print(f())'``) replaced by a space, and the subshells' commands."""
    inner: list[str] = []
    out, i = [], 0
    while (start := text.find("$(", i)) >= 0:
        depth, j = 0, start + 1
        while j < len(text):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        out.append(text[i:start] + " ")
        inner.append(text[start + 2:j])
        i = j + 1
    out.append(text[i:])
    return "".join(out), inner


def _segments(text: str) -> list[list[str]]:
    """The simple commands of one shell line: subshells ``$(...)`` taken out as
    commands of their own, ``for ... do``/``done`` and redirections dropped, split at
    ``&&``, ``;``, ``|``; ``#`` comments removed."""
    text, inner = _take_subshells(text)
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
    if head == "collectives" and not launcher:           # the installed command
        return Command(line, source, "module", "collectives", words[1:], env)
    if head in ("mpiexec", "mpirun", "srun") and not launcher:
        at = next((i for i, w in enumerate(words) if re.match(r"python[\d.]*$", w)), None)
        if at is None:
            return None
        return _command(line, source, words[at:], env, head, words[1:at])
    if head == "torchrun" and not launcher:
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if at is None or words[at].split("/")[0] not in OUR_FOLDERS:
            return None                                   # a file the reader writes
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
_COMMAND_START = re.compile(
    r"^\s*([A-Za-z_]\w*=\S*\s+)*(python[\d.]*|mpiexec|mpirun|srun|torchrun|collectives|for)\s")

_SUBSHELL_START = re.compile(
    r"\$\(\s*([A-Za-z_]\w*=\S*\s+)*(python[\d.]*|mpiexec|mpirun|srun|torchrun|collectives)\s")


def inline_commands(text: str = README) -> list[tuple[int, str]]:
    """`python benchmarks/X.py --flag` written in the prose (outside fenced blocks, also
    across a line break): (page line, command) for each such `span`."""
    blanked = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                     flags=re.S | re.M)
    return [(blanked.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", blanked)
            if _COMMAND_START.match(" ".join(m.group(1).split()) + " ")]


def page_inline_commands() -> list[tuple[str, int, str]]:
    """(page, line, command) for every command `span` in the prose of every page."""
    return [(page, line, text) for page in PAGES
            for line, text in inline_commands(page_text(page))]


def readme_commands(blocks: list[Block] = BLOCKS,
                    inline: Optional[list[tuple]] = None) -> list[Command]:
    """Every command of ours in the shell and unlabelled blocks not marked not-run (and
    `inline` ones from the prose: ``(line, text)`` of the README or ``(page, line,
    text)``), loops expanded, each distinct command once."""
    found: dict[tuple, Command] = {}
    sources = [(b.text, _logical_lines(b), False, b.page) for b in blocks
               if b.lang in SHELL_LANGS and not b.not_run]
    # A span of the prose may be a synopsis with placeholders (`--nproc N`, `DIR`): each
    # stands for a value, here "1", which every int, float or str option takes.
    for item in inline or []:
        page, line, text = item if len(item) == 3 else ("README.md", *item)
        sources.append((text, [(line, re.sub(r"(?<!\S)[A-Z][A-Z_]*(?!\S)", "1", text))],
                        True, page))
    for whole, lines, in_prose, page in sources:
        loops = _loop_values(whole)
        for line, text in lines:
            if not (_COMMAND_START.match(text) or _SUBSHELL_START.search(text)):
                continue                          # output, a file tree, prose
            for variant in _expand(text, loops):
                for words in _segments(variant):
                    cmd = _command(line, text.strip(), words)
                    if cmd is not None:
                        cmd.inline, cmd.page = in_prose, page
                        key = (cmd.launcher, tuple(cmd.launcher_args), cmd.target,
                               tuple(cmd.argv), tuple(sorted(cmd.env.items())))
                        found.setdefault(key, cmd)
    return list(found.values())


# ------------------------------------------------------------ the reader's own scripts

@dataclass
class ScriptRun:
    """A command that runs a script the page has the reader save (``python hello.py``,
    ``mpiexec -n 2 python hello.py``, ``torchrun ... hello.py``): the script is the page's
    block named `name`; `stated` is the comment on the command's line, if any."""
    page: str
    line: int
    source: str
    name: str
    block: Block
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = ""
    launcher_args: list[str] = field(default_factory=list)
    stated: str = ""

    @property
    def id(self) -> str:
        words = [*(f"{k}={v}" for k, v in self.env.items()), self.launcher,
                 *self.launcher_args, self.name, *self.argv]
        return f"{Path(self.page).stem}:L{self.line}:" + " ".join(w for w in words if w)

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def _reader_words(words: list[str]) -> Optional[tuple]:
    """(env, launcher, launcher args, script, args) when `words` run a script of the
    reader's (a bare ``NAME.py``, not one of ours), else None."""
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        name, value = words[0].split("=", 1)
        env[name], words = value, words[1:]
    if not words:
        return None
    head, launcher, launcher_args = os.path.basename(words[0]), "", []
    if head in ("mpiexec", "mpirun", "torchrun"):
        pick = (lambda w: w.endswith(".py")) if head == "torchrun" else \
            (lambda w: bool(re.match(r"python[\d.]*$", w)))
        at = next((i for i, w in enumerate(words) if pick(w)), None)
        if at is None:
            return None
        launcher, launcher_args = head, words[1:at]
        words = words[at:] if head == "torchrun" else words[at + 1:]
    elif re.match(r"python[\d.]*$", head):
        words = words[1:]
    else:
        return None
    if not words or not re.match(r"^[\w-]+\.py$", words[0]):
        return None                                 # python -m ..., a path of ours
    return env, launcher, launcher_args, words[0], words[1:]


def _named_block_on(page: str, name: str) -> Optional[Block]:
    """The first block after the page's first mention of `` `name` ``, if a python one."""
    text = page_text(page)
    at = text.find(f"`{name}`")
    if at < 0:
        return None
    line = text.count("\n", 0, at) + 1
    block = next((b for b in readme_blocks(text, page) if b.line > line), None)
    return block if block is not None and block.lang == "python" else None


def reader_script_runs() -> list[ScriptRun]:
    """Every command, in a shell block or a `span` of the prose, that runs a script the
    same page has the reader save, each distinct command once."""
    found: dict[tuple, ScriptRun] = {}
    for page in PAGES:
        text = page_text(page)
        lines = [(ln, t) for b in readme_blocks(text, page)
                 if b.lang in SHELL_LANGS and not b.not_run for ln, t in _logical_lines(b)]
        lines += inline_commands(text)
        for line, source in lines:
            if not _COMMAND_START.match(source):
                continue
            stated = source.split("#", 1)[1].strip() if "#" in source else ""
            for words in _segments(source):
                parsed = _reader_words(words)
                if parsed is None:
                    continue
                env, launcher, launcher_args, name, argv = parsed
                block = _named_block_on(page, name)
                if block is None or block.not_run:
                    continue
                key = (page, name, tuple(sorted(env.items())), launcher,
                       tuple(launcher_args), tuple(argv))
                found.setdefault(key, ScriptRun(page, line, source.strip(), name, block,
                                                argv, env, launcher, launcher_args, stated))
    return list(found.values())
