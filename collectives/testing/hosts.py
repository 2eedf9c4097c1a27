"""Several "hosts" on one Linux machine: a rig for trying multi-host runs without a cluster.

Each host of a :class:`HostRig` is a set of Linux namespaces held open by an *anchor*
process (a shell waiting on its standard input):

- a network namespace: its own loopback, and an ``eth0`` with address ``10.77.0.<i+1>/24``,
  one end of a veth pair whose other end is a port of a bridge in a namespace of its own
  (the *switch*);
- a UTS namespace: its own hostname (``host0``, ``host1``, ...);
- a mount namespace: its own ``/dev/shm`` (a private tmpfs: shared-memory segments of one
  host are invisible to the others, as on real machines), an ``/etc/hosts`` that names every
  host of the rig, and a ``/sys`` that shows its own interfaces. Everything else (``/tmp``,
  the repository, Python and its packages) is this machine's.

A command runs "on" a host through ``nsenter`` into its anchor's namespaces, so every
command on one host shares that host's ``/dev/shm``, hostname and address. Nothing is
added to the machine's own network namespace (no interface, route or name), so a rig can
neither disturb the machine's network nor collide with another rig.

CPUs: by default every host's commands may run on all of this machine's cores, so the
hosts compete for them, which no cluster's machines do, and a host's ranks see cores that
its neighbours also use. ``cores="split"`` gives each host its own share of the cores (host
``i`` the ``i``-th equal, contiguous share; at least one core per host), set as the CPU
affinity its commands start with, so what a rank reads of its cores is its host's.

Link shape: ``rate`` limits each host's link, both ways, with a ``tbf`` qdisc on both ends of
its veth pair (like a NIC of that speed on a switch): a transfer between two hosts runs at
most at ``rate``. ``delay`` adds a one-way delay to everything a host sends (``netem``);
kernels without netem refuse it with :class:`RigError`.

Teardown (leaving the ``with`` block, or :meth:`HostRig.close`) kills every process still in
a host's namespaces, then the anchors; the namespaces, veths, bridge and mounts go with their
last process. If the creating process dies instead, the anchors read end of file on their
standard input and exit too.

Needs root, util-linux (``unshare``, ``nsenter``) and iproute2 (``ip``, ``tc``);
:func:`rig_unavailable` says what is missing (tests skip with that reason).

Two hosts, a server on one and a client on the other::

    from collectives.testing.hosts import HostRig

    with HostRig(2, rate="1gbit") as rig:
        rig.run("host0", ["hostname"]).stdout          # 'host0\\n'
        server = rig.popen("host1", ["python", "-m", "http.server", "8000"])
        rig.run("host0", ["curl", f"http://{rig.address('host1')}:8000/"])
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence, Union

from collectives.lifetime import process_alive

__all__ = ["HostRig", "RigError", "parse_rate", "rig_unavailable"]

log = logging.getLogger("collectives.testing.hosts")

#: The rig's subnet: private to the switch's namespace, so every rig can use the same one.
SUBNET = "10.77.0"
_TOOLS = ("unshare", "nsenter", "ip", "tc")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
Command = Union[str, Sequence[str]]


class RigError(RuntimeError):
    """The rig could not be built or used: the failing step and what the tool said."""


def rig_unavailable() -> Optional[str]:
    """Why a :class:`HostRig` cannot be built here, or None when it can (root and the tools).

    >>> rig_unavailable() is None or isinstance(rig_unavailable(), str)
    True
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the host rig needs root (network, UTS and mount namespaces)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the host rig needs {', '.join(missing)} (util-linux, iproute2)"
    return None


def parse_rate(rate: Union[str, int, float]) -> int:
    """A link rate in bits per second: a number, or tc's spelling (``"1gbit"``, ``"100mbit"``).

    >>> parse_rate("1gbit"), parse_rate("2.5mbit"), parse_rate(8000)
    (1000000000, 2500000, 8000)
    """
    if isinstance(rate, bool):
        raise TypeError(f"HostRig: argument `rate` must be bits per second or a string "
                        f"like '1gbit', got {rate!r}")
    if isinstance(rate, (int, float)):
        bits = int(rate)
    else:
        match = _RATE.match(str(rate))
        if match is None:
            raise ValueError(f"HostRig: argument `rate`: {rate!r} is not a rate; give bits "
                             f"per second or e.g. '1gbit', '100mbit', '500kbit'")
        bits = int(float(match.group(1)) * _RATE_SCALE[(match.group(2) or "bit").lower()])
    if bits < 8000:
        raise ValueError(f"HostRig: argument `rate` must be at least 8000 bit/s, got {rate!r}")
    return bits


def _tool(cmd: Sequence[str], what: str, stdin: Optional[str] = None) -> str:
    """Run one set-up command; its failure is a :class:`RigError` naming ``what``."""
    try:
        done = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RigError(f"HostRig: {what}: {exc}") from None
    if done.returncode != 0:
        raise RigError(f"HostRig: {what}: `{' '.join(cmd)}` failed with status "
                       f"{done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


class _Anchor:
    """A shell holding a set of new namespaces open until its standard input closes."""

    def __init__(self, namespaces: Sequence[str], what: str, timeout: float = 10.0) -> None:
        self.what = what
        try:
            self.proc = subprocess.Popen(
                ["unshare", *namespaces, "--", "sh", "-c", "echo ready; read _"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)  # a Ctrl-C meant for the tests does not end it
        except OSError as exc:
            raise RigError(f"HostRig: {what}: cannot run unshare: {exc}") from None
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            err = self.proc.stderr.read().decode(errors="replace").strip() \
                if self.proc.stderr else ""
            raise RigError(f"HostRig: {what}: unshare {' '.join(namespaces)} did not start "
                           f"within {timeout:.0f} s: {err or 'no message'}")
        self.pid = self.proc.pid
        self.net_inode = os.stat(f"/proc/{self.pid}/ns/net").st_ino

    def enter(self, *kinds: str) -> list[str]:
        """``nsenter`` into this anchor's namespaces of ``kinds`` (``--net``, ``--uts``...)."""
        return ["nsenter", "-t", str(self.pid), *kinds]

    def close(self, timeout: float = 5.0) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()  # `read` sees end of file; the shell exits
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _split_cores(names: Sequence[str]) -> dict[str, list[int]]:
    """This process's cores in equal, contiguous shares, one per host (the remainder
    unused); a :class:`RigError` where there are fewer cores than hosts."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // len(names)
    if share == 0:
        raise RigError(f"HostRig: cores='split' needs a core per host; {len(names)} hosts, "
                       f"{len(cores)} cores ({cores})")
    if shutil.which("taskset") is None:
        raise RigError("HostRig: cores='split' needs util-linux's taskset")
    return {name: cores[i * share:(i + 1) * share] for i, name in enumerate(names)}


class HostRig:
    """``count`` emulated hosts on one machine; a context manager (see the module's doc).

    ``rate``: each host's link speed, both ways (bits per second, or ``"1gbit"``);
    ``delay``: seconds of one-way delay added to what each host sends (needs netem);
    ``names``: the hostnames (default ``host0``, ``host1``, ...); ``shm_size``: the tmpfs
    size of each host's ``/dev/shm`` (tmpfs's default, half the memory, when None);
    ``cores``: ``"shared"`` (every host may use every core of this machine: the default,
    so that a job run on one host of the rig, as a baseline, has them all) or ``"split"``
    (each host its own share of them, ``host_cores``; see the module's doc).

    Two ranks on two hosts::

        with HostRig(2) as rig:
            env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": rig.address("host0"),
                   "MASTER_PORT": "29500"}
            procs = [rig.popen(h, ["python", "train.py"], env={**env, "RANK": str(r)})
                     for r, h in enumerate(rig.names)]
    """

    def __init__(self, count: int = 2, *, rate: Union[str, int, float, None] = None,
                 delay: Optional[float] = None, names: Optional[Sequence[str]] = None,
                 shm_size: Optional[str] = None, cores: str = "shared") -> None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
            raise ValueError(f"HostRig: argument `count` must be an int from 1 to 250, got "
                             f"{count!r}")
        names = [f"host{i}" for i in range(count)] if names is None else list(names)
        if len(names) != count or len(set(names)) != count or not all(
                isinstance(n, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,62}", n)
                for n in names):
            raise ValueError(f"HostRig: argument `names` must be {count} distinct hostnames "
                             f"(letters, digits, '-'), got {names!r}")
        if delay is not None and not (isinstance(delay, (int, float)) and 0 <= delay <= 10):
            raise ValueError(f"HostRig: argument `delay` must be seconds from 0 to 10, got "
                             f"{delay!r}")
        if cores not in ("shared", "split"):
            raise ValueError(f"HostRig: argument `cores` must be 'shared' or 'split', got "
                             f"{cores!r}")
        reason = rig_unavailable()
        if reason is not None:
            raise RigError(f"HostRig: {reason}")
        self.names: list[str] = names
        #: Each host's cores where ``cores="split"``, else None (all of this machine's).
        self.host_cores: Optional[dict[str, list[int]]] = (
            _split_cores(names) if cores == "split" else None)
        self.rate_bits: Optional[int] = None if rate is None else parse_rate(rate)
        self.delay: Optional[float] = delay
        self._addresses = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self._anchors: dict[str, _Anchor] = {}
        self._switch: Optional[_Anchor] = None
        self._started: list[subprocess.Popen] = []
        self._dir = tempfile.mkdtemp(prefix="collectives-rig-")
        try:
            self._build(shm_size)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ building
    def _build(self, shm_size: Optional[str]) -> None:
        hosts_file = os.path.join(self._dir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            f.writelines(f"{self._addresses[n]}\t{n}\n" for n in self.names)
        self._switch = _Anchor(["--net"], "the switch's network namespace")
        _tool(self._switch.enter("--net") + ["ip", "-batch", "-"], "building the bridge",
              "link set lo up\nlink add br0 type bridge\nlink set br0 up\n")
        tmpfs = "mode=1777" + (f",size={shm_size}" if shm_size else "")
        for i, name in enumerate(self.names):
            anchor = _Anchor(["--net", "--uts", "--mount", "--propagation", "private"],
                             f"host {name}'s namespaces")
            self._anchors[name] = anchor
            _tool(self._switch.enter("--net") + ["ip", "-batch", "-"], f"wiring {name}",
                  f"link add h{i} type veth peer name eth0 netns {anchor.pid}\n"
                  f"link set h{i} master br0 up\n")
            _tool(anchor.enter("--net") + ["ip", "-batch", "-"], f"addressing {name}",
                  f"link set lo up\naddr add {self._addresses[name]}/24 dev eth0\n"
                  f"link set eth0 up\n")
            _tool(anchor.enter("--net", "--uts", "--mount") + [
                "sh", "-c", 'set -e; hostname "$1"; mount -t tmpfs -o "$2" shm /dev/shm; '
                            'mount --bind "$3" /etc/hosts; mount -t sysfs sysfs /sys',
                "sh", name, tmpfs, hosts_file], f"giving {name} its hostname and mounts")
            self._shape(i, name, anchor)

    def _shape(self, index: int, name: str, anchor: _Anchor) -> None:
        """Limit host ``index``'s link: its sending end (``eth0``) and the switch's port
        that sends to it (``h<index>``); the delay on the sending end only."""
        if self.rate_bits is None and self.delay is None:
            return
        limit = []
        if self.rate_bits is not None:
            # A burst of 1 ms at the rate, at least 64 KiB (one GSO packet): smaller ones
            # throttle below the rate, larger ones let bursts through above it.
            burst = max(self.rate_bits // 8000, 64 * 1024)
            limit = ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst),
                     "latency", "50ms"]
            assert self._switch is not None
            _tool(self._switch.enter("--net") + ["tc", "qdisc", "replace", "dev",
                                                 f"h{index}", "root", *limit],
                  f"limiting the link into {name}")
        if self.delay is None:
            sending = limit
        else:
            sending = ["netem", "delay", f"{self.delay * 1e3:.3f}ms"] + (
                ["rate", f"{self.rate_bits}bit"] if self.rate_bits is not None else [])
        _tool(anchor.enter("--net") + ["tc", "qdisc", "replace", "dev", "eth0", "root",
                                       *sending],
              f"shaping the link out of {name}"
              + (" (a delay needs the kernel's netem qdisc)" if self.delay is not None else ""))

    # ------------------------------------------------------------------ using
    def address(self, host: str) -> str:
        """The IPv4 address of ``host`` on the rig's bridge (``10.77.0.<i+1>``)."""
        self._check_host(host, "address")
        return self._addresses[host]

    def enter_command(self, host: str, cwd: Optional[str] = None) -> list[str]:
        """The ``nsenter`` prefix that runs a command on ``host`` in folder ``cwd``
        (default: this process's): ``rig.enter_command("host1") + ["hostname"]``."""
        self._check_host(host, "enter_command")
        return self._anchors[host].enter("--net", "--uts", "--mount") + [
            f"--wd={cwd or os.getcwd()}", "--"] + self._pinning(host)

    def _pinning(self, host: str) -> list[str]:
        """The ``taskset`` prefix that keeps a command on ``host``'s cores (none where
        the hosts share them)."""
        if self.host_cores is None:
            return []
        return ["taskset", "--cpu-list", ",".join(map(str, self.host_cores[host]))]

    def popen(self, host: str, cmd: Command, *, env: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, **kwargs) -> subprocess.Popen:
        """Start ``cmd`` (a list, or a string for ``sh -c``) on ``host``, in a new session,
        with ``env`` added to this process's environment; other keywords go to
        :class:`subprocess.Popen`. Teardown kills it if it still runs."""
        self._check_host(host, "popen")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        proc = subprocess.Popen(self.enter_command(host, cwd) + argv,
                                env={**os.environ, **(env or {})},
                                start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    def run(self, host: str, cmd: Command, *, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, timeout: float = 300.0, check: bool = False,
            ) -> subprocess.CompletedProcess:
        """Run ``cmd`` on ``host`` to its end (at most ``timeout`` seconds: then its whole
        session is killed and :class:`subprocess.TimeoutExpired` raised); stdout and
        stderr are captured as text. ``check=True`` raises on a non-zero status."""
        proc = self.popen(host, cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            proc.communicate()
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def launcher_script(self, path: Optional[str] = None) -> str:
        """Write a script for MPICH Hydra's ``-launcher ssh -launcher-exec SCRIPT``: called
        as ``SCRIPT [-x] HOST COMMAND...`` like ssh, it runs COMMAND on HOST of this rig.
        Returns its path (in the rig's temporary folder unless ``path`` is given)."""
        path = path or os.path.join(self._dir, "enter-host")
        cases = "".join(f"  {n}|{self._addresses[n]}) pid={a.pid} pin='"
                        f"{' '.join(self._pinning(n))}' ;;\n"
                        for n, a in self._anchors.items())
        with open(path, "w") as f:
            f.write("#!/bin/sh\n# Like ssh: skip the options, take the host, run the rest "
                    "through a shell there.\n"
                    'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
                    'host=$1; shift\ncase "$host" in\n' + cases +
                    '  *) echo "enter-host: $host is not a host of this rig" >&2; exit 255 ;;\n'
                    'esac\nexec nsenter -t "$pid" --net --uts --mount --wd="$PWD" -- $pin '
                    'sh -c "$*"\n')
        os.chmod(path, 0o755)
        return path

    def hostfile(self, slots: int, path: Optional[str] = None,
                 hosts: Optional[Sequence[str]] = None) -> str:
        """Write an MPICH host file (``host0:SLOTS`` per line, for ``hosts``: default all
        of them); returns its path."""
        path = path or os.path.join(self._dir, "hostfile")
        with open(path, "w") as f:
            f.writelines(f"{n}:{slots}\n" for n in (self.names if hosts is None else hosts))
        return path

    def processes(self) -> list[int]:
        """Pids of the processes now running on the rig's hosts (anchors excepted)."""
        inodes = {a.net_inode for a in self._all_anchors()}
        anchors = {a.pid for a in self._all_anchors()}
        return [pid for pid in _pids_in_net_namespaces(inodes) if pid not in anchors]

    def _running(self) -> list[int]:
        """The hosts' processes, and those started here that have not entered a host yet."""
        pids = self.processes() if self._all_anchors() else []
        return pids + [p.pid for p in self._started if p.poll() is None and p.pid not in pids]

    def _check_host(self, host: str, what: str) -> None:
        if host not in self._anchors:
            raise ValueError(f"HostRig.{what}: argument `host`: {host!r} is not a host of "
                             f"this rig ({', '.join(self.names)})")

    def _all_anchors(self) -> list[_Anchor]:
        return list(self._anchors.values()) + ([self._switch] if self._switch else [])

    # ------------------------------------------------------------------ teardown
    def close(self, grace: float = 3.0) -> None:
        """Kill whatever still runs on the hosts (SIGTERM, then SIGKILL after ``grace``
        seconds), end the anchors, remove the temporary folder. Safe to call twice."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._running()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while pids and time.monotonic() < deadline:
                for proc in self._started:
                    proc.poll()  # reap our own children
                pids = [p for p in pids if process_alive(p)]
                time.sleep(0.05)
        for proc in self._started:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("HostRig: process %d did not exit", proc.pid)
        self._started.clear()
        for anchor in self._all_anchors():
            anchor.close()
        self._anchors.clear()
        self._switch = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "HostRig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pids_in_net_namespaces(inodes: set) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
            except OSError:
                continue  # exited meanwhile
    return found


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session (process group) ``proc`` leads, or ``proc`` alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
