"""Training strategies written once, against :class:`collectives.ProcessGroup` only.

This package imports ``collectives`` and ``torch``; never a backend, ``mpi4py``, ``zmq``
or ``torch.distributed``.
"""

from .bucket import Bucket, assign_buckets
from .ddp import DDP, DistributedDataParallel
from .sampler import ShardSampler
from . import tp  # parallel.tp: tensor parallelism, a package

__all__ = ["DDP", "Bucket", "DistributedDataParallel", "ShardSampler", "assign_buckets"]
__all__ += ["tp"]
