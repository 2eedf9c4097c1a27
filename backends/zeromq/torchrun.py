"""A rendezvous port of zmq's own under torchrun, whose agent already listens at MASTER_PORT.

Since torch 2.4 torchrun's agent serves its ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` for
the whole job and tells the workers so (``TORCHELASTIC_USE_AGENT_STORE=True``): rank 0 of
the zmq backend cannot listen there. Instead rank 0 draws a free port on its own host
(``MASTER_ADDR`` names rank 0's host under torchrun, on one host or several) and publishes
it in the agent's store; the other ranks read it there. The key holds the restart count,
the job and the number of zmq worlds this process opened at that store before, so every
world of every restart meets at a port of its own, and all ranks agree on it without
talking (they open their worlds in the same order).

Two ranks under ``torchrun --nproc-per-node 2``::

    rdzv = detect_rendezvous()            # master_port: the agent's store
    rdzv = own_port(rdzv, os.environ, 60.0)
    rdzv.master_port                       # the port rank 0 will listen at, on both ranks
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any, Mapping

from collectives.errors import CollectiveTimeout, PeerError
from collectives.errors import where as _where

_KEY = "collectives/zmq/"
_counts: dict[tuple, int] = {}
_counts_lock = threading.Lock()


def agent_holds_port(rdzv: Any, env: Mapping[str, str]) -> bool:
    """Whether ``rdzv``'s meeting point is torchrun's agent store (not a port of ours: the
    ``"collectives"`` torch backend and regrouped generations bring their own)."""
    return (rdzv.launcher == "torchrun" and rdzv.generation == 0
            and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and rdzv.master_port is not None
            and str(rdzv.master_port) == env.get("MASTER_PORT", "").strip())


def own_port(rdzv: Any, env: Mapping[str, str], timeout: float) -> Any:
    """``rdzv`` with ``master_port`` replaced by a port rank 0 drew and published in the
    agent's store (waiting at most ``timeout`` seconds for it); ``rdzv`` unchanged when the
    agent does not hold MASTER_PORT (:func:`agent_holds_port`)."""
    if not agent_holds_port(rdzv, env):
        return rdzv
    import torch.distributed as dist   # torchrun: torch is there
    from backends.torchdist.meeting import first_line
    from collectives.spawn import free_port

    where = _where(rdzv.rank, rdzv.world_size, "zmq init")
    addr, port = rdzv.master_addr or "127.0.0.1", int(rdzv.master_port)
    counted = (addr, port, rdzv.rank)   # (the rank: worlds of threads in one process)
    with _counts_lock:
        count = _counts.get(counted, 0)
        _counts[counted] = count + 1
    key = (f"{_KEY}{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rdzv.job_id}/"
           f"world{count}/port")
    try:
        store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        if rdzv.rank == 0:
            store.set(key, str(free_port(addr)))
        chosen = int(store.get(key))   # waits for rank 0, at most `timeout`
    except RuntimeError as exc:
        text = first_line(exc)
        if "timeout" in text.lower() or "timed out" in text.lower():
            raise CollectiveTimeout(f"{where}: rank 0 did not publish its rendezvous port in "
                                    f"torchrun's store at {addr}:{port} within {timeout:g} s",
                                    op="init", missing=[0]) from exc
        raise PeerError(f"{where}: cannot reach torchrun's store at {addr}:{port} "
                        f"(MASTER_ADDR:MASTER_PORT): {text}") from exc
    return dataclasses.replace(rdzv, master_port=chosen)
