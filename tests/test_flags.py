"""One flag vocabulary for every example, every benchmark and ``collectives bench``
(collectives.cli_flags): each answers ``--help`` with status 0, refuses ``--backend foo``
with one line and status 2, builds its parser with ``cli_flags.flag_parser``, defines
none of the renamed flags (``cli_flags.RENAMED``: ``--nprocs``, ``--world``, ``--ranks``,
``--repeats``, ``--rounds``, ``--reps``, ``--runs``, ``--backends``, ``--transports``...),
gives every shared flag (``cli_flags.FLAGS``) the shared parser and metavar, and has not
imported torch when it parses.

One process (tests/scripts/flag_sweep.py) runs every script up to its parse and reports
its parser; the parsers are asked in that process, so the sweep costs one interpreter
start, not two per script. Two commands run for real at the end, end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collectives import cli_flags

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "tests" / "scripts" / "flag_sweep.py"

#: Every script a user runs: the examples, the benchmarks with a main block, our bench.
TARGETS = sorted(
    str(p.relative_to(ROOT)) for folder in ("examples", "benchmarks")
    for p in (ROOT / folder).glob("*.py")
    if '__name__ == "__main__"' in p.read_text()) + ["-m collectives.bench"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("flags") / "sweep.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(SWEEP), str(out), *TARGETS], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["target"]: r for r in json.loads(out.read_text())}


def test_the_sweep_finds_every_script():
    assert len([t for t in TARGETS if t.startswith("examples/")]) >= 9
    assert len([t for t in TARGETS if t.startswith("benchmarks/")]) >= 24
    assert "benchmarks/mpi_jobs.py" not in TARGETS   # a module the benchmarks share


@pytest.mark.parametrize("target", TARGETS)
def test_help_and_a_bad_backend(sweep, target):
    found = sweep[target]
    assert "error" not in found, found["error"]
    assert not found["torch_imported"], f"{target} imports torch before it parses"
    assert found["help"]["code"] == 0 and found["help"]["stdout"].startswith("usage:")
    bad = found["bad_backend"]
    lines = bad["stderr"].splitlines()
    assert bad["code"] == 2 and len(lines) == 1 and "error: " in lines[0], bad
    defines = {s for o in found["options"] for s in o["strings"]}
    if "--backend" in defines:
        assert "argument --backend: unknown backend 'foo'; available here:" in lines[0]
    elif not found["required"]:
        assert "unrecognized arguments: --backend foo" in lines[0]


@pytest.mark.parametrize("target", TARGETS)
def test_one_vocabulary(sweep, target):
    found = sweep[target]
    assert "error" not in found, found["error"]
    assert found["flag_parser"], f"{target}: build the parser with cli_flags.flag_parser"
    for option in found["options"]:
        for name in option["strings"]:
            assert name not in cli_flags.RENAMED, (
                f"{target} defines {name}; the shared name is {cli_flags.RENAMED[name]}")
            flag = cli_flags.FLAGS.get(name)
            if flag is None or option["hidden"]:
                continue
            allowed = {f"{t.__module__}.{t.__qualname__}" for t in
                       (flag.type, flag.several_type) if t is not None}
            assert option["type"] in allowed, (
                f"{target}: {name} parses with {option['type']}, not the shared "
                f"{' or '.join(sorted(allowed))} (cli_flags.add_flag)")
            assert option["metavar"] in (flag.metavar, "LIST"), (target, name, option)


@pytest.mark.parametrize("target, says", [
    ("examples/fsdp.py", ["--strategy {zero1,zero2,zero3}", "--param-dtype"]),
    ("examples/tp.py", ["every rank sees the same batch"]),
    ("examples/pp.py", ["the whole pipeline's samples per step"]),
    ("examples/cp.py", ["every rank sees the same batch"]),
    ("examples/mesh.py", ["dp*ep*cp*tp*pp, the default", "samples of one dp replica"]),
    ("examples/ddp.py", ["samples per rank per step (default: 32)"]),
])
def test_the_help_says_what_the_example_does(sweep, target, says):
    # the help text as argparse wraps it, joined into one line
    text = " ".join(sweep[target]["help"]["stdout"].split())
    for words in says:
        assert words in text, (target, words)
    if target == "examples/mesh.py":
        assert "ranks to spawn (default: 2" not in text


def test_the_shared_parsers():
    assert cli_flags.parse_sizes("4K,1M,4,1G") == [4, 4096, 1 << 20, 1 << 30]
    assert cli_flags.positive_ints("1,2,4") == [1, 2, 4]
    assert cli_flags.backend_names("shm, p2p:zmq") == ["shm", "p2p:zmq"]
    for parse, text in ((cli_flags.parse_size, "4X"), (cli_flags.parse_size, "0"),
                        (cli_flags.parse_sizes, ","), (cli_flags.positive_int, "0"),
                        (cli_flags.positive_ints, "2,x"), (cli_flags.nonnegative_int, "-1"),
                        (cli_flags.seconds, "0"), (cli_flags.backend_name, "foo"),
                        (cli_flags.comma_choices("a", "b"), "a,c")):
        with pytest.raises(Exception) as info:
            parse(text)
        assert type(info.value).__name__ == "ArgumentTypeError", (parse, text)


def test_a_usage_error_is_one_line_and_status_2(capsys):
    parser = cli_flags.flag_parser("demo.py")
    cli_flags.add_flag(parser, "--nproc", default="2", several=True)
    assert parser.parse_args([]).nproc == [2]
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--nproc", "2,0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("demo.py: error: argument --nproc: must be at "
                                       "least 1, got 0\n")
    with pytest.raises(SystemExit):
        parser.parse_args(["--npro", "2"])   # no abbreviations: one spelling per flag
    assert "unrecognized arguments: --npro 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["examples/ddp.py", "--backend", "foo"],
    ["benchmarks/ddp_vs_torch.py", "--backend", "shm,foo"],
    ["-m", "collectives", "bench", "--sizes", "4K,lots"],
])
def test_a_real_command_refuses_before_importing_torch(argv):
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")]
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and "torch" not in imported, said
    assert len(said) == 1 and "error: argument --" in said[0], said
