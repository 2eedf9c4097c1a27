"""torch.distributed's own transports as backends of this library: ``gloo`` (CPU, TCP),
``nccl`` (CUDA tensors on ``cuda:LOCAL_RANK``) and ``torch`` (``nccl`` where CUDA and
NCCL are usable, ``gloo`` otherwise); and ``collectives``, this library's group driven
through torch.distributed's ``"collectives"`` backend (:mod:`collectives.torch_backend`).

Modules: :mod:`~backends.torchdist.backend` (:class:`TorchBackend`, gloo, and how every
torch backend works), :mod:`~backends.torchdist.nccl` (:class:`NcclBackend` and the
``nccl``/``torch`` factories), :mod:`~backends.torchdist.bridge` (``collectives``; not
imported here, since it registers torch's ``"collectives"`` backend on import),
:mod:`~backends.torchdist.work` (one operation's torch works),
:mod:`~backends.torchdist.failures` (what went wrong, as this library's errors),
:mod:`~backends.torchdist.tensors` (arguments as tensors, c10d options, tags),
:mod:`~backends.torchdist.meeting` (the store the groups of a job meet through).
"""

from .backend import TorchBackend, TorchWork, create_gloo

__all__ = ["TorchBackend", "TorchWork", "create_gloo"]
