"""Argument checks of the public ProcessGroup methods.

Every public call checks its arguments before any message moves, so a bad call raises a
``TypeError``/``ValueError`` naming the rank, the op and the argument, and leaves the group
usable. :class:`Arguments` holds what the checks need of a group (its rank and size);
``where`` is the location text every message starts with (``[rank 0/2] all_reduce``).
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import numpy as np

from .buffers import host_dtype, is_tensor_like, numel

#: User tags of send/recv must lie in [0, MAX_USER_TAG).
MAX_USER_TAG = 1 << 31


def timeout_seconds(timeout: "float | datetime.timedelta | None", default: float,
                    where: str = "", arg: str = "timeout") -> float:
    """Normalise a timeout given in seconds or as a ``timedelta`` (``None``: ``default``).

    A wrong type is a ``TypeError``, a non-positive (or NaN) number a ``ValueError``;
    ``where`` names the call in the message (``"init_process_group"``), ``arg`` the
    argument.

    >>> timeout_seconds(datetime.timedelta(minutes=1), 300.0)
    60.0
    """
    if timeout is None:
        return default
    prefix = f"{where}: " if where else ""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{prefix}argument `{arg}` must be a positive number of seconds or "
                        f"a timedelta, got {type(timeout).__name__} {timeout!r}")
    if not timeout > 0:  # also NaN
        raise ValueError(f"{prefix}argument `{arg}` must be a positive number of seconds, "
                         f"got {timeout!r}")
    return float(timeout)


class Arguments:
    """The checks of one group's calls (its ``rank`` and ``size``).

    Two ranks: ``Arguments(0, 2).rank_of(5, "dst", "[rank 0/2] send")`` raises
    ``ValueError: [rank 0/2] send: argument `dst`=5 is not a rank of this group (0..1)``.
    """

    __slots__ = ("rank", "size")

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def rank_of(self, value: Any, arg: str, where: str, *, allow_self: bool = True) -> int:
        """``value`` as a rank of the group."""
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

    def tag(self, tag: Any, where: str) -> int:
        """A user tag: an int in ``[0, 2**31)``."""
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
            raise TypeError(f"{where}: argument `tag` must be an int, got {type(tag).__name__}")
        if not 0 <= int(tag) < MAX_USER_TAG:
            raise ValueError(f"{where}: argument `tag`={tag} must be in [0, 2**31)")
        return int(tag)

    def tensor(self, obj: Any, arg: str, where: str) -> None:
        """A torch tensor or a numpy array."""
        if not is_tensor_like(obj):
            raise TypeError(f"{where}: argument `{arg}` must be a torch.Tensor or "
                            f"numpy.ndarray, got {type(obj).__name__}")

    def same_dtype(self, a: Any, b: Any, names: tuple[str, str], where: str) -> None:
        da, db = host_dtype(a), host_dtype(b)
        if da != db:
            raise TypeError(f"{where}: arguments `{names[0]}` ({da}) and `{names[1]}` ({db}) "
                            f"must have the same dtype")

    def multiple(self, big: Any, small: Any, names: tuple[str, str], where: str) -> None:
        """``big`` holds group size x ``small``'s elements."""
        nb, ns = numel(big), numel(small)
        if nb != self.size * ns:
            raise ValueError(f"{where}: `{names[0]}` has {nb} elements, expected "
                             f"{self.size} x {ns} = {self.size * ns} (group size x "
                             f"`{names[1]}`)")

    def pair(self, big: Any, small: Any, names: tuple[str, str], where: str) -> None:
        """Both tensors, one dtype, ``big`` holding group size x ``small``."""
        self.tensor(big, names[0], where)
        self.tensor(small, names[1], where)
        self.same_dtype(big, small, names, where)
        self.multiple(big, small, names, where)

    def members(self, ranks: Any, where: str) -> tuple[int, ...]:
        """``new_group``'s ranks: distinct ranks of the group, this one among them;
        returned sorted."""
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"{where}: argument `ranks` must be a sequence of ints, got "
                            f"{type(ranks).__name__}")
        members = [self.rank_of(r, "ranks", where) for r in ranks]
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"{where}: argument `ranks` must be non-empty and without "
                             f"duplicates, got {list(ranks)}")
        if self.rank not in members:
            raise ValueError(f"{where}: this rank ({self.rank}) is not in `ranks` "
                             f"{sorted(members)}; call new_group on member ranks only")
        return tuple(sorted(members))

    def split_counts(self, t: Any, splits: Optional[Sequence[int]], arg: str,
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
