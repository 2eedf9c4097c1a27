"""Pipeline-parallel training of an MNIST MLP with parallel.pp.

    python examples/pp.py --schedule 1f1b --nproc 4             # 4 stages, shared memory
    python examples/pp.py --schedule gpipe --microbatches 8
    python examples/pp.py --schedule interleaved --nproc 2      # 2 x 2 virtual stages
    python examples/pp.py --schedule zb --backend zmq
    mpirun -n 4 python examples/pp.py --schedule 1f1b           # backend mpi
    python examples/pp.py --nproc 4 --trace pp.json --picture pp.png

The model is 8 blocks (784-128, six 128-128, 128-10; each hidden block Linear, LayerNorm,
ReLU), cut by parameter count into --nproc stages (--nproc x --virtual-stages for
interleaved): rank r holds stages r, r+P, ... Every rank builds the same model from
--seed and keeps its stages. --batch-size is the whole pipeline's batch (every rank sees
every step), split into --microbatches; a last partial batch is dropped (the pipeline's
shapes are fixed by its first step). --picture FILE.png draws the schedule from theory;
with --trace also FILE-measured.png, the fastest step as it ran. Rank 0 prints the summary.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.cli_flags import positive_int  # noqa: E402
from examples.common.cli import launch, parse_args, print_summary  # noqa: E402

TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "zb": "ZB-H1", "interleaved": "interleaved 1F1B"}


def _options(p) -> None:
    p.add_argument("--schedule", choices=sorted(TITLES), default="1f1b",
                   help="pipeline schedule (default: %(default)s)")
    p.add_argument("--microbatches", type=positive_int, default=4,
                   help="micro-batches per step; must divide --batch-size (default: "
                        "%(default)s)")
    p.add_argument("--virtual-stages", type=positive_int, default=2,
                   help="stages per rank for --schedule interleaved (default: %(default)s)")
    p.add_argument("--picture", metavar="FILE.png", default=None,
                   help="draw the schedule (and, with --trace, the measured last step)")


def _fit_microbatches(args) -> None:
    """ValueError unless the micro-batches divide the batch."""
    if args.batch_size % args.microbatches:
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of "
                         f"--microbatches {args.microbatches}")


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = parse_args("pp", epochs=4, batch_size=64, lr=0.05, description=__doc__,
                      extra=_options, validate=_fit_microbatches,
                      batch_help="the whole pipeline's samples per step (every rank sees "
                                 "them), split into --microbatches")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import collectives  # noqa: E402
from examples.common.harness import progress  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel.pp import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                         ScheduleInterleaved1F1B, ScheduleZeroBubble, draw_png,
                         split_sequential)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleZeroBubble,
             "interleaved": ScheduleInterleaved1F1B}


def build_pipeline_mlp(seed: int) -> nn.Sequential:
    """Eight blocks, so up to eight stages; initialised from ``seed``."""
    def block(d_in: int, d_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(d_in, d_out), nn.LayerNorm(d_out), nn.ReLU())

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(block(28 * 28, 128), *[block(128, 128) for _ in range(6)],
                             nn.Linear(128, 10))


def pipeline_forward(stages: dict, pg, num_stages: int, x: torch.Tensor, widths: list):
    """Forward only (evaluation): stage by stage, each output sent to the next stage's
    rank. Returns the last stage's output on its rank, None elsewhere."""
    h = None
    for s in range(num_stages):
        here, prev = s % pg.size, (s - 1) % pg.size
        if here != pg.rank:
            continue
        if s > 0 and prev != pg.rank:
            h = torch.empty(len(x), widths[s])
            pg.recv(h, src=prev, tag=1)
        h = stages[s](x if s == 0 else h)
        if s < num_stages - 1 and (s + 1) % pg.size != pg.rank:
            pg.send(h, dst=(s + 1) % pg.size, tag=1)
    return h if (num_stages - 1) % pg.size == pg.rank else None


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))

    virtual = args.virtual_stages if args.schedule == "interleaved" else 1
    num_stages = pg.size * virtual
    model = build_pipeline_mlp(args.seed)
    parts = split_sequential(model, num_stages)
    with torch.no_grad():  # the width entering each stage, for evaluation's receives
        widths, h = [], torch.zeros(1, 28 * 28)
        for part in parts:
            widths.append(h.shape[1])
            h = part(h)
    mine = {s: parts[s] for s in range(pg.rank, num_stages, pg.size)}
    stages = [PipelineStage(mine[s], tracer.wrap(pg), s, num_stages) for s in mine]
    cls = SCHEDULES[args.schedule]
    sched = cls(stages if cls is ScheduleInterleaved1F1B else stages[0], args.microbatches,
                F.cross_entropy)
    params = [p for part in mine.values() for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    first, last = 0 in mine, num_stages - 1 in mine
    if pg.rank == 0 and args.picture:
        draw_png(sched.schedule, args.picture, title=f"{TITLES[args.schedule]}: P={pg.size}"
                 f", M={args.microbatches}{f', V={virtual}' if virtual > 1 else ''} (theory)")

    gen = torch.Generator().manual_seed(args.seed)   # the same order on every rank
    steps = len(x_train) // args.batch_size
    start = time.perf_counter()
    step_no = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=gen)
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for i in progress(range(steps), pg.rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            losses = sched.step(x_train[idx] if first else None,
                                target=y_train[idx] if last else None)
            opt.step()
            for action, t0, t1 in sched.timeline:
                tracer.add_slice(str(action), t0, t1, cat="pp", step=step_no)
            step_no += 1
            if last:
                loss_sum += torch.tensor([sum(l.item() for l in losses) / len(losses)
                                          * len(idx), len(idx)], dtype=torch.float64)
    wall_s = time.perf_counter() - start

    for s in mine.values():
        s.eval()
    with torch.no_grad():
        logits = pipeline_forward(mine, pg, num_stages, x_test, widths)
        result = torch.zeros(2, dtype=torch.float64)
        if last:
            result[0] = (loss_sum[0] / loss_sum[1]).item()
            result[1] = (logits.argmax(1) == y_test).double().mean()
    pg.broadcast(result, src=(num_stages - 1) % pg.size)

    print_summary(pg.rank, example="pp", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, wall_s=wall_s, samples=args.epochs * steps *
                  args.batch_size, final_loss=result[0].item(), final_acc=result[1].item())
    tracer.write(pg, args.trace)
    if pg.rank == 0 and args.picture and args.trace:
        from parallel.pp import timeline_from_trace
        measured = args.picture[:-4] if args.picture.endswith(".png") else args.picture
        draw_png(timeline_from_trace(args.trace, "fastest"), measured + "-measured.png",
                 unit="s", title=f"{TITLES[args.schedule]}: P={pg.size}, M="
                                 f"{args.microbatches} (measured, fastest step, {pg.backend})")
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
