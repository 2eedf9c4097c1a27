"""Context-parallel training of a small transformer that reads each MNIST image as a
long sequence: 196 tokens, one per 2x2 patch (embedded from the 4x4 pixels around it),
plus 4 learned summary tokens (200 tokens, so the zigzag layout's 2C chunks divide it for
C = 1, 2, 4, 5), split over the ranks.

    python examples/cp.py --nproc 2                               # ring attention, shm
    python examples/cp.py --nproc 4 --layout zigzag --causal      # balanced causal work
    python examples/cp.py --cp-algorithm all_gather               # Llama 3's variant
    mpirun -n 4 python examples/cp.py                             # backend mpi
    torchrun --standalone --nproc-per-node 2 examples/cp.py --backend gloo
    python examples/cp.py --trace cp.json                         # then ui.perfetto.dev
    python examples/plot_trace.py cp.json cp.png --step 20 --steps 1

Every rank sees the same batches and holds 200/C tokens of every image (``--layout``:
contiguous blocks or zigzag chunks) in every layer: embedding, LayerNorms, MLPs and the
attention's q, k, v. Attention is the one layer that mixes tokens:
``parallel.cp.ContextParallelAttention`` gets the other ranks' keys and values around a
ring of isend/irecv (``--cp-algorithm ring``) or by one all_gather (``all_gather``), and
its backward sends their gradients back. The blocks are ``parallel.tp``'s
``ParallelTransformerBlock`` (over a tensor-parallel group of one; with ``mesh.py --cp``
the heads are split too). The head gathers the tokens (``unshard_sequence``), takes their
mean and classifies. Each rank's loss is then the whole batch's and the gathered tokens'
backward sums the ranks' gradients, so the replicated parameters' gradients are C times
the one-process ones; DDP over the ranks averages them.

With ``--trace``, each ring step's computation is a slice (``ring forward step i``) and
its isend/irecv of the next block run from their post, before the computation, to their
wait, after it: the transfer hides behind the block's computation. Rank 0 prints each
epoch's mean loss on standard error and the summary as its last line.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.common.cli import launch, parse_args, print_summary  # noqa: E402

PATCH = 2                       # pixels per side of a token
PATCHES = (28 // PATCH) ** 2    # 196 tokens of the image
SUMMARY = 4                     # learned tokens appended: 200 in all
TOKENS = PATCHES + SUMMARY


def add_cp_options(p) -> None:
    p.add_argument("--cp-algorithm", choices=("ring", "all_gather"), default="ring",
                   help="how attention gets the other ranks' keys and values "
                        "(default: %(default)s)")
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous",
                   help="which tokens each rank holds (default: %(default)s)")
    p.add_argument("--causal", action="store_true",
                   help="causal attention (each token sees those before it)")
    p.add_argument("--hidden", type=int, default=32, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=2, help="default: %(default)s")
    p.add_argument("--layers", type=int, default=2, help="default: %(default)s")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop training after this many steps (default 0: no limit)")


def cp_args(argv=None):
    """The example's options; a token count the layout's chunks do not divide is a usage
    error: one line, exit status 2."""
    return parse_args("cp", argv, epochs=10, batch_size=32, lr=2e-3, description=__doc__,
                      extra=add_cp_options, validate=_fit_tokens,
                      batch_help="samples per step (every rank sees the same batch and "
                                 "holds a share of each image's tokens)")


def _fit_tokens(args) -> None:
    """ValueError unless the layout's chunks divide the tokens."""
    chunks = args.nproc * (2 if args.layout == "zigzag" else 1)
    if TOKENS % chunks:
        raise ValueError(f"--nproc {args.nproc} with --layout {args.layout} cuts the "
                         f"{TOKENS} tokens into {chunks} chunks, which does not divide "
                         f"them")


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    ARGS = cp_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler  # noqa: E402

import collectives  # noqa: E402
from examples.common.harness import progress, traced_step  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from collectives import trace  # noqa: E402
from parallel import DDP, DeviceMesh, ShardSampler  # noqa: E402
from parallel.cp import ContextParallelAttention, shard_sequence, unshard_sequence  # noqa: E402
from parallel.tp import ParallelTransformerBlock, TransformerBlock  # noqa: E402

class PatchEmbedding(nn.Module):
    """(b, 784) images -> (b, 200, hidden): a token per 2x2 patch, embedded from the 4x4
    pixels around it (a convolution of stride 2), the summary tokens appended, a learned
    position added."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, hidden, kernel_size=2 * PATCH, stride=PATCH,
                               padding=PATCH // 2)
        self.summary = nn.Parameter(0.02 * torch.randn(SUMMARY, hidden))
        self.pos = nn.Parameter(0.02 * torch.randn(TOKENS, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        patches = self.embed(x.reshape(b, 1, 28, 28))             # (b, hidden, 14, 14)
        tokens = patches.flatten(2).transpose(1, 2)                # (b, 196, hidden)
        tokens = torch.cat([tokens, self.summary.expand(b, -1, -1)], dim=1)
        return tokens + self.pos


def dense_model(args) -> nn.Sequential:
    """The one-process model: embedding, ``--layers`` blocks, LayerNorm, mean, linear."""
    torch.manual_seed(args.seed)
    blocks = [TransformerBlock(args.hidden, args.heads, 2 * args.hidden, causal=args.causal)
              for _ in range(args.layers)]
    return nn.Sequential(PatchEmbedding(args.hidden), *blocks, nn.LayerNorm(args.hidden),
                         nn.Linear(args.hidden, 10))


class ContextParallelModel(nn.Module):
    """``dense`` with every activation's tokens split over ``cp``: this rank's tokens from
    the embedding on, context-parallel attention in each block, the tokens gathered for
    the head. ``attentions``: the blocks' attention modules (for their timelines)."""

    def __init__(self, dense: nn.Sequential, mesh: DeviceMesh, cp_group, args) -> None:
        super().__init__()
        self.cp, self.layout = cp_group, args.layout
        self.embed, self.norm, self.head = dense[0], dense[-2], dense[-1]
        self.attentions = [ContextParallelAttention(cp_group, algorithm=args.cp_algorithm,
                                                    layout=args.layout,
                                                    record=args.trace is not None)
                           for _ in range(args.layers)]
        self.blocks = nn.ModuleList(
            ParallelTransformerBlock.from_dense(block, mesh["tp"], attention=attention)
            for block, attention in zip(dense[1:-2], self.attentions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = shard_sequence(self.embed(x), self.cp, 1, self.layout)   # (b, 200/C, hidden)
        for block in self.blocks:
            h = block(h)
        h = unshard_sequence(h, self.cp, 1, self.layout)              # (b, 200, hidden)
        return self.head(self.norm(h).mean(dim=1))


def record_timelines(model: ContextParallelModel, tracer: trace.Tracer, step: int) -> None:
    """Move the attention modules' recorded computation into the trace."""
    for attention in model.attentions:
        if attention.timeline:
            for name, start, end in attention.timeline:
                tracer.add_slice(name, start, end, cat="cp", step=step)
            attention.timeline.clear()


def train(model: DDP, cp_model: ContextParallelModel, args, rank: int,
          tracer: trace.Tracer) -> tuple:
    """AdamW over ``args.epochs`` epochs (or ``args.max_steps`` steps), the learning rate
    decaying linearly to 0 (a transformer this small otherwise ends on a noisy epoch), the
    same batches on every rank; each epoch's mean loss and the samples trained on."""
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = args.epochs * -(-len(x_train) // args.batch_size)
    total = min(total, args.max_steps) if args.max_steps else total
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / total)
    sampler = ShardSampler(len(x_train), 0, 1, seed=args.seed)   # one shard: all of it
    losses, step, samples = [], 0, 0
    for epoch in range(args.epochs):
        if step == args.max_steps and step:
            break
        sampler.set_epoch(epoch)
        loss_sum = 0.0
        batches = BatchSampler(sampler, args.batch_size, drop_last=False)
        seen = 0
        for idx in progress(batches, rank, desc=f"epoch {epoch + 1}/{args.epochs}"):
            loss = traced_step(model, opt, x_train[idx], y_train[idx], tracer)
            decay.step()
            record_timelines(cp_model, tracer, step)
            loss_sum += loss.item() * len(idx)
            seen += len(idx)
            step += 1
            if step == args.max_steps:
                break
        losses.append(loss_sum / seen)
        samples += seen
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.6f}", file=sys.stderr,
                  flush=True)
    return losses, samples


@torch.no_grad()
def accuracy(model: nn.Module, args) -> float:
    """The share of the test split classified right (every rank runs the same forward)."""
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))
    model.eval()
    right = sum((model(x_test[lo:lo + 250]).argmax(1) == y_test[lo:lo + 250]).sum().item()
                for lo in range(0, len(x_test), 250))
    return right / len(x_test)


def main(args):
    pg = collectives.init_process_group(args.backend)
    tracer = trace.to_file(pg, args.trace)
    # cp: the ranks splitting the tokens; tp of one (the block's heads stay whole). DDP
    # averages the gradients over the world group, a group apart from cp's ring.
    mesh = DeviceMesh(pg, (pg.size, 1), ("cp", "tp"))
    cp_model = ContextParallelModel(dense_model(args), mesh, tracer.wrap(mesh["cp"], "cp"),
                                    args)
    model = DDP(cp_model, tracer.wrap(pg, "dp"))

    started = time.perf_counter()
    losses, samples = train(model, cp_model, args, pg.rank, tracer)
    summary = {"wall_s": time.perf_counter() - started, "final_loss": losses[-1],
               "samples": samples}
    print_summary(pg.rank, example="cp", backend=pg.backend, world_size=pg.size,
                  epochs=args.epochs, final_acc=accuracy(model, args), **summary)
    tracer.write(pg, args.trace)
    mesh.close()
    pg.close()


if __name__ == "__main__":
    launch(main, ARGS)
