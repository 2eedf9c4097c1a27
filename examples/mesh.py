"""Data x pipeline x tensor (x expert, x context) parallelism on one device mesh: a small
transformer classifier of MNIST, cut into ``pp`` pipeline stages (parallel.pp), each
stage's blocks split over ``tp`` (parallel.tp), each (pp, tp) replica sharded by FSDP (or
DDP) across ``dp``; with ``--experts``, each block followed by a mixture of experts sharded
over ``ep``; with ``--cp``, each image's rows split over ``cp`` (parallel.cp).

    python examples/mesh.py --dp 2 --tp 2 --pp 2               # 8 ranks, shared memory
    python examples/mesh.py --dp 2 --tp 2 --pp 2 --fsdp        # FSDP (ZeRO-3) across dp
    python examples/mesh.py --dp 2 --tp 2                      # 4 ranks, no pipeline
    mpirun -n 8 python examples/mesh.py --dp 2 --tp 2 --pp 2   # backend mpi
    python examples/mesh.py --dp 2 --tp 2 --pp 2 --trace mesh.json  # then ui.perfetto.dev
    python examples/mesh.py --dp 2 --ep 2 --tp 1 --experts 4   # experts over ep, 4 ranks
    python examples/mesh.py --dp 2 --cp 2 --tp 2               # rows over cp, 8 ranks

The ranks form ``DeviceMesh(pg, (dp, ep, pp, cp, tp), ("dp", "ep", "pp", "cp", "tp"))``
(row-major, as torch's ``init_device_mesh``; ep and cp are 1 unless given: with
2x1x2x1x2, ranks 0 and 1 are one tp pair, 0 and 2 one pipeline, 0 and 4 one dp pair). The model (``examples/common/mesh_model.py``) reads each
image as a sequence of its 28 rows: a linear and a position embedding, ``--layers``
pre-norm ``ParallelTransformerBlock``s (non-causal; heads and MLP features split over tp),
a LayerNorm, the mean over the rows and a linear head; stage s holds a contiguous run of
the blocks, the embedding lives on stage 0 and the head on the last. The ranks of one
(dp) coordinate see the same batch; the dp replicas deal the epoch out (ShardSampler)
and average the gradients (DDP's all_reduce, or FSDP's all_gathers and reduce_scatters).
With ``--ep`` > 1 the ranks of one ep group hold the E experts of every MoE layer between
them (E/ep each), the ep ranks train on batches of their own,
so the replicated part is averaged over the dp x ep ranks (``mesh.flatten``) and each
expert's gradient, summed over its ep group's tokens by backward, over the dp ranks and
divided by dp x ep (``parallel.ep.average_expert_grads``).
With ``--cp`` > 1 the ranks of one cp group hold 28/cp rows each of the same images
(``--layout``), their attention exchanges keys and values (``--cp-algorithm``), and the
head gathers the rows; every replicated gradient is averaged over dp x ep x cp and the
experts' over dp x cp (``averaging_groups`` in ``examples/common/mesh_model.py``).
``--batch-size`` is the batch of one dp replica per step; with ``--pp`` > 1 it is split
into ``--microbatches`` micro-batches and run by ``--schedule`` (1f1b or gpipe); the
gradients accumulate over the micro-batches and dp averages them once per step.

At the end rank 0 prints the communication account: bytes per step on each mesh
dimension, measured by a counter around each dimension's group, next to what the model's
sizes predict (``predicted_bytes`` in ``examples/common/mesh_model.py``) and whether the
two agree on every rank, and the time per step rank 0 spent in (or waiting for) each
dimension's calls; then the JSON summary line.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.cli_flags import positive_int  # noqa: E402
from examples.common.cli import launch, parse_args, print_summary  # noqa: E402


#: Rows of an MNIST image: the sequence cp splits (``ROWS`` of the model, known before
#: torch is imported).
IMAGE_ROWS = 28


def add_mesh_options(p) -> None:
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas (default: 1)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel ranks: each holds experts/ep of every MoE layer "
                        "and trains on its own batch (default: 1)")
    p.add_argument("--experts", type=int, default=None,
                   help="experts per MoE layer, one after each block; a multiple of --ep "
                        "(default: 2 x ep with --ep > 1, else 0: no MoE layers)")
    p.add_argument("--top-k", type=int, default=2,
                   help="experts per token with --experts (default: %(default)s)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="each expert accepts at most ceil(c*T*k/E) of a rank's T tokens "
                        "(default: no limit)")
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context-parallel ranks: each holds 28/cp rows of every image "
                        "(default: 1)")
    p.add_argument("--cp-algorithm", choices=("ring", "all_gather"), default="ring",
                   help="how attention gets the other cp ranks' keys and values "
                        "(default: %(default)s)")
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous",
                   help="which rows each cp rank holds (default: %(default)s)")
    p.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks (default: 2)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (default: 1)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule with --pp > 1 (default: %(default)s)")
    p.add_argument("--microbatches", type=positive_int, default=4,
                   help="micro-batches per step with --pp > 1; must divide --batch-size "
                        "(default: %(default)s)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard each (pp, tp) replica with FSDP (ZeRO-3) across dp instead "
                        "of DDP")
    p.add_argument("--hidden", type=int, default=64, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=4, help="default: %(default)s")
    p.add_argument("--ffn", type=int, default=128, help="default: %(default)s")
    p.add_argument("--layers", type=positive_int, default=2,
                   help="transformer blocks, at least --pp (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop training after this many steps (default 0: no limit)")


def mesh_args(argv=None):
    """The example's options; ``--nproc`` defaults to dp*ep*cp*tp*pp. An ``--nproc`` other
    than that, fewer blocks than stages, a batch the micro-batches do not divide, or
    experts that --ep does not divide is a usage error: one line, exit status 2."""
    return parse_args("mesh", argv, epochs=10, batch_size=32, lr=0.05, description=__doc__,
                      extra=add_mesh_options, nproc=None, validate=_fit_mesh,
                      nproc_help="ranks to spawn: dp*ep*cp*tp*pp, the default (ignored "
                                 "when started by mpirun or torchrun)",
                      batch_help="samples of one dp replica per step (every rank of the "
                                 "replica sees them)")


def _fit_mesh(args) -> None:
    """Refuse flags that do not fit together (ValueError); fill in --experts and --nproc."""
    if args.experts is None:
        args.experts = 2 * args.ep if args.ep > 1 else 0
    if args.experts < 0 or args.experts % args.ep or (args.ep > 1 and not args.experts):
        raise ValueError(f"--experts {args.experts} must be a positive multiple of --ep "
                         f"{args.ep}")
    if args.experts and not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k {args.top_k} must be between 1 and --experts "
                         f"{args.experts}")
    if args.layers < args.pp:
        raise ValueError(f"--pp {args.pp} stages need at least as many blocks, got "
                         f"--layers {args.layers}")
    if args.pp > 1 and args.batch_size % args.microbatches:
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of "
                         f"--microbatches {args.microbatches}")
    chunks = args.cp * (2 if args.layout == "zigzag" else 1)
    if IMAGE_ROWS % chunks:
        raise ValueError(f"--cp {args.cp} with --layout {args.layout} cuts the "
                         f"{IMAGE_ROWS} rows into {chunks} chunks, which does not divide "
                         f"them")
    total = args.dp * args.ep * args.cp * args.tp * args.pp
    if args.nproc is not None and args.nproc != total:
        dims = "*".join(n for n in ("dp", "ep", "cp", "tp", "pp")
                        if n in ("dp", "tp", "pp") or getattr(args, n) > 1)
        raise ValueError(f"--nproc {args.nproc} must equal {dims} = {total}")
    args.nproc = total


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = mesh_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

import collectives  # noqa: E402
from examples.common.comm_account import CountingGroup  # noqa: E402
from examples.common.harness import progress  # noqa: E402
from examples.common.mesh_model import (ROWS, averaging_groups,  # noqa: E402
                                        context_parallel, expert_parallel, moe_traffic,
                                        predicted_bytes, row_transformer, stage_pieces,
                                        tensor_parallel)
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel import DDP, FSDP, DeviceMesh, ShardSampler  # noqa: E402
from parallel.ep import MoE, average_expert_grads, replicate_outside_experts  # noqa: E402
from parallel.pp import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402
from parallel.tp import ParallelTransformerBlock  # noqa: E402

NAMES = ("dp", "ep", "pp", "cp", "tp")
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
EVAL_CHUNK = 250      # test images per pipelined forward in evaluation


def dense_model(args) -> nn.Sequential:
    """The single-process model, initialised from ``args.seed`` (global random state kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        return row_transformer(args.hidden, args.heads, args.ffn, args.layers, args.experts,
                               args.top_k, args.capacity_factor)


def account_table(measured: dict, predicted: dict, mesh: DeviceMesh) -> str:
    lines = [f"{'dim':<4} {'size':>4} {'calls/step':>10} {'measured B/step':>16} "
             f"{'predicted B/step':>17} {'ms/step':>8}"]
    for name in NAMES:
        m = measured[name]
        lines.append(f"{name:<4} {mesh.size(name):>4} {m['calls']:>10g} {m['bytes']:>16.1f} "
                     f"{predicted[name]:>17.1f} {m['ms']:>8.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ training
class _Replica:
    """This rank's part of the model and how one training step runs it: the stage's pieces
    (blocks split over tp, experts over ep), wrapped in DDP or FSDP over the dp (x ep)
    ranks, driven by a pipeline schedule when there is more than one stage."""

    def __init__(self, args, dense: nn.Sequential, mesh: DeviceMesh, groups: dict) -> None:
        self.stage, self.num_stages = mesh.local_rank("pp"), args.pp
        self.first, self.last = self.stage == 0, self.stage == args.pp - 1
        self.hidden, self.rows = args.hidden, ROWS // args.cp
        split = context_parallel(tensor_parallel(dense, groups["tp"]), groups["cp"],
                                 args.layout, args.cp_algorithm)
        split = expert_parallel(split, groups["ep"])
        self.pieces = nn.Sequential(*(split[i] for i in stage_pieces(args.layers, args.pp,
                                                                     self.stage)))
        self.expert_replicas = groups["experts"]   # the ranks that hold the same experts
        if args.fsdp:
            wrap = lambda m: FSDP(m, groups["dense"], wrap=ParallelTransformerBlock)  # noqa: E731
        else:
            wrap = lambda m: DDP(m, groups["dense"])  # noqa: E731
        self.module = replicate_outside_experts(self.pieces, wrap,
                                                expert_replicas=self.expert_replicas)
        self.moe_layers = [m for m in self.pieces.modules() if isinstance(m, MoE)]
        self.schedule = None
        if args.pp > 1:
            stage = PipelineStage(self.module, groups["pp"], self.stage, args.pp)
            self.schedule = SCHEDULES[args.schedule](stage, args.microbatches,
                                                      F.cross_entropy)

    def step(self, x: torch.Tensor, y: torch.Tensor, opt, tracer: trace.Tracer, step_no: int):
        """One training step; returns the batch's mean loss on the last stage, else None."""
        if self.schedule is None:
            with tracer.span("forward"):
                loss = F.cross_entropy(self.module(x), y)
            opt.zero_grad()
            with tracer.span("backward"):
                loss.backward()
        else:
            opt.zero_grad()
            with tracer.span("pipeline"):
                losses = self.schedule.step(x if self.first else None,
                                            target=y if self.last else None)
            for action, t0, t1 in self.schedule.timeline:
                tracer.add_slice(str(action), t0, t1, cat="pp", step=step_no)
            loss = torch.stack(losses).mean() if self.last else None
        if self.moe_layers:
            with tracer.span("experts"):
                average_expert_grads(self.pieces, self.expert_replicas)
        with tracer.span("step"):
            opt.step()
        return None if loss is None else loss.item()

    @torch.no_grad()
    def logits(self, x: torch.Tensor, pp_group) -> torch.Tensor:
        """The model's output for ``x`` on the last stage's ranks (None elsewhere): stage by
        stage, each sending its output to the next over ``pp_group``."""
        h = x
        if not self.first:
            h = torch.empty(len(x), self.rows, self.hidden)
            pp_group.recv(h, src=self.stage - 1, tag=7)
        h = self.module(h)
        if not self.last:
            pp_group.send(h.contiguous(), dst=self.stage + 1, tag=7)
            return None
        return h


def train_on_mesh(pg, args, dense: nn.Sequential, tracer: trace.Tracer = None) -> dict:
    """Train a copy of ``dense`` on the (dp, ep, pp, cp, tp) mesh over ``pg``. Returns the epochs'
    mean losses (over every replica), this rank's loss of each step (the mean over its dp
    shard of the batch; on the last stage's ranks only, else empty), the steps, the measured
    and the predicted bytes per step on each dimension, the mesh and the replica."""
    tracer = tracer or trace.Tracer(None, pg.rank)
    mesh = DeviceMesh(pg, (args.dp, args.ep, args.pp, args.cp, args.tp), NAMES)
    averaging = averaging_groups(mesh)
    counted = {name: CountingGroup(tracer.wrap(mesh[name], name)) for name in NAMES}
    counters = {name: [g] for name, g in counted.items()}
    # The replicated part's and the experts' averaging groups (dp, or dp with ep and cp),
    # counted under dp.
    reducing = {}
    for role in ("replicated", "experts"):
        if averaging[role] is mesh["dp"]:
            reducing[role] = counted["dp"]
        else:
            reducing[role] = CountingGroup(tracer.wrap(averaging[role], "dp"))
            counters["dp"].append(reducing[role])
    replica = _Replica(args, dense, mesh, {**counted, "dense": reducing["replicated"],
                                           "experts": reducing["experts"]})
    ep_bytes = [0]

    def count_ep(moe, inputs, output) -> None:  # each training forward's exchanges
        if torch.is_grad_enabled() and counted["ep"].counting:
            ep_bytes[0] += moe_traffic(moe)
    for moe in replica.moe_layers:
        moe.register_forward_hook(count_ep)

    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    opt = torch.optim.SGD(replica.module.parameters(), lr=args.lr, momentum=0.9)
    data = averaging["data"]
    sampler = ShardSampler(len(x_train), data.rank, data.size, seed=args.seed)
    # The epoch's mean loss, from the ranks that compute it once per replica.
    reports_loss = replica.last and mesh.local_rank("tp") == 0 and mesh.local_rank("cp") == 0
    for group in [g for gs in counters.values() for g in gs]:
        group.start()                  # the account: training steps only, no set-up
    losses, step_losses = [], []
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum, samples = 0.0, 0
        # Whole batches only: every step moves the same bytes (the account is per step).
        batches = BatchSampler(sampler, args.batch_size, drop_last=True)
        for idx in progress(batches, pg.rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            loss = replica.step(x_train[idx], y_train[idx], opt, tracer, steps)
            steps += 1
            if loss is not None:
                step_losses.append(loss)
                loss_sum += loss * len(idx)
                samples += len(idx)
            if args.max_steps and steps >= args.max_steps:
                break
        # On the bare world group: not counted.
        seen = torch.tensor([loss_sum, float(samples)] if reports_loss else [0.0, 0.0],
                            dtype=torch.float64)
        pg.all_reduce(seen)
        losses.append(seen[0].item() / seen[1].item())
        if pg.rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.6f}", file=sys.stderr,
                  flush=True)
        if args.max_steps and steps >= args.max_steps:
            break
    for group in [g for gs in counters.values() for g in gs]:
        group.counting = False
    measured = {name: {"bytes": sum(g.bytes for g in gs) / steps,
                       "calls": sum(g.calls for g in gs) / steps,
                       "ms": round(1e3 * sum(g.seconds for g in gs) / steps, 3)}
                for name, gs in counters.items()}
    coordinate = {name: mesh.local_rank(name) for name in NAMES}
    return {"losses": losses, "step_losses": step_losses, "steps": steps, "mesh": mesh,
            "measured": measured, "replica": replica, "coordinate": coordinate,
            "predicted": predicted_bytes(args, coordinate, steps, ep_bytes[0])}


def accuracy(run: dict, args, pg) -> float:
    """The share of the test split classified right (every replica evaluates it all; the
    last stage's answer is broadcast along the pipeline)."""
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))
    replica, mesh = run["replica"], run["mesh"]
    replica.module.eval()
    right = torch.zeros(1, dtype=torch.float64)
    for lo in range(0, len(x_test), EVAL_CHUNK):
        out = replica.logits(x_test[lo:lo + EVAL_CHUNK], mesh["pp"])
        if out is not None:
            right += (out.argmax(1) == y_test[lo:lo + EVAL_CHUNK]).sum().item()
    mesh["pp"].broadcast(right, src=args.pp - 1)
    return right.item() / len(x_test)


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    start = time.perf_counter()
    run = train_on_mesh(pg, args, dense_model(args), tracer)
    wall_s = time.perf_counter() - start
    acc = accuracy(run, args, pg)

    # Each rank's measured bytes against its own prediction (a middle pipeline stage
    # moves more than an end one); the table is rank 0's.
    mine = {name: m["bytes"] for name, m in run["measured"].items()}
    agree = pg.all_gather_object(mine == run["predicted"])
    if pg.rank == 0:
        wrong = [r for r, ok in enumerate(agree) if not ok]
        verdict = ("measured == predicted on every rank" if not wrong else
                   f"measured != predicted on ranks {wrong}")
        print(f"communication account (per step, {run['steps']} steps, batch "
              f"{args.batch_size} per dp replica; rank 0's, {verdict}):\n"
              f"{account_table(run['measured'], run['predicted'], run['mesh'])}", flush=True)
        print("account " + json.dumps({"measured": run["measured"],
                                       "predicted": run["predicted"],
                                       "every_rank_agrees": not wrong}), flush=True)
    samples = run["steps"] * args.batch_size * args.dp * args.ep
    print_summary(pg.rank, example="mesh", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s, samples=samples,
                  final_loss=run["losses"][-1], final_acc=acc)
    tracer.write(pg, args.trace)
    run["mesh"].close()
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
