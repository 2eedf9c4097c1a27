"""Context-parallel attention: forward+backward time and the bytes attention saves for
backward per rank, for one process (dense ``F.scaled_dot_product_attention``), ring
attention (contiguous and zigzag layouts) and all-gather attention, causal, sequence
lengths from 1K to 16K tokens, C = 2 and 4 ranks; and PyTorch's experimental
``context_parallel`` over gloo beside them in the same run, where it runs on this machine.

    python benchmarks/cp_attention.py                          # the table of docs/performance.md
    python benchmarks/cp_attention.py --lengths 1024,2048 --nproc 2 --repeat 2 --json cp.json

A row: the implementation, C, L, the median over ``--repeat`` timed repetitions (after one
warm-up) of the slowest rank's forward+backward in milliseconds, the largest rank's saved
bytes (``torch.autograd.graph.saved_tensors_hooks``) in MiB, and that as a share of the
one-process run's. q, k, v are (``--batch-size``, ``--heads``, L/C, ``--head-dim``) float32 per
rank, the ranks are processes of ``--backend`` (default shm). Each C is one spawned job
that runs every length and implementation in turn.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from collectives.cli_flags import (FlagParser, add_flag, flag_parser,  # noqa: E402
                                   positive_int, positive_ints)


def _parser() -> FlagParser:
    p = flag_parser(description=__doc__, defaults_in_help=True)
    p.add_argument("--lengths", type=positive_ints, default="1024,2048,4096,8192,16384",
                   metavar="LIST", help="comma list of sequence lengths L")
    add_flag(p, "--nproc", default="2,4", several=True,
             help="comma list of C, the ranks of one job")
    add_flag(p, "--batch-size", default=1, help="batch of q, k and v")
    p.add_argument("--heads", type=positive_int, default=2, help="attention heads")
    p.add_argument("--head-dim", type=positive_int, default=32, help="features per head")
    add_flag(p, "--repeat", default=3, help="timed repetitions (after one warm-up)")
    add_flag(p, "--backend", default="shm")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out PyTorch's context_parallel")
    add_flag(p, "--json")
    return p


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = _parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import collectives  # noqa: E402
from parallel.cp import (all_gather_attention, ring_attention,  # noqa: E402
                         saved_tensor_bytes, shard_sequence)

#: name -> (function, layout)
IMPLEMENTATIONS = {"ring": (ring_attention, "contiguous"),
                   "ring zigzag": (ring_attention, "zigzag"),
                   "all_gather zigzag": (all_gather_attention, "zigzag")}


def full_inputs(config: dict, length: int) -> list:
    gen = torch.Generator().manual_seed(length)
    shape = (config["batch"], config["heads"], length, config["head_dim"])
    return [torch.randn(shape, generator=gen) for _ in range(3)]


def timed(run, reps: int, barrier=lambda: None) -> list:
    """Per-repetition seconds of ``run()`` (forward and backward), after one warm-up."""
    times = []
    for i in range(reps + 1):
        barrier()
        start = time.perf_counter()
        run()
        if i:
            times.append(time.perf_counter() - start)
    return times


def one_process(config: dict, length: int) -> dict:
    q, k, v = (t.requires_grad_(True) for t in full_inputs(config, length))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    nbytes = saved_tensor_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return {"times": timed(run, config["reps"]), "saved": nbytes}


def _ours_job(config: dict) -> list:
    """One rank of the job of one C: every length and implementation."""
    torch.set_num_threads(1)
    pg = collectives.init_process_group()
    rows = []
    try:
        for length in config["lengths"]:
            full = full_inputs(config, length)
            for name, (fn, layout) in IMPLEMENTATIONS.items():
                q, k, v = (shard_sequence(t, pg, 2, layout).requires_grad_(True) for t in full)

                def forward():
                    return fn(q, k, v, pg, causal=True, layout=layout)
                nbytes = saved_tensor_bytes(forward)
                times = timed(lambda: forward().sum().backward(), config["reps"], pg.barrier)
                rows.append({"impl": name, "length": length, "times": times, "saved": nbytes})
        pg.barrier()
        return rows
    finally:
        pg.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_job(rank: int, size: int, port: int, config: dict, out_dir: str) -> None:
    """One rank of PyTorch's ``context_parallel`` over gloo: each length, timed like ours,
    checked against dense attention; a failure is written as its reason."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    rows = []
    try:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
        mesh = init_device_mesh("cpu", (size,))
        for length in config["lengths"]:
            q, k, v = full_inputs(config, length)
            dense = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            times: list = []

            def run() -> torch.Tensor:
                qs, ks, vs = (t.clone() for t in (q, k, v))   # sharded in place on entry
                with context_parallel(mesh, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2],
                                      no_restore_buffers={qs, ks, vs}):
                    for t in (qs, ks, vs):
                        t.requires_grad_(True)
                    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                    out.sum().backward()
                return out.detach()
            out = run()
            (full,) = context_parallel_unshard(mesh, [out], [2])
            if full.shape != dense.shape or not torch.allclose(full, dense, atol=1e-4):
                raise RuntimeError("its output differs from dense attention's")
            times = timed(run, config["reps"], dist.barrier)
            rows.append({"impl": "torch context_parallel", "length": length, "times": times,
                         "saved": None})
        result = {"rows": rows}
    except Exception as exc:  # noqa: BLE001 - the reason goes into the table
        result = {"rows": rows, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    Path(out_dir, f"torch{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def torch_rows(config: dict, size: int) -> dict:
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_torch_job, args=(size, _free_port(), config, out_dir), nprocs=size)
        return [json.loads(Path(out_dir, f"torch{r}.json").read_text()) for r in range(size)]


def summarise(per_rank: list, dense: dict, size: int) -> list:
    """One row per (impl, length) from every rank's rows: the slowest rank's median."""
    out = []
    for i, row in enumerate(per_rank[0]):
        times = [statistics.median(r[i]["times"]) for r in per_rank]
        saved = [r[i]["saved"] for r in per_rank]
        biggest = None if saved[0] is None else max(saved)
        base = dense[row["length"]]["saved"]
        out.append({"impl": row["impl"], "C": size, "L": row["length"],
                    "ms": round(1e3 * max(times), 2),
                    "saved_mib": None if biggest is None else round(biggest / 2**20, 3),
                    "saved_vs_one": None if biggest is None else round(biggest / base, 4)})
    return out


def table(rows: list) -> str:
    lines = [f"{'impl':<24} {'C':>2} {'L':>6} {'fwd+bwd ms':>11} {'saved MiB/rank':>15} "
             f"{'saved / 1 proc':>15}"]
    for r in rows:
        saved = "-" if r["saved_mib"] is None else f"{r['saved_mib']:.3f}"
        share = "-" if r["saved_vs_one"] is None else f"{r['saved_vs_one']:.3f}"
        lines.append(f"{r['impl']:<24} {r['C']:>2} {r['L']:>6} {r['ms']:>11.2f} {saved:>15} "
                     f"{share:>15}")
    return "\n".join(lines)


def main(args) -> None:
    config = {"lengths": args.lengths, "batch": args.batch_size,
              "heads": args.heads, "head_dim": args.head_dim, "reps": args.repeat}
    torch.set_num_threads(1)
    dense = {length: one_process(config, length) for length in config["lengths"]}
    rows = [{"impl": "one process (dense sdpa)", "C": 1, "L": length,
             "ms": round(1e3 * statistics.median(d["times"]), 2),
             "saved_mib": round(d["saved"] / 2**20, 3), "saved_vs_one": 1.0}
            for length, d in dense.items()]
    notes = []
    for size in args.nproc:
        per_rank = collectives.spawn(_ours_job, size, args=(config,), backend=args.backend,
                                     timeout=600, join_timeout=3600)
        rows += summarise(per_rank, dense, size)
        if not args.no_torch:
            reports = torch_rows(config, size)
            errors = {r.get("error") for r in reports} - {None}
            if errors:
                notes.append(f"torch context_parallel, C={size}: not run on this machine "
                             f"(CPU, gloo): {'; '.join(sorted(errors))}")
            if all(r["rows"] for r in reports):
                rows += summarise([r["rows"] for r in reports], dense, size)
    print(f"causal attention, float32, batch {args.batch_size}, heads {args.heads}, head_dim "
          f"{args.head_dim}; backend {args.backend}; {os.cpu_count()} CPUs; torch "
          f"{torch.__version__}")
    print(table(rows))
    for note in notes:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))


if __name__ == "__main__":
    main(ARGS)
