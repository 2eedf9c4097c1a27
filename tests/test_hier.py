"""The ``hier`` backend (shm inside a host, the network between hosts) beyond the
conformance suite, which runs it on virtual hosts (``COLLECTIVES_HOST``) at 1 to 4 ranks:
the layout of ranks over hosts, the host identity, the automatic choice over shm, the
two-level paths on sizes the sweep draws rarely (pipelined pieces, padding, AVG), results
bitwise identical on every rank, direct routes for point to point, sub-groups across
hosts, three hosts, gloo and mpi between hosts, and a rank killed on the other host.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import collectives
from collectives import ReduceOp
from collectives.hosts import listed_hosts, spans_hosts
from collectives.launch import Rendezvous
from collectives.world import across_hosts
from backends.hier.topology import Topology, host_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import tasks  # noqa: E402
from faults.world import Died, FaultWorld  # noqa: E402
from job_env import job_env  # noqa: E402

MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec")

TWO_BY_TWO = {"COLLECTIVES_HOST": "h0,h0,h1,h1"}


# ------------------------------------------------------------------ layout, identity
def test_topology_of_even_and_uneven_hosts():
    even = Topology.from_keys(["a", "b", "a", "b"], rank=3)   # interleaved placement
    assert even.hosts == ((0, 2), (1, 3)) and even.even
    assert (even.host_index, even.local_index, even.local_ranks) == (1, 1, (1, 3))
    assert even.column(0) == (0, 1) and even.column(1) == (2, 3)
    uneven = Topology.from_keys(["a", "a", "a", "b"], rank=3)
    assert not uneven.even and uneven.column(0) == (0, 3) and uneven.column(2) == (2,)
    sub = uneven.restrict([1, 2, 3])   # ranks 1..3 of the world, renumbered 0..2
    assert sub.hosts == ((0, 1), (2,)) and sub.rank == 2
    assert even.describe() == "2 hosts: a [0, 2], b [1, 3]"


def test_host_key_and_its_override():
    assert host_key({"COLLECTIVES_HOST": " node7 "}) == "node7"
    mine = host_key({})
    assert mine == host_key({}) and mine.startswith(os.uname().nodename + "#")
    assert listed_hosts(2, {"COLLECTIVES_HOST": "a,b,c"}) == ["a", "b"]
    assert listed_hosts(2, {"COLLECTIVES_HOST": "a"}) is None
    with pytest.raises(ValueError, match="COLLECTIVES_HOST.*lists 2 hosts.*4 ranks"):
        listed_hosts(4, {"COLLECTIVES_HOST": "a,b"})


def test_shm_across_hosts_becomes_hier_and_says_so(caplog, monkeypatch):
    two_hosts = Rendezvous(0, 4, 0, 2, "h0", 29500, "j", "torchrun")
    one_host = Rendezvous(0, 4, 0, 4, "h0", 29500, "j", "torchrun")
    monkeypatch.delenv("COLLECTIVES_HOST", raising=False)
    assert spans_hosts(two_hosts) and not spans_hosts(one_host)
    assert spans_hosts(one_host, {"COLLECTIVES_HOST": "x,x,y,y"})
    assert not spans_hosts(two_hosts, {"COLLECTIVES_HOST": "x,x,x,x"})
    with caplog.at_level(logging.INFO, logger="collectives"):
        assert across_hosts("shm", two_hosts) == "hier"
    assert any("spans several hosts" in r.getMessage() for r in caplog.records)
    assert across_hosts("shm", one_host) == "shm"
    assert across_hosts("zmq", two_hosts) == "zmq"


# ------------------------------------------------------------------------- worlds
def _identical_everywhere(pg, a: np.ndarray) -> bool:
    """Whether every rank holds the same bytes as this one."""
    return len({bytes(x) for x in pg.all_gather_object(a.tobytes())}) == 1


def _sizes_and_ops() -> dict:
    """Runs in every rank: the two-level paths on sizes and ops the sweep draws rarely."""
    pg = collectives.init_process_group()   # "shm" from the pool's environment
    out = {"backend": pg.backend, "rank": pg.rank}
    rng = np.random.default_rng(pg.rank)
    n = pg.size
    results = []
    # around the split and piece lines, with counts that do not divide among the ranks
    for count in (1, 3, 16383, 16385, 262147, (3 << 20) // 4 + 5):
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            a = rng.standard_normal(count).astype(np.float32)
            inputs = pg.all_gather_object(a.copy())   # (its own entry is the object)
            pg.all_reduce(a, op)
            exact = np.stack(inputs).astype(np.float64)
            want = exact.max(0) if op is ReduceOp.MAX else \
                exact.sum(0) / (n if op is ReduceOp.AVG else 1)
            results.append((count, op.name, bool(np.allclose(a, want, rtol=1e-4, atol=1e-4)),
                            _identical_everywhere(pg, a)))
    ints = np.arange(100003, dtype=np.int64) * (pg.rank + 1)
    pg.all_reduce(ints)
    results.append(("int64", "SUM", bool((ints == np.arange(100003) * n * (n + 1) // 2).all()),
                    True))
    out["all_reduce"] = results
    # reduce to a rank on the other host: the others' tensors unchanged
    a = np.full(70001, pg.rank + 1.0, np.float64)
    pg.reduce(a, dst=n - 1)
    out["reduce"] = float(a[0]), float(a[-1])
    b = np.full(5, -1, np.int32) if pg.rank else np.arange(5, dtype=np.int32)
    pg.broadcast(b, src=0)
    c = np.full(5, pg.rank, np.int32)
    pg.broadcast(c, src=n - 1)
    out["broadcast"] = b.tolist(), c.tolist()
    gathered = np.empty(3 * n, np.int16)
    pg.all_gather(gathered, np.full(3, pg.rank, np.int16))
    out["all_gather"] = gathered.tolist()
    mine = np.empty(2, np.float32)
    pg.reduce_scatter(mine, np.arange(2 * n, dtype=np.float32))
    out["reduce_scatter"] = mine.tolist()
    out["routes"] = [pg.transport.route(r) if r != pg.rank else "self" for r in range(n)]
    peer = pg.rank ^ 1   # a point to point exchange inside each host, one across
    far = (pg.rank + 2) % n
    for other in (peer, far):
        got = np.empty(4, np.float32)
        if pg.rank < other:
            pg.send(np.full(4, pg.rank, np.float32), other, tag=7)
            pg.recv(got, other, tag=7)
        else:
            pg.recv(got, other, tag=7)
            pg.send(np.full(4, pg.rank, np.float32), other, tag=7)
        out[f"p2p{other}"] = got.tolist()
    # sub-groups: one rank of each host; three ranks over two hosts (uneven)
    if pg.rank in (0, 2):
        across = pg.new_group([0, 2])
        t = np.full(300000, pg.rank + 1.0, np.float32)
        across.all_reduce(t)
        out["across"] = (across.backend, float(t[0]), across.transport.topo.describe())
    if pg.rank in (0, 1, 2):
        within = pg.new_group([0, 1, 2])
        t = np.full(7, pg.rank + 1, np.int64)
        within.all_reduce(t)
        out["within"] = int(t[0])
    pg.barrier()
    out["describe"] = pg.describe()
    pg.close()
    return out


@pytest.mark.timeout(300)
def test_two_hosts_of_two_ranks(monkeypatch):
    for k, v in TWO_BY_TWO.items():
        monkeypatch.setenv(k, v)
    results = collectives.spawn(_sizes_and_ops, 4, backend="shm", timeout=60)
    for r, out in enumerate(results):
        assert out["backend"] == "hier", out
        bad = [x for x in out["all_reduce"] if not (x[2] and x[3])]
        assert not bad, f"rank {r}: (count, op, right, identical on every rank): {bad}"
        assert out["reduce"] == ((10.0, 10.0) if r == 3 else (r + 1.0, r + 1.0))
        assert out["broadcast"] == ([0, 1, 2, 3, 4], [3] * 5)
        assert out["all_gather"] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        assert out["reduce_scatter"] == [8.0 * r, 8.0 * r + 4]
        assert out["routes"] == [("self" if p == r else "shm" if p // 2 == r // 2 else "zmq")
                                 for p in range(4)]
        assert out[f"p2p{r ^ 1}"] == [float(r ^ 1)] * 4
        assert out[f"p2p{(r + 2) % 4}"] == [float((r + 2) % 4)] * 4
        if r in (0, 2):
            assert out["across"] == ("hier", 4.0, "2 hosts: h0 [0], h1 [1]")
        if r < 3:
            assert out["within"] == 6
    assert "2 hosts: h0 [0, 1], h1 [2, 3]" in results[0]["describe"]
    assert "pipelined" in results[0]["describe"]


def _split_sums(backend: str = "shm") -> list:
    """Runs in every rank: all_reduce across the split and piece lines; per size, whether
    the sum is right and the same bits are on every rank."""
    pg = collectives.init_process_group(backend)
    assert pg.backend == "hier", pg.backend
    rng = np.random.default_rng(pg.rank)
    results = []
    big = (3 << 20) // 4 + 5
    for count, dtype, op in ((16385, np.float32, ReduceOp.SUM),
                             (262147, np.float32, ReduceOp.SUM),
                             (big, np.float32, ReduceOp.SUM),
                             (big, np.float32, ReduceOp.MIN),
                             (big, ml_dtypes.bfloat16, ReduceOp.SUM)):
        a = rng.standard_normal(count).astype(dtype)
        inputs = pg.all_gather_object(a.copy())
        pg.all_reduce(a, op)
        exact = np.stack(inputs).astype(np.float64)
        want = exact.min(0) if op is ReduceOp.MIN else exact.sum(0)
        tol = 5e-2 if dtype is ml_dtypes.bfloat16 else 1e-4
        results.append((count, bool(np.allclose(a.astype(np.float64), want, rtol=tol,
                                                atol=tol)),
                        _identical_everywhere(pg, a)))
    pg.close()
    return results


def _check_sums(results: list) -> None:
    for r, rows in enumerate(results):
        bad = [x for x in rows if not (x[1] and x[2])]
        assert not bad, f"rank {r}: (count, right, identical on every rank): {bad}"


@pytest.mark.timeout(300)
def test_three_hosts_run_a_column_all_reduce_per_piece(monkeypatch):
    # (two hosts stream the shards between a column's pair; more hosts than two take the
    # column all_reduce per piece)
    monkeypatch.setenv("COLLECTIVES_HOST", "a,a,b,b,c,c")
    results = collectives.spawn(_split_sums, 6, backend="shm", timeout=120)
    _check_sums(results)


@pytest.mark.timeout(300)
def test_the_most_pieces(monkeypatch):
    # 4 KiB pieces: 1 MiB and more runs in MAX_PIECES (256) pieces, each a few KiB
    monkeypatch.setenv("COLLECTIVES_HOST", "h0,h0,h1,h1")
    monkeypatch.setenv("COLLECTIVES_HIER_PIECE_BYTES", "4096")
    _check_sums(collectives.spawn(_split_sums, 4, backend="shm", timeout=120))


@pytest.mark.timeout(300)
def test_gloo_between_hosts(monkeypatch):
    # COLLECTIVES_HIER_NET: the stream between hosts runs on the column's point to point
    # whatever the network transport
    monkeypatch.setenv("COLLECTIVES_HOST", "h0,h0,h1,h1")
    monkeypatch.setenv("COLLECTIVES_HIER_NET", "gloo")
    results = collectives.spawn(_split_sums, 4, backend="shm", timeout=120)
    _check_sums(results)


@pytest.mark.timeout(300)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec here")
def test_mpi_between_hosts(tmp_path):
    pytest.importorskip("mpi4py")
    env = {**job_env(), "COLLECTIVES_HOST": "h0,h0,h1,h1", "COLLECTIVES_HIER_NET": "mpi"}
    done = subprocess.run([MPIEXEC, "-n", "4", sys.executable, __file__, str(tmp_path)],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_sums([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)])


# ------------------------------------------------------------------ a killed rank
@pytest.mark.timeout(120)
def test_a_rank_killed_on_the_other_host_is_named_and_nobody_hangs():
    """Rank 1 (host h0) is SIGKILLed inside all_reduce: its host's rank 0 (shm) and its
    column peer on host h1, rank 3 (the network), name it; rank 2, which talks to
    neither of them directly in that call, fails too: PeerError, well before the group
    timeout, and nothing is left behind."""
    victim, limit = 1, 10.0
    with FaultWorld("hier", 4, timeout=12.0, env=TWO_BY_TWO) as world:
        outcomes = world.call(tasks.kill_in_collective, "all_reduce", victim, limit + 1.0,
                              limit=30)
    assert isinstance(outcomes[victim], Died), outcomes
    for r in (0, 2, 3):
        out = outcomes[r]
        assert isinstance(out, dict) and out["type"] == "PeerError", f"rank {r}: {out}"
        assert out["message"].startswith(f"[rank {r}/4] all_reduce"), out["message"]
        assert out["after_s"] < limit, f"rank {r}: {out}"
    for r in (0, 3):
        assert outcomes[r]["peer"] == victim and "rank 1" in outcomes[r]["message"], \
            f"rank {r}: {outcomes[r]}"
    # rank 2 is told by a survivor that left the call: its column peer (rank 0, through
    # the network) or its host peer (rank 3), named in this group's numbering
    assert outcomes[2]["peer"] in (0, 3), f"rank 2: {outcomes[2]}"
    print("\n".join(f"rank {r}: {outcomes[r]}" for r in (0, 2, 3)))
    assert not world.leftovers, f"left behind: {world.leftovers}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["recv", "irecv"])
def test_a_peer_that_dies_on_this_host_is_named_in_the_group_s_numbering(how):
    """Rank 3 dies while rank 2, on the same host (h1), waits to receive from it: the
    message goes through shm, whose ranks there are 1 and 0, and the PeerError names
    rank 3, as the group numbers it."""
    victim, receiver, limit = 3, 2, 10.0
    with FaultWorld("hier", 4, timeout=12.0, env=TWO_BY_TWO) as world:
        outcomes = world.call(tasks.kill_during_recv, how, victim, receiver, limit + 1.0,
                              limit=30)
    assert isinstance(outcomes[victim], Died), outcomes
    out = outcomes[receiver]
    assert isinstance(out, dict) and out["type"] == "PeerError", out
    assert out["peer"] == victim, out
    assert out["message"].startswith(f"[rank {receiver}/4] recv: in the host (ranks 2, 3)"
                                     f": rank {victim}"), out["message"]
    assert out["after_s"] < limit, out
    assert not world.leftovers, f"left behind: {world.leftovers}"


# ------------------------------------------------------------------ the documentation
@pytest.mark.timeout(180)
def test_the_documentation_example_runs_as_written(tmp_path):
    """The python block of docs/hierarchical.md prints what its comment says."""
    import re
    import subprocess
    page = (Path(__file__).resolve().parent.parent / "docs" / "hierarchical.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 1, "docs/hierarchical.md: expected one python block"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = re.search(r"# (\('hier'.*\))", blocks[0]).group(1)
    assert done.stdout.splitlines() == [expected] * 4, done.stdout


@pytest.mark.timeout(120)
def test_a_sleeping_rank_is_a_timeout_naming_it_on_both_hosts():
    """Rank 1 (host h0) never makes the call: its host's rank 0 and its column peer on
    h1, rank 3, raise CollectiveTimeout naming op, seq and rank 1 (``missing``) at the
    group timeout; rank 2 names the rank it waited for, rank 0 (a timeout of its own, or
    rank 0 leaving the call at its timeout, whichever comes first)."""
    sleeper, timeout = 1, 2.0
    with FaultWorld("hier", 4, timeout=timeout, env=TWO_BY_TWO) as world:
        outcomes = world.call(tasks.sleep_in_collective, "all_reduce", sleeper, 2 * timeout,
                              limit=60)
    two = outcomes[2]
    assert isinstance(two, dict) and (two["type"], two["missing"] or [two["peer"]]) in (
        ("CollectiveTimeout", [0]), ("PeerError", [0])), f"rank 2: {two}"
    for r, missing in ((0, [1]), (3, [1])):
        out = outcomes[r]
        assert isinstance(out, dict) and out["type"] == "CollectiveTimeout", f"rank {r}: {out}"
        assert (out["op"], out["seq"], out["missing"]) == ("all_reduce", out["expected_seq"],
                                                           missing), f"rank {r}: {out}"
        assert timeout * 0.9 <= out["after_s"] < timeout + 3.0, f"rank {r}: {out}"
    assert not world.leftovers, f"left behind: {world.leftovers}"


def _abort_while_waiting() -> tuple:
    """Runs in every rank: rank 0 (and 3, across hosts) call all_reduce that the others
    never join; every rank aborts its group 0.5 s in."""
    import threading
    import time
    pg = collectives.init_process_group()
    pg.barrier()
    threading.Timer(0.5, pg.abort).start()
    start = time.monotonic()
    if pg.rank in (0, 3):
        try:
            pg.all_reduce(np.ones(1 << 18, np.float32))
        except collectives.CollectiveError as exc:
            return type(exc).__name__, time.monotonic() - start, str(exc)
        return None, time.monotonic() - start, ""
    time.sleep(1.0)
    return "idle", 0.0, ""


@pytest.mark.timeout(120)
def test_abort_ends_a_two_level_call(monkeypatch):
    for k, v in TWO_BY_TWO.items():
        monkeypatch.setenv(k, v)
    results = collectives.spawn(_abort_while_waiting, 4, timeout=30)
    for r in (0, 3):
        kind, after, text = results[r]
        assert kind == "GroupAborted" and after < 2.0, f"rank {r}: {results[r]}"
        assert text.startswith(f"[rank {r}/4] all_reduce"), text


if __name__ == "__main__":   # python tests/test_hier.py DIR, as a rank of mpiexec
    RANK = os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]
    Path(sys.argv[1], f"rank{RANK}.json").write_text(json.dumps(_split_sums("hier")))
