"""all_reduce and reduce of the shm backend: two paths, both over the phase protocol of
``ops`` (fingerprints, one barrier per phase, bank ``q % 2`` written in phase q).

Small messages (up to ``SMALL_REDUCE_BYTES``, and at most a slot): one phase. Every rank
copies its whole input into its slot and, once all arrived, reduces the n slots in rank
order straight into its array: ``a = s0 (op) s1``, then ``a = a (op) s_r``. Views of
exactly the message's length are cached per (dtype, length), so the hot path does no
slicing: one copy in and n - 1 ufunc calls (plus a division for AVG).

Large messages: an all_reduce of an array in symmetric memory reads the peers' buffers
in place (``symmetric.py``), one of ``cma.cma_min_bytes(n)`` or more reads the peers'
arrays where the group can and the kernel copies fast enough (``cma.py``); otherwise,
and for ``reduce``, reduce-scatter then all-gather, pipelined one chunk per phase. A
chunk of C = n x P elements splits into n pieces of P; rank k owns piece k. In the
phase of chunk j every rank

1. copies the pieces of chunk j that *others* own into the input part of its slot (its
   own piece stays in its array: a single copy in, of (n-1)/n of the data),
2. reduces its piece of chunk j-1 from the peers' input parts of the previous bank and
   its own array, in rank order, into the output part of its slot (and, where it wants
   the result, into its array at once), and
3. copies the others' reduced pieces of chunk j-2 (their output parts, previous bank)
   into its array,

then publishes the phase. All writes of phase q go to bank ``q % 2`` and all reads are of
bank ``(q - 1) % 2``, which every rank finished writing before the barrier of phase q-1:
the protocol's rule, so a chunk costs one barrier (not two) and the last reads (chunk
K-1's outputs, after the final barrier) are of the last published bank, as for every
other collective. Each element is reduced once, by its owner, so every rank copies out
the same bits.

Memory traffic per rank and chunk of C bytes: (n-1)/n C copied in, C read and 2C/n
written by the reduction, (n-1)/n C copied out: about 4 C for two ranks, against 6.5 C
for copying the whole chunk in and reducing through a staged accumulator. On the compiled
core (``native_ops._pipelined_reduce_native``) the same steps over the same slots run in
calls of the core, the GIL released, a call going on through the phases until one's
wait outlasts the core's budget.
"""

from __future__ import annotations

import numpy as np

from collectives.reduce_op import ReduceOp, finish, kernel

from .ops import _ALIGN, _DTYPE_CODE, _REDOP_BY_ID, OP_ALL_REDUCE, OP_REDUCE

#: all_reduce/reduce up to this many bytes take the one-phase path.
SMALL_REDUCE_BYTES = 32 << 10
#: The pipelined path's largest piece (the compiled core's own, checked when it loads):
#: a phase's copy in, reduction and copy out then touch a few hundred KiB, within a
#: core's L2, where pieces of a third of the 1 MiB slot spilled it. Measured on 2 vCPUs
#: (the staged path, the three builds in turn, two or three runs each): at 2 ranks 4 MiB
#: in 519-567 us against 580-604 us uncapped, 16 MiB in 2.09-2.30 ms against 2.39-2.59;
#: at 4 ranks 4 MiB in 1.80-1.82 ms against 1.91-2.07, 16 MiB 7.07-7.39 against
#: 7.62-8.47; 1 MiB the same. 128 KiB gained at 2 ranks only, 32 KiB as 64 KiB.
PIECE_MAX_BYTES = 64 << 10

#: ReduceOp -> numpy ufunc, keyed by id(): hashing an Enum member runs Python code. The
#: table is collectives.reduce_op's, so there is one definition of every operator.
_KERNEL_BY_ID = {id(op): kernel(op) for op in ReduceOp}
_AVG = ReduceOp.AVG
_SMALL_CACHE_MAX = 32   # (dtype, length) entries of cached small-message views


class ReduceOps:
    """Mixed into ShmGroup (before ``CollectiveOps``): the all_reduce/reduce hooks."""

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        self._reduce_into(a, op, seq, -1, OP_ALL_REDUCE)

    def reduce(self, a: np.ndarray, dst: int, op: ReduceOp, seq: int) -> None:
        self._reduce_into(a, op, seq, dst, OP_REDUCE)

    def _reduce_into(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                     opcode: int) -> None:
        """all_reduce (``dst`` -1) or reduce to ``dst``, by the path the size calls for."""
        if self.size == 1:
            finish(op, a, 1)
            return
        flat = a if a.ndim == 1 else a.reshape(-1)
        try:
            if flat.nbytes <= self._small_limit:
                self._small_reduce(flat, op, seq, dst, opcode)
            else:
                self._large_reduce(flat, op, seq, dst, opcode)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _large_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                      opcode: int) -> None:
        """A message past the one-phase path: an all_reduce of an array in symmetric
        memory reads the peers' buffers in place (``symmetric.py``; in a group that has
        such buffers, any other large all_reduce pays one phase to find that out), one
        from ``cma_min_bytes(n)`` reads the peers' memory directly where the group can
        (``cma.py``), everything else is pipelined through the segment."""
        if dst < 0 and self._symmetric and self._symmetric_all_reduce(a, op, seq):
            return  # read in place from every rank's symmetric buffer (symmetric.py)
        self._large_reduce_unplaced(a, op, seq, dst, opcode)

    def _large_reduce_unplaced(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                               opcode: int) -> None:
        """``_large_reduce`` once symmetric memory is ruled out (the vote declined)."""
        if dst < 0 and a.nbytes >= self._cma_bytes and self._cma is not False \
                and self._cma_all_reduce(a, op, seq):
            return
        self._pipelined_reduce(a, op, seq, dst, opcode)

    # ------------------------------------------------------------------ small
    @property
    def _small_limit(self) -> int:
        """Largest message of the one-phase path: it must fit one slot."""
        return min(SMALL_REDUCE_BYTES, self._S)

    def _small_views(self, dt: np.dtype, count: int) -> tuple:
        """``[bank][rank]`` -> the first ``count`` elements of that slot as ``dt``."""
        key = (dt, count)
        views = self._small_cache.get(key)
        if views is None:
            if len(self._small_cache) >= _SMALL_CACHE_MAX:
                self._small_cache.clear()
            typed = self._views(dt)
            views = self._small_cache[key] = tuple(
                [slot[:count] for slot in bank] for bank in typed)
        return views

    def _small_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                      opcode: int) -> None:
        """One phase: write the input, barrier, reduce all n slots in rank order."""
        if self._broken is not None or self._seg is None:
            self._start(opcode, seq)  # raises the group's error
        dt = a.dtype
        me = self.rank
        slots = self._small_views(dt, a.size)
        # What _start() computes (ops.fingerprint), inline: this path is all overhead.
        self._op_name = "all_reduce" if dst < 0 else "reduce"
        self._op_seq = seq
        fp0 = self._fp0 = (opcode | (_REDOP_BY_ID.get(id(op), 0) << 4)
                           | (_DTYPE_CODE.get(dt, 0) << 8) | (((dst + 1) & 0xFFFF) << 16)
                           | ((seq & 0xFFFFFFFF) << 32))
        nbytes = self._fp1 = a.nbytes
        q = self._phase = self._phase + 1
        mine = slots[q & 1]
        i = self._fp_idx[q & 1][me]
        u64 = self._u64
        u64[i] = fp0
        u64[i + 1] = nbytes
        mine[me][...] = a
        self._exchange(q)
        if dst < 0 or dst == me:
            kernel = _KERNEL_BY_ID[id(op)]
            kernel(mine[0], mine[1], out=a)
            for r in range(2, self.size):
                kernel(a, mine[r], out=a)
            if op is _AVG:
                finish(op, a, self.size)

    # ------------------------------------------------------------------ large
    def _piece_layout(self, itemsize: int) -> tuple[int, int]:
        """(P, C): elements per piece and per chunk. A slot holds the chunk's input part
        (C = n x P elements) followed by one output piece (P): (n + 1) x P elements, at
        most :data:`PIECE_MAX_BYTES` a piece."""
        piece_bytes = min(self._S // (self.size + 1) // _ALIGN * _ALIGN, PIECE_MAX_BYTES)
        P = max(1, piece_bytes // itemsize)
        return P, self.size * P

    def _pipelined_reduce(self, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                          opcode: int) -> None:
        """Reduce-scatter + all-gather, one chunk per phase (see the module docstring)."""
        n, me, dt = self.size, self.rank, a.dtype
        self._start(opcode, seq, dt, a.nbytes, dst, op)
        gets_result = dst < 0 or dst == me
        P, C = self._piece_layout(a.itemsize)
        align = max(1, _ALIGN // a.itemsize)
        views = self._views(dt)        # [bank][rank] -> whole slot as dt
        total = a.size
        K = (total + C - 1) // C       # chunks; phases K + 1
        # Chunk j starts at j * C; piece k of it is [k0, k1) relative to that start.
        # Pieces are aligned but never longer than P (the output part of a slot).
        bounds = []
        for lo in range(0, total, C):
            c = min(C, total - lo)
            part = min(P, ((c + n - 1) // n + align - 1) // align * align)
            bounds.append([(min(c, k * part), min(c, (k + 1) * part)) for k in range(n)])

        for j in range(K + 1):
            q = self._enter()
            b = q & 1
            slot_in = views[b][me]
            if j < K:                              # 1. copy in others' pieces of chunk j
                lo = j * C
                c = min(C, total - lo)
                k0, k1 = bounds[j][me]
                if k0 > 0:
                    slot_in[:k0] = a[lo:lo + k0]
                if k1 < c:
                    slot_in[k1:c] = a[lo + k1:lo + c]
            if j >= 1:                             # 2. reduce my piece of chunk j-1
                lo = (j - 1) * C
                k0, k1 = bounds[j - 1][me]
                if k1 > k0:
                    prev = views[b ^ 1]
                    mine = a[lo + k0:lo + k1]
                    srcs = [mine if r == me else prev[r][k0:k1] for r in range(n)]
                    published = slot_in[C:C + (k1 - k0)]
                    if gets_result:   # into my array too: step 3 skips my own piece
                        self._rank_order_reduce(mine, srcs, op, (published,))
                    else:
                        self._rank_order_reduce(published, srcs, op)
            if j >= 2 and gets_result:             # 3. copy out chunk j-2
                self._copy_out(a, views[b ^ 1], (j - 2) * C, C, bounds[j - 2])
            self._exchange(q)
        if gets_result:                            # chunk K-1, from the last bank
            self._copy_out(a, views[q & 1], (K - 1) * C, C, bounds[K - 1])

    def _rank_order_reduce(self, out: np.ndarray, srcs: list, op: ReduceOp,
                           copies: tuple = ()) -> None:
        """``out = srcs[0] (op) srcs[1] (op) ...`` in rank order, AVG divided once, and
        the result also into each of ``copies``: the compiled core's ``combine`` (GIL
        released; the copies made piece by piece while the result is in cache), else
        numpy's kernels. ``out`` may be one of ``srcs`` (the in-place paths reduce a
        piece into its owner's array)."""
        combine = self._native_combine
        if combine is not None:  # accumulates block by block: any source may be `out`
            combine(out, srcs, _DTYPE_CODE.get(out.dtype, 0), _REDOP_BY_ID[id(op)], len(srcs),
                    copies)
            return
        kernel = _KERNEL_BY_ID[id(op)]
        if any(s is out for s in srcs[2:]):  # numpy would overwrite it before reading it
            srcs = [s.copy() if s is out else s for s in srcs]
        kernel(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            kernel(out, s, out=out)
        finish(op, out, len(srcs))
        for view in copies:
            np.copyto(view, out)

    def _copy_out(self, a: np.ndarray, bank: list, lo: int, C: int, bounds: list) -> None:
        """The peers' reduced pieces of the chunk at ``lo`` (the output parts of ``bank``,
        piece k at ``bounds[k]``) into ``a`` (this rank reduced its own into ``a``)."""
        me = self.rank
        for r, (k0, k1) in enumerate(bounds):
            if k1 > k0 and r != me:
                a[lo + k0:lo + k1] = bank[r][C:C + (k1 - k0)]
