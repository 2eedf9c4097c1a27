"""The public collectives (mixed into :class:`~collectives.group.ProcessGroup`): each
checks its arguments, stages its tensors (``_to_host``) and hands the backend's hook
**flat** (1-D), C-contiguous arrays through ``_dispatch_collective`` (see
:mod:`collectives.hooks` for the contract every hook keeps).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .buffers import host_dtype
from .errors import CollectiveError
from .reduce_op import ReduceOp, check_reducible
from .work import Work

Tensor = Any  # torch.Tensor or numpy.ndarray


class CollectiveCalls:
    """``barrier``, ``broadcast``, ``all_reduce``, ``reduce``, ``all_gather``, ``gather``,
    ``scatter``, ``reduce_scatter``, ``all_to_all``."""

    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Return once every rank of the group called ``barrier``.

        Both ranks: ``pg.barrier()`` returns on each once the other called it too.
        """
        if self._fast and not async_op and not self._pending:   # (collectives.fast_path)
            if self._closed:
                raise CollectiveError(f"{self._where('barrier')}: the group is closed")
            self._run_numbered("barrier", self._barrier, (), None, None, -1, None)
            return None
        return self._dispatch_collective("barrier", self._barrier, [], async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, *, async_op: bool = False) -> Optional[Work]:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Both ranks: ``t = np.full(2, pg.rank, np.int64); pg.broadcast(t, src=1)`` ->
        ``[1, 1]`` everywhere.
        """
        if (self._fast and not async_op and not self._pending and type(src) is int
                and 0 <= src < self.size
                and self._fast_collective("broadcast", self._broadcast, tensor, src, src,
                                          None)):  # (collectives.fast_path)
            return None
        w = self._where("broadcast")
        self._check_tensor(tensor, "tensor", w)
        src = self._check_rank(src, "src", w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=self.rank != src)
        return self._dispatch_collective(
            "broadcast", lambda seq: self._broadcast(buf.array.reshape(-1), src, seq),
            [buf], async_op, buf.array.shape, buf.array.dtype, src)

    def all_reduce(self, tensor: Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks, in place; every rank gets bitwise-identical
        values.

        Both ranks: ``t = np.full(2, pg.rank + 1.0); pg.all_reduce(t)`` -> ``[3., 3.]``.
        """
        if (self._fast and not async_op and not self._pending and op is not None
                and self._fast_collective("all_reduce", self._all_reduce, tensor, op, -1,
                                          op)):  # (collectives.fast_path)
            return None
        w = self._where("all_reduce")
        self._check_tensor(tensor, "tensor", w)
        op = check_reducible(op, host_dtype(tensor), w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=True)
        return self._dispatch_collective(
            "all_reduce", lambda seq: self._all_reduce(buf.array.reshape(-1), op, seq),
            [buf], async_op, buf.array.shape, buf.array.dtype, -1, op)

    def reduce(self, tensor: Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks into ``tensor`` of rank ``dst``; the other
        ranks' tensors are left unchanged.

        Both ranks: ``t = np.full(2, pg.rank + 1.0); pg.reduce(t, dst=0)`` -> rank 0 holds
        ``[3., 3.]``, rank 1 still ``[2., 2.]``.
        """
        if (self._fast and not async_op and not self._pending and op is not None
                and type(dst) is int and 0 <= dst < self.size):   # (collectives.fast_path)
            found = self._host_views.lookup(tensor)
            if found is not None and id(op) in found[2]:
                if self._closed:
                    raise CollectiveError(f"{self._where('reduce')}: the group is closed")
                self._run_numbered("reduce", self._reduce, (found[0], dst, op), found[1],
                                   found[3], dst, op)
                return None
        w = self._where("reduce")
        self._check_tensor(tensor, "tensor", w)
        dst = self._check_rank(dst, "dst", w)
        op = check_reducible(op, host_dtype(tensor), w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=self.rank == dst)
        return self._dispatch_collective(
            "reduce", lambda seq: self._reduce(buf.array.reshape(-1), dst, op, seq),
            [buf], async_op, buf.array.shape, buf.array.dtype, dst, op)

    def all_gather(self, output: Tensor, input: Tensor, *,
                   async_op: bool = False) -> Optional[Work]:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` (size x input).

        Both ranks: ``out = np.empty(4); pg.all_gather(out, np.full(2, pg.rank * 1.0))`` ->
        ``[0, 0, 1, 1]``.
        """
        if self._fast and not async_op and not self._pending:   # (collectives.fast_path)
            pair = self._fast_pair("all_gather", output, input, None)
            if pair is not None:
                (out, *_), (inp, shape, _, dtype) = pair
                self._run_numbered("all_gather", self._all_gather, (out, inp), shape, dtype,
                                   -1, None)
                return None
        w = self._where("all_gather")
        self._check_tensor(output, "output", w)
        self._check_tensor(input, "input", w)
        self._check_same_dtype(output, input, ("output", "input"), w)
        self._check_multiple(output, input, ("output", "input"), w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "all_gather",
            lambda seq: self._all_gather(out.array.reshape(-1),
                                         inp.array.reshape(-1), seq),
            [out], async_op, inp.array.shape, inp.array.dtype)

    def gather(self, input: Tensor, output: Optional[Tensor] = None, dst: int = 0, *,
               async_op: bool = False) -> Optional[Work]:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` on rank ``dst``
        (``output`` is ignored, and may be None, elsewhere).

        Rank 0: ``pg.gather(np.zeros(2), out := np.empty(4), dst=0)``; rank 1:
        ``pg.gather(np.ones(2), None, dst=0)`` -> rank 0's out is ``[0, 0, 1, 1]``.
        """
        if (self._fast and not async_op and not self._pending
                and self._fast_rooted("gather", self._gather, input, output, dst)):
            return None   # (collectives.fast_path)
        w = self._where("gather")
        self._check_tensor(input, "input", w)
        dst = self._check_rank(dst, "dst", w)
        out = None
        if self.rank == dst:
            if output is None:
                raise ValueError(f"{w}: argument `output` must be given on the "
                                 f"destination rank {dst}")
            self._check_tensor(output, "output", w)
            self._check_same_dtype(output, input, ("output", "input"), w)
            self._check_multiple(output, input, ("output", "input"), w)
            out = self._to_host(output, where=w, arg="output", write=True)
        # staged after every check: a backend's _to_host may note what it staged
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "gather",
            lambda seq: self._gather(
                inp.array.reshape(-1),
                None if out is None else out.array.reshape(-1), dst, seq),
            [out] if out else [], async_op, inp.array.shape, inp.array.dtype,
            dst)

    def scatter(self, output: Tensor, input: Optional[Tensor] = None, src: int = 0, *,
                async_op: bool = False) -> Optional[Work]:
        """Split ``input`` of rank ``src`` into ``size`` equal parts along dim 0; rank i
        receives part i in ``output`` (``input`` is ignored, and may be None, elsewhere).

        Rank 0: ``pg.scatter(out := np.empty(2), np.arange(4.0), src=0)``; rank 1:
        ``pg.scatter(out := np.empty(2), None, src=0)`` -> ``[0, 1]`` and ``[2, 3]``.
        """
        if (self._fast and not async_op and not self._pending
                and self._fast_rooted("scatter", self._scatter, output, input, src)):
            return None   # (collectives.fast_path)
        w = self._where("scatter")
        self._check_tensor(output, "output", w)
        src = self._check_rank(src, "src", w)
        inp = None
        if self.rank == src:
            if input is None:
                raise ValueError(f"{w}: argument `input` must be given on the source rank {src}")
            self._check_tensor(input, "input", w)
            self._check_same_dtype(output, input, ("output", "input"), w)
            self._check_multiple(input, output, ("input", "output"), w)
            inp = self._to_host(input, where=w, arg="input", write=False)
        out = self._to_host(output, where=w, arg="output", write=True)
        return self._dispatch_collective(
            "scatter",
            lambda seq: self._scatter(
                out.array.reshape(-1),
                None if inp is None else inp.array.reshape(-1), src, seq),
            [out], async_op, out.array.shape, out.array.dtype, src)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = False) -> Optional[Work]:
        """Reduce ``input`` (size x output) over all ranks; rank i receives part i.

        Both ranks: ``pg.reduce_scatter(out := np.empty(1), np.array([1.0, 2.0]))`` ->
        rank 0 ``[2.]``, rank 1 ``[4.]``.
        """
        if (self._fast and not async_op and not self._pending
                and op is not None):   # (collectives.fast_path)
            pair = self._fast_pair("reduce_scatter", input, output, op)
            if pair is not None:
                (inp, *_), (out, shape, _, dtype) = pair
                self._run_numbered("reduce_scatter", self._reduce_scatter, (out, inp, op),
                                   shape, dtype, -1, op)
                return None
        w = self._where("reduce_scatter")
        self._check_tensor(output, "output", w)
        self._check_tensor(input, "input", w)
        self._check_same_dtype(output, input, ("output", "input"), w)
        op = check_reducible(op, host_dtype(input), w, "input")
        self._check_multiple(input, output, ("input", "output"), w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "reduce_scatter",
            lambda seq: self._reduce_scatter(out.array.reshape(-1),
                                             inp.array.reshape(-1), op, seq),
            [out], async_op, out.array.shape, out.array.dtype, -1, op)

    def all_to_all(self, output: Tensor, input: Tensor, *,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None,
                   async_op: bool = False) -> Optional[Work]:
        """Rank i sends part j of ``input`` (dim 0) to rank j, which stores it as part i of
        ``output``. Parts are equal unless split sizes (rows along dim 0) are given.

        Both ranks: ``pg.all_to_all(out := np.empty(2), np.array([10.0 * pg.rank, 10.0 * pg.rank + 1]))``
        -> rank 0 ``[0., 10.]``, rank 1 ``[1., 11.]``.
        """
        if (self._fast and not async_op and not self._pending and output_split_sizes is None
                and input_split_sizes is None
                and self._fast_even_all_to_all(output, input)):   # (collectives.fast_path)
            return None
        w = self._where("all_to_all")
        self._check_tensor(output, "output", w)
        self._check_tensor(input, "input", w)
        self._check_same_dtype(output, input, ("output", "input"), w)
        out_counts = self._split_counts(output, output_split_sizes, "output", w)
        in_counts = self._split_counts(input, input_split_sizes, "input", w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "all_to_all",
            lambda seq: self._all_to_all(out.array.reshape(-1),
                                         inp.array.reshape(-1),
                                         out_counts, in_counts, seq),
            [out], async_op, None, inp.array.dtype,
            counts=(out_counts, in_counts))
