"""Training strategies written once, against :class:`collectives.ProcessGroup` only.

This package imports ``collectives`` and ``torch``; never a backend, ``mpi4py``, ``zmq``
or ``torch.distributed``.
"""

from .bucket import Bucket, assign_buckets
from .ddp import DDP, DistributedDataParallel
from .fsdp import FSDP, FullyShardedDataParallel
from .mesh import DeviceMesh
from .sampler import ShardSampler
from . import tp  # parallel.tp: tensor parallelism, a package
from . import ep  # parallel.ep: expert parallelism (MoE), a package
from . import cp  # parallel.cp: context parallelism (ring attention), a package

from . import pp  # noqa: E402  pipeline parallelism: parallel.pp.PipelineStage, Schedule1F1B, ...

__all__ = ["DDP", "FSDP", "Bucket", "DistributedDataParallel", "FullyShardedDataParallel",
           "ShardSampler", "assign_buckets", "cp", "ep", "pp", "tp", "DeviceMesh"]
