"""Data-parallel training of the MNIST MLP with parallel.DDP.

    python examples/ddp.py                                    # 2 ranks, shared memory
    python examples/ddp.py --backend shm --nproc 4
    python examples/ddp.py --nproc 1                          # one rank, same code
    mpirun -n 2 python examples/ddp.py                        # backend mpi
    torchrun --nproc-per-node 2 examples/ddp.py --backend gloo
    python examples/ddp.py --trace ddp.json                   # then open it in ui.perfetto.dev

Every rank holds the whole model, rank 0's initial weights (DDP broadcasts them), and
trains on its own shard of each epoch (ShardSampler). --batch-size is per rank: one
optimizer step sees batch_size x world_size samples, and backward leaves in every .grad
the average over all of them. At the end each rank scores its share of the test split and
the counts are summed. Rank 0 prints the summary as its last line of output.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.common.cli import launch, parse_args, print_summary  # noqa: E402

if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = parse_args("ddp", epochs=5, batch_size=32, lr=0.05, description=__doc__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

import collectives  # noqa: E402
from examples.common.harness import build_mlp, progress, sharded_accuracy  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel import DDP, ShardSampler  # noqa: E402


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))

    model = DDP(build_mlp(args.seed), tracer.wrap(pg))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ShardSampler(len(x_train), pg.rank, pg.size, seed=args.seed)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, dtype=torch.float64)  # sum of losses, samples
        batches = BatchSampler(sampler, args.batch_size, drop_last=False)
        for idx in progress(batches, pg.rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            with tracer.span("forward"):
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            opt.zero_grad(set_to_none=False)  # keep .grad as views into DDP's buckets
            with tracer.span("backward"):
                loss.backward()  # all-reduces overlap backward; returns with averages
            with tracer.span("step"):
                opt.step()
            loss_sum += torch.tensor([loss.item() * len(idx), len(idx)], dtype=torch.float64)
    wall_s = time.perf_counter() - start
    pg.all_reduce(loss_sum)  # the last epoch's mean loss over every rank's samples

    final_acc = sharded_accuracy(model, pg, x_test, y_test)

    print_summary(pg.rank, example="ddp", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s, samples=args.epochs * sampler.total_size,
                  final_loss=(loss_sum[0] / loss_sum[1]).item(),
                  final_acc=final_acc)
    tracer.write(pg, args.trace)
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
