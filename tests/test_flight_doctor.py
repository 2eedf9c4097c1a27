"""The flight recorder, the COLLECTIVES_DEBUG call check, and ``collectives.doctor``.

Worlds of thread ranks (``run_threads``) keep these fast; the same base-class code runs
on every backend (the fault suite checks the debug switch on mpi and gloo processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from collectives import CollectiveMismatch, CollectiveTimeout, ReduceOp
from collectives import doctor, flight, settings
from collectives.testing.threads import run_threads


@pytest.fixture
def flight_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_FLIGHT_DIR", str(tmp_path))
    monkeypatch.setenv("COLLECTIVES_JOB_ID", "testjob")
    return tmp_path / "testjob"


def _catch(fn):
    """Run ``fn()`` and return the exception it raised (or None)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def test_recorder_keeps_the_last_n_calls_in_order():
    r = flight.Recorder(3)
    for seq in range(5):
        rec = r.start(seq, "all_reduce", (seq,), np.dtype(np.float32), -1, ReduceOp.SUM, -1)
        r.finish(rec, None if seq < 4 else ValueError("boom"))
    records = r.records()
    assert [d["seq"] for d in records] == [2, 3, 4]
    assert records[0] == {**records[0], "op": "all_reduce", "shape": [2], "dtype": "float32",
                          "reduce_op": "SUM", "state": "ok"}
    assert records[-1]["state"] == "ValueError: boom"
    assert records[0]["end"] >= records[0]["start"]


def test_recorder_can_be_switched_off_and_rejects_a_bad_setting(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_FLIGHT_RECORDER", "0")
    assert run_threads(lambda pg: pg._recorder, 2) == [None, None]
    monkeypatch.setenv("COLLECTIVES_FLIGHT_RECORDER", "-1")
    with pytest.raises(ValueError, match="COLLECTIVES_FLIGHT_RECORDER"):
        settings.FLIGHT_RECORDER.get()
    monkeypatch.setenv("COLLECTIVES_FLIGHT_RECORDER", "lots")
    with pytest.raises(ValueError, match="COLLECTIVES_FLIGHT_RECORDER"):
        run_threads(lambda pg: None, 2)


def test_every_call_is_recorded_with_its_shape_dtype_root_and_peer(flight_dir):
    def body(pg):
        t = np.ones(4, np.float32)
        pg.all_reduce(t)
        pg.broadcast(t, src=1)
        pg.all_reduce(t, op=ReduceOp.MAX, async_op=True).wait()
        if pg.rank == 0:
            pg.send(np.zeros(2, np.int64), dst=1, tag=5)
        else:
            pg.recv(np.zeros(2, np.int64), src=0, tag=5)
        pg.barrier()
        return pg._recorder.records()

    records = run_threads(body, 2)[1]
    assert [(d["seq"], d["op"]) for d in records] == [
        (0, "all_reduce"), (1, "broadcast"), (2, "all_reduce"), (-1, "recv"), (3, "barrier")]
    assert records[1]["root"] == 1 and records[1]["shape"] == [4]
    assert records[2]["reduce_op"] == "MAX" and records[2]["state"] == "ok"
    assert records[3]["peer"] == 0 and records[3]["dtype"] == "int64"
    assert all(d["state"] == "ok" for d in records)
    assert not flight_dir.exists()  # nothing failed: nothing written


def test_debug_switch_names_both_sides_of_a_different_collective(flight_dir, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_DEBUG", "1")

    def body(pg):
        t = np.ones(4, np.float32)
        pg.all_reduce(t)  # the same call on both ranks passes the check
        if pg.rank == 0:
            return _catch(lambda: pg.all_reduce(t))
        return _catch(lambda: pg.broadcast(t, src=0))

    errors = run_threads(body, 2, timeout=10)
    for rank, exc in enumerate(errors):
        assert isinstance(exc, CollectiveMismatch), exc
        text = str(exc)
        assert text.startswith(f"[rank {rank}/2]")
        assert "all_reduce(shape=(4,), dtype=float32, op=SUM)" in text
        assert "broadcast(shape=(4,), dtype=float32, root=0)" in text
        assert f"rank {1 - rank} called" in text
        assert any("collectives.doctor" in note for note in exc.__notes__)
    report = doctor.diagnose(doctor.load([str(flight_dir)]))
    assert "FIRST DIVERGENCE at seq 3: the ranks made different calls" in report
    assert "rank 0: all_reduce(shape=(4,), dtype=float32, op=SUM)" in report
    assert "rank 1: broadcast(shape=(4,), dtype=float32, root=0)" in report
    assert "1 collectives agree" in report


@pytest.mark.parametrize("case", ["shape", "dtype", "root", "reduce_op", "splits"])
def test_debug_switch_catches_each_kind_of_difference(case, flight_dir, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_DEBUG", "1")

    def body(pg):
        r = pg.rank
        if case == "shape":
            return _catch(lambda: pg.all_reduce(np.ones(4 + r, np.float32)))
        if case == "dtype":
            return _catch(lambda: pg.all_reduce(np.ones(4, [np.float32, np.float64][r])))
        if case == "root":
            return _catch(lambda: pg.broadcast(np.ones(4, np.float32), src=r))
        if case == "reduce_op":
            return _catch(lambda: pg.all_reduce(np.ones(4), op=[ReduceOp.SUM, ReduceOp.MAX][r]))
        # all_to_all: rank 0 sends 2 rows to rank 1, which expects 1.
        inp = np.zeros(3, np.float32)
        out = np.zeros([2, 3][r], np.float32)
        splits_in = [[1, 2], [1, 2]][r]
        splits_out = [[1, 1], [2, 1]][r]
        return _catch(lambda: pg.all_to_all(out, inp, output_split_sizes=splits_out,
                                            input_split_sizes=splits_in))

    errors = run_threads(body, 2, timeout=10)
    expected = {"shape": "shape=(5,)", "dtype": "float64", "root": "root=1",
                "reduce_op": "op=MAX", "splits": "split sizes disagree"}[case]
    for exc in errors:
        assert isinstance(exc, CollectiveMismatch), exc
        assert expected in str(exc)


def test_without_the_switch_there_is_no_extra_exchange(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_DEBUG", raising=False)
    seqs = run_threads(lambda pg: (pg.barrier(), pg.barrier(), pg._seq)[-1], 2)
    assert seqs == [2, 2]
    monkeypatch.setenv("COLLECTIVES_DEBUG", "1")
    seqs = run_threads(lambda pg: (pg.barrier(), pg.barrier(), pg._seq)[-1], 2)
    assert seqs == [4, 4]  # one check per call
    monkeypatch.setenv("COLLECTIVES_DEBUG", "maybe")
    with pytest.raises(ValueError, match="COLLECTIVES_DEBUG"):
        run_threads(lambda pg: None, 1)


def test_a_hang_is_written_down_and_the_doctor_names_the_silent_rank(flight_dir):
    def body(pg):
        t = np.ones(3, np.float32)
        for _ in range(3):
            pg.all_reduce(t)
        if pg.rank == 0:  # (a barrier: the thread world flags unreceived messages)
            return _catch(pg.barrier)
        time.sleep(1.5)  # rank 1 stops calling
        return None

    errors = run_threads(body, 2, timeout=0.5)
    assert isinstance(errors[0], CollectiveTimeout)
    files = sorted(os.listdir(flight_dir))
    assert files == ["world.rank0.json"]
    document = json.loads((flight_dir / files[0]).read_text())
    assert document["rank"] == 0 and document["size"] == 2
    assert document["records"][-1]["op"] == "barrier"
    assert document["records"][-1]["state"].startswith("CollectiveTimeout")
    result = subprocess.run([sys.executable, "-m", "collectives.doctor", str(flight_dir)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "no record from ranks [1]" in result.stdout
    assert "FIRST DIVERGENCE at seq 3" in result.stdout
    assert "3 collectives agree" in result.stdout


def test_doctor_lines_up_ranks_by_sequence_and_reports_a_rank_that_fell_behind(tmp_path):
    def document(rank, calls, error=None):
        records = [{"seq": s, "op": op, "shape": [4], "dtype": "float32", "root": -1,
                    "reduce_op": None, "peer": -1, "start": 100.0 + s, "end": end,
                    "state": state} for s, op, end, state in calls]
        return {"format": flight.FORMAT, "rank": rank, "size": 3, "backend": "shm",
                "group": "world", "job": "j", "written": 200.0, "error": error,
                "records": records}

    ok = [(s, "all_reduce", 100.5 + s, "ok") for s in range(4)]
    docs = {0: document(0, ok + [(4, "barrier", None, "running")]),
            1: document(1, ok + [(4, "barrier", None, "running")]),
            2: document(2, ok[1:])}  # a shorter ring, and it never got to seq 4
    for rank, doc in docs.items():
        (tmp_path / f"world.rank{rank}.json").write_text(json.dumps(doc))
    report = doctor.diagnose(doctor.load([str(tmp_path)]))
    assert "3 collectives agree on every recorded rank before seq 4" in report
    assert "FIRST DIVERGENCE at seq 4: ranks [2] never made this call" in report
    assert "rank 2: (no call at seq 4) its last was seq 3 all_reduce" in report

    for rank in (0, 1):
        docs[rank]["records"] = docs[rank]["records"][:4]
        (tmp_path / f"world.rank{rank}.json").write_text(json.dumps(docs[rank]))
    assert "no divergence" in doctor.diagnose(doctor.load([str(tmp_path)]))


def test_doctor_rejects_what_is_not_a_flight_record(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    assert doctor.main([str(tmp_path / "x.json")]) == 2
    assert "not a collectives flight record" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert doctor.main([str(empty)]) == 2


def test_sub_groups_get_their_own_record_file(flight_dir):
    def body(pg):
        sub = pg.new_group([0, 1])
        again = pg.new_group([0, 1])
        names = (sub._flight_name, again._flight_name)
        sub.close()
        again.close()
        return names

    assert run_threads(body, 2) == [("world.0-1", "world.0-1#1")] * 2
