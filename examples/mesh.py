"""Data x tensor parallelism on one device mesh: a small transformer classifier of MNIST,
its blocks split over ``tp`` (parallel.tp), each tp replica sharded by FSDP (or DDP) over
``dp``.

    python examples/mesh.py --dp 2 --tp 2                    # 4 ranks, shared memory
    python examples/mesh.py --dp 2 --tp 2 --fsdp             # FSDP (ZeRO-3) across dp
    mpirun -n 4 python examples/mesh.py --dp 2 --tp 2        # backend mpi
    python examples/mesh.py --dp 2 --tp 2 --trace mesh.json  # then open it in ui.perfetto.dev

The ranks form ``DeviceMesh(pg, (dp, tp), ("dp", "tp"))`` (row-major: ranks 0 and 1 are
one tp pair, ranks 0 and 2 one dp pair). Each image is read as a sequence of its 28 rows:
a linear embedding (28 -> hidden) plus a learned position embedding, ``--layers``
pre-norm ``ParallelTransformerBlock``s (non-causal attention; heads and MLP features split
over tp), a LayerNorm, the mean over the sequence and a linear head to 10 classes. The
ranks of one tp group see the same batch; the dp groups deal the epoch out
(ShardSampler) and average the gradients (DDP's all_reduce, or FSDP's all_gathers and
reduce_scatters). ``--batch-size`` is the batch of one dp rank per step.

``--pp`` > 1 (pipeline stages) is not available yet: the example says so and exits with
status 2. ``--nproc`` defaults to dp*tp*pp.

At the end rank 0 prints the communication account: bytes per step on each mesh
dimension, measured by a counter around each dimension's group, next to what the model's
sizes predict (see :func:`predicted_bytes`), and the time per step rank 0 spent in (or
waiting for) each dimension's collectives; then the JSON summary line.
"""

import copy
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

import collectives  # noqa: E402
from examples.common.comm_account import CountingGroup  # noqa: E402
from examples.common.harness import launch, parse_args, print_summary, progress  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from examples.common.trace import Tracer  # noqa: E402
from parallel import DDP, FSDP, DeviceMesh, ShardSampler  # noqa: E402
from parallel.tp import ParallelTransformerBlock, TransformerBlock  # noqa: E402

ROWS = COLS = 28
CLASSES = 10


class RowTransformer(nn.Module):
    """MNIST as a sequence of 28 rows of 28 pixels -> 10 logits. ``blocks`` are
    :class:`TransformerBlock` (dense) or :class:`ParallelTransformerBlock` (split)."""

    def __init__(self, hidden: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(COLS, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(ROWS, hidden))
        self.blocks = nn.ModuleList(TransformerBlock(hidden, heads, ffn, causal=False)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(-1, ROWS, COLS)) + self.pos       # (b, 28, hidden)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))                 # (b, 10)


def dense_model(args) -> RowTransformer:
    """The single-process model, initialised from ``args.seed`` (global random state kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        return RowTransformer(args.hidden, args.heads, args.ffn, args.layers)


def tp_model(dense: RowTransformer, tp_group) -> RowTransformer:
    """A copy of ``dense`` with every block split over ``tp_group`` (the rest replicated)."""
    model = copy.deepcopy(dense)
    model.blocks = nn.ModuleList(ParallelTransformerBlock.from_dense(b, tp_group)
                                 for b in dense.blocks)
    return model


# ------------------------------------------------------------------ the account
def local_param_counts(args, tp: int) -> dict:
    """Elements of one rank's parameters, from the sizes: ``{"block": per block, "rest":
    everything outside the blocks}`` (each tp rank holds 1/tp of q, k, v, fc1 and the
    input columns of proj, fc2; LayerNorms and the row layers' biases whole)."""
    h, f = args.hidden, args.ffn
    block = (2 * 2 * h                                  # ln1, ln2
             + 3 * (h * h // tp + h // tp)              # q, k, v: column-parallel
             + h * h // tp + h                          # proj: row-parallel, whole bias
             + f * h // tp + f // tp                    # fc1: column-parallel
             + h * f // tp + h)                         # fc2: row-parallel, whole bias
    rest = (COLS * h + h) + ROWS * h + 2 * h + (h * CLASSES + CLASSES)  # embed pos norm head
    # Parameter tensors: a block's ln1, ln2, q, k, v, proj, fc1, fc2 (weight and bias each);
    # outside: embed (2), pos (1), norm (2), head (2).
    return {"block": block, "rest": rest, "block_tensors": 16, "rest_tensors": 7}


def predicted_bytes(args, dp: int, tp: int, fsdp: bool) -> dict:
    """Bytes per training step on each mesh dimension (float32; a group of one rank: 0).

    - tp: each block all-reduces its (batch, 28, hidden) activations twice in forward (after
      proj and fc2) and their gradients twice in backward (before q/k/v and fc1).
    - dp with DDP: one all_reduce of every local gradient, plus one float per parameter
      tensor (each bucket's "gradient ready" flags travel with it; parallel/bucket.py).
    - dp with FSDP (ZeRO-3, each block a unit, the rest the root unit; a unit's flat
      parameter padded to a multiple of dp): the root gathered once, each block twice
      (forward, and again in backward after resharding), every unit reduce-scattered once.
    """
    counts, f32 = local_param_counts(args, tp), 4
    out = {"tp": 0, "dp": 0}
    if tp > 1:
        out["tp"] = 4 * args.layers * args.batch_size * ROWS * args.hidden * f32
    if dp > 1:
        if not fsdp:
            grads = counts["rest"] + args.layers * counts["block"]
            flags = counts["rest_tensors"] + args.layers * counts["block_tensors"]
            out["dp"] = (grads + flags) * f32
        else:
            padded = lambda n: math.ceil(n / dp) * dp  # noqa: E731
            root, block = padded(counts["rest"]), padded(counts["block"])
            gathered = root + 2 * args.layers * block
            reduced = root + args.layers * block
            out["dp"] = (gathered + reduced) * f32
    return out


def account_table(measured: dict, predicted: dict, mesh: DeviceMesh) -> str:
    lines = [f"{'dim':<4} {'size':>4} {'calls/step':>10} {'measured B/step':>16} "
             f"{'predicted B/step':>17} {'ms/step':>8}"]
    for name in ("dp", "tp"):
        m = measured[name]
        lines.append(f"{name:<4} {mesh.size(name):>4} {m['calls']:>10g} {m['bytes']:>16.0f} "
                     f"{predicted[name]:>17} {m['ms']:>8.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ training
def train_on_mesh(pg, args, dense: RowTransformer, tracer: Tracer = None) -> dict:
    """Train a copy of ``dense`` on the (dp, tp) mesh over ``pg``; returns the epochs' mean
    losses (over the whole dp group), this rank's loss of each step (of its dp shard of the
    batch), the steps, the measured and the predicted bytes per step on each dimension, the
    mesh and the model."""
    tracer = tracer or Tracer(pg.rank, enabled=False)
    mesh = DeviceMesh(pg, (args.dp, args.tp), ("dp", "tp"))
    counted = {name: CountingGroup(tracer.wrap(mesh[name], name)) for name in mesh.names}
    model = tp_model(dense, counted["tp"])
    if args.fsdp:
        model = FSDP(model, counted["dp"], wrap=ParallelTransformerBlock)
    else:
        model = DDP(model, counted["dp"])

    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ShardSampler(len(x_train), mesh.local_rank("dp"), args.dp, seed=args.seed)
    for group in counted.values():
        group.start()                  # the account: training steps only, no set-up
    losses, step_losses = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum, samples = 0.0, 0
        # Whole batches only: every step moves the same bytes (the account is per step).
        batches = BatchSampler(sampler, args.batch_size, drop_last=True)
        for idx in progress(batches, pg.rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            with tracer.span("forward"):
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            opt.zero_grad()
            with tracer.span("backward"):
                loss.backward()
            with tracer.span("step"):
                opt.step()
            step_losses.append(loss.item())
            loss_sum += loss.item() * len(idx)
            samples += len(idx)
            if args.max_steps and len(step_losses) >= args.max_steps:
                break
        # The epoch's mean over every dp rank's samples (on the bare group: not counted).
        seen = torch.tensor([loss_sum, float(samples)], dtype=torch.float64)
        mesh["dp"].all_reduce(seen)
        losses.append(seen[0].item() / seen[1].item())
        if pg.rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.6f}", file=sys.stderr,
                  flush=True)
        if args.max_steps and len(step_losses) >= args.max_steps:
            break
    steps = len(step_losses)
    for group in counted.values():
        group.counting = False
    measured = {name: {"bytes": g.bytes / steps, "calls": g.calls / steps,
                       "ms": round(1e3 * g.seconds / steps, 3)}
                for name, g in counted.items()}
    return {"losses": losses, "step_losses": step_losses, "steps": steps, "mesh": mesh,
            "measured": measured, "model": model,
            "predicted": predicted_bytes(args, args.dp, args.tp, args.fsdp)}


def accuracy(model: nn.Module, args) -> float:
    """The share of the test split classified right (every rank runs the same forward)."""
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))
    model.eval()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).double().mean().item()


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = Tracer(pg.rank, enabled=args.trace is not None)
    start = time.perf_counter()
    run = train_on_mesh(pg, args, dense_model(args), tracer)
    wall_s = time.perf_counter() - start
    acc = accuracy(run["model"], args)

    # The bytes and calls are the same on every rank? (The times are each rank's own.)
    mine = {name: (m["bytes"], m["calls"]) for name, m in run["measured"].items()}
    everyone = pg.all_gather_object(mine)
    if pg.rank == 0:
        same = "equal" if all(m == everyone[0] for m in everyone) else "NOT equal"
        print(f"communication account (per step, {run['steps']} steps, batch "
              f"{args.batch_size} per dp rank; measured on rank 0, bytes {same} on "
              f"every rank):\n{account_table(run['measured'], run['predicted'], run['mesh'])}",
              flush=True)
        print("account " + json.dumps({"measured": run["measured"],
                                       "predicted": run["predicted"]}), flush=True)
    samples = run["steps"] * args.batch_size * args.dp
    print_summary(pg.rank, example="mesh", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s, samples=samples,
                  final_loss=run["losses"][-1], final_acc=acc)
    tracer.write(pg, args.trace)
    run["mesh"].close()
    pg.close()


def add_mesh_options(p) -> None:
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default: 1)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default: 2)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (only 1: pipeline composition is not available yet)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard each tp replica with FSDP (ZeRO-3) across dp instead of DDP")
    p.add_argument("--hidden", type=int, default=64, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=4, help="default: %(default)s")
    p.add_argument("--ffn", type=int, default=128, help="default: %(default)s")
    p.add_argument("--layers", type=int, default=2, help="default: %(default)s")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop training after this many steps (default 0: no limit)")


def mesh_args(argv=None):
    """The example's options; ``--nproc`` defaults to dp*tp*pp. ``--pp`` > 1 or an
    ``--nproc`` other than dp*tp*pp ends the program with status 2 and a message."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args("mesh", argv, epochs=10, batch_size=32, lr=0.05, description=__doc__,
                      extra=add_mesh_options)
    for name in ("dp", "tp", "pp"):
        if getattr(args, name) < 1:
            sys.exit(f"examples/mesh.py: --{name} must be at least 1")
    if args.pp > 1:
        print(f"examples/mesh.py: --pp {args.pp}: pipeline composition is not available yet "
              f"(parallel.pp is not part of this version); run with --pp 1",
              file=sys.stderr, flush=True)
        sys.exit(2)
    total = args.dp * args.tp * args.pp
    if any(a == "--nproc" or a.startswith("--nproc=") for a in argv):
        if args.nproc != total:
            print(f"examples/mesh.py: --nproc {args.nproc} must equal dp*tp*pp = {total}",
                  file=sys.stderr, flush=True)
            sys.exit(2)
    args.nproc = total
    return args


if __name__ == "__main__":
    launch(main, mesh_args())
