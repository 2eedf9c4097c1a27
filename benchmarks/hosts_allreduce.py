"""all_reduce across emulated hosts: ``hier`` (shm inside a host, zmq between hosts) against
flat ``zmq`` and torch.distributed's gloo, on a rig of network namespaces whose links are
limited to a rate (collectives.testing.hosts); then examples/ddp.py's training time over
hier and over flat zmq on the same rig. Needs root.

    python benchmarks/hosts_allreduce.py                        # 2 hosts x 2 ranks, 1 Gbit/s
    python benchmarks/hosts_allreduce.py --sizes 1M,4M,16M,64M --repeat 3 --json hosts.json
    python benchmarks/hosts_allreduce.py --rate 10gbit --ddp-epochs 0   # all_reduce only
    python benchmarks/hosts_allreduce.py --cores shared         # hosts share every core
    python benchmarks/hosts_allreduce.py --backend hier,gloo --floor --ddp-epochs 0

``--cores split`` (the default) gives each host its own share of this machine's cores, as
separate machines have; ``shared`` lets every host's ranks run on every core, so the hosts
compete for them and each rank sees cores that the other hosts also use (shm's waits, which
spin and yield longer with a core per rank, then hold cores another host needs).

Every rank of a case is started fresh (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``... as torchrun sets them), ranks 0..N-1 on the first host, the next N on the
second. Per size, after a barrier and warm-up calls, rank 0 times each call separately
(the next starts when the previous returned on rank 0) and takes the median; the
result is checked once on every rank. The cases take turns round by round (``--repeat``),
so the machine's changing load hits them alike, and the median round is reported.

``--floor`` adds two floors under hier between two hosts: the bytes hier moves, with
nothing of ours around them (no step inside the host, no reduction, so no result to
check). ``tcp``: the first rank of each host swaps the whole tensor with the other's over
one plain TCP socket; the hosts' other ranks do nothing. ``tcp-columns``: as hier's
columns do, every rank swaps its share with the rank of its local index on the other host
over a socket of its own, and the host's ranks meet after each call.

busbw = bytes x 2(n-1)/n / time, n the world size (the traffic of a ring on every link;
nccl-tests' definition). gloo is driven through torch.distributed directly (no wrapper of
ours in the way); float32 torch tensors throughout.

"payload share" is how much of what the first host's link carried for a case was the
case's data: the payload it sent there (the interface's bytes, less one frame's headers
per packet the kernel handed it) over the bytes the link's tbf charged for them (headers
counted once per 1500-byte frame), over all its rounds. It is the transport's header
cost, not how busy it kept the link: the busbw says that.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.bench.cases import bandwidths  # noqa: E402
from collectives.cli_flags import (add_flag, flag_parser, nonnegative_int,  # noqa: E402
                                   positive_int)
from collectives.testing.hosts import HostRig, parse_rate, rig_unavailable  # noqa: E402
from collectives.testing.hosts_launch import run_ranks, summary  # noqa: E402

IMPLS = ("hier", "zmq", "gloo")
MIB = 1 << 20
#: The cases of --floor (see the module docstring).
FLOORS = ("tcp", "tcp-columns")
#: The floor's ports: MASTER_PORT + this + the local index between hosts, MASTER_PORT +
#: this + ranks per host for the host's meeting point.
TCP_PORT_OFFSET = 100


def _iterations(nbytes: int) -> int:
    """Enough calls for a stable median, few enough at 1 Gbit/s (64 MiB: ~1 s a call)."""
    return 12 if nbytes <= 2 * MIB else 6 if nbytes <= 16 * MIB else 3


def rank_main(impl: str, sizes: list[int]) -> None:
    """One rank of one case: time all_reduce at each size; rank 0 prints the JSON line."""
    import torch
    torch.set_num_threads(1)
    if impl in FLOORS:
        rank, size, all_reduce, barrier, close = _bare_tcp(columns=impl == "tcp-columns")
    elif impl == "gloo":
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        rank, size = dist.get_rank(), dist.get_world_size()
        all_reduce, barrier, close = dist.all_reduce, dist.barrier, dist.destroy_process_group
    else:
        import collectives
        pg = collectives.init_process_group(impl)
        rank, size = pg.rank, pg.size
        all_reduce, barrier, close = pg.all_reduce, pg.barrier, pg.close
    rows = {}
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, dtype=torch.float32)  # zeros: sums stay finite
        iters = _iterations(nbytes)
        barrier()
        for _ in range(max(1, iters // 4)):
            all_reduce(t)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            all_reduce(t)
            times.append(time.perf_counter() - start)
        t.fill_(rank + 1.0)
        all_reduce(t)
        if impl not in FLOORS and not bool((t == size * (size + 1) / 2).all()):
            raise RuntimeError(f"[rank {rank}/{size}] {impl} all_reduce of {nbytes} bytes: "
                               f"wrong sum")
        rows[nbytes] = statistics.median(times)
    close()
    if rank == 0:
        print(json.dumps({"impl": impl, "world_size": size, "seconds": rows}), flush=True)


def _connect(port: int, host: Optional[str]) -> Any:
    """One TCP connection on ``port``: accepted (``host`` None) or made to ``host``
    (retried for a minute while the other side starts)."""
    import socket
    if host is None:
        with socket.create_server(("", port)) as server:
            server.settimeout(60)
            sock, _ = server.accept()
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sock.settimeout(300)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _bare_tcp(columns: bool) -> tuple:
    """A rank of the floor's cases (:data:`FLOORS`). ``tcp``: the first rank of each host
    holds one socket to the other's and its "all_reduce" sends the whole tensor (a sender
    thread) while it receives as much; the other ranks do nothing. ``tcp-columns``: every
    rank swaps its share (1/ranks per host of the tensor) with the rank of its local index
    on the other host over its own socket, then the host's ranks meet (over loopback), as
    hier's columns stream and keep in step. Returns (rank, size, all_reduce, barrier,
    close)."""
    import queue
    import threading

    import torch
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    if size != 2 * per_host:
        raise SystemExit(f"hosts_allreduce: the floor needs 2 hosts, not {size // per_host}")
    local, first_host = rank % per_host, rank < per_host
    flows = per_host if columns else 1
    if local >= flows:
        def idle(*_: Any) -> None:
            pass
        return rank, size, idle, idle, idle
    port = int(os.environ["MASTER_PORT"]) + TCP_PORT_OFFSET
    sock = _connect(port + local, None if first_host else os.environ["MASTER_ADDR"])
    # The host's meeting point: its first rank, on loopback (one socket per other rank).
    host_peers = []
    if flows > 1:
        if local == 0:
            host_peers = [_connect(port + per_host, None) for _ in range(1, per_host)]
        else:
            host_peers = [_connect(port + per_host, "127.0.0.1")]
    jobs: "queue.SimpleQueue" = queue.SimpleQueue()
    sent: "queue.SimpleQueue" = queue.SimpleQueue()

    def sender() -> None:
        while (data := jobs.get()) is not None:
            try:
                sock.sendall(data)
                sent.put(None)
            except OSError as exc:   # (the receiving side raises it)
                sent.put(exc)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()

    buffers: dict = {}   # one receive buffer per size, kept (its pages faulted in once)
    token = memoryview(bytearray(1))   # what the host's ranks meet with

    def receive(peer: Any, into: memoryview, what: str) -> None:
        got = 0
        while got < len(into):
            n = peer.recv_into(into[got:])
            if not n:
                raise ConnectionError(f"[rank {rank}] floor: {what} closed the connection "
                                      f"after {got} of {len(into)} bytes")
            got += n

    def swap(t: Any) -> None:
        whole = memoryview(t.numpy()).cast("B")
        data = whole[local * len(whole) // flows:(local + 1) * len(whole) // flows]
        if len(data) not in buffers:
            buffers[len(data)] = memoryview(bytearray(len(data)))   # (not reduced into t)
        jobs.put(data)
        receive(sock, buffers[len(data)], "the other host's rank")
        failed = sent.get(timeout=300)
        if failed is not None:
            raise failed
        for peer in host_peers:       # the host's ranks meet: all in, then all out
            if local:
                peer.sendall(b"i")
            receive(peer, token, "a rank of this host")
        if local == 0:
            for peer in host_peers:
                peer.sendall(b"o")

    def barrier() -> None:
        swap(torch.zeros(flows, dtype=torch.uint8))

    def close() -> None:
        jobs.put(None)
        thread.join(10)
        for peer in [sock, *host_peers]:
            peer.close()

    return rank, size, swap, barrier, close


def _link_counters(rig: HostRig) -> tuple[int, int, int]:
    """The first host's link: bytes charged by its tbf, bytes and packets sent."""
    out = rig.run(rig.names[0], "tc -s qdisc show dev eth0; cat /sys/class/net/eth0/"
                  "statistics/tx_bytes /sys/class/net/eth0/statistics/tx_packets",
                  check=True).stdout
    charged = int(out.split("Sent", 1)[1].split()[0])
    sent, packets = (int(x) for x in out.split()[-2:])
    return charged, sent, packets


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes % MIB == 0 else f"{nbytes >> 10} KiB"


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    return bandwidths("all_reduce", nbytes, n, seconds)[1]


def _parser() -> argparse.ArgumentParser:
    p = flag_parser("hosts_allreduce.py", __doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=positive_int, default=2, help="emulated hosts")
    p.add_argument("--per-host", type=positive_int, default=2, help="ranks per host")
    p.add_argument("--rate", default="1gbit", help="each host's link (tc syntax or bit/s)")
    p.add_argument("--cores", choices=("split", "shared"), default="split",
                   help="each host its own share of the cores, or all hosts on all cores")
    add_flag(p, "--sizes", default="1M,4M,16M,64M")
    add_flag(p, "--backend", default=",".join(IMPLS), several=True,
             help="what to compare: backends of ours, and gloo driven through "
                  "torch.distributed directly")
    p.add_argument("--floor", action="store_true",
                   help="also time the bare-TCP floors between two hosts (the cases tcp "
                        "and tcp-columns)")
    add_flag(p, "--repeat", default=3, help="rounds (the median round is reported)")
    p.add_argument("--ddp-epochs", type=nonnegative_int, default=5,
                   help="examples/ddp.py epochs per run over hier and zmq (0: skip)")
    add_flag(p, "--json")
    p.add_argument("--rank-job", nargs=2, metavar=("IMPL", "SIZES"), help=argparse.SUPPRESS)
    return p


def main(args: argparse.Namespace) -> int:
    if args.rank_job:
        rank_main(args.rank_job[0], [int(s) for s in args.rank_job[1].split(",")])
        return 0
    if args.floor and args.hosts != 2:
        print(f"hosts_allreduce: --floor needs --hosts 2, not {args.hosts}", file=sys.stderr)
        return 2
    reason = rig_unavailable()
    if reason is not None:
        print(f"hosts_allreduce: {reason}", file=sys.stderr)
        return 2
    sizes, impls = args.sizes, args.backend + (list(FLOORS) if args.floor else [])
    n = args.hosts * args.per_host
    secret = {"COLLECTIVES_SECRET": os.urandom(32).hex()}
    runs: dict = {i: [] for i in impls}
    link = {i: [0, 0] for i in impls}   # payload, charged
    ddp: dict = {"hier": [], "zmq": []} if args.ddp_epochs > 0 else {}
    load = os.getloadavg()
    started = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    print(f"# {args.hosts} hosts x {args.per_host} ranks, links {args.rate} "
          f"({parse_rate(args.rate) / 1e9:g} Gbit/s), cores {args.cores}; "
          f"{platform.node()}, {os.cpu_count()} "
          f"CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {started}",
          flush=True)
    with HostRig(args.hosts, rate=args.rate, cores=args.cores) as rig:
        for rnd in range(args.repeat):
            for impl in impls:
                before = _link_counters(rig)
                out = run_ranks(rig, [sys.executable, __file__, "--rank-job", impl,
                                      ",".join(map(str, sizes))],
                                per_host=args.per_host, env=secret, timeout=600)
                charged, sent, packets = (b - a for a, b in zip(before, _link_counters(rig)))
                link[impl][0] += sent - 66 * packets   # Ethernet 14, IP 20, TCP 32
                link[impl][1] += charged
                runs[impl].append({int(k): v for k, v in summary(out)["seconds"].items()})
                print(f"# round {rnd + 1}/{args.repeat} {impl}: " + ", ".join(
                    f"{_size(s)} {_busbw(s, runs[impl][-1][s], n):.3f} GB/s"
                    for s in sizes), flush=True)
            for impl in ddp:
                out = run_ranks(rig, [sys.executable, "examples/ddp.py", "--backend", impl,
                                      "--epochs", str(args.ddp_epochs)],
                                per_host=args.per_host, env=secret, timeout=600)
                ddp[impl].append(summary(out))
                print(f"# round {rnd + 1}/{args.repeat} ddp over {impl}: wall_s "
                      f"{ddp[impl][-1]['wall_s']}, final_acc {ddp[impl][-1]['final_acc']}",
                      flush=True)
    med = {i: {s: statistics.median(r[s] for r in runs[i]) for s in sizes} for i in impls}
    ratios = [(a, b) for a in impls for b in impls if a == "hier" and b != a]
    # (three decimals on the ratios: 1.497 and 1.5 differ where a target is 1.5x)
    columns = [(f"{i} GB/s", lambda bw, i=i: f"{bw[i]:.3f}") for i in impls] + [
        (f"{a}/{b}", lambda bw, a=a, b=b: f"{bw[a] / bw[b]:.3f}x") for a, b in ratios]
    widths = [max(12, len(label) + 2) for label, _ in columns]
    print(f"\nall_reduce busbw, median of {args.repeat} rounds:\n{'size':>8}"
          + "".join(f"{label:>{w}}" for (label, _), w in zip(columns, widths)))
    for s in sizes:
        bw = {i: _busbw(s, med[i][s], n) for i in impls}
        print(f"{_size(s):>8}"
              + "".join(f"{cell(bw):>{w}}" for (_, cell), w in zip(columns, widths)))
    print("payload share of the link's bytes: "
          + ", ".join(f"{i} {link[i][0] / max(1, link[i][1]):.1%}" for i in impls))
    if ddp:
        wall = {i: statistics.median(r["wall_s"] for r in ddp[i]) for i in ddp}
        print(f"\nexamples/ddp.py --epochs {args.ddp_epochs}, {n} ranks, training loop "
              f"(wall_s), median of {args.repeat}:")
        for i in ddp:
            print(f"  {i:<5} {wall[i]:8.3f} s   final_acc {ddp[i][-1]['final_acc']}")
        print(f"  zmq/hier {wall['zmq'] / wall['hier']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hosts": args.hosts, "per_host": args.per_host, "rate": args.rate,
                   "cores": args.cores,
                       "started": started, "load_average": load,
                       "allreduce_seconds": runs, "link_payload_charged": link,
                       "ddp": ddp}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(_parser().parse_args()))
