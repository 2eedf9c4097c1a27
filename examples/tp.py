"""Tensor-parallel training of the MNIST MLP with parallel.tp (Megatron-LM's layout).

    python examples/tp.py --backend shm --nproc 4
    mpirun -n 4 python examples/tp.py                         # backend mpi
    python examples/tp.py                                     # 2 ranks, shared memory
    torchrun --standalone --nproc-per-node 2 examples/tp.py --backend gloo
    python examples/tp.py --trace tp.json                     # then open it in ui.perfetto.dev

The MLP's hidden layers are split across the ranks, column then row: rank r holds rows
[r*256/n, (r+1)*256/n) of the first layer (784 -> 256) and the same columns of the second
(256 -> 64), so the 256 hidden features never leave their rank (--nproc must divide 256:
1, 2, 4, 8, ...; another number is a ValueError naming the layer). The row layer's
partial outputs are summed by one all_reduce in forward; backward needs none here (the
column layer's all_reduce of dL/dx is skipped: the images need no gradient). The layers after it
(LayerNorm(64), ReLU, Linear(64, 10)) are replicated and see bitwise-identical inputs on
every rank, so their gradients agree without communication.

The model is the examples' MLP (build_mlp) without its LayerNorm(256): a LayerNorm over
features that are split across ranks would need a collective of its own. Every rank sees
the same batches (tensor parallelism splits the model, not the data); --batch-size is the
batch of one step. Rank 0 prints each epoch's mean loss on standard error and the summary
as its last line of output; tests/test_tp.py checks that the curve follows the dense
model's from the same initial weights.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.common.cli import launch, parse_args, print_summary  # noqa: E402

if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = parse_args("tp", epochs=3, batch_size=32, lr=0.05, description=__doc__,
                      batch_help="samples per step (every rank sees the same batch)")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

import collectives  # noqa: E402
from examples.common.harness import build_mlp, progress, traced_step  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel import ShardSampler  # noqa: E402
from parallel.tp import ColumnParallelLinear, RowParallelLinear  # noqa: E402


def dense_mlp(seed: int) -> nn.Sequential:
    """784-256-ReLU-64-LayerNorm-ReLU-10: build_mlp(seed) with its LayerNorm(256) removed
    (the other layers keep build_mlp's initial weights)."""
    model = build_mlp(seed)
    model[1] = nn.Identity()
    return model


def tp_mlp(dense: nn.Sequential, group) -> nn.Sequential:
    """``dense`` with its hidden layers split over ``group``, column then row."""
    return nn.Sequential(
        ColumnParallelLinear.from_dense(dense[0], group),    # (b, 784) -> (b, 256/n)
        nn.ReLU(),                                           # on this rank's block
        RowParallelLinear.from_dense(dense[3], group),       # (b, 256/n) -> (b, 64), summed
        dense[4], nn.ReLU(), dense[6],                       # replicated
    )


def train(model: nn.Module, args, rank: int = 0, tracer: trace.Tracer = None) -> list:
    """SGD with momentum over ``args.epochs`` epochs of the training split, the same batch
    order on every rank; returns each epoch's mean loss."""
    tracer = tracer or trace.Tracer(None, rank)
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ShardSampler(len(x_train), 0, 1, seed=args.seed)   # one shard: all of it
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros((), dtype=torch.float64)
        batches = BatchSampler(sampler, args.batch_size, drop_last=False)
        for idx in progress(batches, rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            loss = traced_step(model, opt, x_train[idx], y_train[idx], tracer)
            loss_sum += loss.item() * len(idx)
        losses.append(loss_sum.item() / len(sampler))
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.6f}", file=sys.stderr,
                  flush=True)
    return losses


def accuracy(model: nn.Module, args) -> float:
    """The share of the test split classified right (every rank runs the same forward)."""
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))
    model.eval()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).double().mean().item()


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    model = tp_mlp(dense_mlp(args.seed), tracer.wrap(pg))

    start = time.perf_counter()
    losses = train(model, args, pg.rank, tracer)
    wall_s = time.perf_counter() - start
    acc = accuracy(model, args)

    print_summary(pg.rank, example="tp", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s,
                  samples=args.epochs * len(load_mnist(args.data_dir, "train")[1]),
                  final_loss=losses[-1], final_acc=acc)
    tracer.write(pg, args.trace)
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
