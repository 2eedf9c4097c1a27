"""Every code block of README.md and of every page in docs/ that a reader can run,
checked against the code.

Two kinds of checks, one test per block or command, each named by its page, the nearest
heading and the line, so that a failure says where the documentation went stale:

- ``test_python_block``: every ```python block that ``tests/test_readme_kit.py`` (or a
  page's own test, ``RUN_ELSEWHERE``) does not already run, saved in a fresh folder and
  started with ``python FILE`` (``PYTHONPATH`` = the repository root,
  ``OMP_NUM_THREADS=1``), must exit 0 within its timeout. Where the page states the
  output next to the block (a comment on the ``print`` line, a following unlabelled
  block after "prints", or "prints `...`" right after the block), the key parts of it
  must appear in what the block printed; a Python literal in the comment of the block's
  last ``print`` line must equal the last line printed.
- ``test_command_arguments``: every shell command in ```bash and unlabelled blocks that
  starts a script of ours (``python examples/X.py``, ``mpiexec -n N python ...``,
  ``torchrun ... SCRIPT ...``, ``python benchmarks/X.py``, ``python -m collectives.X``,
  with env-var prefixes, ``\\`` continuations and ``for`` loops, whose variables are
  expanded over their values) must pass the script's own argparse parser. Nothing is
  trained or measured: one process (``tests/scripts/parse_only.py``) runs every script
  with ``ArgumentParser.parse_args`` patched to stop right after a successful parse (the
  examples instead stop in ``examples.common.cli.launch``, so their own checks after
  the parse, e.g. mesh.py's ``--nproc`` = dp*tp*pp, run too); an unknown, abbreviated or
  malformed flag is argparse's exit status 2 and fails the test that names the page
  and line. Inline `spans` of the prose that start such a command are checked the same way;
  ``collectives CMD`` (the installed command) is ``python -m collectives CMD``.
- ``test_reader_script_command``: a command that runs a script the page has the reader
  save (``python which_path.py``, ``mpiexec -n 2 python hello.py``, ``torchrun ...
  hello.py``) runs it, saved from the page's block, under that launcher and environment:
  it must exit 0, and print last the literal its comment states, if any.
- Blocks that cannot run on a CPU-only machine of one host carry a ``<!-- not-run:
  REASON -->`` marker on the line above their fence: they are left out of both checks,
  listed by ``test_not_run_blocks_are_few_and_say_why``, and at most
  ``MAX_NOT_RUN`` of them are allowed.

The pages are split into blocks and commands by ``tests/readme_parse.py``.

Run: ``python -m pytest tests/test_readme_blocks.py -q``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest

from readme_parse import (BLOCKS, KIT_BLOCKS, PAGES, PYTHON_BLOCKS, ROOT, RUN_ELSEWHERE,
                          Block, Command, ScriptRun, inline_commands, not_run_markers,
                          page_inline_commands, page_text, readme_blocks, readme_commands,
                          reader_script_runs)

#: Seconds one python block may run; the slowest measured here took well under half.
BLOCK_TIMEOUT = 180.0
PARSE_ONLY = ROOT / "tests" / "scripts" / "parse_only.py"


# ------------------------------------------------------------ what the pages say they print

def _squash(text: str) -> str:
    return " ".join(text.split())


def _comment(block: Block, marker: str) -> str:
    """The comment on the block's line that contains `marker`."""
    line = next(l for l in block.text.splitlines() if marker in l)
    return line.split("#", 1)[1].strip()


def _expect_output_block(block: Block, out: str) -> list[str]:
    """A following unlabelled block, with at most the word "prints" between: every line of
    it is a line of the output."""
    between = block.after.strip()
    nxt = block.next_block
    if nxt is None or nxt.lang or between not in ("", "prints", "prints:"):
        return []
    lines = [l.rstrip() for l in out.splitlines()]
    missing = [l for l in nxt.text.splitlines() if l.strip() and l.rstrip() not in lines]
    assert not missing, (f"{nxt.where}: the output shown is not what the block "
                         f"printed; missing lines {missing}\n--- printed:\n{out}")
    return nxt.text.splitlines()


def _expect_prints_spans(block: Block, out: str) -> list[str]:
    """"prints `X`, ... `Y`" right after the block: every `span` of that paragraph appears
    in the output (whitespace squashed)."""
    paragraph = block.after.strip().split("\n\n")[0]
    if not paragraph.startswith("prints"):
        return []
    blanked = re.sub(r"`[^`]+`", lambda m: "x" * len(m.group(0)), paragraph)
    end = re.search(r"\.(\s|$)", blanked)                  # the first sentence only
    paragraph = paragraph[:end.start() if end else len(paragraph)]
    spans = [_squash(s) for s in re.findall(r"`([^`]+)`", paragraph)]
    printed = _squash(out)
    missing = [s for s in spans
               if not re.search(r"(?<!\S)" + re.escape(s) + r"(?!\S)", printed)]
    assert not missing, (f"{block.page} after line {block.line}: says it prints {missing}\n"
                         f"--- printed:\n{out}")
    return spans


def _last_literal(out: str):
    return ast.literal_eval(out.strip().splitlines()[-1])


def _stated_literal(block: Block):
    """The Python literal in the comment of the block's last ``print(`` line, or None:
    ``print(collectives.spawn(main, 2))   # [True, True]``."""
    prints = [l for l in block.text.splitlines() if "print(" in l and "#" in l]
    if not prints:
        return None
    try:
        return (ast.literal_eval(prints[-1].split("#", 1)[1].strip()),)
    except (ValueError, SyntaxError):
        return None


def _expect_stated_literal(block: Block, out: str) -> list[str]:
    stated = _stated_literal(block)
    if stated is None:
        return []
    printed = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        got = ast.literal_eval(printed)
    except (ValueError, SyntaxError):
        got = printed
    assert got == stated[0], (f"{block.where}: the last print says {stated[0]!r} in its "
                              f"comment, the block printed {printed!r}\n--- printed:\n{out}")
    return [repr(stated[0])]


def _check_api(block: Block, out: str) -> None:
    # "# both ranks: [3., 3., 3., 3.]" after the all_reduce; MAX and the send keep it.
    values = ast.literal_eval(_comment(block, "pg.all_reduce(t)").split(":", 1)[1].strip()
                              .replace(".,", ".0,").replace(".]", ".0]"))
    assert _last_literal(out) == [values, values], f"expected {[values, values]}"


def _check_tp_layers(block: Block, out: str) -> None:
    # "# [((16, 16), (4, 16), True, True), ...]": that tuple on each of the 2 ranks.
    one = ast.literal_eval(_comment(block, "spawn(main, 2)").replace(", ...]", "]"))[0]
    assert _last_literal(out) == [one, one], f"expected {[one, one]}"


def _check_tp_transformer(block: Block, out: str) -> None:
    # "# the same loss twice on each rank": (loss, reference) equal, and equal across ranks.
    assert "the same loss twice" in _comment(block, "spawn(main, 2)")
    result = _last_literal(out)
    assert len(result) == 2 and all(a == b for a, b in result) and result[0] == result[1], \
        "expected [(loss, loss), (loss, loss)]: one loss, twice on each of 2 ranks"


def _check_fsdp_shape(block: Block, out: str) -> None:
    expected = _comment(block, "print(shape)")              # torch.Size([256, 256])
    assert out.splitlines()[0].strip() == expected, f"expected {expected!r} first"


def _check_pipeline(block: Block, out: str) -> None:
    # "# [None, 1.3269]: rank 1 has the loss"
    expected = re.match(r"(\[.*?\])", _comment(block, "spawn(main, 2)")).group(1)
    assert out.strip().splitlines()[-1] == expected, f"expected {expected!r} last"


def _check_mesh(block: Block, out: str) -> None:
    # "# rank 5: (1, 0, 1), (4, 5), (1, 5), 2, 9.0": what rank 5 printed.
    rank, values = re.match(r"rank (\d+): (.*)", _comment(block, "print(rank, seen)")).groups()
    expected = ast.literal_eval(f"({values})")
    lines = {int(l.split(" ", 1)[0]): ast.literal_eval(l.split(" ", 1)[1])
             for l in out.strip().splitlines()}
    assert tuple(lines[int(rank)]) == expected, f"expected rank {rank}: {expected}"
    assert sorted(lines) == list(range(8)), "expected a line for each of ranks 0-7"


#: A marker (a line of the block) -> a check of the printed output against the page's
#: comment on that block. Each marker must be in exactly one block
#: (``test_every_output_check_names_one_block``).
OUTPUT_CHECKS: dict[str, Callable[[Block, str], None]] = {
    "pg.all_gather(out, np.full(2, pg.rank, np.float32))": _check_api,
    "col = ColumnParallelLinear.from_dense(fc1, pg)": _check_tp_layers,
    "block = ParallelTransformerBlock(hidden, heads, pg, sequence_parallel=True)":
        _check_tp_transformer,
    "print(shape)  # torch.Size([256, 256])": _check_fsdp_shape,
    "sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.mse_loss)": _check_pipeline,
    'mesh = DeviceMesh(pg, (2, 2, 2), ("dp", "pp", "tp"))': _check_mesh,
}
#: Blocks left to ``-m slow``, by a line of theirs. torch's DDP over the "collectives"
#: backend on zmq is the slowest block (9-17 s here, alone or beside another: two fresh
#: ranks import torch.distributed and rendezvous twice, torch's store and zmq's); with it
#: the default file took 81-84 s at load average 4-7, without it 44-84 s at load 4-8
#: (most of it torch imports: 17 fresh interpreters). Its calls are checked by default in
#: tests/test_torch_backend.py. Moving another block to slow is one line here.
SLOW_MARKERS: tuple[str, ...] = ('dist.init_process_group("collectives")',)


def _block_params() -> list:
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if any(
        m in b.text for m in SLOW_MARKERS) else []) for b in PYTHON_BLOCKS]


#: The most ``not-run`` blocks the pages may hold: exceptions stay few.
MAX_NOT_RUN = 8    # a GPU (nccl) and a real cluster (sbatch, several nodes) only


def run_block(block: Block, timeout: float = BLOCK_TIMEOUT):
    """Save the block as readme_block.py in a fresh folder and run ``python`` on it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="readme-block-") as folder:
        Path(folder, "readme_block.py").write_text(block.text)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "readme_block.py"], cwd=folder, env=env,
                              text=True, capture_output=True, timeout=timeout)
        return done, time.monotonic() - start


#: Blocks run at the same time: most of a block's time is its ranks starting (imports,
#: rendezvous), so two at once keep the file well inside its time on 2 cores.
BLOCK_WORKERS = 2


@pytest.fixture(scope="module")
def block_runs(request):
    """Every selected python block started once, BLOCK_WORKERS at a time; each test waits
    for its own."""
    selected = sorted({item.callspec.params["block"].id for item in request.session.items
                       if getattr(item, "originalname", "") == "test_python_block"})
    by_id = {b.id: b for b in PYTHON_BLOCKS}
    pool = ThreadPoolExecutor(BLOCK_WORKERS)
    try:
        yield {key: pool.submit(run_block, by_id[key]) for key in selected}
    finally:                          # after a -x stop, start no block still waiting
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("block", _block_params())
def test_python_block(block: Block, block_runs):
    try:
        done, seconds = block_runs[block.id].result()
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT:.0f} s")
    print(f"{block.where} ({block.heading}): {seconds:.1f} s")
    assert done.returncode == 0, (f"{block.where}: exit status "
                                  f"{done.returncode}\n{done.stderr[-3000:]}")
    checked = (_expect_output_block(block, done.stdout)
               + _expect_prints_spans(block, done.stdout))
    if not any(m in block.text for m in OUTPUT_CHECKS):
        checked += _expect_stated_literal(block, done.stdout)
    for marker, check in OUTPUT_CHECKS.items():
        if marker in block.text:
            try:
                check(block, done.stdout)
            except AssertionError as exc:
                raise AssertionError(
                    f"{block.where}: the block did not print what the page "
                    f"says next to `{marker}`: {exc}\n--- printed:\n{done.stdout}") from None
            checked.append(marker)
    print(f"  checked {len(checked)} stated outputs")


def test_every_block_with_a_stated_output_is_checked():
    # A `print(...)  # what it prints` line, or "prints" after the block, with no check
    # here, would let that output go stale unseen: add it to OUTPUT_CHECKS.
    for block in PYTHON_BLOCKS:
        states = any("print(" in l and "#" in l for l in block.text.splitlines()) \
            or block.after.strip().startswith("prints")
        generic = block.after.strip().startswith("prints")   # both generic checks need it
        generic = generic or (block.after.strip() == "" and block.next_block is not None
                              and block.next_block.lang == "")
        generic = generic or _stated_literal(block) is not None
        assert not states or generic or any(m in block.text for m in OUTPUT_CHECKS), \
            f"{block.where}: states an output that no check reads"


def test_every_output_check_names_one_block():
    for marker in [*OUTPUT_CHECKS, *SLOW_MARKERS]:
        holders = [b.id for b in PYTHON_BLOCKS if marker in b.text]
        assert len(holders) == 1, f"output check {marker!r} matches blocks {holders}"


def test_the_block_finder_sees_the_kit_blocks_and_the_others():
    assert len(KIT_BLOCKS) >= 3, KIT_BLOCKS                    # the kit's scripts
    assert all(b.lang == "python" for b in BLOCKS if (b.page, b.line) in KIT_BLOCKS)
    assert len(PYTHON_BLOCKS) >= 15, [b.id for b in PYTHON_BLOCKS]
    assert {"README.md", "docs/getting-started.md", "docs/concepts.md"} <= set(PAGES)
    assert any(b.page == "README.md" for b in PYTHON_BLOCKS)


def test_a_page_run_elsewhere_is_run_by_its_test():
    # The generic runner leaves these pages' python blocks to their own test: that test
    # must still read the page and run them.
    for page, test in RUN_ELSEWHERE.items():
        source = (ROOT / test).read_text()
        assert page.split("/")[-1] in source and "python" in source, (page, test)
        assert any(b.page == page and b.lang == "python" for b in BLOCKS), page


def test_not_run_blocks_are_few_and_say_why():
    marked = [b for b in BLOCKS if b.not_run]
    for block in marked:
        print(f"not run: {block.where} ({block.lang or 'text'}): {block.not_run}")
    print(f"{len(marked)} block(s) not run, of {len(BLOCKS)} on {len(PAGES)} pages")
    assert len(marked) <= MAX_NOT_RUN, [b.where for b in marked]
    for page in PAGES:
        text = page_text(page)
        at_blocks = {(b.line, b.not_run) for b in BLOCKS if b.page == page and b.not_run}
        for line, reason in not_run_markers(text):
            assert reason, f"{page} line {line}: a not-run marker must say why"
            following = [b for b in BLOCKS if b.page == page and b.line > line]
            assert following and (following[0].line, reason) in at_blocks, \
                f"{page} line {line}: the not-run marker is not right above a code block"


def test_a_not_run_marker_is_read_from_the_line_above_the_fence():
    text = ("# t\n\n<!-- not-run: needs a GPU -->\n```python\nimport torch\n```\n\n"
            "```bash\npython examples/ddp.py\n```\n")
    first, second = readme_blocks(text, "made-up.md")
    assert (first.not_run, second.not_run) == ("needs a GPU", "")
    assert readme_commands([first]) == [] and len(readme_commands([second])) == 1


#: Seconds one script may run in the bootstrap before it counts as past its parser.
PARSE_SECONDS = 60


def _parses_with_argparse(path: Path) -> bool:
    source = path.read_text()
    return "argparse" in source or "parse_args(" in source


def bootstrap_checks(cmd: Command) -> list[dict]:
    """What the bootstrap runs for one command of a page: torchrun's own parser on its
    options, then the script's (or module's) parser on the script's arguments."""
    checks: list[dict] = []
    if cmd.inline and not cmd.argv and not cmd.launcher:
        return checks                                  # a mention: it must only exist
    if cmd.launcher == "torchrun":
        checks.append({"kind": "module", "target": "torch.distributed.run",
                       "argv": [*cmd.launcher_args, cmd.target, *cmd.argv]})
    if cmd.kind == "module" or _parses_with_argparse(ROOT / cmd.target):
        checks.append({"kind": cmd.kind, "target": cmd.target, "argv": cmd.argv})
    for check in checks:
        check.update(env=cmd.env, seconds=PARSE_SECONDS)
    return checks


def run_bootstrap(checks: list[dict], timeout: float = 600.0) -> list[dict]:
    """One process runs every check in turn (torch and the scripts' imports load once)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="readme-args-") as folder:
        todo, done = Path(folder, "checks.json"), Path(folder, "results.json")
        todo.write_text(json.dumps(checks))
        run = subprocess.run([sys.executable, str(PARSE_ONLY), str(todo), str(done)],
                             cwd=ROOT, env=env, text=True, capture_output=True,
                             timeout=timeout)
        assert run.returncode == 0 and done.exists(), f"bootstrap failed:\n{run.stderr[-3000:]}"
        return json.loads(done.read_text())


COMMANDS = readme_commands(BLOCKS, page_inline_commands())
#: Commands that must NOT pass, run in the same bootstrap: proof that the patched parsers
#: still refuse (an unknown flag, a malformed value, an example's own check after the
#: parse, a module's parser, torchrun's).
MUST_FAIL = [
    Command(0, "", "path", "examples/ddp.py", ["--no-such-flag"]),
    Command(0, "", "path", "examples/fsdp.py", ["--strategy", "zero4"]),
    Command(0, "", "path", "examples/pp.py", ["--epochs", "two"]),
    Command(0, "", "path", "examples/pp.py", ["--virtual", "2"]),    # an abbreviation
    Command(0, "", "path", "examples/mesh.py", ["--dp", "2", "--tp", "2", "--nproc", "3"]),
    Command(0, "", "path", "examples/plot_trace.py", ["only-one-positional.json"]),
    Command(0, "", "path", "benchmarks/torch_ddp_backends.py", ["--repeats", "5"]),
    Command(0, "", "module", "collectives.bench", ["--sizes", "lots"]),
    Command(0, "", "path", "examples/ddp.py", [], launcher="torchrun",
            launcher_args=["--nproc-per-nodes", "2"]),
]


@pytest.fixture(scope="module")
def parse_results() -> dict[int, list[dict]]:
    """The bootstrap's outcomes for every command of the pages and MUST_FAIL, run once."""
    plan = [(i, c) for i, c in enumerate(COMMANDS + MUST_FAIL)]
    checks, owners = [], []
    for i, cmd in plan:
        for check in bootstrap_checks(cmd):
            checks.append(check)
            owners.append(i)
    start = time.monotonic()
    results = run_bootstrap(checks)
    print(f"\nbootstrap: {len(checks)} parses of {len(plan)} commands in "
          f"{time.monotonic() - start:.1f} s")
    by_command: dict[int, list[dict]] = {i: [] for i, _ in plan}
    for owner, check, result in zip(owners, checks, results):
        by_command[owner].append(dict(result, target=check["target"]))
    return by_command


def _check_launcher(cmd: Command) -> None:
    if cmd.launcher in ("mpiexec", "mpirun"):
        args = cmd.launcher_args
        assert len(args) == 2 and args[0] in ("-n", "-np") and args[1].isdigit() \
            and int(args[1]) >= 1, (f"{cmd.where}: {cmd.launcher} options "
                                    f"{args}, expected -n N")


#: Commands a page shows being refused (docs/startup.md: "a bad flag is refused before
#: torch is imported"), as (script, arguments): they must exit with argparse's status 2.
DOCUMENTED_REFUSALS = {("examples/ddp.py", ("--backend", "foo"))}


@pytest.mark.parametrize("index", range(len(COMMANDS)),
                         ids=[c.id for c in COMMANDS])
def test_command_arguments(index: int, parse_results):
    cmd = COMMANDS[index]
    where = f"{cmd.where}: `{cmd.source}`"
    if (cmd.target, tuple(cmd.argv)) in DOCUMENTED_REFUSALS:
        assert [(r["outcome"], r["code"]) for r in parse_results[index]] == [("exit", 2)], \
            f"{where}: the page shows it refused, but it was not: {parse_results[index]}"
        return
    _check_launcher(cmd)
    if cmd.kind == "module":
        assert importlib.util.find_spec(cmd.target) is not None, f"{where}: no module"
    if cmd.kind == "path":
        path = ROOT / cmd.target
        assert path.is_file(), f"{where}: no file {cmd.target}"
        if not _parses_with_argparse(path):
            # A script that reads sys.argv itself (tests/scripts/torch_backend_job.py
            # picks a job by name): each argument must be a quoted name in its source.
            source = path.read_text()
            missing = [a for a in cmd.argv if f'"{a}"' not in source and f"'{a}'" not in source]
            assert not missing, f"{where}: {cmd.target} knows no {missing}"
    for result in parse_results[index]:
        # accepted: the parser took the arguments; exit 0: the command only printed
        # (`collectives --version`) and ran nothing
        assert result["outcome"] == "accepted" or (result["outcome"], result["code"]) == (
            "exit", 0), (
            f"{where}: {result['target']} did not accept the arguments "
            f"({result['outcome']}, exit status {result['code']}):\n{result['stderr']}")


@pytest.mark.parametrize("index", range(len(MUST_FAIL)), ids=[
    " ".join([c.launcher, *c.launcher_args, c.target, *c.argv]).strip()
    for c in MUST_FAIL])
def test_a_wrong_argument_is_refused(index: int, parse_results):
    results = parse_results[len(COMMANDS) + index]
    assert results and results[0]["outcome"] == "exit" and results[0]["code"] == 2, results


def test_the_commands_cover_every_launcher_and_kind():
    launchers = {c.launcher for c in COMMANDS}
    assert {"", "torchrun"} <= launchers and launchers & {"mpiexec", "mpirun"}, launchers
    assert any(c.target == "collectives" for c in COMMANDS)     # the installed command
    assert any(c.kind == "module" for c in COMMANDS)
    assert any(c.env for c in COMMANDS)
    assert len(COMMANDS) >= 20, [c.id for c in COMMANDS]


def test_the_command_finder_on_a_made_up_block():
    text = "\n".join([
        "python -m pip install -e '.[test]' && python -m pytest",
        "FOO=1 BAR=x mpiexec -n 3 python examples/ddp.py --epochs 1   # a comment",
        "torchrun --standalone --nproc-per-node 2 examples/tp.py --backend gloo",
        "python examples/pp.py --schedule 1f1b \\",
        "    --epochs 2",
        "for s in a b; do for n in 2 4; do",
        '  echo "$s $(python benchmarks/x.py --s $s --n ${n} 2>/dev/null | tail -1)"',
        "done; done",
        "rank 0 | python examples/ddp.py is output, not a command",
        "python my_own_file.py --anything",
        "python -m collectives.bench --ops all",
        "srun -N 2 --ntasks-per-node 2 python examples/ddp.py --backend zmq",
        "collectives bench --nproc 2 --sizes 4K,1M",
        "torchrun --nproc-per-node 2 my_own_file.py",
    ]) + "\n"
    got = [(c.line, c.env, c.launcher, c.launcher_args, c.target, c.argv)
           for c in readme_commands([Block("bash", 10, "# x", text)])]
    assert got == [
        (11, {"FOO": "1", "BAR": "x"}, "mpiexec", ["-n", "3"], "examples/ddp.py",
         ["--epochs", "1"]),
        (12, {}, "torchrun", ["--standalone", "--nproc-per-node", "2"], "examples/tp.py",
         ["--backend", "gloo"]),
        (13, {}, "", [], "examples/pp.py", ["--schedule", "1f1b", "--epochs", "2"]),
        (16, {}, "", [], "benchmarks/x.py", ["--s", "a", "--n", "2"]),
        (16, {}, "", [], "benchmarks/x.py", ["--s", "a", "--n", "4"]),
        (16, {}, "", [], "benchmarks/x.py", ["--s", "b", "--n", "2"]),
        (16, {}, "", [], "benchmarks/x.py", ["--s", "b", "--n", "4"]),
        (20, {}, "", [], "collectives.bench", ["--ops", "all"]),
        (21, {}, "srun", ["-N", "2", "--ntasks-per-node", "2"], "examples/ddp.py",
         ["--backend", "zmq"]),
        (22, {}, "", [], "collectives", ["bench", "--nproc", "2", "--sizes", "4K,1M"]),
    ], got


def test_a_prose_span_is_a_command_with_placeholders_as_values():
    spans = inline_commands("Run `python -m collectives.bench --nproc N\n--memcpy` or\n"
                            "`python check_mine.py`; `python -m pytest -q`.\n")
    assert spans == [(1, "python -m collectives.bench --nproc N --memcpy"),
                     (3, "python check_mine.py"), (3, "python -m pytest -q")], spans
    [cmd] = readme_commands([], spans)
    assert (cmd.kind, cmd.target, cmd.argv, cmd.inline) == (
        "module", "collectives.bench", ["--nproc", "1", "--memcpy"], True)


# ------------------------------------------------------------ the reader's own scripts

#: The commands that run a script a page has the reader save, but those of the scripts
#: tests/test_readme_kit.py runs with checks of its own.
SCRIPT_RUNS = [r for r in reader_script_runs() if (r.page, r.block.line) not in KIT_BLOCKS]


def _leading_literal(comment: str):
    """``[True, True] where the core is built`` -> ([True, True],); None without one."""
    for end in range(len(comment), 0, -1):
        if comment[end - 1] in "])}'\"0123456789eE":
            try:
                return (ast.literal_eval(comment[:end]),)
            except (ValueError, SyntaxError):
                continue
    return None


def _script_argv(run: ScriptRun) -> list[str]:
    if run.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *run.launcher_args,
                run.name, *run.argv]
    python = [sys.executable, run.name, *run.argv]
    return [run.launcher, *run.launcher_args, *python] if run.launcher else python


@pytest.mark.parametrize("run", SCRIPT_RUNS, ids=[r.id for r in SCRIPT_RUNS])
def test_reader_script_command(run: ScriptRun):
    if run.launcher in ("mpiexec", "mpirun") and shutil.which(run.launcher) is None:
        pytest.skip(f"no {run.launcher} here")
    env = dict(os.environ, OMP_NUM_THREADS="1", **run.env, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="readme-script-") as folder:
        Path(folder, run.name).write_text(run.block.text)
        done = subprocess.run(_script_argv(run), cwd=folder, env=env, text=True,
                              capture_output=True, timeout=BLOCK_TIMEOUT)
    assert done.returncode == 0, (f"{run.where}: `{run.source}` exited with "
                                  f"{done.returncode}\n{done.stderr[-3000:]}")
    stated = _leading_literal(run.stated)
    if stated is not None:
        last = done.stdout.strip().splitlines()[-1]
        assert ast.literal_eval(last) == stated[0], (
            f"{run.where}: `{run.source}` printed {last!r}, the page says {stated[0]!r}")


def test_the_reader_script_finder():
    # hello.py under each launcher (docs/launching.md), which_path.py with a variable
    # (docs/compiled-core.md): the kinds of command the finder must keep seeing
    kinds = {(r.name, r.launcher, bool(r.env)) for r in SCRIPT_RUNS}
    assert {("hello.py", ""), ("hello.py", "mpiexec"), ("hello.py", "torchrun")} <= {
        (name, launcher) for name, launcher, _ in kinds}, kinds
    assert ("which_path.py", "", True) in kinds, kinds
    assert not any(r.name == "check_my_all_reduce.py" for r in SCRIPT_RUNS)   # the kit's
    assert _leading_literal("[True, True] where the core is built") == ([True, True],)
    assert _leading_literal("starts 2 local ranks") is None
