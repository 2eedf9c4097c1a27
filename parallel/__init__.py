"""Training strategies written once, against :class:`collectives.ProcessGroup` only.

This package imports ``collectives`` and ``torch``; never a backend, ``mpi4py``, ``zmq``
or ``torch.distributed``.
"""

from .bucket import Bucket, assign_buckets
from .ddp import DDP, DistributedDataParallel
from .sampler import ShardSampler

__all__ = ["DDP", "Bucket", "DistributedDataParallel", "ShardSampler", "assign_buckets"]

from . import pp  # noqa: E402  pipeline parallelism: parallel.pp.PipelineStage, Schedule1F1B, ...

__all__ += ["pp"]
