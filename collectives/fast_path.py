"""The group's fast path (functions of the :class:`~collectives.group.ProcessGroup` they
run for): a blocking collective on a contiguous CPU tensor or array, checked, numbered,
recorded and handed to its backend in about a microsecond; the same for the two-array
collectives (``all_gather``, ``gather``, ``scatter``, ``reduce_scatter``: ``fast_pair``
and ``fast_rooted`` check both arrays), ``all_to_all`` (equal parts or split sizes) and
``reduce``; and
a blocking ``send``/``recv``, checked, recorded and handed to the backend's
``send_now``/``recv_now`` (:mod:`collectives.backend`).

The general path (:mod:`collectives.validation`, :mod:`collectives.running`) checks every
argument, builds a :class:`~collectives.buffers.HostBuffer`, a closure and a flight record
list per call: several microseconds of Python before the transport moves a byte, as much
as the shm transport's own phase for a small message (docs/performance.md). The calls of
a training loop repeat one argument list over and over, so the fast path keeps what it
found out:

- :class:`HostViews`: the flat host array of a contiguous CPU torch tensor, found once
  and re-used while the tensor keeps its memory, shape and dtype (``t.numpy()`` alone
  costs most of a fast call). Checked on every hit: the same object (weak reference), the same
  ``data_ptr()`` (a storage resized or swapped with ``set_`` moves it), shape, dtype and
  contiguity. A numpy array is checked directly: that costs less than a cache lookup.
- the reduction's validity for the dtype: :data:`VALID_REDUCTIONS`, per dtype the ops
  that ``collectives.reduce_op.check_reducible`` accepts.
- the flight record: one tuple appended to the recorder's ring after the call, instead
  of a list made before and updated after (a failure still records and dumps as before,
  with the call's start time). So a blocking call is not in the ring *while* it runs: a
  dump made meanwhile (another thread's failure) lacks it.

Anything else (async_op, a queued async op, ``COLLECTIVES_DEBUG``, a backend whose hooks
return Works or take tensors, a non-contiguous or CUDA tensor, a read-only array, an
unknown dtype or root) takes the general path, which raises the usual typed errors.

Two ranks, both: ``t = torch.ones(4); pg.all_reduce(t)`` -> the first call fills the
cache, every later one with ``t`` skips ``t.numpy()`` and the checks it implies.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Any, Callable, Optional

import numpy as np

from . import dtypes
from .buffers import torch_numpy_dtype
from .reduce_op import ReduceOp
from .running import check_open, failed, fast_failed, run_numbered
from .validation import MAX_USER_TAG

#: Tensors whose storage is at most this many bytes are cached: the cached numpy view
#: keeps the storage alive, so large temporaries must not be pinned (their per-call cost
#: is the transfer anyway, not the microsecond saved).
CACHE_STORAGE_BYTES = 1 << 20
#: Entries kept before the cache starts over (so at most 32 MiB stay pinned).
CACHE_ENTRIES = 32

_time = time.time

#: id(dtype) -> the ids of the ReduceOp members that check_reducible accepts for it (none
#: for bool, no AVG on integers), for every supported dtype: one lookup says both whether
#: the fast path takes the dtype (a key) and which reductions (the value). By identity:
#: hashing an int is cheaper than hashing a dtype or building a tuple, and an equal dtype
#: that is not the canonical object (one with metadata) takes the general path. Members
#: and canonical (native-endian) dtypes live as long as the interpreter.
#: bfloat16 joins when first met (collectives.dtypes); until then its calls take the
#: general path, which meets it.
VALID_REDUCTIONS: dict[int, frozenset] = {}


def _add_valid_reductions(d: np.dtype) -> None:
    VALID_REDUCTIONS[id(d)] = frozenset() if d == np.bool_ else frozenset(
        id(op) for op in ReduceOp if not (op is ReduceOp.AVG and np.issubdtype(d, np.integer)))


for _d in dtypes.NUMPY_DTYPES:
    _add_valid_reductions(_d)
dtypes.when_bfloat16(_add_valid_reductions)


def _first_bfloat16(dtype: np.dtype) -> Optional[frozenset]:
    """On a dtype VALID_REDUCTIONS lacks: its reductions if it is the first bfloat16 met
    (which completes every table), else None."""
    return VALID_REDUCTIONS.get(id(dtype)) if dtypes.resolve(dtype) else None


class HostViews:
    """``id(tensor)`` -> its flat host array, for contiguous CPU torch tensors.

    >>> import torch
    >>> views = HostViews()
    >>> t = torch.zeros(2, 3)
    >>> flat, shape, valid, dtype = views.lookup(t)
    >>> flat.shape, tuple(shape), len(valid)
    ((6,), (2, 3), 5)
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}

    def lookup(self, obj: Any) -> Optional[tuple[np.ndarray, Any, frozenset, np.dtype]]:
        """``(flat host array, caller's shape, the ids of its valid reductions, the
        array's dtype)`` when ``obj`` may go straight to a method as a zero-copy, writable
        view; None when it needs the general path."""
        if type(obj) is np.ndarray:   # (fast_collective checks it alike)
            valid = VALID_REDUCTIONS.get(id(obj.dtype))
            if valid is None:
                valid = _first_bfloat16(obj.dtype)
            if valid is not None and obj.flags.carray:
                return (obj if obj.ndim == 1 else obj.reshape(-1)), obj.shape, valid, obj.dtype
            return None
        entry = self._entries.get(id(obj))
        if entry is not None:
            ref, ptr, shape, dtype, found = entry
            if (ref() is obj and obj.data_ptr() == ptr and obj.shape == shape
                    and obj.dtype is dtype and obj.is_contiguous()):
                return found
        return self._fill(obj)

    def _fill(self, obj: Any) -> Optional[tuple[np.ndarray, Any, frozenset, np.dtype]]:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            return None
        dt = torch_numpy_dtype(torch, obj.dtype)
        if (dt is None or id(dt) not in VALID_REDUCTIONS or not obj.is_cpu
                or not obj.is_contiguous() or obj.is_neg() or obj.is_conj()):
            return None
        host = obj.detach()
        if dt.name == "bfloat16":
            flat = host.view(torch.uint16).numpy().view(dt).reshape(-1)
        else:
            flat = host.numpy().reshape(-1)
        found = (flat, obj.shape, VALID_REDUCTIONS[id(dt)], flat.dtype)
        if obj.untyped_storage().nbytes() <= CACHE_STORAGE_BYTES:
            if len(self._entries) >= CACHE_ENTRIES:
                self._entries.clear()
            self._entries[id(obj)] = (weakref.ref(obj), obj.data_ptr(), obj.shape,
                                      obj.dtype, found)
        return found

    def clear(self) -> None:
        self._entries.clear()


def fast_collective(group: Any, op: str, method: Callable[..., Any], tensor: Any, arg: Any,
                    root: int, reduce_op: Any) -> bool:
    """A blocking collective on ``tensor`` whose other arguments the caller checked: when
    the path applies (contiguous, writable CPU memory of a supported dtype, and
    ``reduce_op`` valid for it), number the call, run ``method(flat, arg, seq)`` inline,
    record it, and return True: what ``running.dispatch`` + ``running.run`` do for a
    blocking call with nothing queued. False leaves the call to the general path.
    ``reduce_op`` is None for a collective that does not reduce, so the caller of one
    that does sees to it that its op is not None.

    A numpy array is checked here rather than in ``HostViews.lookup``: one Python call
    less per collective (about a tenth of the microsecond this path has)."""
    if type(tensor) is np.ndarray:   # the rule of HostViews.lookup's first branch
        dtype = tensor.dtype
        valid = VALID_REDUCTIONS.get(id(dtype))
        if valid is None:
            valid = _first_bfloat16(dtype)
        # carray: C-contiguous, aligned and writeable, in one flag
        if valid is None or not tensor.flags.carray:
            return False
        shape = tensor.shape
        flat = tensor if len(shape) == 1 else tensor.reshape(-1)
    else:
        found = group._host_views.lookup(tensor)
        if found is None:
            return False
        flat, shape, valid, dtype = found
    if reduce_op is not None and id(reduce_op) not in valid:
        return False
    if group._closed:
        check_open(group, op)
    # What running.run_numbered does, inline: calling it costs a fifth of this path.
    seq = group._seq
    group._seq = seq + 1
    recorder = group._recorder
    t0 = _time() if recorder is not None else 0.0
    try:
        method(flat, arg, seq)
    except BaseException as exc:
        if recorder is not None:
            fast_failed(group, (seq, op, shape, dtype, root, reduce_op, -1, t0), exc)
        raise failed(group, exc, op, seq)
    if recorder is not None:
        recorder.append((seq, op, shape, dtype, root, reduce_op, -1, t0, _time(), "ok"))
    return True


def fast_pair(group: Any, op: str, big: Any, small: Any, reduce_op: Any) -> Optional[tuple]:
    """The two arrays of a blocking all_gather, gather, scatter or reduce_scatter when the
    path applies: ``(big, small)``, each ``HostViews.lookup``'s tuple, where both are
    contiguous, writable CPU memory of one dtype, ``big`` holds group size x ``small``'s
    elements and ``reduce_op`` (None where the op does not reduce) is valid for the
    dtype; None leaves the call to the general path, which raises whatever error
    applies. Raises at once on a closed group (naming ``op``). (An input that may not be
    written, a read-only array, takes the general path too.)

    Two ranks: ``pg.all_gather(out := np.empty(4), np.ones(2))`` finds ``(out, input)``
    here and runs the backend's ``all_gather`` under ``run_numbered``."""
    views = group._host_views
    found_big = views.lookup(big)
    if found_big is None:
        return None
    found_small = views.lookup(small)
    if (found_small is None or found_small[3] is not found_big[3]
            or found_big[0].size != group.size * found_small[0].size
            or (reduce_op is not None and id(reduce_op) not in found_big[2])):
        return None
    check_open(group, op)
    return found_big, found_small


def fast_rooted(group: Any, op: str, method: Callable[..., Any], small: Any, big: Any,
                root: Any) -> bool:
    """A blocking gather (``small``: the input; ``big``: the root's output) or scatter
    (``small``: the output; ``big``: the root's input): when the path applies
    (``fast_pair`` at the root, ``small`` alone elsewhere, where ``big`` is ignored as the
    general path ignores it), ``method(small, big or None, root, seq)`` under
    ``run_numbered``, and True; False leaves the call to the general path."""
    if not (type(root) is int and 0 <= root < group.size):
        return False
    if group.rank == root:
        pair = None if big is None else fast_pair(group, op, big, small, None)
        if pair is None:
            return False
        found, flat_big = pair[1], pair[0][0]
    else:
        found, flat_big = group._host_views.lookup(small), None
        if found is None:
            return False
        check_open(group, op)
    run_numbered(group, op, method, (found[0], flat_big, root), found[1], found[3], root, None)
    return True


def split_counts(shape: Any, size: int, splits: Any, n: int) -> Optional[list]:
    """Element counts per peer of one all_to_all array of ``shape`` (``size`` elements):
    equal parts where ``splits`` is None, else ``splits`` rows each; None where the
    general path must decide (and raise): a list or tuple of ``n`` plain non-negative
    ints summing to the rows along dim 0 is all this takes, and no empty array (whose
    row size the shape alone says)."""
    rows = shape[0]
    if not rows:
        return None
    if splits is None:
        return None if rows % n else [size // n] * n
    if (splits.__class__ is not list and splits.__class__ is not tuple) or len(splits) != n:
        return None
    total = 0
    for s in splits:
        if s.__class__ is not int or s < 0:
            return None
        total += s
    if total != rows:
        return None
    row = size // rows
    return list(splits) if row == 1 else [s * row for s in splits]


def fast_all_to_all(group: Any, output: Any, input: Any, output_splits: Any,
                    input_splits: Any) -> bool:
    """A blocking all_to_all, in equal parts (split sizes None) or in the rows of the
    split sizes: when both arrays take the path, share a dtype and have at least one
    dimension, and the split sizes are plain ints that fit them (:func:`split_counts`),
    the backend's ``all_to_all(out, inp, out_counts, in_counts, seq)`` under
    ``run_numbered`` with the counts the general path computes, and True; False leaves
    the call to the general path (and its errors). Expert parallelism calls this with
    new split sizes every step, so they are checked here, not cached."""
    views = group._host_views
    found_out = views.lookup(output)
    if found_out is None:
        return False
    found_in = views.lookup(input)
    if found_in is None or found_in[3] is not found_out[3]:
        return False
    out_shape, in_shape = found_out[1], found_in[1]
    if not out_shape or not in_shape:
        return False
    n = group.size
    out, inp = found_out[0], found_in[0]
    out_counts = split_counts(out_shape, out.size, output_splits, n)
    if out_counts is None:
        return False
    in_counts = split_counts(in_shape, inp.size, input_splits, n)
    if in_counts is None:
        return False
    check_open(group, "all_to_all")
    run_numbered(group, "all_to_all", group.transport.all_to_all,
                 (out, inp, out_counts, in_counts), None, found_in[3], -1, None)
    return True


def fast_p2p(group: Any, op: str, method: Callable[[np.ndarray, int, int], None],
             tensor: Any, peer: Any, tag: Any) -> bool:
    """A blocking send or receive of ``tensor``: when the path applies (a peer and a
    user tag as plain ints, contiguous CPU memory), ``method(flat, peer, tag)`` (the
    backend's ``send_now`` or ``recv_now``) inline, recorded as the general path records
    it (not numbered), and True; False leaves the call to the general path."""
    if not (peer.__class__ is int and tag.__class__ is int and 0 <= peer < group.size
            and peer != group.rank and 0 <= tag < MAX_USER_TAG):
        return False
    found = group._host_views.lookup(tensor)
    if found is None:
        return False
    flat, shape, _, dtype = found
    if group._closed:
        check_open(group, op)
    recorder = group._recorder
    t0 = _time() if recorder is not None else 0.0
    try:
        method(flat, peer, tag)
    except BaseException as exc:
        if recorder is not None:
            fast_failed(group, (-1, op, shape, dtype, -1, None, peer, t0), exc)
        raise failed(group, exc, op, -1)
    if recorder is not None:
        recorder.append((-1, op, shape, dtype, -1, None, peer, t0, _time(), "ok"))
    return True
