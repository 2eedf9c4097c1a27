"""One :class:`~collectives.testing.strategies.CollectiveCase` run on one rank, and the
verdict over every rank's result.

:func:`run_case` is what each worker of a :class:`~collectives.testing.WorldPool` calls:
it builds the rank's tensors (numpy or torch, contiguous or a strided view into a larger
buffer whose gaps hold a sentinel), calls the collective through the public
:class:`~collectives.ProcessGroup` API and returns a :class:`CaseResult` of plain numpy
arrays. :func:`compare` judges all ranks' results against the reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..buffers import to_host
from .strategies import (IN_PLACE_OPS, CollectiveCase, all_inputs, expected_outputs,
                         make_input, numpy_dtype, output_shape, tolerance)

#: What output buffers and the gaps of strided views hold before the call: no input value
#: and no result is ever 111, so an element a backend forgot to write, or wrote by
#: mistake, shows (except in bool tensors, where every value is a possible result).
SENTINEL = 111


@dataclass
class CaseResult:
    """What one rank saw: its output (the tensor itself for in-place ops; None where the
    op has none), its input after the call (out-of-place ops), problems it noticed itself
    (a write outside a strided view, a Work not completed after ``wait()``), or the
    exception it raised (a :class:`~collectives.testing.RemoteError`, set by the pool)."""

    rank: int
    output: Optional[np.ndarray] = None
    input_after: Optional[np.ndarray] = None
    problems: list[str] = field(default_factory=list)
    error: Optional[BaseException] = None


# ------------------------------------------------------------------------------ tensors
def to_numpy(t: Any) -> np.ndarray:
    """A C-contiguous numpy copy of a numpy array or a torch tensor (any device, bfloat16
    as ``ml_dtypes.bfloat16``)."""
    return np.array(to_host(t, where="collectives.testing", arg="tensor", write=False).array,
                    copy=True)


def _from_numpy(a: np.ndarray, kind: str) -> Any:
    if kind == "numpy":
        return a
    import torch
    t = (torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if str(a.dtype) == "bfloat16"
         else torch.from_numpy(a))
    return t.to("cuda") if kind == "cuda" else t


class _Tensor:
    """``data`` as the case asks: the ``view`` handed to the collective, and the ``base``
    buffer it lives in."""

    def __init__(self, data: np.ndarray, case: CollectiveCase) -> None:
        self.strided = case.layout == "strided" and data.ndim > 0
        self.transposed = self.strided and data.ndim >= 2 and case.seed % 2 == 1
        if not self.strided:
            base = data.copy()
        elif self.transposed:  # every axis reversed: a permuted view, no gaps
            base = np.ascontiguousarray(data.transpose())
        else:  # every other element of a buffer twice as long in the last axis
            base = np.full((*data.shape[:-1], 2 * data.shape[-1]), SENTINEL, data.dtype)
            base[..., ::2] = data
        self.base = _from_numpy(base, case.kind)
        if not self.strided:
            self.view = self.base
        elif self.transposed:
            self.view = (self.base.transpose() if case.kind == "numpy"
                         else self.base.permute(*reversed(range(data.ndim))))
        else:
            self.view = self.base[..., ::2]

    def gaps_untouched(self) -> bool:
        if not self.strided or self.transposed:
            return True
        gaps = to_numpy(self.base)[..., 1::2]
        return bool((gaps == np.array(SENTINEL).astype(gaps.dtype)).all())


# ---------------------------------------------------------------------------- one rank
def run_case(group: Any, case: CollectiveCase) -> CaseResult:
    """Run ``case`` on this rank of ``group`` (every rank of the group calls it with the
    same case) and return what it saw. Exceptions propagate to the caller."""
    rank, n = group.rank, group.size
    data = make_input(case, rank, n)
    inp = None if data is None else _Tensor(data, case)
    shape = output_shape(case, rank, n)
    out = None if shape is None else _Tensor(
        np.full(shape, SENTINEL).astype(numpy_dtype(case.dtype)), case)

    if case.delay is not None and case.delay[0] == rank:
        time.sleep(case.delay[1])  # skewed arrival: the others wait for this rank
    work = _call(group, case, inp, out)
    result = CaseResult(rank)
    if work is not None:
        work.wait()
        if not work.is_completed():
            result.problems.append(f"rank {rank}: Work.is_completed() is False after wait()")
    if case.op in IN_PLACE_OPS:
        result.output = to_numpy(inp.view)
    else:
        result.output = None if out is None else to_numpy(out.view)
        result.input_after = None if inp is None else to_numpy(inp.view)
    for name, t in (("input", inp), ("output", out)):
        if t is not None and not t.gaps_untouched():
            result.problems.append(f"rank {rank}: the call wrote into the gaps of the strided "
                                   f"{name} view (memory outside the view changed)")
    return result


def _call(group: Any, case: CollectiveCase, inp: Optional[_Tensor],
          out: Optional[_Tensor]) -> Any:
    kw: dict[str, Any] = {"async_op": True} if case.async_op else {}
    op, root, red = case.op, case.root, case.reduction
    i = None if inp is None else inp.view
    o = None if out is None else out.view
    if op == "barrier":
        return group.barrier(**kw)
    if op == "broadcast":
        return group.broadcast(i, src=root, **kw)
    if op == "all_reduce":
        return group.all_reduce(i, op=red, **kw)
    if op == "reduce":
        return group.reduce(i, dst=root, op=red, **kw)
    if op == "all_gather":
        return group.all_gather(o, i, **kw)
    if op == "gather":
        return group.gather(i, o, dst=root, **kw)
    if op == "scatter":
        return group.scatter(o, i, src=root, **kw)
    if op == "reduce_scatter":
        return group.reduce_scatter(o, i, op=red, **kw)
    if case.splits is not None:
        kw["input_split_sizes"] = list(case.splits[group.rank])
        kw["output_split_sizes"] = [row[group.rank] for row in case.splits]
    return group.all_to_all(o, i, **kw)


# ----------------------------------------------------------------------------- verdict
def compare(case: CollectiveCase, world_size: int, results: Sequence[CaseResult]) -> list[str]:
    """Everything wrong with ``results`` (one per rank): errors raised, outputs that differ
    from the reference, inputs modified, writes outside views, ranks whose all_reduce
    results are not bitwise identical. Empty when the case passed."""
    problems: list[str] = []
    expected = expected_outputs(case, world_size)
    inputs = all_inputs(case, world_size)
    rtol = tolerance(case)
    for r, res in enumerate(results):
        if res.error is not None:
            problems.append(f"rank {r} raised {res.error}")
            continue
        problems.extend(res.problems)
        if expected[r] is None:
            if res.output is not None:
                problems.append(f"rank {r}: expected no output, got {res.output!r}")
        else:
            diff = array_diff(res.output, expected[r], rtol)
            if diff:
                problems.append(f"rank {r}: output {diff}")
        if case.op not in IN_PLACE_OPS and inputs[r] is not None:
            diff = array_diff(res.input_after, inputs[r], None)
            if diff:
                problems.append(f"rank {r}: the input was modified: {diff}")
    if case.op == "all_reduce" and not problems:
        first = results[0].output
        for r, res in enumerate(results[1:], 1):
            if res.output.tobytes() != first.tobytes():
                problems.append(f"rank {r}: all_reduce result is not bitwise identical to "
                                f"rank 0's: {array_diff(res.output, first, None)}")
    return problems


def array_diff(got: Optional[np.ndarray], expected: np.ndarray, rtol: Optional[float],
               limit: int = 6) -> str:
    """A one-paragraph description of how ``got`` differs from ``expected`` ('' if it does
    not): shape or dtype, else how many elements differ and the first few of them.
    ``rtol`` None means exact (by value: ``-0.0 == 0.0``)."""
    if got is None:
        return f"is missing (expected {expected.dtype}{list(expected.shape)})"
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (f"has {got.dtype}{list(got.shape)}, expected "
                f"{expected.dtype}{list(expected.shape)}")
    if got.dtype == np.bool_ or np.issubdtype(got.dtype, np.integer):
        g, e = got, expected
        bad = g != e
    else:
        g, e = got.astype(np.float64), expected.astype(np.float64)
        if rtol is None:
            bad = ~((g == e) | (np.isnan(g) & np.isnan(e)))
        else:
            bad = ~np.isclose(g, e, rtol=rtol, atol=3 * rtol, equal_nan=True)
    if not bad.any():
        return ""
    where = np.argwhere(bad) if bad.ndim else np.zeros((1, 0), int)
    shown = ", ".join(f"[{','.join(map(str, idx))}] got {g[tuple(idx)]!r} expected "
                      f"{e[tuple(idx)]!r}" for idx in where[:limit])
    more = f", ... ({len(where) - limit} more)" if len(where) > limit else ""
    within = f" (rtol={rtol:g})" if rtol else ""
    text = f"differs in {int(bad.sum())} of {bad.size} elements{within}: {shown}{more}"
    if got.size <= 16:
        text += f"\n    got      {got.tolist()}\n    expected {expected.tolist()}"
    return text
