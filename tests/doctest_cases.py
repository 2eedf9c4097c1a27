"""The library's docstring examples (``>>>``), found and sorted by how they must run.

``tests/test_doctests.py`` runs them; this module only finds them:

- every module file of ``collectives``, ``backends``, ``parallel`` and ``examples/common``
  (a ``__main__`` module only where its command is guarded by ``__name__``) is imported and
  searched with ``doctest.DocTestFinder``: one :class:`DocCase` per docstring that holds
  examples;
- ``local`` cases run in the test's own process, as ``python -m doctest`` would, with
  the module's globals;
- ``ranks`` cases start ranks (``collectives.spawn(...)``): their ranks must import the
  functions the examples define, which works only from a real program's ``__main__``.
  :func:`script_of` writes such a docstring as that program: the examples that only
  define (``def``, ``class``, ``import``) at its top level, where a rank importing the
  program by path finds them, and all its examples, run by doctest in the program's own
  namespace, under ``if __name__ == "__main__":``. Such examples import what they use
  (a reader runs them as a script of their own, not inside the module);
- ``skip`` cases need what this machine may lack (a GPU, an MPI launcher): the reason
  says which, and pytest counts them.

Every example runs with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` (a long expected value
may wrap as the code's line length asks). An example that cannot run anywhere as
written (it shows output that depends on the machine, say) keeps doctest's
``# doctest: +SKIP``; doctest counts those too, as skipped examples.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("collectives", "backends", "parallel", "examples/common")
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: An example that starts ranks (collectives.spawn, or spawn imported from it).
STARTS_RANKS = re.compile(r"\bspawn\(")
#: What an example may need that a machine may not have: (pattern, reason).
NEEDS = (
    (re.compile(r"\bcuda\b|\bnccl\b"), "needs a CUDA GPU"),
    (re.compile(r"\bmpiexec\b|\bmpirun\b|\bsrun\b"), "needs an MPI launcher"),
)
PROMPT = re.compile(r"^\s*>>> ", re.MULTILINE)


@dataclass
class DocCase:
    """One docstring's examples: ``kind`` is ``local``, ``ranks`` or ``skip``."""

    module: str
    test: doctest.DocTest
    kind: str
    reason: str = ""

    @property
    def name(self) -> str:
        return self.test.name

    @property
    def where(self) -> str:
        line = (self.test.lineno or 0) + 1
        return f"{Path(self.test.filename).relative_to(ROOT)}:{line}"


def module_files() -> list[Path]:
    """The files searched: every module of the packages; a ``__main__.py`` only where
    its command runs under ``if __name__ == "__main__":`` (importing it then runs none)."""
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if path.name != "__main__.py" or '__name__ == "__main__"' in path.read_text()]


def module_names() -> list[str]:
    """The dotted names of the modules searched, in file order."""
    names = []
    for path in module_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def classify(test: doctest.DocTest) -> tuple[str, str]:
    source = "\n".join(example.source for example in test.examples)
    for pattern, reason in NEEDS:
        if pattern.search(source):
            return "skip", reason
    return ("ranks" if STARTS_RANKS.search(source) else "local"), ""


def collect() -> list[DocCase]:
    """Every docstring with examples in the searched modules (see the module's doc)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    cases = []
    for name in module_names():
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            # (the finder also yields objects the module imported from elsewhere)
            if test.examples and test.filename == module.__file__:
                kind, reason = classify(test)
                cases.append(DocCase(name, test, kind, reason))
    return sorted(cases, key=lambda case: (case.test.filename, case.test.lineno or 0))


def skipped_examples(cases: list[DocCase]) -> list[tuple[str, str]]:
    """``(where, source)`` of every example marked ``# doctest: +SKIP``."""
    return [(f"{case.where.rsplit(':', 1)[0]}:{case.test.lineno + example.lineno + 1}",
             example.source.strip())
            for case in cases for example in case.test.examples
            if example.options.get(doctest.SKIP)]


def prompts_in_sources() -> int:
    """``>>>`` lines in the searched files: each should be an example a case holds."""
    return sum(len(PROMPT.findall(path.read_text())) for path in module_files())


def _only_defines(source: str) -> bool:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    return bool(body) and all(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.ClassDef, ast.Import, ast.ImportFrom))
                              for node in body)


def script_of(case: DocCase) -> str:
    """A program that runs ``case``'s examples as a user's script would (module doc);
    it exits 1 with doctest's report when an example fails."""
    definitions = "".join(example.source for example in case.test.examples
                          if _only_defines(example.source))
    return (f"# The examples of {case.name} ({case.where}), as a program.\n"
            f"{definitions}\n"
            "if __name__ == '__main__':\n"
            "    import doctest, sys\n"
            f"    test = doctest.DocTestParser().get_doctest({case.test.docstring!r}, "
            f"{{}}, {case.name!r}, {case.test.filename!r}, {case.test.lineno!r})\n"
            "    test.globs = globals()   # not a copy: examples define in __main__\n"
            f"    runner = doctest.DocTestRunner(optionflags={OPTIONS})\n"
            "    sys.exit(1 if runner.run(test, clear_globs=False).failed else 0)\n")
