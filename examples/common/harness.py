"""What the examples (ddp, fsdp, tp, pp, mesh, cp, moe) share: the command line, the model, the
launch, the progress bar and the closing JSON line.

The contract every example keeps (the README's Quick start runs ``examples/ddp.py``)::

    python examples/NAME.py [--backend B] [--nproc N] [--epochs E] [--batch-size B]
                            [--data-dir D] [--seed S] [--lr LR] [--trace FILE]

Rank 0 shows a tqdm bar on standard error and prints, as the last line of standard
output, one JSON object: ``{"example", "backend", "world_size", "epochs", "wall_s",
"samples_per_s", "final_loss", "final_acc"}``. The other ranks print nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

import collectives

__all__ = ["SUMMARY_KEYS", "build_mlp", "launch", "parse_args", "print_summary", "progress",
           "traced_step"]

BACKENDS = ("shm", "zmq", "mpi", "gloo", "nccl")


def parse_args(example: str, argv: Optional[Sequence[str]] = None, *, epochs: int = 3,
               batch_size: int = 32, lr: float = 0.05, description: str = "",
               extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
               ) -> argparse.Namespace:
    """The examples' common options; each example passes its own defaults, and
    ``extra(parser)`` may add the example's own options.

    ``--backend`` defaults to the launcher's: ``mpi`` under mpirun, ``COLLECTIVES_BACKEND``
    when set, ``shm`` otherwise.
    """
    p = argparse.ArgumentParser(prog=f"examples/{example}.py", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, metavar="|".join(BACKENDS),
                   help="transport, or any registered backend's name (default: shm; mpi "
                        "when started by mpirun)")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn (default: %(default)s; ignored when started by "
                        "mpirun or torchrun)")
    p.add_argument("--epochs", type=int, default=epochs, help="default: %(default)s")
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help="samples per rank per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=lr,
                   help="SGD learning rate, momentum 0.9 (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="folder with the MNIST IDX files (default: the bundled subset)")
    p.add_argument("--seed", type=int, default=0,
                   help="model initialisation and data order (default: %(default)s)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write a Chrome trace (chrome://tracing, ui.perfetto.dev) of every "
                        "rank's steps and collectives to FILE")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    for name in ("nproc", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.example = example
    return args


def traced_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor,
                tracer: Any) -> torch.Tensor:
    """One optimizer step on the cross-entropy of ``model(x)`` against ``y``, its forward,
    backward and step each a span of ``tracer`` (examples/common/trace.py); the loss."""
    with tracer.span("forward"):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    with tracer.span("backward"):
        loss.backward()
    with tracer.span("step"):
        opt.step()
    return loss


def build_mlp(seed: int) -> nn.Module:
    """The MNIST MLP of the examples: 784-256-LayerNorm-ReLU-64-LayerNorm-ReLU-10,
    initialised from ``seed`` (the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(28 * 28, 256), nn.LayerNorm(256), nn.ReLU(),
            nn.Linear(256, 64), nn.LayerNorm(64), nn.ReLU(),
            nn.Linear(64, 10),
        )


def launch(main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """Run ``main(args)`` on every rank.

    Started by mpirun or torchrun, this process is one rank already: run ``main`` here.
    Started alone, spawn ``args.nproc`` ranks. ``main`` must be importable from a fresh
    interpreter: define it at the top level of the script and keep the script's own top
    level under ``if __name__ == "__main__":`` (spawned ranks import the script as
    ``__mp_main__``).

    Spawned ranks that fail end the process with status 1 after one report (the failing
    rank and its traceback, from :class:`collectives.SpawnError`); Ctrl-C (SIGINT) with
    130 and SIGTERM with 143, every rank stopped and the job's segments removed.
    """
    if collectives.detect_rendezvous().launcher != "single":
        _rank_entry(main, args)
        return
    # collectives.spawn stops every rank and removes the job's segments before it
    # raises; what is left to do here is to say what happened in a few lines, instead of
    # the parent's own traceback on top of the rank's.
    prog = f"examples/{args.example}.py"
    try:
        collectives.spawn(_rank_entry, args.nproc, args=(main, args), backend=args.backend)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every rank was stopped", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    except collectives.SpawnError as exc:  # the failing rank, its traceback, once
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def _rank_entry(main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """One rank: compute with ``OMP_NUM_THREADS`` threads (default 1), then run ``main``.

    One thread per rank makes N ranks use N cores, so that runs with different world sizes
    compare; torch's default, a thread per core in every rank, oversubscribes the cores,
    and its OpenMP threads then slow down by orders of magnitude. ``collectives.spawn``
    and torchrun already export ``OMP_NUM_THREADS=1``; mpirun does not, hence the default.
    """
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    main(args)


def progress(iterable: Iterable, rank: int, **kwargs: Any) -> Iterable:
    """A tqdm bar on standard error on rank 0; the bare iterable elsewhere."""
    if rank != 0:
        return iterable
    from tqdm import tqdm
    # One bar in one process: a thread lock will do. tqdm's default also creates a
    # multiprocessing semaphore, which a rank stopped while exiting leaves behind.
    tqdm.set_lock(threading.RLock())
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False, **kwargs)


def sharded_accuracy(model: Any, pg: Any, x_test: Any, y_test: Any) -> float:
    """Test accuracy of a data-parallel ``model`` (the same on every rank): rank r scores
    test images r, r+n, ..., and the counts are summed over ``pg``. A collective."""
    import torch
    model.eval()
    with torch.no_grad():
        mine = slice(pg.rank, None, pg.size)
        correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
        counts = torch.tensor([correct.item(), len(y_test[mine])], dtype=torch.int64)
    pg.all_reduce(counts)
    return (counts[0] / counts[1]).item()


#: The keys of the closing JSON line, in order.
SUMMARY_KEYS = ("example", "backend", "world_size", "epochs", "wall_s", "samples_per_s",
                "final_loss", "final_acc")


def print_summary(rank: int, *, example: str, backend: str, world_size: int, epochs: int,
                  wall_s: float, samples: int, final_loss: float, final_acc: float,
                  extra: Optional[dict] = None) -> None:
    """On rank 0, print the closing JSON line. ``wall_s`` is the training loop's time (start-up
    and evaluation excluded), ``samples`` the training samples all ranks processed in it;
    ``extra``: an example's own keys, after the common ones (examples/moe.py: the experts'
    load)."""
    if rank != 0:
        return
    line = dict(zip(SUMMARY_KEYS, (
        example, backend, world_size, epochs, round(wall_s, 3),
        round(samples / wall_s, 1) if wall_s > 0 else None,
        round(final_loss, 5), round(final_acc, 4))))
    line.update({k: v for k, v in (extra or {}).items() if k not in line})
    sys.stderr.flush()
    print(json.dumps(line), flush=True)
