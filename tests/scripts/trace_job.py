"""A job for tests/test_trace.py, run as ``python tests/scripts/trace_job.py MODE NPROC``
with ``COLLECTIVES_TRACE`` and ``COLLECTIVES_FLIGHT_DIR`` set by the test.

``collectives``: every rank runs a few collectives (a span around them, an async one, a
sub-group's broadcast, point to point) and leaves. ``hang``: rank 1 writes its pid to
``$TRACE_JOB_PID_FILE`` and waits in an all_reduce that rank 0 never joins (rank 0
sleeps), until the test signals rank 1. ``peer_dies``: rank 1 raises after one
all_reduce while rank 0 waits in the next.
"""

import os
import sys
import time

import numpy as np

import collectives
from collectives import trace


def collectives_only() -> None:
    pg = collectives.init_process_group()
    t = np.ones(1024, np.float32)
    for step in range(3):
        with trace.span("step", step=step):
            pg.all_reduce(t)
            pg.all_reduce(t, async_op=True).wait()
    half = pg.new_group([r for r in range(pg.size) if r % 2 == pg.rank % 2])
    half.broadcast(t, src=0)
    if pg.rank % 2 == 0 and pg.rank + 1 < pg.size:
        pg.send(t, dst=pg.rank + 1)
    elif pg.rank % 2 == 1:
        pg.recv(t, src=pg.rank - 1)
    pg.barrier()
    pg.close()


def hang() -> None:
    pg = collectives.init_process_group()
    t = np.ones(16, np.float32)
    pg.all_reduce(t)                       # seq 1 (seq 0: the trace's clock mark)
    if pg.rank == 1:
        with open(os.environ["TRACE_JOB_PID_FILE"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.environ["TRACE_JOB_PID_FILE"] + ".tmp",
                   os.environ["TRACE_JOB_PID_FILE"])
        pg.all_reduce(t)                   # never joined: SIGTERM ends it
    else:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # stopped by the launcher once rank 1 dies
            time.sleep(0.05)
    pg.close()


def peer_dies() -> None:
    pg = collectives.init_process_group()
    t = np.ones(16, np.float32)
    pg.all_reduce(t)
    if pg.rank == 1:
        raise RuntimeError("rank 1 gives up")
    pg.all_reduce(t)                       # its peer is gone: PeerError, or the SIGTERM
    pg.close()


if __name__ == "__main__":
    mode, nproc = sys.argv[1], int(sys.argv[2])
    fn = {"collectives": collectives_only, "hang": hang, "peer_dies": peer_dies}[mode]
    collectives.spawn(fn, nproc, timeout=120)
