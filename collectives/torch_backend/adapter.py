"""``ProcessGroupCollectives``: torch's backend methods, written once over our ProcessGroup.

torch calls a backend with lists of tensors and option structs (``AllreduceOptions``:
``reduceOp``, ``asyncOp``; ``BroadcastOptions``: ``rootRank``; ...). Each method here
checks the torch-side structure (list lengths, equal sizes), maps the options to our
arguments and queues the call on the group's :class:`~.work.Runner`; the transport (shm,
zmq, mpi, ...) is whatever our group is, so nothing here is per transport.

Both names torch uses for a method are provided (``_allgather_base`` and
``all_gather_single``, ``alltoall_base`` and ``all_to_all_single``, ...): Python callers
use one, the C++ callers of functional collectives the other.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..group import ProcessGroup as OurGroup
from ..reduce_op import ReduceOp
from .errors import translate
from .work import CollectiveWork, PointToPointWork, Runner

__all__ = ["BACKEND_NAME", "ProcessGroupCollectives"]

#: The name torch knows the backend by: ``dist.init_process_group("collectives")``.
BACKEND_NAME = "collectives"

_OURS = {op.name: op for op in ReduceOp}


class ProcessGroupCollectives(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` that runs every call on our ``group``.

    Built by ``dist.init_process_group("collectives", ...)`` and ``dist.new_group``; use
    it through ``torch.distributed`` as any other group. Two ranks::

        import torch, torch.distributed as dist, collectives.torch_backend
        dist.init_process_group("collectives", rank=rank, world_size=2)
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t)                      # tensor([3., 3., 3.]) on both
        dist.get_backend()                      # 'collectives'
        dist.group.WORLD.transport              # 'shm' (COLLECTIVES_BACKEND)
        dist.destroy_process_group()
    """

    def __init__(self, group: OurGroup, transport: str) -> None:
        super().__init__(group.rank, group.size)
        #: Our ProcessGroup underneath (the one the collectives run on).
        self.group = group
        #: The transport's registry name (``"shm"``, ``"zmq"``, ``"mpi"``, ...).
        self.transport = transport
        self._runner = Runner(f"{transport}-r{group.rank}", self._translate,
                              abort=lambda: group.abort("the process is exiting"))
        self._on_shutdown: list[Callable[[], None]] = []
        self._group_name = ""
        self._group_desc = ""
        #: How many times torch called each backend method (what a wrapper uses).
        self.calls: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------- identity
    # torch keeps a group's name in its C++ backends; a Python group keeps its own (the
    # name is how DeviceMesh and the functional collectives find the group).
    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return (f"<ProcessGroupCollectives transport={self.transport} "
                f"rank={self.group.rank}/{self.group.size}>")

    def _where(self, op: str) -> str:
        return f"[collectives backend, rank {self.group.rank}/{self.group.size}] {op}"

    def _translate(self, exc: BaseException, op: str) -> BaseException:
        return translate(exc, op=op, rank=self.group.rank, size=self.group.size)

    def _submit(self, op: str, fn: Callable[[], None], result: Any,
                opts: Any) -> CollectiveWork:
        blocking = opts is not None and getattr(opts, "asyncOp", True) is False
        self.calls[op] += 1
        return self._runner.submit(op, fn, result, blocking)

    def run_on_group_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in order with this group's collectives; return its result."""
        out: list = []
        self._runner.submit("run", lambda: out.append(fn()), None, True).wait()
        return out[0]

    # ------------------------------------------------------------- argument helpers
    def _tensors(self, tensors: Any, op: str, arg: str = "tensors") -> list:
        if isinstance(tensors, torch.Tensor):
            return [tensors]
        if isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor)
                                                      for t in tensors):
            return list(tensors)
        raise TypeError(f"{self._where(op)}: argument `{arg}` must be a list of "
                        f"torch.Tensor, got {type(tensors).__name__}")

    def _lists(self, lists: Any, op: str, arg: str) -> list:
        if not isinstance(lists, (list, tuple)):
            raise TypeError(f"{self._where(op)}: argument `{arg}` must be a list of lists "
                            f"of tensors, got {type(lists).__name__}")
        return [self._tensors(x, op, arg) for x in lists]

    def _parts(self, parts: list, like: torch.Tensor, op: str, arg: str) -> None:
        """``parts`` must be one tensor per rank, each with ``like``'s size and dtype."""
        size = self.group.size
        if len(parts) != size:
            raise ValueError(f"{self._where(op)}: `{arg}` holds {len(parts)} tensors, "
                             f"expected one per rank ({size})")
        for i, p in enumerate(parts):
            if p.numel() != like.numel() or p.dtype != like.dtype:
                raise ValueError(
                    f"{self._where(op)}: `{arg}[{i}]` has {p.numel()} elements of "
                    f"{p.dtype}, expected {like.numel()} of {like.dtype} (uneven sizes "
                    f"are not supported)")

    def _reduce_op(self, opts: Any, op: str) -> ReduceOp:
        red = getattr(opts, "reduceOp", None)
        if red is None:
            return ReduceOp.SUM
        kind = getattr(red, "op", red)  # a torch ReduceOp holds its RedOpType in .op
        name = getattr(kind, "name", str(kind))
        if name not in _OURS:
            raise ValueError(f"{self._where(op)}: reduce op {name} is not supported "
                             f"(supported: {', '.join(_OURS)})")
        return _OURS[name]

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    @staticmethod
    def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n

    # ----------------------------------------------------------------- collectives
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = self._tensors(tensors, "allreduce")
        op = self._reduce_op(opts, "allreduce")
        return self._submit("allreduce", lambda: [self.group.all_reduce(t, op)
                                                  for t in tensors], tensors, opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        """One all_reduce per dtype and device over the tensors flattened together."""
        tensors = self._tensors(tensors, "allreduce_coalesced")
        op = self._reduce_op(opts, "allreduce_coalesced")

        def run() -> None:
            groups: dict = {}
            for t in tensors:
                groups.setdefault((t.dtype, t.device), []).append(t)
            for same in groups.values():
                if len(same) == 1:
                    self.group.all_reduce(same[0], op)
                    continue
                flat = self._flat(same)
                self.group.all_reduce(flat, op)
                self._unflatten(flat, same)
        return self._submit("allreduce_coalesced", run, tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = self._tensors(tensors, "broadcast")
        root = getattr(opts, "rootRank", 0)
        return self._submit("broadcast", lambda: [self.group.broadcast(t, root)
                                                  for t in tensors], tensors, opts)

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = self._tensors(tensors, "reduce")
        op, root = self._reduce_op(opts, "reduce"), getattr(opts, "rootRank", 0)
        return self._submit("reduce", lambda: [self.group.reduce(t, root, op)
                                               for t in tensors], tensors, opts)

    def allgather(self, output_tensors: Any, input_tensors: Any,
                  opts: Any = None) -> dist.Work:
        outs = self._lists(output_tensors, "allgather", "output_tensors")
        ins = self._tensors(input_tensors, "allgather", "input_tensors")
        if len(outs) != len(ins):
            raise ValueError(f"{self._where('allgather')}: {len(outs)} output lists for "
                             f"{len(ins)} inputs")
        for parts, inp in zip(outs, ins):
            self._parts(parts, inp, "allgather", "output_tensors")

        def run() -> None:
            for parts, inp in zip(outs, ins):
                flat = torch.empty(self.group.size * inp.numel(), dtype=inp.dtype,
                                   device=inp.device)
                self.group.all_gather(flat, inp)
                self._unflatten(flat, parts)
        return self._submit("allgather", run, outs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        return self._submit("all_gather_single",
                            lambda: self.group.all_gather(output, input), [output], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any,
                                    opts: Any = None) -> dist.Work:
        outputs = self._tensors(outputs, "all_gather_single_coalesced", "outputs")
        inputs = self._tensors(inputs, "all_gather_single_coalesced", "inputs")
        return self._submit("all_gather_single_coalesced",
                            lambda: [self.group.all_gather(o, i)
                                     for o, i in zip(outputs, inputs)], outputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: Any, input_tensors: Any,
               opts: Any = None) -> dist.Work:
        ins = self._tensors(input_tensors, "gather", "input_tensors")
        root = getattr(opts, "rootRank", 0)
        outs = self._lists(output_tensors, "gather", "output_tensors")
        if self.group.rank == root:
            self._parts(outs[0] if outs else [], ins[0], "gather", "output_tensors")

        def run() -> None:
            inp = ins[0]
            if self.group.rank != root:
                self.group.gather(inp, None, root)
                return
            flat = torch.empty(self.group.size * inp.numel(), dtype=inp.dtype,
                               device=inp.device)
            self.group.gather(inp, flat, root)
            self._unflatten(flat, outs[0])
        return self._submit("gather", run, outs, opts)

    def scatter(self, output_tensors: Any, input_tensors: Any,
                opts: Any = None) -> dist.Work:
        outs = self._tensors(output_tensors, "scatter", "output_tensors")
        root = getattr(opts, "rootRank", 0)
        ins = self._lists(input_tensors, "scatter", "input_tensors")
        if self.group.rank == root:
            self._parts(ins[0] if ins else [], outs[0], "scatter", "input_tensors")
        flat = self._flat(ins[0]) if self.group.rank == root else None
        return self._submit("scatter", lambda: self.group.scatter(outs[0], flat, root),
                            outs, opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any,
                       opts: Any = None) -> dist.Work:
        outs = self._tensors(output_tensors, "reduce_scatter", "output_tensors")
        ins = self._lists(input_tensors, "reduce_scatter", "input_tensors")
        op = self._reduce_op(opts, "reduce_scatter")
        if len(outs) != len(ins):
            raise ValueError(f"{self._where('reduce_scatter')}: {len(outs)} outputs for "
                             f"{len(ins)} input lists")
        for out, parts in zip(outs, ins):
            self._parts(parts, out, "reduce_scatter", "input_tensors")
        return self._submit("reduce_scatter",
                            lambda: [self.group.reduce_scatter(out, self._flat(parts), op)
                                     for out, parts in zip(outs, ins)], outs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        op = self._reduce_op(opts, "reduce_scatter_single")
        return self._submit("reduce_scatter_single",
                            lambda: self.group.reduce_scatter(output, input, op),
                            [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> dist.Work:
        outputs = self._tensors(outputs, "reduce_scatter_single_coalesced", "outputs")
        inputs = self._tensors(inputs, "reduce_scatter_single_coalesced", "inputs")
        op = self._reduce_op(opts, "reduce_scatter_single_coalesced")
        return self._submit("reduce_scatter_single_coalesced",
                            lambda: [self.group.reduce_scatter(o, i, op)
                                     for o, i in zip(outputs, inputs)], outputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts: Any = None) -> dist.Work:
        out_splits = list(output_split_sizes) or None
        in_splits = list(input_split_sizes) or None
        return self._submit(
            "all_to_all_single",
            lambda: self.group.all_to_all(output, input, output_split_sizes=out_splits,
                                          input_split_sizes=in_splits), [output], opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: Any, input_tensors: Any,
                 opts: Any = None) -> dist.Work:
        outs = self._tensors(output_tensors, "alltoall", "output_tensors")
        ins = self._tensors(input_tensors, "alltoall", "input_tensors")
        for arg, parts in (("output_tensors", outs), ("input_tensors", ins)):
            if len(parts) != self.group.size:
                raise ValueError(f"{self._where('alltoall')}: `{arg}` holds {len(parts)} "
                                 f"tensors, expected one per rank ({self.group.size})")

        def run() -> None:
            flat_in = self._flat(ins)
            flat_out = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype,
                                   device=outs[0].device)
            self.group.all_to_all(flat_out, flat_in,
                                  output_split_sizes=[o.numel() for o in outs],
                                  input_split_sizes=[i.numel() for i in ins])
            self._unflatten(flat_out, outs)
        return self._submit("alltoall", run, outs, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._submit("barrier", self.group.barrier, None, opts)

    # ------------------------------------------------------------- point to point
    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        tensors = self._tensors(tensors, "send")
        if len(tensors) != 1:
            raise ValueError(f"{self._where('send')}: one tensor per send, got {len(tensors)}")
        self.calls["send"] += 1
        return PointToPointWork(self.group.isend(tensors[0], dstRank, tag), tensors, "send",
                                self._translate)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        tensors = self._tensors(tensors, "recv")
        if len(tensors) != 1:
            raise ValueError(f"{self._where('recv')}: one tensor per recv, got {len(tensors)}")
        self.calls["recv"] += 1
        return PointToPointWork(self.group.irecv(tensors[0], srcRank, tag), tensors, "recv",
                                self._translate)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        raise ValueError(f"{self._where('recv')}: a receive from any source (src=None) is "
                         f"not supported; name the source rank")

    # ------------------------------------------------------------------ coalescing
    def start_coalescing(self, device: Any) -> None:
        """Nothing to do: the calls inside run in order as they come."""

    def end_coalescing(self, device: Any) -> dist.Work:
        """A Work that completes when every call queued before it has."""
        return self._runner.submit("end_coalescing", lambda: None, None, False)

    # -------------------------------------------------------------------- lifetime
    def shutdown(self) -> None:
        """Finish queued calls, then close our group (``dist.destroy_process_group``)."""
        self._runner.close()
        callbacks, self._on_shutdown = self._on_shutdown, []
        for callback in callbacks:
            callback()
        self.group.close()

    def abort(self) -> None:
        """End the calls in flight and queued at once (our group's ``abort``: each fails
        with ``GroupAborted`` within a second, whatever the peers do), then shut down;
        ``shutdown`` alone would first wait for them, up to our group's timeout."""
        self.group.abort("the torch process group was aborted")
        self.shutdown()
