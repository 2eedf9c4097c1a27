"""Our transports as a torch.distributed backend named ``"collectives"``.

Importing this module registers the backend; then torch's own wrappers (DDP, FSDP2,
pipelining, DTensor) run over shm, zmq or mpi by changing one string::

    import torch.distributed as dist
    import collectives.torch_backend                    # registers "collectives"

    dist.init_process_group("collectives", rank=rank, world_size=2)   # or under torchrun
    model = torch.nn.parallel.DistributedDataParallel(model)

The transport is ``COLLECTIVES_BACKEND`` (default ``shm``), or
``pg_options=collectives.torch_backend.Options(transport="zmq")``. CPU tensors, and CUDA
tensors staged through host memory. Communication failures reach the caller as
:class:`CollectivesBackendError` (a ``torch.distributed.DistBackendError``) with our
``CollectiveTimeout``/``PeerError``/``CollectiveMismatch`` as the cause.
"""

from __future__ import annotations

import torch.distributed as dist

from .adapter import BACKEND_NAME, ProcessGroupCollectives
from .errors import CollectivesBackendError
from .rendezvous import DEFAULT_TRANSPORT, Options, create_backend

__all__ = ["BACKEND_NAME", "CollectivesBackendError", "DEFAULT_TRANSPORT", "Options",
           "ProcessGroupCollectives", "create_backend", "register"]


def register() -> None:
    """Register the ``"collectives"`` backend with torch.distributed (done on import;
    calling it again does nothing)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True,
                                  devices=["cpu", "cuda"])


register()
