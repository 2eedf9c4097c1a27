"""Fully sharded data-parallel training of the MNIST MLP with parallel.FSDP.

    python examples/fsdp.py                                   # 2 ranks, shared memory, zero3
    python examples/fsdp.py --backend shm --nproc 4
    python examples/fsdp.py --strategy zero2                  # or zero1: same numbers
    python examples/fsdp.py --param-dtype bfloat16            # bf16 compute, fp32 master
    mpiexec -n 2 python examples/fsdp.py                      # backend mpi
    torchrun --nproc-per-node 2 examples/fsdp.py --backend gloo
    python examples/fsdp.py --trace fsdp.json                 # then open it in ui.perfetto.dev

Each nn.Linear is a unit: every rank holds 1/N of its weights (and of their gradients
and momentum), gathers the whole layer just before it computes and frees it after; the
next layer's all_gather runs while the current one computes. The LayerNorms are the
root's leftover parameters. --batch-size is per rank, as in examples/ddp.py: one step
sees batch_size x world_size samples. Rank 0 prints the summary as its last line.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.common.cli import launch, parse_args, print_summary  # noqa: E402

PARAM_DTYPES = ("float32", "bfloat16", "float16")


def _options(p) -> None:
    p.add_argument("--strategy", choices=("zero1", "zero2", "zero3"), default="zero3",
                   help="what is sharded: optimizer state (zero1), + gradients (zero2), "
                        "+ parameters (zero3) (default: %(default)s)")
    p.add_argument("--param-dtype", choices=PARAM_DTYPES, default="float32",
                   help="compute (and gather, and reduce gradients) in this dtype; the "
                        "sharded master weights stay float32 (default: %(default)s)")


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = parse_args("fsdp", epochs=5, batch_size=32, lr=0.05, description=__doc__,
                      extra=_options)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

import collectives  # noqa: E402
from examples.common.harness import build_mlp, progress, sharded_accuracy  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel import FSDP, ShardSampler  # noqa: E402

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))

    model = FSDP(build_mlp(args.seed), tracer.wrap(pg), wrap=nn.Linear,
                 strategy=args.strategy, param_dtype=DTYPES[args.param_dtype])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ShardSampler(len(x_train), pg.rank, pg.size, seed=args.seed)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, dtype=torch.float64)  # sum of losses, samples
        batches = BatchSampler(sampler, args.batch_size, drop_last=False)
        for idx in progress(batches, pg.rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            with tracer.span("forward"):
                loss = F.cross_entropy(model(x_train[idx]).float(), y_train[idx])
            opt.zero_grad()
            with tracer.span("backward"):
                loss.backward()  # gathers again, reduce-scatters; returns with shard grads
            with tracer.span("step"):
                opt.step()       # on this rank's shards only
            loss_sum += torch.tensor([loss.item() * len(idx), len(idx)], dtype=torch.float64)
    wall_s = time.perf_counter() - start
    pg.all_reduce(loss_sum)  # the last epoch's mean loss over every rank's samples

    final_acc = sharded_accuracy(model, pg, x_test, y_test)

    print_summary(pg.rank, example="fsdp", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s, samples=args.epochs * sampler.total_size,
                  final_loss=(loss_sum[0] / loss_sum[1]).item(),
                  final_acc=final_acc)
    tracer.write(pg, args.trace)
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
