"""Our transports as a torch.distributed backend named ``"collectives"``.

Importing this module registers the backend; then torch's own wrappers (DDP, FSDP2,
pipelining, DTensor) run over shm, zmq or mpi by changing one string::

    import torch.distributed as dist
    import collectives.torch_backend                    # registers "collectives"

    dist.init_process_group("collectives", rank=rank, world_size=2)   # or under torchrun
    model = torch.nn.parallel.DistributedDataParallel(model)

The transport is ``COLLECTIVES_BACKEND`` (default ``shm``; ``hier`` where ``shm`` would
span several hosts), or ``pg_options=collectives.torch_backend.Options(transport="zmq")``.
This library's own backend ``collectives`` (:mod:`backends.torchdist.bridge`) drives its
ProcessGroup through this one, as ``gloo`` drives it through torch's gloo. CPU tensors,
and CUDA tensors staged through host memory. Communication failures reach the caller as
:class:`CollectivesBackendError` (a ``torch.distributed.DistBackendError``) with our
``CollectiveTimeout``/``PeerError``/``CollectiveMismatch`` as the cause.
"""

from __future__ import annotations

import torch.distributed as dist

from .adapter import BACKEND_NAME, ProcessGroupCollectives
from .errors import CollectivesBackendError
from .rendezvous import DEFAULT_TRANSPORT, Options, build_group, create_backend, transport_of

__all__ = ["BACKEND_NAME", "CollectivesBackendError", "DEFAULT_TRANSPORT", "Options",
           "ProcessGroupCollectives", "build_group", "create_backend", "register",
           "transport_of"]


def register() -> None:
    """Register the ``"collectives"`` backend with torch.distributed (done on import;
    calling it again does nothing)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True,
                                  devices=["cpu", "cuda"])


register()
