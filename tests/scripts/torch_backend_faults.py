"""Fault jobs of ``tests/test_torch_backend.py``: a rank of a 3-rank "collectives" job dies
or goes silent, and what torch's callers in the others see.

    python tests/scripts/torch_backend_faults.py kill       # one process per rank: RANK,
    python tests/scripts/torch_backend_faults.py hang       # WORLD_SIZE=3, MASTER_ADDR/PORT
    python tests/scripts/torch_backend_faults.py kill_ddp   # and COLLECTIVES_BACKEND from env

Each rank prints one JSON line ``{"rank": r, ...}`` (rank 2 of ``kill`` prints nothing).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_backend_job import _batch, build_mlp, init  # noqa: E402


def kill_job(hang: bool = False, ddp: bool = False) -> dict:
    """Rank 2 SIGKILLs itself after three all_reduces (``hang``: stops calling, past the
    group timeout of 2 s, until the others timed out; ``ddp``: after three steps of
    torch's DDP, which the others then go on training); the others keep calling."""
    init(seconds=60.0, group_timeout=2.0 if hang else None)
    rank = dist.get_rank()
    t = torch.ones(1000)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(build_mlp(0))

        def call() -> None:
            x, y = _batch(0, rank, 3)
            F.cross_entropy(model(x), y).backward()
    else:
        def call() -> None:
            dist.all_reduce(t)
    for _ in range(3):
        call()
    if rank == 2:
        if not hang:
            os.kill(os.getpid(), signal.SIGKILL)
        # Silent until both others timed out (they say so in torch's store), 6 s at most.
        store = dist.distributed_c10d._get_default_store()
        try:
            store.wait(["timed_out/0", "timed_out/1"], datetime.timedelta(seconds=6))
        except Exception:  # noqa: BLE001 - the others failed otherwise: the test says how
            pass
        return {"rank": rank}
    start = time.monotonic()
    report = {"rank": rank, "error": None}
    try:
        for _ in range(100000):
            call()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report.update(_describe(exc), elapsed_s=time.monotonic() - start)
    if hang:
        dist.distributed_c10d._get_default_store().set(f"timed_out/{rank}", "1")
    if ddp:  # then a plain collective on the broken group: torch.distributed's own error
        try:
            dist.all_reduce(t)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report["after"] = _describe(exc)
    return report


def _describe(exc: BaseException) -> dict:
    cause = exc.__cause__
    return {"type": type(exc).__name__, "message": str(exc),
            "is_dist_backend_error": isinstance(exc, dist.DistBackendError),
            "cause": type(cause).__name__ if cause else None,
            "peer": getattr(exc, "peer", None), "op": getattr(exc, "op", None),
            "seq": getattr(exc, "seq", None), "missing": getattr(exc, "missing", None)}


if __name__ == "__main__":
    job = {"kill": kill_job, "hang": lambda: kill_job(hang=True),
           "kill_ddp": lambda: kill_job(ddp=True)}[sys.argv[1]]
    print(json.dumps(job()), flush=True)
