"""What the data-parallel strategies (DDP, FSDP) ask of torch's autograd engine, in one
place: running code once a backward pass is over, telling passes apart, and walking a
module's outputs.

Two of these have no public spelling in torch, and torch's own DDP and FSDP use the same
two: ``torch.autograd.Variable._execution_engine.queue_callback`` (run a function when
the running backward pass has finished) and ``torch._C._current_graph_task_id`` (an id of
the running pass). They are reached through :func:`queue_callback` and
:func:`graph_task_id` only, and ``tests/test_ddp.py::test_the_autograd_internals_we_rely_on``
fails when a torch release changes them. Everything else the strategies do goes through
torch's public API.

Two ranks, both, inside a hook that backward reaches::

    queue_callback(lambda: print("the pass", graph_task_id(), "is over"))
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["collect_outputs", "graph_task_id", "queue_callback", "replace_outputs"]

_task_id = getattr(torch._C, "_current_graph_task_id", None)
_engine = torch.autograd.Variable._execution_engine


def graph_task_id() -> Optional[int]:
    """An id of the backward pass running on this thread (None outside one, or where
    this torch cannot tell)."""
    return _task_id() if _task_id is not None else None


def queue_callback(fn: Callable[[], None]) -> None:
    """Have the autograd engine call ``fn`` once the running backward pass is over (call
    it from a hook that backward runs)."""
    _engine.queue_callback(fn)


def collect_outputs(obj: Any, out: list) -> None:
    """The tensors requiring grad in a (nested tuple/list/dict) output, in order."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            collect_outputs(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            collect_outputs(item, out)


def replace_outputs(obj: Any, new: Iterator) -> Any:
    """``obj`` with the tensors :func:`collect_outputs` finds replaced by ``new``'s, in
    order."""
    if isinstance(obj, torch.Tensor):
        return next(new) if obj.requires_grad else obj
    if isinstance(obj, tuple):
        items = [replace_outputs(item, new) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [replace_outputs(item, new) for item in obj]
    if isinstance(obj, dict):
        return type(obj)((k, replace_outputs(v, new)) for k, v in obj.items())
    return obj
