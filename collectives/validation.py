"""Argument checks of the public ProcessGroup methods (mixed into
:class:`~collectives.group.ProcessGroup`).

Every public call checks its arguments before any message moves, so a bad call raises a
``TypeError``/``ValueError`` naming the rank, the op and the argument, and leaves the group
usable. The location text (``[rank 0/2] all_reduce``) is kept per op.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .buffers import host_dtype, is_tensor_like, numel
from .errors import where as _where

#: User tags of send/recv must lie in [0, MAX_USER_TAG).
MAX_USER_TAG = 1 << 31


class ArgumentChecks:
    """The checks; needs ``rank``, ``size`` and ``_where_text`` (a dict) on the group."""

    rank: int
    size: int
    _where_text: dict

    def _where(self, op: str) -> str:
        # Every call formats its location for the messages it might raise: keep the text
        # per op instead of formatting it each time (a rank's rank and size never change).
        try:
            return self._where_text[op]
        except KeyError:
            text = self._where_text[op] = _where(self.rank, self.size, op)
            return text

    def _check_rank(self, value: Any, arg: str, where: str, *, allow_self: bool = True) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{where}: argument `{arg}` must be an int rank, got "
                            f"{type(value).__name__}")
        value = int(value)
        if not 0 <= value < self.size:
            raise ValueError(f"{where}: argument `{arg}`={value} is not a rank of this "
                             f"group (0..{self.size - 1})")
        if not allow_self and value == self.rank:
            raise ValueError(f"{where}: argument `{arg}`={value} is this rank itself")
        return value

    def _check_tag(self, tag: Any, where: str) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
            raise TypeError(f"{where}: argument `tag` must be an int, got {type(tag).__name__}")
        if not 0 <= int(tag) < MAX_USER_TAG:
            raise ValueError(f"{where}: argument `tag`={tag} must be in [0, 2**31)")
        return int(tag)

    def _check_same_dtype(self, a: Any, b: Any, names: tuple[str, str], where: str) -> None:
        da, db = host_dtype(a), host_dtype(b)
        if da != db:
            raise TypeError(f"{where}: arguments `{names[0]}` ({da}) and `{names[1]}` ({db}) "
                            f"must have the same dtype")

    def _check_multiple(self, big: Any, small: Any, names: tuple[str, str], where: str) -> None:
        nb, ns = numel(big), numel(small)
        if nb != self.size * ns:
            raise ValueError(f"{where}: `{names[0]}` has {nb} elements, expected "
                             f"{self.size} x {ns} = {self.size * ns} (group size x "
                             f"`{names[1]}`)")

    def _check_tensor(self, obj: Any, arg: str, where: str) -> None:
        if not is_tensor_like(obj):
            raise TypeError(f"{where}: argument `{arg}` must be a torch.Tensor or "
                            f"numpy.ndarray, got {type(obj).__name__}")

    def _split_counts(self, t: Any, splits: Optional[Sequence[int]], arg: str,
                      where: str) -> list[int]:
        """Element counts per peer for one all_to_all argument."""
        shape = tuple(t.shape)
        rows = shape[0] if shape else 1
        row_numel = numel(t) // rows if rows else int(np.prod(shape[1:], dtype=np.int64))
        if splits is None:
            if rows % self.size:
                raise ValueError(f"{where}: `{arg}` has {rows} rows along dim 0, not "
                                 f"divisible by the group size {self.size}; pass "
                                 f"`{arg}_split_sizes`")
            return [rows // self.size * row_numel] * self.size
        if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
            raise TypeError(f"{where}: argument `{arg}_split_sizes` must be a sequence of "
                            f"{self.size} ints, got {type(splits).__name__}")
        splits = list(splits)
        if len(splits) != self.size or any(
                isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0
                for s in splits):
            raise ValueError(f"{where}: `{arg}_split_sizes` must be {self.size} "
                             f"non-negative ints, got {splits!r}")
        if sum(splits) != rows:
            raise ValueError(f"{where}: `{arg}_split_sizes` {splits} sum to {sum(splits)}, "
                             f"but `{arg}` has {rows} rows along dim 0")
        return [int(s) * row_numel for s in splits]
