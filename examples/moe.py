"""Expert-parallel training of an MNIST classifier with mixture-of-experts layers (parallel.ep).

    python examples/moe.py                                   # 2 ranks, shared memory
    python examples/moe.py --nproc 4 --capacity-factor 1.25  # 4 ranks, tokens dropped
    mpirun -n 4 python examples/moe.py                       # backend mpi
    torchrun --nproc-per-node 2 examples/moe.py --backend gloo
    python examples/moe.py --aux-weight 0                    # no load balancing
    python examples/moe.py --trace moe.json                  # then open it in ui.perfetto.dev

Each image is one token: ``Linear(784, dim)``, then ``--layers`` residual blocks
``h + MoE(LayerNorm(h))`` of ``--experts`` expert MLPs (dim -> 2*dim -> dim) with top-k
gating, then ``LayerNorm`` and ``Linear(dim, 10)``. The experts are sharded: rank r of n
holds experts ``r*E/n .. (r+1)*E/n - 1`` of each layer (``--experts`` must be divisible by
``--nproc``), and each step sends every token to the ranks of its chosen experts and back
(all_to_all with uneven split sizes). Everything else (the input layer, the routers, the
norms and the head) is replicated and averaged by DDP; each expert's gradient, summed over
every rank's tokens on its owner by backward, is divided by n (the mean of the ranks'
losses). Every rank trains on its own shard of each epoch; the loss adds
``--aux-weight`` times each layer's load-balancing loss (Switch Transformer), which keeps
the routers from sending most tokens to a few experts.

At the end rank 0 prints each layer's expert load over the last epoch (tokens each expert
accepted, summed over the ranks, and the least loaded expert's share of an even split),
then the summary line, which adds ``tokens_per_expert`` (per layer), ``drop_rate`` (the
share of token choices the capacity dropped) and ``min_expert_share``.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives  # noqa: E402
from examples.common.cli import launch, parse_args, print_summary  # noqa: E402


def add_moe_options(p) -> None:
    p.add_argument("--experts", type=int, default=8,
                   help="experts per layer, divisible by the ranks (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: "
                   "%(default)s)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="each expert accepts at most ceil(c * T * k / E) of a rank's T "
                        "tokens per step (default: no limit)")
    p.add_argument("--aux-weight", type=float, default=0.05,
                   help="weight of the load-balancing loss; 0 turns it off (default: "
                        "%(default)s)")
    p.add_argument("--dim", type=int, default=64, help="token width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="MoE blocks (default: %(default)s)")


def moe_args(argv=None):
    """The example's options. Spawning ``--nproc`` ranks that do not divide ``--experts``
    is a usage error, one line and exit status 2 (under mpirun or torchrun the layer
    itself refuses, with a ValueError naming both)."""
    return parse_args("moe", argv, epochs=5, batch_size=32, lr=0.05, description=__doc__,
                      extra=add_moe_options, validate=_fit_experts)


def _fit_experts(args) -> None:
    """ValueError if the ranks this process spawns do not divide the experts."""
    single = collectives.detect_rendezvous().launcher == "single"
    if single and args.experts % args.nproc:
        raise ValueError(f"--experts {args.experts} is not divisible by --nproc "
                         f"{args.nproc}")


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = moe_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

from examples.common.harness import progress, sharded_accuracy  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel import DDP, ShardSampler  # noqa: E402
from parallel.ep import MoE, average_expert_grads, replicate_outside_experts  # noqa: E402


class MoEBlock(nn.Module):
    """``h + MoE(LayerNorm(h))`` on tokens of shape (T, dim)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(moe.dim), moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


def moe_classifier(args, group) -> nn.Sequential:
    """The model with this rank's share of the experts: every rank draws the whole
    one-process model from ``args.seed`` (the same weights everywhere) and keeps experts
    ``r*E/n .. (r+1)*E/n - 1`` of each layer (``MoE.from_dense``)."""
    dim, E = args.dim, args.experts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        layers: list = [nn.Linear(28 * 28, dim), nn.GELU()]
        for _ in range(args.layers):
            experts = [nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                       for _ in range(E)]
            whole = MoE(nn.Linear(dim, E, bias=False), experts, None, top_k=args.top_k,
                        capacity_factor=args.capacity_factor)
            layers.append(MoEBlock(MoE.from_dense(whole, group)))
        layers += [nn.LayerNorm(dim), nn.Linear(dim, 10)]
    return nn.Sequential(*layers)


class ExpertLoad:
    """Tokens each expert accepted and choices dropped, summed over steps (and, by
    :meth:`total`, over ranks)."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(len(self.layers), self.layers[0].num_experts,
                                  dtype=torch.int64)
        self.dropped = 0

    def add(self) -> None:
        for i, moe in enumerate(self.layers):
            self.counts[i] += moe.tokens_per_expert
            self.dropped += moe.dropped

    def total(self, pg) -> tuple:
        """``(counts per layer and expert, dropped)`` over every rank (a collective)."""
        flat = torch.cat([self.counts.reshape(-1), torch.tensor([self.dropped])])
        pg.all_reduce(flat)
        return flat[:-1].reshape(self.counts.shape), int(flat[-1])


def load_report(counts: torch.Tensor, dropped: int) -> tuple:
    """The expert-load line and the summary's keys: each layer's counts, the drop rate
    (dropped choices / all choices) and the least loaded expert's share of an even split
    of the accepted tokens."""
    fair = counts.sum(1, keepdim=True).double() / counts.shape[1]
    shares = (counts.double() / fair).min(1).values
    choices = int(counts.sum()) + dropped
    drop_rate = dropped / choices if choices else 0.0
    layers = "; ".join(f"layer {i}: {c.tolist()} (min {s:.2f}x fair)"
                       for i, (c, s) in enumerate(zip(counts, shares)))
    line = (f"expert load, last epoch, all ranks: {layers}; dropped {dropped} of {choices} "
            f"choices ({100 * drop_rate:.2f}%)")
    return line, {"tokens_per_expert": counts.tolist(), "drop_rate": round(drop_rate, 5),
                  "min_expert_share": round(float(shares.min()), 4)}


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    group = tracer.wrap(pg)
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))

    net = moe_classifier(args, group)
    layers = [m for m in net.modules() if isinstance(m, MoE)]
    model = replicate_outside_experts(net, lambda m: DDP(m, group))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ShardSampler(len(x_train), pg.rank, pg.size, seed=args.seed)
    load = ExpertLoad(layers)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        load.reset()                                  # the report is the last epoch's
        loss_sum = torch.zeros(2, dtype=torch.float64)
        batches = BatchSampler(sampler, args.batch_size, drop_last=False)
        for idx in progress(batches, pg.rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            with tracer.span("forward"):
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                aux = sum(m.aux_loss for m in layers)
            opt.zero_grad()
            with tracer.span("backward"):
                (loss + args.aux_weight * aux).backward()
                average_expert_grads(net)
            with tracer.span("step"):
                opt.step()
            load.add()
            loss_sum += torch.tensor([loss.item() * len(idx), len(idx)], dtype=torch.float64)
        pg.all_reduce(loss_sum)
        if pg.rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss_sum[0] / loss_sum[1]:.6f}",
                  file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - start

    final_acc = sharded_accuracy(model, pg, x_test, y_test)
    line, extra = load_report(*load.total(pg))
    if pg.rank == 0:
        print(line, flush=True)
    print_summary(pg.rank, example="moe", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s, samples=args.epochs * sampler.total_size,
                  final_loss=(loss_sum[0] / loss_sum[1]).item(), final_acc=final_acc,
                  extra=extra)
    tracer.write(pg, args.trace)
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
