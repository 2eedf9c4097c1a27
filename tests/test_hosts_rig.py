"""The several-hosts rig (collectives.testing.hosts): hosts really are apart, the link
shape takes effect, and teardown leaves nothing behind."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import pytest

from collectives.testing.hosts import HostRig, RigError, parse_rate, rig_unavailable

needs_rig = pytest.mark.skipif(rig_unavailable() is not None,
                               reason=rig_unavailable() or "")

# A TCP sink and source: the sink prints how many bytes it got and in how many seconds,
# counted from the first byte (so the connection's set-up is left out).
_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); got, start = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    start = start or time.perf_counter(); got += len(b)
print(got, time.perf_counter() - start, flush=True)
"""
_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def _transfer(rig: HostRig, sender: str, receiver: str, to: str, nbytes: int) -> tuple:
    """Send ``nbytes`` from ``sender`` to ``receiver`` (reached at ``to``): (bytes, s)."""
    sink = rig.popen(receiver, [sys.executable, "-c", _SINK, "5601"],
                     stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "listening"
    rig.run(sender, [sys.executable, "-c", _SOURCE, to, "5601", str(nbytes)],
            timeout=60, check=True)
    out, _ = sink.communicate(timeout=60)
    got, seconds = out.split()
    return int(got), float(seconds)


def test_parse_rate_and_bad_arguments():
    assert parse_rate("1gbit") == 10**9 and parse_rate("100Mbit") == 10**8
    assert parse_rate(2_000_000) == 2_000_000
    for bad in ("fast", "1 gbyte", "-5mbit"):
        with pytest.raises(ValueError, match="argument `rate`"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="at least 8000"):
        parse_rate(100)
    with pytest.raises(TypeError, match="argument `rate`"):
        parse_rate(True)
    with pytest.raises(ValueError, match="argument `count`"):
        HostRig(0)
    with pytest.raises(ValueError, match="argument `names`"):
        HostRig(2, names=["a", "a"])
    with pytest.raises(ValueError, match="argument `delay`"):
        HostRig(2, delay=-1)
    with pytest.raises(ValueError, match="argument `cores`"):
        HostRig(2, cores="half")


_AFFINITY = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]


@needs_rig
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_split_cores_give_each_host_its_own():
    mine = sorted(os.sched_getaffinity(0))
    with HostRig(2, cores="split") as rig:
        seen = {h: eval(rig.run(h, _AFFINITY, check=True).stdout) for h in rig.names}
        assert seen == rig.host_cores
        assert seen["host0"] and seen["host1"]
        assert not set(seen["host0"]) & set(seen["host1"])
        assert set(seen["host0"]) | set(seen["host1"]) <= set(mine)
        # a command's children keep their host's cores
        nested = rig.run("host1", ["sh", "-c", shlex.join(_AFFINITY)], check=True)
        assert eval(nested.stdout) == seen["host1"]
        # and what mpiexec starts on host1 from host0 (through the launcher script, as
        # run_mpiexec does) runs on host1's cores, not on those of host0 it came from
        hopped = rig.run("host0", [rig.launcher_script(), "-x", "host1",
                                   shlex.join(_AFFINITY)], check=True)
        assert eval(hopped.stdout) == seen["host1"]
    with HostRig(2) as rig:
        assert rig.host_cores is None
        assert eval(rig.run("host1", _AFFINITY, check=True).stdout) == mine
        hopped = rig.run("host0", [rig.launcher_script(), "host1", shlex.join(_AFFINITY)],
                         check=True)
        assert eval(hopped.stdout) == mine
    with pytest.raises(RigError, match="a core per host"):
        HostRig(len(mine) + 1, cores="split")


@needs_rig
def test_hosts_have_their_own_hostname_shm_and_address():
    with HostRig(2) as rig:
        assert rig.names == ["host0", "host1"]
        for host in rig.names:
            out = rig.run(host, "hostname; getent hosts host0 host1; "
                                "ip -4 -o addr show dev eth0", check=True).stdout.split()
            assert out[0] == host
            assert out[1:5] == [rig.address("host0"), "host0", rig.address("host1"), "host1"]
            assert f"{rig.address(host)}/24" in out
        assert rig.address("host0") != rig.address("host1")
        # /dev/shm: shared by the commands of one host, private to it
        rig.run("host0", "echo hello > /dev/shm/rig-probe", check=True)
        assert rig.run("host0", ["cat", "/dev/shm/rig-probe"], check=True).stdout == "hello\n"
        assert rig.run("host1", ["ls", "/dev/shm"], check=True).stdout == ""
        assert not os.path.exists("/dev/shm/rig-probe")
        with pytest.raises(ValueError, match="'host7' is not a host of this rig"):
            rig.run("host7", ["true"])


@needs_rig
def test_hosts_reach_each_other_over_tcp_by_name_and_address():
    with HostRig(3) as rig:
        for to in ("host2", rig.address("host2")):
            got, _ = _transfer(rig, "host0", "host2", to, 1 << 20)
            assert got == 1 << 20
        # nothing of the rig's appears in the machine's own network namespace
        own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert "10.77.0." not in own and "br0" not in own


@needs_rig
def test_rate_limit_takes_effect():
    rate = parse_rate("40mbit")                        # 5 MB/s
    nbytes = 4 << 20                                   # ~0.8 s at that rate
    with HostRig(2, rate=rate) as rig:
        got, seconds = _transfer(rig, "host0", "host1", "host1", nbytes)
    assert got == nbytes
    achieved = got * 8 / seconds
    # Never faster than the link (the first burst aside); a loaded 2-core box may be slower,
    # but not ten times so at this modest rate.
    assert rate / 10 < achieved < rate * 1.25, f"{achieved / 1e6:.1f} Mbit/s over a 40 Mbit/s link"


@needs_rig
def test_delay_needs_netem_or_is_felt():
    try:
        rig = HostRig(2, delay=0.05)
    except RigError as exc:
        assert "netem" in str(exc)
        pytest.skip(f"this kernel has no netem: {exc}")
    with rig:
        start = time.perf_counter()
        got, _ = _transfer(rig, "host0", "host1", "host1", 1000)
        # connect + data + close cross the link several times, each way >= 50 ms
        assert got == 1000 and time.perf_counter() - start > 0.1


@needs_rig
def test_teardown_leaves_nothing():
    before = set(os.listdir("/tmp"))
    rig = HostRig(2, rate="1gbit")
    folder = rig._dir
    anchors = [a.pid for a in rig._all_anchors()]
    orphan = rig.popen("host1", "sleep 300 & sleep 300; wait")  # a child of its own too
    deadline = time.monotonic() + 10
    while len(rig.processes()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    on_hosts = rig.processes()
    assert len(on_hosts) >= 3
    rig.close()
    rig.close()  # twice is fine
    assert orphan.returncode is not None
    for pid in on_hosts + anchors:
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    assert not os.path.exists(folder)
    assert set(os.listdir("/tmp")) - before == set()
    mounts = open("/proc/self/mounts").read()
    assert "collectives-rig" not in mounts


@needs_rig
def test_failed_build_leaves_nothing():
    anchors_before = _unshare_anchors()
    with pytest.raises(RigError, match="giving host0 its hostname"):
        HostRig(2, shm_size="not-a-size")
    assert _unshare_anchors() == anchors_before


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _unshare_anchors() -> set:
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"echo ready; read _" in f.read():
                    found.add(entry)
        except OSError:
            continue
    return found


@needs_rig
def test_jobs_on_the_rig_report_failures_and_time_out():
    from collectives.testing.hosts_launch import JobFailed, run_ranks, summary
    with HostRig(2) as rig:
        outs = run_ranks(rig, ["sh", "-c", 'echo "$RANK $LOCAL_RANK $(hostname) $MASTER_ADDR"'])
        lines = sorted(line for o in outs for line in o.stdout.splitlines())
        assert lines == ["0 0 host0 host0", "1 1 host0 host0", "2 0 host1 host0",
                         "3 1 host1 host0"]
        with pytest.raises(ValueError, match="no host printed a JSON line"):
            summary(outs)
        with pytest.raises(JobFailed, match=r"2 ranks on host0, host1: failed") as info:
            run_ranks(rig, ["sh", "-c", 'echo "rank $RANK says no" >&2; exit $RANK'],
                      per_host=1)
        assert "rank 1 says no" in str(info.value)
        assert [o.returncodes for o in info.value.outputs] == [(0,), (1,)]
        start = time.monotonic()
        with pytest.raises(JobFailed, match="not finished within 1 s; every process was"):
            run_ranks(rig, ["sleep", "60"], per_host=1, timeout=1)
        assert time.monotonic() - start < 20 and rig.processes() == []
