"""The peers: the same ops through the raw libraries our backends wrap, as a user of each
would call them, for the ratio columns.

- ``mpi4py``: the upper-case (buffer) methods on a duplicate of ``MPI.COMM_WORLD``,
  ``MPI.IN_PLACE`` for all_reduce and the root of reduce (in place, as ours); an uneven
  all_to_all is ``Alltoallv`` with counts and displacements. Ranks are started by
  ``mpiexec``.
- ``torch-gloo``: ``torch.distributed`` with a ``gloo`` process group of its own
  (``init_process_group("gloo", init_method="tcp://...")``), on CPU tensors that share
  memory with the case's numpy buffers (``torch.from_numpy``: no copies); an uneven
  all_to_all is ``all_to_all_single`` with split sizes.

Nothing here imports this library's backends: the peers are what ours are measured
against. Both run under the loop of :mod:`collectives.bench.measure`.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import numpy as np

from .cases import ROOT, Case
from .measure import Unsupported

#: Peer names accepted by ``--peer``.
PEERS: tuple[str, ...] = ("mpi4py", "torch-gloo")


def missing_library(peer: str) -> Optional[str]:
    """Why ``peer`` cannot run here (a missing Python library), or None."""
    module = {"mpi4py": "mpi4py", "torch-gloo": "torch"}[peer]
    if importlib.util.find_spec(module) is None:
        extra = "pip install 'collectives[mpi]'" if peer == "mpi4py" else "pip install torch"
        return f"peer {peer} needs the Python package {module} ({extra})"
    return None


def unsupported_dtype(peer: str, dtype: str) -> Optional[str]:
    """Why ``peer`` cannot carry ``dtype``, or None."""
    if peer == "mpi4py" and dtype == "bfloat16":
        return "MPI has no bfloat16 datatype"
    return None


class Mpi4pyRunner:
    """Raw mpi4py on a duplicate of ``MPI.COMM_WORLD``."""

    impl = "mpi4py"

    def __init__(self) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def bind(self, case: Case) -> Callable[[], None]:
        why = unsupported_dtype(self.impl, case.dtype)
        if why:
            raise Unsupported(why)
        MPI, comm, send, recv = self.MPI, self.comm, case.send, case.recv
        root = self.rank == ROOT
        calls: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, recv, MPI.SUM),
            "reduce": (lambda: comm.Reduce(MPI.IN_PLACE, recv, MPI.SUM, root=ROOT)) if root
            else (lambda: comm.Reduce(recv, None, MPI.SUM, root=ROOT)),
            "broadcast": lambda: comm.Bcast(recv, root=ROOT),
            "all_gather": lambda: comm.Allgather(send, recv),
            "gather": lambda: comm.Gather(send, recv, root=ROOT),
            "scatter": lambda: comm.Scatter(send, recv, root=ROOT),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(send, recv, MPI.SUM),
            "all_to_all": lambda: comm.Alltoall(send, recv),
        }
        if case.splits is not None:
            # Counts and displacements in elements, made here rather than in the call.
            out_counts, in_counts = case.recv_splits, case.send_splits
            out_spec = [recv, (out_counts, _displacements(out_counts))]
            in_spec = [send, (in_counts, _displacements(in_counts))]
            return lambda: comm.Alltoallv(in_spec, out_spec)
        return calls[case.op]

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values, np.float64)
        self.comm.Allreduce(np.ascontiguousarray(values, np.float64), out, self.MPI.MAX)
        return out

    def sum_over_ranks(self, value: int) -> int:
        return int(self.comm.allreduce(int(value), self.MPI.SUM))

    def close(self) -> None:
        self.comm.Free()


def _displacements(counts: list) -> list:
    """Where each part starts: ``[0, c0, c0 + c1, ...]`` without the total."""
    return [int(d) for d in np.cumsum([0, *counts[:-1]])]


def _tensor(a: Optional[np.ndarray]) -> Any:
    """A torch tensor sharing ``a``'s memory (bfloat16 through an int16 view)."""
    import torch
    if a is None:
        return None
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class TorchGlooRunner:
    """Raw ``torch.distributed`` on a gloo group of its own, met at ``tcp://addr:port``."""

    impl = "torch-gloo"

    def __init__(self, rank: int, size: int, addr: str, port: int, timeout: float) -> None:
        import datetime

        import torch.distributed as dist
        self.dist = dist
        self.rank, self.size = rank, size
        wait = datetime.timedelta(seconds=timeout)
        # An explicit store: under torchrun a tcp:// init_method makes every rank a client
        # of the agent's store (TORCHELASTIC_USE_AGENT_STORE), and none would serve here.
        store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                timeout=wait)
        self.group = dist.group.WORLD
        # torch 2.13 renamed the flat-tensor collectives; older torch has only the old names.
        self._all_gather = getattr(dist, "all_gather_single", None) or \
            dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or \
            dist.reduce_scatter_tensor

    def bind(self, case: Case) -> Callable[[], None]:
        dist = self.dist
        send, recv = _tensor(case.send), _tensor(case.recv)
        root = self.rank == ROOT
        # gather/scatter take lists of per-rank tensors: views into the one buffer, made
        # once here rather than inside the timed call.
        parts = (lambda t: list(t.chunk(self.size)) if t is not None else None)
        calls: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: dist.all_reduce(recv),
            "reduce": lambda: dist.reduce(recv, dst=ROOT),
            "broadcast": lambda: dist.broadcast(recv, src=ROOT),
            "all_gather": lambda: self._all_gather(recv, send),
            "reduce_scatter": lambda: self._reduce_scatter(recv, send),
            "all_to_all": lambda: dist.all_to_all_single(recv, send),
        }
        if case.splits is not None:
            out_splits, in_splits = case.recv_splits, case.send_splits
            return lambda: dist.all_to_all_single(recv, send, output_split_sizes=out_splits,
                                                  input_split_sizes=in_splits)
        if case.op == "gather":
            out = parts(recv) if root else None
            return lambda: dist.gather(send, out, dst=ROOT)
        if case.op == "scatter":
            inp = parts(send) if root else None
            return lambda: dist.scatter(recv, inp, src=ROOT)
        return calls[case.op]

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        import torch
        t = torch.from_numpy(np.ascontiguousarray(values, np.float64).copy())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.numpy()

    def sum_over_ranks(self, value: int) -> int:
        import torch
        t = torch.tensor([int(value)], dtype=torch.int64)
        self.dist.all_reduce(t)
        return int(t[0])

    def close(self) -> None:
        self.dist.destroy_process_group()
