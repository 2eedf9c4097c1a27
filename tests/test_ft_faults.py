"""Fault-tolerant training (``parallel.ft`` in ``examples/elastic.py``) with faults
injected from outside the ranks at each phase of a step: before it, inside the gradient
all_reduce, during the commit, during healing (the healing source dies), two failures in
a row, and a rank stopped with SIGSTOP past the timeout then continued. After every
committed step the replicas' parameters are bitwise equal, no step is applied by a
strict subset of its participants, and training ends with ``final_acc`` >= 0.85.

Each case is one run of the example's replicas from this process
(``examples.common.elastic_launcher.run_elastic``) with :class:`ft_phases.PhaseHook`
logging phases and lingering where the fault must land.
"""

from __future__ import annotations

import pytest

from examples import elastic
from examples.common.cli import parse_args
from examples.common.elastic_launcher import run_elastic
from ft_phases import Injector, PhaseHook, check_consistency, read_log, sigkill, sigstop_for
from test_faults import _param

#: Collective timeout and heartbeat timeout of these runs (seconds): short, so that a
#: stopped rank costs little; long enough for 2 busy cores.
GROUP_TIMEOUT = 4.0
HEARTBEAT_TIMEOUT = 1.5
MIN_ACC = 0.85


def _run(tmp_path, backend: str, nproc: int, pauses: tuple, action, *, count: int = 1,
         respawn: bool = False, epochs: int = 3, step_s: float = 0.03):
    log = str(tmp_path / "phases.jsonl")
    argv = ["--backend", backend, "--nproc", str(nproc), "--epochs", str(epochs),
            "--timeout", str(GROUP_TIMEOUT), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
    args = parse_args("elastic", argv + (["--respawn"] if respawn else []),
                      epochs=epochs, batch_size=32, lr=0.05, extra=elastic._options)
    args.phase_hook = PhaseHook(log, pauses, step_s)
    injector = Injector(log, action, count)
    try:
        outcome = run_elastic(elastic.main, args, nproc=nproc, backend=backend,
                              respawn=respawn, heartbeat_timeout=HEARTBEAT_TIMEOUT,
                              group_timeout=GROUP_TIMEOUT, limit_s=300.0)
    finally:
        injector.stop()
    return outcome, read_log(log), injector


def _check(outcome, lines, injector, *, faults: int, deaths: int) -> list:
    assert not outcome.errors, outcome.errors
    assert len(injector.fired) == faults, injector.fired
    assert len(outcome.deaths) == deaths, outcome.deaths
    done = [r for r in outcome.results if r["finished"]]
    assert done, outcome
    assert len({r["digest"] for r in done}) == 1, [r["digest"][:8] for r in done]
    assert all(r["final_acc"] >= MIN_ACC for r in done), [r["final_acc"] for r in done]
    problems = check_consistency(lines, {r["pid"] for r in done})
    assert not problems, problems
    return done


def _skipped(outcome) -> int:
    """Steps the coordinator decided not to commit."""
    return sum(1 for h in outcome.history if h["event"] == "skip")


#: (backend, phase, rank killed, step): the default run kills inside the all_reduce on
#: shm; the other phases and transports are slow. Killed before its step, a rank is
#: left out of the next quorum and no step fails; killed while the others wait in the
#: all_reduce or for its vote, that step is not committed by anyone.
KILLS = [("shm", "before_all_reduce", 0, 6), ("zmq", "before_all_reduce", 0, 6),
         ("gloo", "before_all_reduce", 0, 6), ("shm", "before_step", 1, 5),
         ("zmq", "before_commit", 2, 7)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend, phase, rank, step",
                         [_param(*k, slow=k != KILLS[0]) for k in KILLS])
def test_killed_at_phase(tmp_path, backend, phase, rank, step):
    outcome, lines, injector = _run(tmp_path, backend, 3, ((rank, phase, step, 30.0),),
                                    sigkill)
    done = _check(outcome, lines, injector, faults=1, deaths=1)
    assert {r["world_size_final"] for r in done} == {2}
    assert _skipped(outcome) == (0 if phase == "before_step" else 1), outcome.history[:8]


@pytest.mark.timeout(300)
def test_healing_source_dies_then_replacement_heals_from_another(tmp_path):
    """Rank 2 is killed; its replacement asks to heal; the first source (rank 0) is
    killed as it starts sending; both are replaced and heal from the survivor."""
    pauses = ((2, "before_step", 4, 30.0), (0, "heal_send", 0, 30.0))
    outcome, lines, injector = _run(tmp_path, "shm", 3, pauses, sigkill, count=2,
                                    respawn=True)
    done = _check(outcome, lines, injector, faults=2, deaths=2)
    assert {r["world_size_final"] for r in done} == {3}
    assert sum(r["stats"]["healed"] for r in done) >= 2


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_failures_in_a_row(tmp_path):
    pauses = ((1, "before_all_reduce", 4, 30.0), (2, "before_step", 5, 30.0))
    outcome, lines, injector = _run(tmp_path, "shm", 4, pauses, sigkill, count=2)
    done = _check(outcome, lines, injector, faults=2, deaths=2)
    assert {r["world_size_final"] for r in done} == {2}


@pytest.mark.timeout(300)
def test_stopped_past_the_timeout_is_excluded_and_heals_back(tmp_path):
    """SIGSTOP while the others wait in the all_reduce for it, for longer than the group
    timeout, then SIGCONT: the others go on without it, and it heals back in and
    finishes equal to them."""
    pauses = ((1, "before_all_reduce", 5, 1.0),)
    outcome, lines, injector = _run(tmp_path, "shm", 3, pauses,
                                    sigstop_for(GROUP_TIMEOUT + 2.0))
    done = _check(outcome, lines, injector, faults=1, deaths=0)
    assert _skipped(outcome) >= 1
    stopped = injector.fired[0]["pid"]
    back = [r for r in done if r["pid"] == stopped]
    assert back and back[0]["stats"]["healed"] >= 1, [r["stats"] for r in done]
    assert {r["world_size_final"] for r in done} == {3}
