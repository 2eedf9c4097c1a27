"""The ``nccl`` backend, and ``torch``, which picks ``nccl`` or ``gloo``.

:class:`NcclBackend` is :class:`~backends.torchdist.TorchBackend` (rendezvous, stores, sub-groups,
collectives, errors, shutdown) over a c10d ``ProcessGroupNCCL`` on ``cuda:LOCAL_RANK``
instead of gloo; it only overrides what NCCL needs. Registry names: ``nccl``
(:func:`create_nccl`) and ``torch`` (:func:`create_auto`: ``nccl`` where CUDA and NCCL are
usable, ``gloo`` otherwise), registered as ``backends.torchdist.nccl:create_nccl`` and
``backends.torchdist.nccl:create_auto``.

NCCL tensors stay on the device: :meth:`NcclBackend.stage` hands the collectives CUDA tensors
(staging host or other-device arguments through ``cuda:LOCAL_RANK``), and waits block the
host (``TORCH_NCCL_BLOCKING_WAIT=1`` unless set) so ``Work.wait`` re-raises errors.
NCCL ignores send/recv tags: messages between a pair match in posting order.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from collectives.backend import Capabilities
from collectives.buffers import HostBuffer, to_host
from collectives.errors import where as _where
from collectives.launch import Rendezvous
from collectives.reduce_op import ReduceOp

from .tensors import ALLREDUCE_OPTS, TORCH_DTYPES, as_tensor
from .work import TorchWork
from .backend import TorchBackend, create_gloo

__all__ = ["NcclBackend", "create_nccl", "create_auto"]


class NcclBackend(TorchBackend):
    """A ProcessGroup over a c10d ``ProcessGroupNCCL`` on ``cuda:LOCAL_RANK``.

    The collective methods receive CUDA tensors on this device (see :meth:`stage`), so CUDA
    tensors go to NCCL without a trip through host memory. CPU tensors and numpy arrays are
    accepted too, staged through the device.
    """

    name = "nccl"
    capabilities = Capabilities(memory="device", returns_work=True, translates_errors=True)
    #: NCCL's reduce-scatter moves (n-1)/n of the data all_reduce does, and its waits
    #: are not watched (see `_exchange_pids`).
    native_reduce_scatter = True

    def regroup_refusal(self) -> str:
        return REGROUP_REFUSAL

    def __init__(self, rank: int, size: int, *, timeout: float, c10d: Any, store: Any,
                 prefix: str, device: torch.device) -> None:
        super().__init__(rank, size, timeout=timeout, c10d=c10d, store=store, prefix=prefix)
        self.device = device

    @classmethod
    def _make_c10d(cls, store: Any, rank: int, size: int, timeout: float,
                   device: Optional[torch.device] = None) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    @classmethod
    def _connect(cls, rendezvous: Rendezvous, timeout: float, **extra: Any) -> "TorchBackend":
        if not _nccl_usable():
            where = _where(rendezvous.rank, rendezvous.world_size, "init_process_group")
            raise RuntimeError(f"{where}: backend 'nccl' needs CUDA and a torch build with "
                               f"NCCL; use 'gloo' (or 'torch', which picks it)")
        device = torch.device("cuda", rendezvous.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # Work.wait() must block the host and raise NCCL's errors, as on every backend.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        return super()._connect(rendezvous, timeout, device=device)

    def _sub_group_extra(self) -> dict:
        return {"device": self.device}

    def stage(self, obj: Any, *, where: str, arg: str, write: bool) -> HostBuffer:
        """Device memory on ``self.device`` for argument ``arg``: the tensor itself when it
        is a contiguous CUDA tensor there, otherwise a device copy written back after the
        operation when ``write``."""
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            if obj.dtype not in TORCH_DTYPES:
                raise TypeError(f"{where}: argument `{arg}` has unsupported dtype {obj.dtype}")
            src = obj.detach()
            if src.device == self.device and src.is_contiguous() and not src.is_neg() \
                    and not src.is_conj():
                return HostBuffer(src)
            staged = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            staged.copy_(src)
            return HostBuffer(staged, (lambda d: src.copy_(d)) if write else None)
        host = to_host(obj, where=where, arg=arg, write=write)  # checks; host staging
        staged = as_tensor(host.array).to(self.device).reshape(host.array.shape)

        def writeback(d: torch.Tensor, host: HostBuffer = host) -> None:
            as_tensor(host.array).copy_(d.reshape(-1))  # device -> host, synchronous
            host.commit()

        return HostBuffer(staged, writeback if write else None)

    def barrier(self, seq: int) -> TorchWork:
        t = torch.zeros(1, device=self.device)
        return self._issue(self._c10d("barrier").allreduce([t], ALLREDUCE_OPTS[ReduceOp.SUM]),
                           "barrier", seq, keep=[t])


#: Why ``nccl`` does not declare ``Capabilities.regroups`` (what ``shrink``, ``grow``,
#: ``reform`` and ``join_group`` raise, as ``NotImplementedError``).
REGROUP_REFUSAL = (
    "the nccl backend cannot re-form a group (shrink, grow, join): after a peer dies, a "
    "NCCL communicator can hang in a kernel on the GPU until it is aborted "
    "(ncclCommAbort), and re-forming one without restarting the process (ncclCommShrink, "
    "or a new communicator after the abort) has not been built and tested here; use gloo "
    "(CPU) for elastic jobs")


def create_nccl(rendezvous: Rendezvous, timeout: float) -> TorchBackend:
    """The world group over NCCL on ``cuda:LOCAL_RANK`` (registry name ``nccl``)."""
    return NcclBackend._connect(rendezvous, timeout)


def create_auto(rendezvous: Rendezvous, timeout: float) -> TorchBackend:
    """``nccl`` where CUDA and NCCL are usable here, otherwise ``gloo`` (name ``torch``)."""
    return create_nccl(rendezvous, timeout) if _nccl_usable() else create_gloo(rendezvous, timeout)


def _nccl_usable() -> bool:
    return (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
            and torch.cuda.device_count() > 0)
