"""The native collectives of the shm backend: a phase protocol over two data banks.

Every rank counts phases identically. In phase q a rank writes only its own slot of bank
``q % 2`` (every rank has published phase q-1, so nobody still reads that bank from
phase q-2), stores its op fingerprint and ``arrived = q``, rings the others, waits until
every rank arrived at q, compares their fingerprints with its own (a few integer
compares: different ops, sizes, dtypes, roots or reduce ops raise CollectiveMismatch
on every rank) and then reads bank ``q % 2``. Each phase is thus a full barrier; large
messages go through in chunks of S bytes (one slot) with the two banks pipelining
consecutive chunks, so any size works with a fixed footprint of 2 x n x S bytes.

Reductions combine the ranks' inputs in rank order 0, 1, ..., n-1 through
``collectives.reduce_op.combine_into`` and ``finish``, element by element the same on
every rank whatever the chunking, so all ranks hold bitwise-identical results that match
every other implementation of the library.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from collectives.buffers import SUPPORTED_DTYPES
from collectives.errors import CollectiveError, CollectiveMismatch, PeerError, add_note
from collectives.reduce_op import ReduceOp, combine_into, finish


_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_DTYPE_NAME = {i + 1: str(dt) for i, dt in enumerate(SUPPORTED_DTYPES)}
_DTYPE_NAME[_DTYPE_CODE[np.dtype(ml_dtypes.bfloat16)]] = "bfloat16"


def dtype_code(dt: np.dtype) -> int:
    """A small code for the dtypes the library moves (0 for anything else)."""
    return _DTYPE_CODE.get(dt, 0)


def dtype_name(code: int) -> str:
    return _DTYPE_NAME.get(code, "bytes")


OP_BARRIER, OP_BROADCAST, OP_ALL_REDUCE, OP_REDUCE, OP_ALL_GATHER, OP_GATHER, OP_SCATTER, \
    OP_REDUCE_SCATTER, OP_ALL_TO_ALL = range(1, 10)
#: Written over a rank's fingerprint when it fails a phase it had published, so that a
#: peer arriving later raises PeerError instead of completing with it.
OP_FAILED = 0xF
_OP_NAMES = {OP_BARRIER: "barrier", OP_BROADCAST: "broadcast", OP_ALL_REDUCE: "all_reduce",
             OP_REDUCE: "reduce", OP_ALL_GATHER: "all_gather", OP_GATHER: "gather",
             OP_SCATTER: "scatter", OP_REDUCE_SCATTER: "reduce_scatter",
             OP_ALL_TO_ALL: "all_to_all"}
_ROOTED = {OP_BROADCAST, OP_REDUCE, OP_GATHER, OP_SCATTER}
_REDOP_CODE = {ReduceOp.SUM: 1, ReduceOp.AVG: 2, ReduceOp.PRODUCT: 3, ReduceOp.MIN: 4,
               ReduceOp.MAX: 5}
_REDOP_NAME = {v: k.name for k, v in _REDOP_CODE.items()}
_REDOP_BY_ID = {id(k): v for k, v in _REDOP_CODE.items()}  # Enum.__hash__ is Python code

_ALIGN = 64
_INT64 = np.dtype(np.int64)


def piece_bounds(count: int, n: int, itemsize: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of rank k's piece of a ``count``-element array split n ways, each piece
    starting on an ``_ALIGN`` boundary (the last ones may be short or empty): the
    ownership of the in-place all_reduces (single-copy and symmetric).

    >>> piece_bounds(10, 3, 4)
    [(0, 10), (10, 10), (10, 10)]
    >>> piece_bounds(100, 2, 4)
    [(0, 64), (64, 100)]
    """
    align = max(1, _ALIGN // itemsize)
    part = ((count + n - 1) // n + align - 1) // align * align
    return [(min(count, k * part), min(count, (k + 1) * part)) for k in range(n)]


def _describe(fp0: int, fp1: int, dtype_name) -> str:
    op = fp0 & 0xF
    redop = (fp0 >> 4) & 0xF
    dt = dtype_name((fp0 >> 8) & 0xFF)
    root = ((fp0 >> 16) & 0xFFFF) - 1
    seq = fp0 >> 32
    text = f"{_OP_NAMES.get(op, f'op {op}')} (seq {seq})"
    if op == OP_ALL_TO_ALL:
        text += f" on {dt}"
    elif op != OP_BARRIER:
        text += f" with {fp1} bytes of {dt}"
    if op in _ROOTED:
        text += f", root {root}"
    if redop:
        text += f", op {_REDOP_NAME.get(redop, redop)}"
    return text


def fingerprint(opcode: int, redop: int, dtype: int, root: int, seq: int) -> int:
    """Word 0 of a phase's fingerprint (word 1 is the message's bytes): the operation,
    operator and dtype codes, root + 1 (0: none) and the call's sequence number, in the
    fields every rank compares (the core computes the same in ``small_all_reduce``).

    >>> hex(fingerprint(OP_ALL_REDUCE, 1, 2, -1, 7))
    '0x700000213'
    """
    return (opcode | (redop << 4) | (dtype << 8) | (((root + 1) & 0xFFFF) << 16)
            | ((seq & 0xFFFFFFFF) << 32))


class CollectiveOps:
    """Mixed into ShmGroup: the ``_broadcast``/``_all_reduce``/... hooks."""

    # ------------------------------------------------------------ phase machinery
    def _start(self, opcode: int, seq: int, dtype: Optional[np.dtype] = None,
               nbytes: int = 0, root: int = -1, redop: Optional[ReduceOp] = None) -> None:
        name = _OP_NAMES[opcode]
        if self._broken is not None:
            raise CollectiveError(
                f"{self.where(name)} (seq {seq}): this group failed in an earlier "
                f"collective ({type(self._broken).__name__}: {self._broken}); close it")
        if self._seg is None:
            raise CollectiveError(f"{self.where(name)}: the group is closed")
        self._op_name, self._op_seq = name, seq
        self._fp0 = fingerprint(opcode, _REDOP_BY_ID.get(id(redop), 0),
                                _DTYPE_CODE.get(dtype, 0), root, seq)
        self._fp1 = nbytes

    def _enter(self) -> int:
        """Begin the next phase: publish the fingerprint for it; return its number."""
        q = self._phase + 1
        self._phase = q
        p = q & 1
        u64 = self._u64
        u64[self._fp_idx[p][self.rank]] = self._fp0
        u64[self._fp_idx[p][self.rank] + 1] = self._fp1
        return q

    def _exchange(self, q: int) -> None:
        """Publish phase ``q``, wait for everybody's, check their fingerprints.

        Only the last rank to arrive rings the others (each waiter is woken once per
        phase, not once per arrival). Two ranks arriving at once both store ``arrived``,
        fence, then load the others' (Dekker): at least one of them sees everybody."""
        u64 = self._u64
        u64[self._me_arrived] = q
        self._bells.fence()
        for i in self._arrived_idx:
            if u64[i] < q:
                break
        else:
            self._bells.ring(self._peers)
        self._await_all(q)
        fp0, fp1 = self._fp0, self._fp1
        for i in self._fp_idx[q & 1]:
            if u64[i] != fp0 or u64[i + 1] != fp1:
                self._mismatch(q)

    def _mismatch(self, q: int) -> None:
        u64 = self._u64
        mine = _describe(self._fp0, self._fp1, dtype_name)
        fps = [(r, u64[i], u64[i + 1]) for r, i in enumerate(self._fp_idx[q & 1])]
        for r, fp0, fp1 in fps:
            if fp0 & 0xF == OP_FAILED:
                raise PeerError(
                    f"{self.where(self._op_name)} (seq {self._op_seq}): rank {r} failed "
                    f"in this collective (see its error)", peer=r)
        for r, fp0, fp1 in fps:
            if fp0 != self._fp0 or fp1 != self._fp1:
                other = _describe(fp0, fp1, dtype_name)
                raise CollectiveMismatch(
                    f"{self.where(self._op_name)} (seq {self._op_seq}): rank {r} called "
                    f"{other}; this rank {mine}")

    def _sv(self, bank: int, r: int, dt: np.dtype) -> np.ndarray:
        """Slot ``r`` of ``bank`` as a flat array of ``dt``."""
        return self._views(dt)[bank][r]

    def _views(self, dt: np.dtype) -> list:
        """``[bank][rank]`` -> that slot as a flat array of ``dt`` (cached)."""
        views = self._typed.get(dt)
        if views is None:
            views = self._typed[dt] = [[slot.view(dt) for slot in bank]
                                       for bank in self._slots]
        return views

    def _guard(self, fn, *args) -> None:
        """Run one collective; any failure leaves the group broken and tells the peers."""
        try:
            fn(*args)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Record ``exc`` as the group's failure and tell the peers (best effort): over a
        phase this rank already published, its fingerprint becomes OP_FAILED, so a peer
        arriving later raises PeerError instead of completing with it. Then wait for a
        peer in the middle of writing into this rank's memory (``pushing.py``): once
        this returns, none writes there any more."""
        if self._seg is not None and self._broken is None:
            self._broken = exc
            try:
                from . import segment as sg
                q = self._phase
                if self._u64[self._me_arrived] == q:
                    i = self._fp_idx[q & 1][self.rank]
                    self._u64[i] = OP_FAILED | (self._fp0 & ~0xF)
                self._mark(sg.STATE_FAILED)
            except Exception:  # noqa: BLE001 - report the original error
                pass
            writing = self._await_pushers()
            if writing:
                add_note(exc, f"[rank {self.rank}] ranks {writing} were still writing into "
                              f"this call's memory {self.timeout:g} s after this error "
                              f"(stopped in the middle of a piece?)")

    def _piece_elems(self, itemsize: int) -> int:
        """Elements of one of the n pieces of a slot (64-byte aligned)."""
        return (self._S // self.size) // _ALIGN * _ALIGN // itemsize

    # ----------------------------------------------------------------- barrier
    def barrier(self, seq: int) -> None:
        """One empty phase (what ``_guard`` does, inline: a barrier is all overhead)."""
        if self.size == 1:
            return
        try:
            self._start(OP_BARRIER, seq)
            self._exchange(self._enter())
        except BaseException as exc:
            self._fail(exc)
            raise

    # --------------------------------------------------------------- broadcast
    def broadcast(self, a: np.ndarray, src: int, seq: int) -> None:
        if self.size == 1:
            return
        self._guard(self._broadcast_impl, a.reshape(-1), src, seq)

    def _broadcast_impl(self, a: np.ndarray, src: int, seq: int) -> None:
        self._start(OP_BROADCAST, seq, a.dtype, a.nbytes, src)
        E = self._S // a.itemsize
        total = a.size
        lo = 0
        while True:
            hi = min(total, lo + E)
            q = self._enter()
            slot = self._sv(q & 1, src, a.dtype)
            if self.rank == src:
                slot[:hi - lo] = a[lo:hi]
            self._exchange(q)
            if self.rank != src:
                a[lo:hi] = slot[:hi - lo]
            lo = hi
            if lo >= total:
                break

    # ----------------------------------------------------------- gather family
    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> None:
        if self.size == 1:
            out[...] = inp
            return
        self._guard(self._gather_impl, inp, out, None, seq)

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], dst: int, seq: int) -> None:
        if self.size == 1:
            out[...] = inp
            return
        self._guard(self._gather_impl, inp, out, dst, seq)

    def _gather_impl(self, inp: np.ndarray, out: Optional[np.ndarray], dst: Optional[int],
                     seq: int) -> None:
        n, me, dt = self.size, self.rank, inp.dtype
        self._start(OP_ALL_GATHER if dst is None else OP_GATHER, seq, dt, inp.nbytes,
                    -1 if dst is None else dst)
        gets_result = dst is None or dst == me
        m = inp.size
        E = self._S // inp.itemsize
        lo = 0
        while True:
            hi = min(m, lo + E)
            q = self._enter()
            b = q & 1
            self._sv(b, me, dt)[:hi - lo] = inp[lo:hi]
            self._exchange(q)
            if gets_result:
                for r in range(n):
                    out[r * m + lo:r * m + hi] = self._sv(b, r, dt)[:hi - lo]
            lo = hi
            if lo >= m:
                break

    # ---------------------------------------------------------- scatter family
    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], src: int, seq: int) -> None:
        if self.size == 1:
            out[...] = inp
            return
        self._guard(self._scatter_impl, out, inp, src, None, seq)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, seq: int) -> None:
        if self.size == 1:
            out[...] = inp
            finish(op, out, 1)
            return
        self._guard(self._scatter_impl, out, inp, -1, op, seq)

    def _scatter_impl(self, out: np.ndarray, inp: Optional[np.ndarray], src: int,
                      op: Optional[ReduceOp], seq: int) -> None:
        """scatter from ``src`` (``op`` None) or reduce_scatter (``src`` -1)."""
        n, me, dt = self.size, self.rank, out.dtype
        reducing = op is not None
        self._start(OP_REDUCE_SCATTER if reducing else OP_SCATTER, seq, dt, out.nbytes,
                    src, op)
        writes = reducing or me == src
        m = out.size
        E = self._S // out.itemsize
        if n * m <= E:
            stride, step = m, max(m, 1)         # the whole input fits in one slot
        else:
            stride = step = self._piece_elems(out.itemsize)
        lo = 0
        while True:
            hi = min(m, lo + step)
            c = hi - lo
            q = self._enter()
            b = q & 1
            if writes:
                mine = self._sv(b, me, dt)
                if stride == m:
                    mine[:n * m] = inp
                else:
                    for k in range(n):
                        mine[k * stride:k * stride + c] = inp[k * m + lo:k * m + hi]
            self._exchange(q)
            at = me * stride
            if reducing and self._native_combine is not None:  # compiled, GIL released
                self._native_combine(out[lo:hi], [self._sv(b, r, dt)[at:at + c]
                                                  for r in range(n)],
                                     _DTYPE_CODE.get(dt, 0), _REDOP_BY_ID[id(op)], n)
            elif reducing:
                acc = out[lo:hi]
                acc[...] = self._sv(b, 0, dt)[at:at + c]
                for r in range(1, n):
                    combine_into(op, acc, self._sv(b, r, dt)[at:at + c])
                finish(op, acc, n)
            else:
                out[lo:hi] = self._sv(b, src, dt)[at:at + c]
            lo = hi
            if lo >= m:
                break

    # -------------------------------------------------------------- all_to_all
    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                    in_counts: Sequence[int], seq: int) -> None:
        if self.size == 1:
            if out_counts[0] != in_counts[0]:
                raise CollectiveMismatch(
                    f"{self.where('all_to_all')} (seq {seq}): this rank sends "
                    f"{in_counts[0]} elements to itself but expects {out_counts[0]}")
            out[...] = inp
            return
        self._guard(self._all_to_all_impl, out, inp, list(out_counts), list(in_counts), seq)

    def _all_to_all_impl(self, out: np.ndarray, inp: np.ndarray, out_counts: list,
                         in_counts: list, seq: int) -> None:
        n, me, dt = self.size, self.rank, out.dtype
        self._start(OP_ALL_TO_ALL, seq, dt, 0)
        # Phase 1: everybody's counts, so that all agree on the data phases and check
        # that what j sends to k is what k expects from j; behind them, at `head`
        # elements, the whole input where it fits the rest of the slot. Where every
        # rank's did (the counts say so alike on every rank), this phase is the call.
        q = self._enter()
        b = q & 1
        self._sv(b, me, _INT64)[:2 * n] = in_counts + out_counts
        head = self._a2a_head_bytes() // out.itemsize
        if inp.size <= self._S // out.itemsize - head:
            self._sv(b, me, dt)[head:head + inp.size] = inp
        self._exchange(q)
        self._all_to_all_rest(out, inp, out_counts, in_counts, seq, b)

    def _a2a_head_bytes(self) -> int:
        """Where the input starts in the all_to_all's first slot: after the 2n counts."""
        return (16 * self.size + _ALIGN - 1) // _ALIGN * _ALIGN

    def _all_to_all_rest(self, out: np.ndarray, inp: np.ndarray, out_counts: list,
                         in_counts: list, seq: int, b: int) -> None:
        """The all_to_all once its first phase (in bank ``b``) is done: check the counts
        (CollectiveMismatch where they disagree), then copy out what came with them, or
        run one more phase (every input fits a slot) or rounds of pieces."""
        n, me, dt = self.size, self.rank, out.dtype
        head = self._a2a_head_bytes() // out.itemsize
        room = self._S // out.itemsize - head
        # Python lists, not numpy: for the few ranks of a host, each numpy call here
        # costs more than the whole comparison (a 2-rank all_to_all of 8 bytes spent
        # most of its 57 us in them).
        rows = [self._sv(b, r, _INT64)[:2 * n].tolist() for r in range(n)]
        for j in range(n):   # rows[j][k]: j sends to k; rows[k][n + j]: k expects from j
            for k in range(n):
                if rows[j][k] != rows[k][n + j]:
                    raise CollectiveMismatch(
                        f"{self.where('all_to_all')} (seq {seq}): rank {j} sends "
                        f"{rows[j][k]} elements to rank {k}, but rank {k} expects "
                        f"{rows[k][n + j]} from rank {j} (input/output split sizes "
                        f"disagree)")
        in_off = list(accumulate(in_counts, initial=0))
        out_off = list(accumulate(out_counts, initial=0))
        widest = max(sum(row[:n]) for row in rows)
        if widest <= self._S // out.itemsize:
            if widest > room:
                # One more phase: every rank's whole input fits in its slot.
                q = self._enter()
                b = q & 1
                self._sv(b, me, dt)[:inp.size] = inp
                self._exchange(q)
                head = 0
            # (else every input came with the counts, behind them)
            for r in range(n):
                c = out_counts[r]
                if c:
                    at = head + sum(rows[r][:me])
                    out[out_off[r]:out_off[r] + c] = self._sv(b, r, dt)[at:at + c]
            return
        P = self._piece_elems(out.itemsize)
        rounds = (max(max(row[:n]) for row in rows) + P - 1) // P
        for t in range(rounds):
            lo = t * P
            q = self._enter()
            b = q & 1
            mine = self._sv(b, me, dt)
            for k in range(n):
                c = min(P, in_counts[k] - lo)
                if c > 0:
                    mine[k * P:k * P + c] = inp[in_off[k] + lo:in_off[k] + lo + c]
            self._exchange(q)
            for r in range(n):
                c = min(P, out_counts[r] - lo)
                if c > 0:
                    out[out_off[r] + lo:out_off[r] + lo + c] = \
                        self._sv(b, r, dt)[me * P:me * P + c]
