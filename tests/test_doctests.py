"""The ``>>>`` examples of the library's docstrings run, each docstring one test.

``tests/doctest_cases.py`` finds them and says how each must run: in this process
(``local``), as a program of its own that starts ranks (``ranks``: two-rank examples
with ``collectives.spawn``), or not on this machine (``skip``, with the reason).
Each runs in an empty temporary folder, so an example that writes a file leaves
nothing behind.

Run: ``python -m pytest tests/test_doctests.py -q`` (``-k parallel.pp`` for some).
"""

from __future__ import annotations

import doctest
import io
import os
import subprocess
import sys

import pytest

from doctest_cases import (OPTIONS, ROOT, collect, prompts_in_sources, script_of,
                           skipped_examples)

CASES = collect()
#: seconds a program of ranks may take (a spawn of two ranks takes about one)
RANKS_TIMEOUT_S = 120


def _param(case):
    marks = [pytest.mark.skip(reason=f"{case.where}: {case.reason}")] \
        if case.kind == "skip" else []
    return pytest.param(case, id=case.name, marks=marks)


def test_every_example_is_found():
    # doctest's finder misses examples in some places (a nested function's docstring, a
    # string that is not a docstring): none may hide there, never run.
    found = sum(len(case.test.examples) for case in CASES)
    assert found == prompts_in_sources(), \
        "some '>>>' lines are in no docstring the doctest finder reaches"


@pytest.mark.parametrize("where, source", [
    pytest.param(where, source, id=where,
                 marks=pytest.mark.skip(reason=f"{where}: marked +SKIP: {source}"))
    for where, source in skipped_examples(CASES)])
def test_examples_marked_skip(where, source):
    """Never runs: lists, as skipped tests, the examples doctest is told to skip."""


@pytest.mark.parametrize("case", [_param(c) for c in CASES if c.kind != "ranks"])
def test_local_examples(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    test = case.test
    test.globs = dict(test.globs)   # (each run starts from the module's globals)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    result = runner.run(test, out=report.write, clear_globs=True)
    assert result.failed == 0, f"{case.where}:\n{report.getvalue()}"


@pytest.mark.parametrize("case", [_param(c) for c in CASES if c.kind == "ranks"])
def test_examples_that_start_ranks(case, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(script_of(case))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RANKS_TIMEOUT_S)
    assert done.returncode == 0, \
        f"{case.where}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
