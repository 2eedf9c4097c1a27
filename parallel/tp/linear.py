"""Column- and row-parallel linear layers (Megatron-LM, arXiv 1909.08053, section 3).

``nn.Linear`` computes ``y = x W^T + b`` with ``W`` of shape (out, in). Over a group of n
ranks:

- :class:`ColumnParallelLinear` splits the output features: rank r holds rows
  ``[r*out/n, (r+1)*out/n)`` of ``W`` and of ``b`` and computes that block of ``y``. Its
  input is replicated, so backward all-reduces dL/dx (``copy_to``).
- :class:`RowParallelLinear` splits the input features: rank r holds columns
  ``[r*in/n, (r+1)*in/n)`` of ``W``, takes the matching block of ``x`` and computes a partial
  ``y``; the partials are summed (``reduce_from``), then the whole bias is added once.

Column then row (an MLP, ``fc2(act(fc1(x)))``) needs no communication in between: the
column layer's output blocks are exactly the row layer's input blocks, and an elementwise
activation acts on blocks independently. The pair costs one all_reduce in forward (the row
layer's) and one in backward (the column layer's, on dL/dx; none where ``x`` needs no
gradient, as for the input data).

Sizes must split into equal blocks: an ``out_features`` (column) or ``in_features`` (row)
not divisible by the group size is a ``ValueError`` naming the layer, the size and the
group size.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .regions import block_size, check_group, copy_to, gather_from, reduce_from, scatter_to
from .regions import all_gather_along

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "dense_linear_init"]


def dense_linear_init(in_features: int, out_features: int, bias: bool,
                      generator: torch.Generator,
                      dtype: Optional[torch.dtype] = None) -> tuple:
    """The weight (out, in) and bias (out) that ``nn.Linear(in, out).reset_parameters()``
    draws, from ``generator`` instead of the global random state."""
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features, dtype=dtype).uniform_(-bound, bound, generator=generator)
    return weight, b


def _check_linear(linear: Any, where: str) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{where}.from_dense: argument `linear` must be a torch.nn.Linear, "
                        f"got {type(linear).__name__}")


def _check_size(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: argument `{name}` must be a positive int, got {value!r}")
    return value


def _shared_seed(group: Any, seed: Optional[int]) -> int:
    """``seed``, or one drawn by rank 0 from torch's global random state and broadcast."""
    if seed is not None:
        return seed
    mine = int(torch.randint(0, 2**62, ())) if group.rank == 0 else None
    return group.broadcast_object(mine, src=0) if group.size > 1 else mine


class _ParallelLinear(nn.Module):
    """What the two layers share: sizes, the group, parameters from blocks, errors."""

    #: The dimension of the dense weight (out, in) that this layer splits.
    split_dim: int = 0

    def __init__(self, in_features: int, out_features: int, group: Any, bias: bool = True,
                 *, seed: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        name = type(self).__name__
        check_group(group, name)
        _check_size(in_features, "in_features", name)
        _check_size(out_features, "out_features", name)
        self._setup(in_features, out_features, group)
        gen = torch.Generator().manual_seed(_shared_seed(group, seed))
        weight, b = dense_linear_init(in_features, out_features, bias, gen, dtype)
        self._take_blocks(weight, b)

    @classmethod
    def _from_dense(cls, linear: nn.Linear, group: Any) -> "_ParallelLinear":
        _check_linear(linear, cls.__name__)
        check_group(group, cls.__name__)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(linear.in_features, linear.out_features, group)
        layer._take_blocks(linear.weight.detach(),
                           None if linear.bias is None else linear.bias.detach())
        return layer

    def _setup(self, in_features: int, out_features: int, group: Any) -> None:
        self.in_features, self.out_features, self.group = in_features, out_features, group
        split = (out_features, "out_features") if self.split_dim == 0 else \
            (in_features, "in_features")
        self._block = block_size(split[0], group, type(self).__name__, split[1])
        self._where = f"[rank {group.rank}/{group.size}] {type(self).__name__}"

    def _take_blocks(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """Keep this rank's block of the dense ``weight`` (and ``bias``), as copies."""
        start = self.group.rank * self._block
        w = weight.narrow(self.split_dim, start, self._block)
        self.weight = nn.Parameter(w.clone(memory_format=torch.contiguous_format))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            b = bias.narrow(0, start, self._block) if self.split_dim == 0 else bias
            self.bias = nn.Parameter(b.clone())

    def _check_input(self, x: Any, features: int, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._where}: the input must be a torch.Tensor, got "
                            f"{type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(f"{self._where}: the input's last dim must be {features} "
                             f"({what}), got shape {tuple(x.shape)}")

    def to_dense(self) -> nn.Linear:
        """The whole layer as an ``nn.Linear``, on every rank (a collective: every rank of
        the group calls it). Its parameters are new tensors, not views of the blocks."""
        with torch.no_grad():
            weight = all_gather_along(self.weight.detach(), self.split_dim, self.group)
            bias = self.bias
            if bias is not None:
                bias = bias.detach()
                if self.split_dim == 0:
                    bias = all_gather_along(bias, 0, self.group)
        dense = nn.Linear(self.in_features, self.out_features, bias=bias is not None,
                          device="meta")
        dense.weight = nn.Parameter(weight.clone())
        if bias is not None:
            dense.bias = nn.Parameter(bias.clone())
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block={tuple(self.weight.shape)}, "
                f"group_size={self.group.size}")


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with its output features split over
    ``group``: rank r holds rows ``[r*out/n, (r+1)*out/n)`` of the dense weight as ``.weight``
    (shape (out/n, in)) and the same block of the bias as ``.bias``.

    The input is replicated (the same on every rank). The output is this rank's block of
    the dense output, shape (..., out/n), or with ``gather_output=True`` the whole output
    (..., out), gathered. The constructor is a collective unless ``seed`` is given: rank 0
    draws the seed of the dense initialisation (``nn.Linear``'s) and every rank keeps its
    block, so the layer equals one dense ``nn.Linear``.

    Two ranks, each with half of the output features:

    >>> import torch, collectives
    >>> from torch import nn
    >>> from parallel.tp import ColumnParallelLinear
    >>> def column():
    ...     pg = collectives.init_process_group()
    ...     torch.manual_seed(0)                              # the same dense layer on both
    ...     dense = nn.Linear(8, 4)
    ...     fc = ColumnParallelLinear.from_dense(dense, pg)   # .weight (2, 8): rank r's rows
    ...     x = torch.ones(3, 8)                              # the same input on both
    ...     h = fc(x)                                         # (3, 2): rank r's block
    ...     mine = dense(x)[:, 2 * pg.rank:2 * pg.rank + 2]
    ...     pg.close()
    ...     return tuple(fc.weight.shape), tuple(h.shape), torch.allclose(h, mine)
    >>> collectives.spawn(column, 2)
    [((2, 8), (3, 2), True), ((2, 8), (3, 2), True)]
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, group: Any, bias: bool = True,
                 gather_output: bool = False, *, seed: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, out_features, group, bias, seed=seed, dtype=dtype)
        self.gather_output = bool(gather_output)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: Any,
                   gather_output: bool = False) -> "ColumnParallelLinear":
        """This rank's block of rows of ``linear`` (the same layer on every rank; copied,
        no communication)."""
        layer = cls._from_dense(linear, group)
        layer.gather_output = bool(gather_output)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features, "in_features")
        x = copy_to(x, self.group)                      # (..., in), backward: all_reduce
        y = F.linear(x, self.weight, self.bias)     # (..., in) @ (in, out/n) -> (..., out/n)
        return gather_from(y, self.group) if self.gather_output else y   # (..., out)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with its input features split over
    ``group``: rank r holds columns ``[r*in/n, (r+1)*in/n)`` of the dense weight as
    ``.weight`` (shape (out, in/n)); ``.bias`` is the whole bias, the same on every rank,
    added once after the partial outputs are summed.

    With ``input_is_parallel=True`` (the default: after a :class:`ColumnParallelLinear`) the
    input is this rank's block of features, shape (..., in/n); with ``False`` it is the
    whole input (..., in) and the layer keeps its block. The output (..., out) is the dense
    output, bitwise the same on every rank. The constructor is a collective unless ``seed``
    is given (see :class:`ColumnParallelLinear`).

    Two ranks, after a :class:`ColumnParallelLinear`: the two layers equal the dense
    ones, on both ranks.

    >>> import torch, collectives
    >>> from torch import nn
    >>> from parallel.tp import ColumnParallelLinear, RowParallelLinear
    >>> def mlp():
    ...     pg = collectives.init_process_group()
    ...     torch.manual_seed(0)                              # the same dense layers on both
    ...     dense1, dense2 = nn.Linear(8, 4), nn.Linear(4, 2)
    ...     fc1 = ColumnParallelLinear.from_dense(dense1, pg)
    ...     fc2 = RowParallelLinear.from_dense(dense2, pg)    # .weight (2, 2): rank r's columns
    ...     x = torch.ones(3, 8)
    ...     y = fc2(fc1(x))                                   # (3, 2), the same on both
    ...     dense = dense2(dense1(x))
    ...     pg.close()
    ...     return tuple(fc2.weight.shape), tuple(y.shape), torch.allclose(y, dense, atol=1e-6)
    >>> collectives.spawn(mlp, 2)
    [((2, 2), (3, 2), True), ((2, 2), (3, 2), True)]
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, group: Any, bias: bool = True,
                 input_is_parallel: bool = True, *, seed: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, out_features, group, bias, seed=seed, dtype=dtype)
        self.input_is_parallel = bool(input_is_parallel)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: Any,
                   input_is_parallel: bool = True) -> "RowParallelLinear":
        """This rank's block of columns of ``linear`` and its whole bias (the same layer on
        every rank; copied, no communication)."""
        layer = cls._from_dense(linear, group)
        layer.input_is_parallel = bool(input_is_parallel)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            self._check_input(x, self._block, "in_features / group size")
        else:
            self._check_input(x, self.in_features, "in_features")
            x = scatter_to(x, self.group)               # (..., in) -> (..., in/n)
        y = F.linear(x, self.weight)                # (..., in/n) @ (in/n, out) -> (..., out)
        y = reduce_from(y, self.group)                  # sum of the ranks' partial products
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"
