"""``collectives.trace`` and ``collectives trace merge``: each rank's events streamed to
its own file as they happen, merged into one Chrome/Perfetto trace with one row per rank
(checked against a JSON schema of the format, tests/chrome_trace_schema.py); a rank
killed with SIGTERM leaves its trace and its flight record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from chrome_trace_schema import check_chrome_trace
from collectives import doctor, trace, trace_merge
from collectives.testing.threads import run_threads

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "scripts" / "trace_job.py"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("COLLECTIVES_") and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collectives", *args], cwd=ROOT,
                          env=env or _env(), capture_output=True, text=True, timeout=120)


def _by_rank(events: list, ph: str) -> dict:
    out: dict = {}
    for e in events:
        if e["ph"] == ph:
            out.setdefault(e["pid"], []).append(e)
    return out


def test_four_ranks_stream_their_collectives_and_merge_into_one_row_each(tmp_path):
    """A 4-rank collectives-only job traced by the setting alone: a file per rank,
    streamed; ``collectives trace merge`` makes one schema-valid trace, one named row per
    rank, every collective a begin/end pair with its bytes and sequence number."""
    folder = tmp_path / "traces"
    job = subprocess.run([sys.executable, str(JOB), "collectives", "4"], cwd=ROOT,
                         env=_env(COLLECTIVES_TRACE=str(folder),
                                  COLLECTIVES_FLIGHT_DIR=str(tmp_path / "flight")),
                         capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted(os.listdir(folder)) == [f"rank{r}.jsonl" for r in range(4)]
    out = tmp_path / "job.json"
    merged = _cli("trace", "merge", str(folder), "-o", str(out))
    assert merged.returncode == 0, merged.stderr
    assert "from ranks 0, 1, 2, 3" in merged.stdout
    document = json.loads(out.read_text())
    assert check_chrome_trace(document) == {r: f"rank {r}" for r in range(4)}
    events = document["traceEvents"]
    begins, ends = _by_rank(events, "b"), _by_rank(events, "e")
    for rank in range(4):
        ops = [e["name"] for e in begins[rank]]
        # the clock mark's barrier, 3 x (all_reduce, async all_reduce), the sub-group's
        # broadcast, a send or a receive, the last barrier
        assert ops[:7] == ["barrier"] + ["all_reduce"] * 6, ops
        assert ops[7] == "broadcast" and ops[8] in ("send", "recv") and ops[9] == "barrier"
        assert len(ends[rank]) == len(begins[rank])
        first = begins[rank][1]
        assert first["args"] == {"bytes": 4096, "group": "world", "seq": 1}
        peer = begins[rank][8]["args"]["peer"]
        assert peer == (rank + 1 if rank % 2 == 0 else rank - 1)
        spans = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert [e["name"] for e in spans if e["name"] == "step"] == ["step"] * 3
        assert sum(e["name"] == "wait all_reduce" for e in spans) == 3
        # A span holds the collectives issued inside it.
        step0 = next(e for e in spans if e["name"] == "step")
        assert step0["ts"] <= first["ts"] <= step0["ts"] + step0["dur"]
    assert document["otherData"]["missing_ranks"] == []
    assert set(document["otherData"]["clock_offsets_us"].values()) == {0.0}  # one host


def test_the_ddp_example_with_four_ranks_traces_one_row_per_rank(tmp_path):
    """``examples/ddp.py --nproc 4 --trace FILE`` (one epoch of the bundled MNIST subset:
    a few seconds): FILE is a schema-valid trace with exactly one row per rank, each with
    its training phases, its all_reduces and the waits for them; the streamed per-rank
    files stay beside it and merge again from the command line."""
    out = tmp_path / "ddp.json"
    run = subprocess.run([sys.executable, "examples/ddp.py", "--nproc", "4", "--epochs", "1",
                          "--trace", str(out)], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads(out.read_text())
    assert check_chrome_trace(document) == {r: f"rank {r}" for r in range(4)}
    for rank in range(4):
        names = {e["name"] for e in document["traceEvents"] if e["pid"] == rank}
        assert {"forward", "backward", "step", "all_reduce", "wait all_reduce",
                "clock sync"} <= names, names
    again = _cli("trace", "merge", f"{out}.ranks", "-o", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stderr
    assert check_chrome_trace(json.loads((tmp_path / "again.json").read_text())) == \
        {r: f"rank {r}" for r in range(4)}


def test_sigterm_leaves_the_ranks_flight_record_and_streamed_trace(tmp_path):
    """Rank 1 waits in an all_reduce rank 0 never joins; SIGTERM to rank 1 writes its
    flight record (the running all_reduce, reason SIGTERM) and its trace holds that
    all_reduce's begin; it still dies by SIGTERM, and the launcher's SIGTERM to rank 0
    writes rank 0's record too. The merged trace ends the all_reduce as unfinished, and
    the doctor names the divergence."""
    folder, flight_root = tmp_path / "traces", tmp_path / "flight"
    pid_file = tmp_path / "rank1.pid"
    job = subprocess.Popen([sys.executable, str(JOB), "hang", "2"], cwd=ROOT,
                           env=_env(COLLECTIVES_TRACE=str(folder),
                                    COLLECTIVES_FLIGHT_DIR=str(flight_root),
                                    TRACE_JOB_PID_FILE=str(pid_file)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "rank 1 never started"
            time.sleep(0.1)
        rank1 = int(pid_file.read_text())
        time.sleep(0.5)                       # rank 1 is inside the all_reduce by now
        os.kill(rank1, signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0
    assert "rank 1" in stderr and "signal 15 (SIGTERM)" in stderr, stderr[-3000:]

    jobs = os.listdir(flight_root)
    assert len(jobs) == 1
    records = {name: json.loads((flight_root / jobs[0] / name).read_text())
               for name in os.listdir(flight_root / jobs[0])}
    assert set(records) == {"world.rank0.json", "world.rank1.json"}
    mine = records["world.rank1.json"]
    assert mine["reason"] == "SIGTERM" and mine["error"] is None
    assert [(r["seq"], r["op"], r["state"]) for r in mine["records"]][-2:] == [
        (1, "all_reduce", "ok"), (2, "all_reduce", "running")]
    assert records["world.rank0.json"]["reason"] == "SIGTERM"

    header, events = trace_merge.read_rank_file(str(folder / "rank1.jsonl"))
    assert header["rank"] == 1
    comm = [(e["name"], e["ph"], e["args"].get("seq")) for e in events if e["cat"] == "comm"]
    assert comm[-1] == ("all_reduce", "b", 2)
    assert any(e["name"] == "signal SIGTERM" for e in events)
    merged = trace_merge.merge(str(folder))
    check_chrome_trace(merged)
    unfinished = [e for e in merged["traceEvents"]
                  if e["ph"] == "e" and e["args"].get("unfinished")]
    assert [(e["pid"], e["name"]) for e in unfinished] == [(1, "all_reduce")]

    report = _cli("doctor", "--json", env=_env(COLLECTIVES_FLIGHT_DIR=str(flight_root)))
    assert report.returncode == 0, report.stderr
    (group,) = json.loads(report.stdout)["groups"]
    assert group["reasons"] == {"0": "SIGTERM", "1": "SIGTERM"}
    assert group["divergence"]["seq"] == 2
    assert group["divergence"]["ranks"]["1"]["state"] == "running"


def test_a_peers_failure_leaves_the_survivors_record(tmp_path):
    """Rank 1 raises while rank 0 waits in an all_reduce: rank 0 learns it (a PeerError
    from the transport, or the launcher's SIGTERM, whichever comes first) and its record
    holds that all_reduce, unfinished or failed; the trace too."""
    flight_root = tmp_path / "flight"
    job = subprocess.run([sys.executable, str(JOB), "peer_dies", "2"], cwd=ROOT,
                         env=_env(COLLECTIVES_TRACE=str(tmp_path / "traces"),
                                  COLLECTIVES_FLIGHT_DIR=str(flight_root)),
                         capture_output=True, text=True, timeout=240)
    assert job.returncode != 0 and "rank 1 gives up" in job.stderr, job.stderr[-3000:]
    (folder,) = os.listdir(flight_root)
    record = json.loads((flight_root / folder / "world.rank0.json").read_text())
    assert record["reason"] in ("PeerError", "SIGTERM"), record["reason"]
    last = record["records"][-1]
    assert (last["seq"], last["op"]) == (2, "all_reduce") and last["state"] != "ok"
    if record["reason"] == "SIGTERM" and last["state"] != "running":
        assert record["error"].startswith("PeerError")   # the failure, then the SIGTERM
    _, events = trace_merge.read_rank_file(str(tmp_path / "traces" / "rank0.jsonl"))
    begins = [e for e in events if e["ph"] == "b"]
    assert (begins[-1]["name"], begins[-1]["args"]["seq"]) == ("all_reduce", 2)


def test_a_cut_last_line_is_dropped_and_a_bad_directory_is_refused(tmp_path):
    folder = tmp_path / "t"
    tracer = trace.Tracer(str(folder), 0, 1)
    with tracer.span("whole"):
        pass
    tracer.close()
    with open(folder / "rank0.jsonl", "a") as f:
        f.write('{"name": "cut sh')                 # a rank killed mid-line
    header, events = trace_merge.read_rank_file(str(folder / "rank0.jsonl"))
    assert [e["name"] for e in events] == ["whole"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no trace files"):
        trace_merge.merge(str(empty))
    refused = _cli("trace", "merge", str(empty))
    assert refused.returncode == 2 and "no trace files" in refused.stderr


def test_a_stale_file_of_a_larger_job_is_not_merged(tmp_path):
    (tmp_path / "rank3.jsonl").write_text("{}\n")
    tracer = trace.Tracer(str(tmp_path), 0, 2)
    tracer.close()
    assert sorted(os.listdir(tmp_path)) == ["rank0.jsonl"]


def test_tracing_context_manager_traces_groups_made_inside_it(tmp_path):
    """``trace.tracing(dir)``: the first group names the file; a group's operations,
    labelled (``wrap(group, "tp")``) or not, and a span; the block's end closes it."""
    def body(pg):
        pg.all_reduce(np.ones(3, np.float64))
        return pg._recorder

    with trace.tracing(str(tmp_path)):
        assert trace.active() is None          # no group yet: no rank, no file
        recorders = run_threads(body, 1)
        tracer = trace.active()
        assert tracer is not None and tracer.rank == 0
        with trace.span("mine", k=1):
            pass
    assert trace.active() is None
    assert isinstance(recorders[0], trace.TracedRecorder)
    _, events = trace_merge.read_rank_file(str(tmp_path / "rank0.jsonl"))
    assert [(e["name"], e["ph"]) for e in events] == [
        ("all_reduce", "b"), ("all_reduce", "e"), ("mine", "X")]
    assert events[0]["args"]["bytes"] == 24
    assert events[2]["args"] == {"k": 1}


def test_a_labelled_group_names_its_slices_and_a_disabled_tracer_does_nothing(tmp_path):
    tracer = trace.Tracer(str(tmp_path), 0, 1)

    def body(pg):
        tracer.wrap(pg, "tp")
        pg.all_reduce(np.ones(2, np.float32), async_op=True).wait()

    run_threads(body, 1)
    tracer.close()
    _, events = trace_merge.read_rank_file(str(tmp_path / "rank0.jsonl"))
    assert [e["name"] for e in events] == ["tp all_reduce", "tp all_reduce",
                                          "wait tp all_reduce"]
    assert events[0]["args"]["dim"] == "tp"
    off = trace.Tracer(None, 0)
    with off.span("x"):
        pass
    assert off.wrap("not a group") == "not a group" and not off.enabled


def test_clock_offsets_align_other_hosts_by_the_barrier_mark():
    def rank(host, sync_us):
        return ({"host": host, "size": 3},
                [{"name": "clock sync", "ph": "i", "ts": sync_us, "pid": 0}])

    offsets = trace_merge.clock_offsets({0: rank("a", 1000.0), 1: rank("a", 1003.0),
                                         2: rank("b", 5000.0)})
    assert offsets == {0: 0.0, 1: 0.0, 2: -4000.0}
