"""A device mesh: the ranks of one group laid out as an n-dimensional array, with one
sub-group per dimension (PyTorch's ``init_device_mesh``, row-major).

Rank r sits at ``numpy.unravel_index(r, shape)``; its sub-group along dimension ``d`` is
the ranks whose coordinates equal its own everywhere but in ``d``, in increasing order
(so its rank there is its coordinate ``d``). Eight ranks as ``(2, 2, 2)`` named
``("dp", "pp", "tp")``: rank 5 is at (1, 0, 1); its ``tp`` group is {4, 5}, its ``pp``
group {5, 7}, its ``dp`` group {1, 5}.

Why no deadlock: ``ProcessGroup.new_group`` is called by member ranks only, and some
transports (shm) block in it until every member attached. Every rank belongs to exactly
one sub-group per dimension and creates them in dimension order, so its k-th ``new_group``
call is its dimension-k group, which every other member also creates as its k-th call. By
induction over k, every member of a dimension-k group arrives at it once they all finished
dimension k-1: no rank waits in one group for a peer that waits in another.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .arguments import check_group

__all__ = ["DeviceMesh", "mesh_groups"]

_GROUP_ATTRS = ("rank", "size", "new_group")


def mesh_groups(shape: Sequence[int], dim: int) -> list:
    """Every sub-group along ``dim`` of a row-major mesh of ``shape``, as tuples of ranks, in
    the order ``init_device_mesh`` creates them (``arange.reshape(shape)`` with ``dim`` moved
    last, then one group per row).

    ``mesh_groups((2, 2), 0)`` -> ``[(0, 2), (1, 3)]``; ``mesh_groups((2, 2), 1)`` ->
    ``[(0, 1), (2, 3)]``.
    """
    shape = tuple(shape)
    ranks = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    rows = np.swapaxes(ranks, -1, dim).reshape(-1, shape[dim])
    return [tuple(int(r) for r in row) for row in rows]


def _check(group: Any, shape: Any, names: Any) -> tuple:
    check_group(group, "DeviceMesh", _GROUP_ATTRS)
    where = f"[rank {group.rank}/{group.size}] DeviceMesh"
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{where}: argument `shape` must be a sequence of ints, got "
                        f"{type(shape).__name__}")
    shape = tuple(shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
                        for s in shape):
        raise ValueError(f"{where}: argument `shape` must be a non-empty sequence of positive "
                         f"ints, got {shape}")
    shape = tuple(int(s) for s in shape)
    if isinstance(names, str) or not hasattr(names, "__iter__"):
        raise TypeError(f"{where}: argument `names` must be a sequence of strings (one per "
                        f"dimension), got {names!r}")
    names = tuple(names)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{where}: argument `names` must hold non-empty strings, got {names}")
    if len(names) != len(shape):
        raise ValueError(f"{where}: argument `names` {names} must name each dimension of "
                         f"shape {shape}: {len(names)} names for {len(shape)} dimensions")
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: argument `names` must be unique, got {names}")
    total = int(np.prod(shape, dtype=np.int64))
    if total != group.size:
        raise ValueError(f"{where}: shape {shape} holds {total} ranks but the group has "
                         f"{group.size}; the product of the shape must equal the group size")
    return shape, names


class DeviceMesh:
    """The ranks of ``group`` as a row-major array of ``shape``, one named sub-group per
    dimension. A collective: every rank of ``group`` constructs it, with the same
    arguments, in the same order relative to its other ``new_group`` calls.

    Four ranks::

        mesh = DeviceMesh(pg, (2, 2), ("dp", "tp"))
        mesh.coordinate          # rank 3: (1, 1)
        mesh["tp"]               # rank 3: the group of ranks (2, 3); mesh["tp"].rank == 1
        mesh.group("dp")         # rank 3: the group of ranks (1, 3)
        mesh.size("dp")          # 2; mesh.size() is 4
        mesh.ranks("tp")         # (2, 3): ranks of ``group``

    A shape whose product is not ``group.size`` is a ``ValueError`` naming both; ``names``
    must be unique non-empty strings, one per dimension. An unknown name is a ``KeyError``
    in ``mesh[name]`` and a ``ValueError`` in the methods, listing the mesh's names.
    """

    def __init__(self, group: Any, shape: Sequence[int], names: Sequence[str]) -> None:
        self.shape, self.names = _check(group, shape, names)
        self.parent = group
        self.rank = group.rank
        self.coordinate: tuple = tuple(int(c) for c in np.unravel_index(group.rank, self.shape))
        self._ranks: dict = {}
        self._groups: dict = {}
        self._flat: dict = {}          # flatten(): dimension names -> (ranks, group)
        self._named: dict = {}         # flatten(name=...): name -> dimension names
        # One sub-group per dimension, dimensions in order (see the module's docstring).
        for dim, name in enumerate(self.names):
            mine = next(g for g in mesh_groups(self.shape, dim) if group.rank in g)
            self._ranks[name] = mine
            self._groups[name] = group.new_group(list(mine))

    def _dim(self, name: Any, op: str, error: type = ValueError) -> str:
        if not isinstance(name, str) or name not in self._groups:
            named = f" (flattened: {sorted(self._named)})" if self._named else ""
            raise error(f"[rank {self.rank}/{self.parent.size}] DeviceMesh.{op}: no "
                        f"dimension {name!r}; the mesh's names are {self.names}{named}")
        return name

    def __getitem__(self, name: str) -> Any:
        """This rank's sub-group along dimension ``name``, or the group of a flattening
        named ``name`` (:meth:`flatten`)."""
        if isinstance(name, str) and name in self._named:
            return self.flatten(self._named[name])
        return self._groups[self._dim(name, "__getitem__", KeyError)]

    def group(self, name: str) -> Any:
        """This rank's sub-group along dimension ``name`` (the same as ``mesh[name]``)."""
        return self._groups[self._dim(name, "group")]

    def size(self, name: Optional[str] = None) -> int:
        """The length of dimension ``name``; without a name, the number of ranks."""
        if name is None:
            return self.parent.size
        return self.shape[self.names.index(self._dim(name, "size"))]

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along ``name``: its rank in ``mesh[name]``."""
        return self.coordinate[self.names.index(self._dim(name, "local_rank"))]

    def ranks(self, name: str) -> tuple:
        """The ranks (of the parent group) in this rank's sub-group along ``name``."""
        return self._ranks[self._dim(name, "ranks")]

    def flatten(self, dims: Sequence[str], name: Optional[str] = None) -> Any:
        """This rank's sub-group over several dimensions at once: the ranks whose
        coordinates equal its own outside ``dims``, in increasing order. Expert
        parallelism's replicated parameters are averaged over ``("dp", "ep")``: every rank
        there trains on its own batch. A collective: every rank calls it with the same
        ``dims`` in the same order relative to its other ``new_group`` calls (each rank
        is in exactly one such group, so the module's argument holds); the group is made
        once and kept (one dimension: that dimension's group; every one: the parent
        group). With ``name``, ``mesh[name]`` finds the group afterwards (a name may not
        be a dimension's, nor name two different flattenings).

        Four ranks as ``(2, 2)`` named ``("dp", "ep")``: ``mesh.flatten(("dp", "ep"))`` is
        the group of all four; on a ``(2, 1, 2)`` mesh ``("dp", "tp", "ep")`` too.
        ``mesh.flatten(("dp", "cp"), name="dp_cp")`` then ``mesh["dp_cp"]``.
        """
        where = f"[rank {self.rank}/{self.parent.size}] DeviceMesh.flatten"
        if isinstance(dims, str) or not hasattr(dims, "__iter__"):
            raise TypeError(f"{where}: argument `dims` must be a sequence of dimension "
                            f"names, got {dims!r}")
        key = tuple(self._dim(n, "flatten") for n in dims)
        if not key or len(set(key)) != len(key):
            raise ValueError(f"{where}: argument `dims` must name distinct dimensions, got "
                             f"{key}")
        key = tuple(n for n in self.names if n in key)   # mesh order, whatever was asked
        if name is not None:
            if not isinstance(name, str) or not name or name in self.names or \
                    self._named.get(name, key) != key:
                raise ValueError(f"{where}: argument `name` must be a new non-empty string "
                                 f"(not a dimension's, not another flattening's), got "
                                 f"{name!r}; dimensions {self.names}, flattenings "
                                 f"{self._named}")
            self._named[name] = key
        if len(key) == 1:
            return self._groups[key[0]]
        if len(key) == len(self.names):
            return self.parent
        if key not in self._flat:
            dims_at = [self.names.index(n) for n in key]
            ranks = np.arange(self.parent.size).reshape(self.shape)
            mine = ranks[tuple(slice(None) if d in dims_at else c
                               for d, c in enumerate(self.coordinate))]
            self._flat[key] = (tuple(int(r) for r in mine.reshape(-1)),
                               self.parent.new_group([int(r) for r in mine.reshape(-1)]))
        return self._flat[key][1]

    def close(self) -> None:
        """Close the sub-groups (not the parent group)."""
        for g in list(self._groups.values()) + [g for _, g in self._flat.values()]:
            g.close()

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"DeviceMesh({dims}; rank {self.rank} at {self.coordinate})"
