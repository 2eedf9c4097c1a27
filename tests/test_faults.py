"""Fault injection: a rank SIGKILLed inside a collective, a rank that stops calling, ranks
whose calls differ; on shm, zmq, gloo and (where MPI's semantics allow) mpi.

Each fault runs in a world of its own (``faults.world.FaultWorld``: a killed rank breaks
any world). What every test checks, per backend:

- killed: each survivor raises ``PeerError`` naming the dead rank (``.peer`` and the
  text) within :data:`DETECT_LIMIT` seconds of the kill; the job leaves no segment in
  /dev/shm, no process, no bound port. As with torch/NCCL, a rank whose part of the
  call in flight is done (a sender in ``gather``) may return from that call; its next
  call over the group raises, and the survivors call in a loop, so they all must raise.
  MPI cannot survive a rank's death: ``mpiexec`` ends the whole job instead (see
  :func:`test_mpi_kill_aborts_the_job`).
- hang: a rank sleeps; the others raise ``CollectiveTimeout`` whose ``op``, ``seq`` and
  ``missing`` (and text) name the call and the sleeper, within the timeout plus
  :data:`HANG_SLACK`.
- mismatch: different ops, shapes, dtypes or roots raise ``CollectiveMismatch`` naming
  both calls; always on for shm and zmq, with ``COLLECTIVES_DEBUG=1`` for mpi and gloo.

Every test prints its measurements (``-s`` shows them): ``FAULTS backend=... detect_s=...``.
The default run kills a rank in every collective at three ranks per backend and in
all_reduce at two and four; the whole matrix is ``-m slow``.
"""

from __future__ import annotations

import os
import re

import pytest

import collectives
from collectives.testing.pool import LauncherUnavailable, RemoteError, launcher_for
from faults import tasks
from faults.world import Died, FaultWorld

#: Seconds within which a survivor must learn that a peer died (the issue's bound).
DETECT_LIMIT = 10.0
#: Group timeout in the hang tests, and how late past it the error may come.
HANG_TIMEOUT = 2.0
HANG_SLACK = 2.0
#: Group timeout in the kill tests: longer than DETECT_LIMIT (and than the survivors'
#: loop, DETECT_LIMIT + 1 s), so a timeout cannot pass for a detection.
KILL_TIMEOUT = 12.0
#: The victim / the sleeper / the odd one out (a middle rank: not the root of rooted ops).
VICTIM = 1

SPAWNED_BACKENDS = ("shm", "zmq", "gloo")


def _usable(backend: str) -> list:
    """Skip marks for a backend this machine cannot run."""
    if backend not in collectives.available_backends():
        return [pytest.mark.skip(reason=f"backend {backend!r} not available here")]
    try:
        launcher_for(backend)
    except LauncherUnavailable as exc:
        return [pytest.mark.skip(reason=f"{backend}: {exc}")]
    return []


def _param(backend: str, *rest, slow: bool = False):
    marks = _usable(backend) + ([pytest.mark.slow] if slow else [])
    return pytest.param(backend, *rest, marks=marks,
                        id="-".join([backend, *map(str, rest)]))


def _kill_params():
    """Every collective at 3 ranks, and all_reduce at 2 and 4, in the default run; the
    rest of the matrix is slow."""
    return [_param(backend, op, n, slow=n != 3 and op != "all_reduce")
            for backend in SPAWNED_BACKENDS for n in (3, 2, 4) for op in tasks.COLLECTIVES] + [
        _param("shm", "all_reduce_symmetric", n, slow=n == 4) for n in (2, 3, 4)] + [
        _param("shm", "all_reduce_small", n, slow=n == 4) for n in (2, 3, 4)] + [
        _param("shm", "all_reduce_single_copy", n, slow=n == 4) for n in (2, 3, 4)]


def _report(**fields) -> None:
    print("FAULTS " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in fields.items()))


def _prefix_ok(text: str, rank: int, n: int, op: str) -> bool:
    """The library's message prefix: ``[rank r/n] op``."""
    return text.startswith(f"[rank {rank}/{n}] {op}")


def _describe(outcome) -> str:
    return outcome.describe() if isinstance(outcome, RemoteError) else repr(outcome)


def _names_rank(text: str, rank: int) -> bool:
    """``text`` names ``rank`` after its own prefix: "rank 1", "ranks [1]", "ranks 0, 1"."""
    rest = text.split("]", 1)[-1]
    return bool(re.search(rf"\branks? \[?(\d+, )*{rank}\b", rest))


# ------------------------------------------------------------------------- killed rank
@pytest.mark.parametrize("backend, op, n", _kill_params())
def test_killed_rank_is_a_peer_error_naming_it(backend, op, n):
    with FaultWorld(backend, n, timeout=KILL_TIMEOUT) as world:
        for ports in world.call(tasks.listening_ports, limit=30):
            world.note_ports(ports)
        outcomes = world.call(tasks.kill_in_collective, op, VICTIM, DETECT_LIMIT + 1.0,
                              limit=KILL_TIMEOUT + 10)
    victim = outcomes[VICTIM]
    assert isinstance(victim, Died) and "signal 9" in victim.how, victim
    slowest = 0.0
    for r, out in enumerate(outcomes):
        if r == VICTIM:
            continue
        assert isinstance(out, dict), f"rank {r}: {_describe(out)}"
        assert out["type"] == "PeerError", f"rank {r}: {out}\nall ranks: {outcomes}"
        text = out["message"]
        assert out["peer"] == VICTIM, f"rank {r}: PeerError.peer={out['peer']}: {text}"
        name = tasks.OP_NAMES.get(op, op)
        assert _prefix_ok(text, r, n, name), f"rank {r}: the message does not start with " \
                                             f"'[rank {r}/{n}] {name}': {text}"
        assert _names_rank(text, VICTIM), f"rank {r}: the dead rank is not named: {text}"
        assert out["after_s"] < DETECT_LIMIT, f"rank {r}: {out['after_s']:.1f} s: {text}"
        slowest = max(slowest, out["after_s"])
    assert not world.leftovers, f"left behind: {world.leftovers}"
    assert not world.slow_to_close, f"ranks {world.slow_to_close} still running 5 s after " \
                                    f"being asked to close their group"
    _report(test="kill", backend=backend, op=op, n=n, detect_s=slowest)


@pytest.mark.parametrize("backend, op, n", [
    _param("mpi", "all_reduce", 2), _param("mpi", "all_reduce", 4),
    *[_param("mpi", op, 3, slow=op != "broadcast") for op in tasks.COLLECTIVES]])
def test_mpi_kill_aborts_the_job(backend, op, n):
    """What MPI does when a rank dies: no rank survives to raise ``PeerError``. MPICH's
    ``mpiexec`` (Hydra) sees the rank end without ``MPI_Finalize``, kills every other rank
    of the job at once (well under a second here), exits non-zero (9: the status it
    reports) and prints "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES / PID 1234
    RUNNING AT host / EXIT CODE: 9". It names a process by pid, never a rank (the
    pid-to-rank map comes from the test kit, ``FaultWorld.pids``), and not always the
    one that died: it reports the first bad termination it handles, and the ranks it
    killed itself end with the same status (seen: 1 run in 3 at four ranks named rank 0
    for a SIGKILLed rank 1). So the test asserts that a pid of the job is named, and
    prints which rank. MPICH's own segments (``/dev/shm/mpich_shm_*``) of the killed job
    stay behind: ``FaultWorld`` removes them (``mpich_segments_left`` in the printed
    line), as it does after every mpi world it had to stop by force."""
    with FaultWorld(backend, n, timeout=KILL_TIMEOUT) as world:
        outcomes = world.call(tasks.kill_in_collective, op, VICTIM, DETECT_LIMIT + 1.0,
                              limit=KILL_TIMEOUT + 10)
        output = world._world.output_tail(40)
        code = world._world.proc.wait(10)
    assert all(isinstance(o, Died) for o in outcomes), outcomes
    killed_after = max(o.after_s for o in outcomes)
    assert killed_after < DETECT_LIMIT, outcomes
    assert code != 0, output
    named = [r for r, pid in enumerate(world.pids) if f"PID {pid} " in output]
    assert named and "EXIT CODE: 9" in output, output
    assert not world.leftovers, f"left behind: {world.leftovers}"
    _report(test="kill", backend=backend, op=op, n=n, detect_s=killed_after,
            named_rank=named[0], mpich_segments_left=len(world.mpich_removed))


# ------------------------------------------------------------------------ sleeping rank
def _hang_params():
    params = []
    for backend in (*SPAWNED_BACKENDS, "mpi"):
        for op in ("all_reduce", "all_gather", "barrier"):
            params.append(_param(backend, op, 3, slow=backend == "mpi" and op != "all_reduce"))
    return params + [_param("shm", op, 3) for op in ("all_reduce_symmetric", "all_reduce_small",
                                                     "all_reduce_single_copy")]


def _hang_slack(backend: str) -> float:
    """How late past the timeout a hang's error may come: HANG_SLACK, and for the torch
    backends their documented wait for the survivors' reports on top (a sleeping rank
    never reports, so they always wait it out: about timeout + 1 s)."""
    if backend in ("gloo", "torch"):
        from backends.torchdist.failures import _TIMEOUT_REPORT_GRACE
        return HANG_SLACK + _TIMEOUT_REPORT_GRACE
    return HANG_SLACK


@pytest.mark.parametrize("backend, op, n", _hang_params())
def test_sleeping_rank_is_a_timeout_naming_op_seq_and_rank(backend, op, n):
    with FaultWorld(backend, n, timeout=HANG_TIMEOUT) as world:
        outcomes = world.call(tasks.sleep_in_collective, op, VICTIM,
                              1.0, limit=60)
    slowest = 0.0
    for r, out in enumerate(outcomes):
        if r == VICTIM:
            continue
        assert isinstance(out, dict), f"rank {r}: {_describe(out)}"
        assert out["type"] == "CollectiveTimeout", f"rank {r}: {out}"
        text, seq = out["message"], out["expected_seq"]
        name = tasks.OP_NAMES.get(op, op)
        assert (out["op"], out["seq"]) == (name, seq), \
            f"rank {r}: op={out['op']!r} seq={out['seq']} (expected {name!r}, {seq}): {text}"
        assert out["missing"] == [VICTIM], f"rank {r}: missing={out['missing']}: {text}"
        assert _prefix_ok(text, r, n, name), f"rank {r}: {text}"
        assert f"seq {seq}" in text and _names_rank(text, VICTIM), \
            f"rank {r}: the text lacks 'seq {seq}' or 'rank {VICTIM}': {text}"
        assert HANG_TIMEOUT * 0.9 <= out["after_s"] < HANG_TIMEOUT + _hang_slack(backend), \
            f"rank {r}: after {out['after_s']:.2f} s (timeout {HANG_TIMEOUT} s): {text}"
        slowest = max(slowest, out["after_s"])
    _report(test="hang", backend=backend, op=op, n=n, timeout_s=HANG_TIMEOUT,
            report_s=slowest)


# ----------------------------------------------------------------------------- mismatch
#: kind -> patterns naming both sides of it (the odd rank's call and the others'): 16 or
#: 24 float32 elements (64 or 96 bytes), roots 0 and 1.
MISMATCH_SIDES = {
    "op": (r"\ball_reduce\b", r"\bbroadcast\b"),
    "shape": (r"\b(16|64)\b", r"\b(24|96)\b"),
    "dtype": (r"\bfloat32\b", r"\bint32\b"),
    "root": (r"\b(root|src)[ =]?0\b", r"\b(root|src)[ =]?1\b"),
    "symmetric op": (r"\bSUM\b", r"\bMAX\b"),
}
#: Kinds only some backends have: shm's all_reduce in symmetric memory (elsewhere it is
#: plain memory, and the "op" kinds cover it).
MISMATCH_ONLY = {"symmetric op": ("shm",)}


#: Which backends check every call: shm and zmq always (a fingerprint travels with every
#: message), mpi and gloo only with COLLECTIVES_DEBUG=1 (one extra exchange per call).
MISMATCH_DEBUG = {"shm": False, "zmq": False, "gloo": True, "mpi": True}
_mismatch_results: dict = {}


def _mismatch_outcomes(backend: str) -> dict:
    """Every kind's outcomes on ``backend``, from one world of 3 ranks (each kind in a
    fresh sub-group), run once per session."""
    if backend not in _mismatch_results:
        env = {"COLLECTIVES_DEBUG": "1"} if MISMATCH_DEBUG[backend] else {}
        results = {}
        with FaultWorld(backend, 3, timeout=10.0, env=env) as world:
            for kind in MISMATCH_SIDES:
                if backend not in MISMATCH_ONLY.get(kind, (backend,)):
                    continue
                results[kind] = world.call(tasks.mismatch, kind, VICTIM, limit=30)
                if not all(isinstance(o, dict) for o in results[kind]):
                    break  # the world is gone: the kinds after this one fail
        _mismatch_results[backend] = results
    return _mismatch_results[backend]


def _mismatch_params():
    return [_param(backend, kind) for backend in MISMATCH_DEBUG for kind in MISMATCH_SIDES
            if backend in MISMATCH_ONLY.get(kind, (backend,))]


@pytest.mark.parametrize("backend, kind", _mismatch_params())
def test_mismatched_calls_name_both_sides(backend, kind):
    n = 3
    outcomes = _mismatch_outcomes(backend).get(kind)
    assert outcomes is not None, "the world broke in an earlier kind"
    bad = [(r, o) for r, o in enumerate(outcomes) if not isinstance(o, dict)
           or o["type"] not in (None, "CollectiveMismatch", "PeerError")]
    mismatches = [(r, o) for r, o in enumerate(outcomes)
                  if isinstance(o, dict) and o["type"] == "CollectiveMismatch"]
    assert mismatches and not bad, f"no CollectiveMismatch, or other errors: {outcomes}"
    for r, o in mismatches:
        text = o["message"]
        assert text.startswith(f"[rank {r}/{n}] "), f"rank {r}: no prefix: {text}"
        op = "broadcast" if kind == "root" else "all_reduce"
        assert re.search(rf"\b{op}\b", text), f"rank {r}: does not name the op {op}: {text}"
        sides = [pat for pat in MISMATCH_SIDES[kind] if not re.search(pat, text)]
        assert not sides, f"rank {r}: does not name both calls (no {sides}): {text}"
        assert re.search(r"\branks? \[?\d", text.split("]", 1)[-1]), \
            f"rank {r}: names no other rank: {text}"
        assert o["after_s"] < 5.0, f"rank {r}: took {o['after_s']:.1f} s: {text}"
    _report(test="mismatch", backend=backend, kind=kind, debug=int(MISMATCH_DEBUG[backend]),
            detect_s=max(o["after_s"] for _, o in mismatches))


# ------------------------------------------------------------------ the checks themselves
def test_leak_checks_see_what_they_look_for():
    """The leftover checks are not vacuous: a listening port, a live process and a
    segment of the job are each seen."""
    import socket
    import subprocess
    import sys

    from collectives.shm_names import segment_name
    from faults.world import _job_segments, _pid_alive, port_bound

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_bound(port)
    assert not port_bound(port)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not _pid_alive(proc.pid)
    job = "fault-self-test-" + os.urandom(4).hex()
    path = os.path.join("/dev/shm", segment_name(f"COLLECTIVES_JOB_ID={job}", "world"))
    open(path, "wb").close()
    try:
        assert _job_segments(job) == [os.path.basename(path)]
    finally:
        os.unlink(path)
