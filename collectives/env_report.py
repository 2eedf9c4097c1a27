"""``collectives env``: what to paste into a bug report, as ``torch.utils.collect_env`` does.

One report of everything that decides how this library behaves on this machine: the
versions of Python, numpy, torch, mpi4py with its MPI library, pyzmq with libzmq; whether
the compiled core of the shm backend is built and used; the transports available; the
launcher this process would meet its peers through; the variables of the environment
that steer the library and the launchers; the cores this process may run on and the NUMA
nodes. Text by default, JSON with ``--json``::

    collectives env                 # or: python -m collectives env
    collectives env --json > env.json

Nothing heavy is imported to make it but what the report names: mpi4py's ``MPI`` module
initialises MPI, so the MPI library is asked in a child process, with a time limit, and a
broken or hanging MPI is a line of the report rather than a hang.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from typing import Any, Optional, Sequence

from . import settings

__all__ = ["collect", "main", "render_text"]

#: Packages whose installed version the report names (distribution names).
PACKAGES = ("numpy", "ml_dtypes", "torch", "mpi4py", "mpich", "pyzmq",
            "hypothesis", "tqdm")
#: Variables of the launchers and runtimes that change how ranks meet or run.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID")
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_")
#: Seconds the child process asking the MPI library may take (a broken MPI may hang).
MPI_QUERY_TIMEOUT = 30.0

_MPI_QUERY = ("import json; from mpi4py import MPI; "
              "print(json.dumps({'library': MPI.Get_library_version().strip(), "
              "'standard': '%d.%d' % MPI.Get_version()}))")


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, Optional[str]]:
    """Installed version of each of :data:`PACKAGES` (None where it is missing), read
    from the installed metadata: nothing is imported."""
    return {name: _version(name) for name in PACKAGES}


def mpi_library(timeout: float = MPI_QUERY_TIMEOUT) -> dict[str, Any]:
    """The MPI library mpi4py runs on (``MPI.Get_library_version()``), asked in a child
    process (importing ``mpi4py.MPI`` initialises MPI). ``{"error": ...}`` when mpi4py is
    missing, the child fails or it takes longer than ``timeout`` seconds."""
    if _version("mpi4py") is None:
        return {"error": "mpi4py is not installed (pip install 'collectives[mpi]')"}
    # A singleton MPI_Init must not take this process's launcher variables for its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    try:
        done = subprocess.run([sys.executable, "-c", _MPI_QUERY], capture_output=True,
                              text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"importing mpi4py.MPI did not finish within {timeout:g} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"importing mpi4py.MPI failed: {tail}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected answer: {done.stdout.strip()[:200]!r}"}


def zmq_library() -> dict[str, Any]:
    """pyzmq's version and the libzmq it runs on (imports zmq; nothing else starts)."""
    try:
        import zmq
    except ImportError as exc:
        return {"error": f"pyzmq is not importable ({exc}; pip install 'collectives[zmq]')"}
    return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}


def shm_core() -> dict[str, Any]:
    """Whether the compiled core of the shm backend is built (it loads and matches this
    package) and used (``COLLECTIVES_SHM_NATIVE`` does not turn it off)."""
    from backends.shm import native
    error = native.load_error()
    built = error is None
    try:
        wanted = settings.SHM_NATIVE.get()
    except ValueError as exc:
        return {"built": built, "used": False, "why": str(exc)}
    why = error if not built else (None if wanted else f"{settings.SHM_NATIVE.name}=0")
    return {"built": built, "used": built and wanted, "why": why}


def launcher() -> dict[str, Any]:
    """What :func:`collectives.detect_rendezvous` finds in this process's environment."""
    from .launch import detect_rendezvous
    try:
        return dataclasses.asdict(detect_rendezvous())
    except (ValueError, TypeError) as exc:
        return {"error": str(exc)}


def relevant_environment(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Every ``COLLECTIVES_*`` variable that is set, and the launchers' variables
    (:data:`LAUNCHER_VARIABLES` and those starting with :data:`LAUNCHER_PREFIXES`);
    secrets are shown as ``<set>``.

    >>> relevant_environment({"RANK": "1", "HOME": "/root", "SLURM_JOB_ID": "7"})
    {'RANK': '1', 'SLURM_JOB_ID': '7'}
    """
    env = dict(os.environ if env is None else env)
    secret = {settings.SECRET.name}
    chosen = {k: ("<set>" if k in secret else v) for k, v in env.items()
              if k.startswith(settings.PREFIX) or k in LAUNCHER_VARIABLES
              or k.startswith(LAUNCHER_PREFIXES)}
    return dict(sorted(chosen.items()))


def cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'`` (the kernel's cpulist format).

    >>> cpu_list([0, 1, 2, 5, 7, 8])
    '0-2,5,7-8'
    """
    ranges: list[list[int]] = []
    for c in sorted(cpus):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


def cores() -> dict[str, Any]:
    """The machine's logical cores, those this process may run on, and the load."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    out: dict[str, Any] = {"logical": os.cpu_count(),
                           "usable": None if usable is None else len(usable),
                           "affinity": None if usable is None else cpu_list(usable)}
    if hasattr(os, "getloadavg"):
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def numa_nodes(root: str = "/sys/devices/system/node") -> list[dict[str, Any]]:
    """The NUMA nodes and their cores, from sysfs (empty where there is none).

    >>> numa_nodes("/nonexistent")
    []
    """
    try:
        names = os.listdir(root)
    except OSError:
        return []
    nodes = []
    for name in sorted(names, key=lambda n: int(n[4:]) if n[4:].isdigit() else -1):
        if not re.fullmatch(r"node\d+", name):
            continue
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                cpus = f.read().strip()
        except OSError:
            cpus = "?"
        nodes.append({"node": int(name[4:]), "cpus": cpus})
    return nodes


def collect(*, mpi_timeout: float = MPI_QUERY_TIMEOUT) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` writes).

    ``collect()["backends"]`` -> ``['mpi', 'nccl', 'shm', 'torch', 'gloo', 'zmq']`` (those
    whose libraries are installed here).
    """
    from . import __file__ as package_file
    from ._version import __version__
    from .registry import available_backends
    return {
        "collectives": {"version": __version__, "path": os.path.dirname(package_file)},
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": platform.platform(),
        "packages": package_versions(),
        "mpi": mpi_library(mpi_timeout),
        "zmq": zmq_library(),
        "shm_core": shm_core(),
        "backends": available_backends(),
        "launcher": launcher(),
        "environment": relevant_environment(),
        "cores": cores(),
        "numa": numa_nodes(),
    }


def _or_error(info: dict[str, Any], text: str) -> str:
    return f"not available: {info['error']}" if "error" in info else text


def render_text(report: dict[str, Any]) -> str:
    """The report as the lines ``collectives env`` prints."""
    pkgs = report["packages"]
    shm, mpi, zmq, where = report["shm_core"], report["mpi"], report["zmq"], report["launcher"]
    first_line = " ".join((mpi.get("library") or "?").splitlines()[0].split())  # (of ~20)
    mpi_text = _or_error(mpi, f"{first_line} (MPI standard {mpi.get('standard', '?')})")
    lines = [
        f"collectives:      {report['collectives']['version']} ({report['collectives']['path']})",
        f"Python:           {report['python']['version']} "
        f"({report['python']['implementation']}, {report['python']['executable']})",
        f"platform:         {report['platform']}",
        "",
        *(f"{name + ':':<18}{version or 'not installed'}" for name, version in pkgs.items()),
        f"{'MPI library:':<18}{mpi_text}",
        f"{'libzmq:':<18}{_or_error(zmq, zmq.get('libzmq', '?'))}",
        "",
        f"{'shm core:':<18}{'built' if shm['built'] else 'not built'}, "
        f"{'used' if shm['used'] else 'not used'}"
        f"{' (' + shm['why'] + ')' if shm.get('why') else ''}",
        f"{'transports:':<18}{', '.join(report['backends'])}",
        f"{'launcher:':<18}" + _or_error(
            where, f"{where.get('launcher')}: rank {where.get('rank')} of "
                   f"{where.get('world_size')}, local rank {where.get('local_rank')} of "
                   f"{where.get('local_world_size')}, job {where.get('job_id')}"),
        "",
        f"{'cores:':<18}{report['cores']['logical']} logical, {report['cores']['usable']} "
        f"usable by this process ({report['cores']['affinity']})"
        + (f", load average {' '.join(map(str, report['cores']['load_average']))}"
           if report["cores"].get("load_average") else ""),
        f"{'NUMA nodes:':<18}" + ("; ".join(f"node {n['node']}: cpus {n['cpus']}"
                                           for n in report["numa"]) or "none found"),
        "",
        "environment:" + ("" if report["environment"] else " no relevant variable is set"),
        *(f"  {k}={v}" for k, v in report["environment"].items()),
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None, *, prog: str = "collectives env") -> int:
    """The command line: print the report (text, or JSON with ``--json``); returns 0."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Report the versions, transports, launcher, environment "
                               "variables, cores and NUMA nodes that decide how collectives "
                               "behaves here (paste it into a bug report).")
    parser.add_argument("--json", action="store_true", help="write the report as JSON")
    parser.add_argument("--mpi-timeout", type=float, default=MPI_QUERY_TIMEOUT,
                        metavar="SECONDS", help="how long asking the MPI library may take")
    args = parser.parse_args(argv)
    report = collect(mpi_timeout=args.mpi_timeout)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 0
