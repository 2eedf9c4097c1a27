"""What the examples (ddp, fsdp, tp, pp, mesh, cp, moe) share beyond the command line: the
model, the traced training step, the progress bar and the test accuracy. The command
line, the launch and the closing JSON line are in ``examples.common.cli`` (no torch
there: the examples parse their arguments before importing torch).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["build_mlp", "progress", "sharded_accuracy", "traced_step"]


def traced_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor,
                tracer: Any) -> torch.Tensor:
    """One optimizer step on the cross-entropy of ``model(x)`` against ``y``, its forward,
    backward and step each a span of ``tracer`` (a ``collectives.trace.Tracer``); the loss."""
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


def progress(iterable: Iterable, rank: int, **kwargs: Any) -> Iterable:
    """A tqdm bar on standard error on rank 0 when standard error is a terminal; the bare
    iterable elsewhere, and where tqdm is not installed (it is the ``examples`` extra:
    ``pip install 'collectives[examples]'``)."""
    if rank != 0:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    # One bar in one process: a thread lock will do. tqdm's default also creates a
    # multiprocessing semaphore, which a rank stopped while exiting leaves behind.
    tqdm.set_lock(threading.RLock())
    # disable=None: no bar when stderr is a file or a pipe, whose log would otherwise
    # fill with the bar's carriage-return frames.
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False, disable=None,
                **kwargs)


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


