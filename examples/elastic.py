"""MNIST training that survives a SIGKILL of any rank at any moment (rank 0 included),
with parallel.ft: a coordinator in this launcher, a Manager per rank, FaultTolerantDDP.

    python examples/elastic.py                                # 2 ranks, shared memory
    python examples/elastic.py --backend zmq --nproc 4        # then: kill -9 <a rank's pid>
    python examples/elastic.py --nproc 4 --respawn            # a replacement heals and joins

Every step trains on one global batch (--batch-size x --nproc samples, the next ones of
the epoch's order), split among that step's participants; a step counts only when every
participant's gradient all_reduce succeeded (the coordinator decides, the same for all),
so no sample is lost or seen twice and the live replicas stay bitwise equal. When a
rank dies the others re-form their group without it; with --respawn the launcher starts
a replacement, which receives the model and optimizer state from a live replica before
it contributes. This launcher (not a rank) prints the summary, whichever rank died; it
adds failures, recoveries, world_size_final, steps_committed, steps_skipped and
replicas_equal (every finished replica's parameters hashed, all equal). Every rank
process is started (executed, not forked) with RANK, LOCAL_RANK and WORLD_SIZE in its
environment, so a chaos tool finds rank k among this launcher's children by
/proc/PID/environ; each is also named coll-rank<k> (ps -o comm, pgrep -x coll-rank2).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives import settings  # noqa: E402
from collectives.cli_flags import add_flag, positive_int, seconds  # noqa: E402
from examples.common.cli import parse_args, print_summary  # noqa: E402


def _options(p):
    p.add_argument("--respawn", action="store_true",
                   help="start a replacement for every rank that dies; it heals and joins")
    p.add_argument("--min-replicas", type=positive_int, default=1,
                   help="fewest replicas a step may run with (default: %(default)s)")
    add_flag(p, "--timeout", default=5.0,
             help="seconds a collective may wait (a stopped rank costs this long)")
    p.add_argument("--heartbeat-timeout", type=seconds, default=2.0,
                   help="seconds of silence after which the coordinator drops a replica "
                        "(default: %(default)s)")


def _regroupable_backend(args) -> None:
    """ValueError unless --backend can re-form a group."""
    if args.backend not in (None, "shm", "zmq", "gloo", "collectives"):
        raise ValueError(f"argument --backend: {args.backend} cannot re-form a group; "
                         f"use shm, zmq, gloo or collectives")


if __name__ == "__main__":   # parse first: a bad flag is refused before torch loads
    # The launcher executes its ranks (RANK in their real environment) instead of forking
    # them from the warm fork server, so parse_args need not start one.
    os.environ.setdefault(settings.START_METHOD.name, "spawn")
    ARGS = parse_args("elastic", epochs=5, batch_size=32, lr=0.05, description=__doc__,
                      extra=_options, validate=_regroupable_backend)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common.elastic_launcher import run_elastic  # noqa: E402
from examples.common.harness import build_mlp  # noqa: E402
from examples.common.mnist import load_mnist  # noqa: E402
from parallel.ft import FaultTolerantDDP, Manager  # noqa: E402


def main(args):
    """One replica: train until the job's last step is committed; return what the
    launcher's summary needs."""
    torch.set_num_threads(1)
    x_train, y_train = map(torch.from_numpy, load_mnist(args.data_dir, "train"))
    x_test, y_test = map(torch.from_numpy, load_mnist(args.data_dir, "test"))
    model = build_mlp(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    # (tests/ft_phases.py passes a hook that logs each phase and may linger in one,
    # so that a fault injected from outside lands there)
    hook = getattr(args, "phase_hook", None) or (lambda phase, manager, model: None)
    manager = Manager(state_dict=state_dict, load_state_dict=load_state_dict,
                      backend=args.backend, timeout=args.timeout,
                      on_phase=lambda phase, m: hook(phase, m, model))
    ddp = FaultTolerantDDP(model, manager, dataset_size=len(x_train),
                           global_batch=args.batch_size * args.nproc, seed=args.seed)
    total_steps = args.epochs * ddp.steps_per_epoch
    start = time.perf_counter()
    loss_sum = torch.zeros(2, dtype=torch.float64)
    first_contribution = None
    while manager.step < total_steps:
        hook("before_step", manager, model)
        if not manager.start_step():
            break
        idx = torch.from_numpy(ddp.local_indices())
        opt.zero_grad(set_to_none=True)
        loss = None
        if len(idx):
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx], reduction="sum")
            (loss * ddp.loss_scale()).backward()
        hook("before_all_reduce", manager, model)
        ddp.sync_gradients()
        hook("before_commit", manager, model)
        if manager.should_commit():
            opt.step()
            hook("committed", manager, model)
            if first_contribution is None:
                first_contribution = time.time()
            if loss is not None and ddp.epoch == args.epochs - 1:
                loss_sum += torch.tensor([loss.item(), len(idx)], dtype=torch.float64)
    wall_s = time.perf_counter() - start
    finished = manager.step >= total_steps
    world_size_final = manager.size
    manager.close(finished=finished)
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    return {"rank_env": int(os.environ.get("RANK", "0")), "pid": os.getpid(),
            "finished": finished,
            "step": manager.step, "world_size_final": world_size_final, "wall_s": wall_s,
            "final_acc": acc, "loss": loss_sum.tolist(), "stats": manager.stats,
            "digest": manager.digest(model.parameters()),
            "first_contribution": first_contribution,
            "samples": manager.step * args.batch_size * args.nproc}


def summarize(args, outcome) -> int:
    """Print the closing JSON line from the launcher; the exit status."""
    for error in outcome.errors:
        print(f"examples/elastic.py: {error}", file=sys.stderr, flush=True)
    done = [r for r in outcome.results if r["finished"]]
    if not done:
        print("examples/elastic.py: no replica trained to the end", file=sys.stderr)
        return 1
    first = done[0]
    commits = [h for h in outcome.history if h["event"] == "commit"]
    skips = [h for h in outcome.history if h["event"] == "skip"]
    recoveries = sum(1 for _, _, t in outcome.deaths if any(c["time"] > t for c in commits))
    loss = torch.tensor([r["loss"] for r in done], dtype=torch.float64).sum(0)
    equal = len({r["digest"] for r in done}) == 1
    print_summary(0, example="elastic", backend=args.backend or "shm",
                  world_size=args.nproc, epochs=args.epochs,
                  wall_s=max(r["wall_s"] for r in done), samples=first["samples"],
                  final_loss=(loss[0] / max(loss[1], 1)).item(),
                  final_acc=first["final_acc"],
                  extra={"failures": len(outcome.deaths), "recoveries": recoveries,
                         "world_size_final": first["world_size_final"],
                         "steps_committed": len(commits), "steps_skipped": len(skips),
                         "replicas_equal": equal})
    return 0 if equal and not outcome.errors else 1


if __name__ == "__main__":
    outcome = run_elastic(main, ARGS, nproc=ARGS.nproc, backend=ARGS.backend,
                          respawn=ARGS.respawn, min_replicas=ARGS.min_replicas,
                          heartbeat_timeout=ARGS.heartbeat_timeout, group_timeout=ARGS.timeout)
    sys.exit(summarize(ARGS, outcome))
