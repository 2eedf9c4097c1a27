"""Bad input, drawn by hypothesis: every public call rejects wrong arguments with
``TypeError`` or ``ValueError`` naming the rank, the op and the argument, before any
communication, and the group stays usable.

The driver draws a :class:`BadCall` (which public method, which argument is wrong and
how); every rank of a running world (the ``pool`` fixture: every backend, world sizes 1
to 4) builds valid arguments for its rank, spoils the one argument and makes the call.
Where only the root validates an argument (gather's ``output``, scatter's ``input``,
broadcast_object's ``obj``) only the root calls; the others skip the call, as they would
be waiting in the collective. Then every rank runs a correct all_reduce and a ring of
sends with checked results under a short timeout: had a rank sent anything before
raising, or had one not raised at all, that check would mismatch or hang.

``init_process_group`` and ``spawn`` are checked in this process (they raise before any
rank starts).
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives
from collectives import ReduceOp
from collectives.testing.pool import WorldPool
from collectives.testing.strategies import DTYPES, FLOAT_DTYPES, numpy_dtype

#: Hypothesis examples per world (each is one round trip to the workers, ~5-30 ms).
MAX_EXAMPLES = 50
#: Seconds the bad call plus the check after it may take before the world is declared
#: hung (a rank that communicated instead of raising leaves the others waiting).
CHECK_TIMEOUT = 20.0
#: Elements of one rank's part in the valid arguments.
PART = 4

ROOTED = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src",
          "broadcast_object": "src"}
P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
#: The tensor arguments of each op taking tensors (in-place ops: ``tensor``).
TENSOR_ARGS = {"send": ("tensor",), "isend": ("tensor",), "recv": ("tensor",),
               "irecv": ("tensor",), "broadcast": ("tensor",), "all_reduce": ("tensor",),
               "reduce": ("tensor",), "all_gather": ("output", "input"),
               "gather": ("input", "output"), "scatter": ("output", "input"),
               "reduce_scatter": ("output", "input"), "all_to_all": ("output", "input")}
#: Arguments that only the root looks at.
ROOT_ONLY_ARGS = {("gather", "output"), ("scatter", "input")}
#: Tensor arguments the op writes on every rank (a read-only array is an error there).
WRITTEN_ARGS = {("recv", "tensor"), ("irecv", "tensor"), ("all_reduce", "tensor"),
                ("all_gather", "output"), ("scatter", "output"),
                ("reduce_scatter", "output"), ("all_to_all", "output"),
                ("gather", "output")}
#: Dtypes no backend moves (numpy names; the torch ones exist in torch >= 2.3).
NUMPY_UNSUPPORTED = ("complex64", "complex128", "object", "<U3", "S2", "datetime64[ns]",
                     "timedelta64[s]", "uint16", "uint32", "uint64", "longdouble")
TORCH_UNSUPPORTED = ("complex64", "complex128", "uint16", "uint32", "uint64",
                     "float8_e4m3fn")
#: Values that are not tensors (None included: no argument may be left out).
NOT_TENSORS = ([1.0, 2.0], 3, 2.5, "abc", b"xy", {"a": 1}, None, (1, 2))
#: Values that are not ranks, and ranks of no group of at most 4 ranks.
NOT_INTS = ("0", 0.0, 1.5, None, True, [0], b"\x00")


@dataclass(frozen=True)
class BadCall:
    """One public call with one argument spoiled.

    ``arg`` is the argument that is wrong (its name must be in the message), ``fault``
    how (``"type"``, ``"dtype"``, ``"rank"``, ``"self"``, ``"size"``, ``"mixed dtypes"``,
    ``"op"``, ``"splits"``, ``"read-only"``, ``"tag"``, ``"missing"``, ``"members"``,
    ``"unpicklable"``), ``value`` the bad value where one is needed; the valid arguments
    use ``dtype``, ``kind`` (numpy or torch) and ``root``. ``error`` is the exception
    every calling rank must raise; with ``root_only`` only the root calls.
    """

    op: str
    arg: str
    fault: str
    error: str
    value: Any = None
    dtype: str = "float32"
    kind: str = "numpy"
    root: int = 0
    async_op: bool = False
    root_only: bool = False

    def calls_on(self, rank: int) -> bool:
        """Whether ``rank`` makes the call (all ranks, or only the root)."""
        return not self.root_only or rank == self.root


# ------------------------------------------------------------------------- strategies
_RANKS_OUTSIDE = st.one_of(st.integers(-(2**40), -1), st.integers(4, 2**40))


def _bad_rank(n: int) -> st.SearchStrategy[tuple[Any, str]]:
    """(value, expected error) for a rank argument of a world of ``n``."""
    return st.one_of(
        st.tuples(st.one_of(_RANKS_OUTSIDE, st.integers(n, 8)), st.just("ValueError")),
        st.tuples(st.sampled_from([np.int64(-1), np.int32(n)]), st.just("ValueError")),
        st.tuples(st.sampled_from(NOT_INTS), st.just("TypeError")))


#: Every public call that takes arguments (barrier and close take none).
OPS_WITH_ARGUMENTS = (*TENSOR_ARGS, "broadcast_object", "all_gather_object", "new_group")


@st.composite
def bad_calls(draw: st.DrawFn, n: int) -> BadCall:
    """A :class:`BadCall` for a world of ``n`` ranks."""
    op = draw(st.sampled_from(OPS_WITH_ARGUMENTS))
    root = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["numpy", "torch"]))
    dtype = draw(st.sampled_from([d for d in DTYPES if d != "bool"]))
    async_op = draw(st.booleans()) and op not in P2P and op not in (
        "broadcast_object", "all_gather_object", "new_group")
    base = dict(op=op, root=root, kind=kind, dtype=dtype, async_op=async_op)

    if op == "new_group":
        value, error = draw(st.sampled_from([
            (3, "TypeError"), ("01", "TypeError"), (["0"], "TypeError"), ([0.0], "TypeError"),
            ([n], "ValueError"), ([-1], "ValueError"), ([], "ValueError"),
            ([0, 0], "ValueError"), ("not me", "ValueError")]))
        return BadCall(**base, arg="ranks", fault="members", value=value, error=error)
    if op == "all_gather_object":
        return BadCall(**base, arg="obj", fault="unpicklable", error="TypeError")
    if op == "broadcast_object":  # (an unpicklable object on `src`: see the test below)
        value, error = draw(_bad_rank(n))
        return BadCall(**base, arg="src", fault="rank", value=value, error=error)

    faults = ["type", "dtype", "read-only"]
    if op in ROOTED:
        faults.append("rank")
    if op in P2P:
        faults += ["rank", "self", "tag"]
        if n == 1:  # the only peer is the rank itself: that check comes first
            faults = ["type", "rank", "self"]
    if op in REDUCING:
        faults.append("op")
    if len(TENSOR_ARGS[op]) == 2:
        faults += ["size", "mixed dtypes"]
    if op == "all_to_all":
        faults.append("splits")
    if op in ("gather", "scatter"):
        faults.append("missing")
    fault = draw(st.sampled_from(faults))
    if fault == "read-only":
        written = [a for a in TENSOR_ARGS[op] if (op, a) in WRITTEN_ARGS]
        if not written or kind != "numpy":  # torch tensors have no read-only flag
            fault = "type"
        else:
            arg = draw(st.sampled_from(written))
            return BadCall(**base, arg=arg, fault=fault, error="ValueError",
                           root_only=(op, arg) in ROOT_ONLY_ARGS)
    if fault in ("type", "dtype"):
        arg = draw(st.sampled_from(TENSOR_ARGS[op]))
        if fault == "type":
            value = draw(st.sampled_from(NOT_TENSORS))
        else:
            value = draw(st.sampled_from(NUMPY_UNSUPPORTED if kind == "numpy"
                                         else TORCH_UNSUPPORTED))
        if op in REDUCING:
            base["dtype"] = "float32"  # SUM below: any reduction is defined on it
        # None for an argument only the root needs: "must be given there"
        error = "ValueError" if value is None and (op, arg) in ROOT_ONLY_ARGS else "TypeError"
        return BadCall(**base, arg=arg, fault=fault, value=value, error=error,
                       root_only=(op, arg) in ROOT_ONLY_ARGS)
    if fault == "rank":
        arg = ROOTED.get(op) or P2P[op]
        value, error = draw(_bad_rank(n))
        return BadCall(**base, arg=arg, fault=fault, value=value, error=error)
    if fault == "self":
        return BadCall(**base, arg=P2P[op], fault=fault, error="ValueError")
    if fault == "tag":
        value, error = draw(st.one_of(
            st.tuples(st.one_of(st.integers(-(2**40), -1), st.integers(2**31, 2**62)),
                      st.just("ValueError")),
            st.tuples(st.sampled_from(["1", 1.0, True, None]), st.just("TypeError"))))
        return BadCall(**base, arg="tag", fault=fault, value=value, error=error)
    if fault == "op":
        choice = draw(st.sampled_from(["not an op", "avg on integers", "bool"]))
        if choice == "not an op":
            value = draw(st.sampled_from(["median", 3, None, 1.5, "SUMS", sum]))
            return BadCall(**base, arg="op", fault=fault, value=value, error="TypeError")
        if choice == "bool":
            value = draw(st.sampled_from(list(ReduceOp))).name
            return BadCall(**{**base, "dtype": "bool"}, arg="op", fault=fault, value=value,
                           error="TypeError")
        integer = draw(st.sampled_from([d for d in DTYPES
                                        if d not in FLOAT_DTYPES and d != "bool"]))
        return BadCall(**{**base, "dtype": integer}, arg="op", fault=fault, value="AVG",
                       error="ValueError")
    if fault == "size":
        arg = "input" if op in ("scatter", "reduce_scatter") else "output"
        if op == "all_to_all":
            if n == 1:  # every row count divides by 1: spoil the dtype instead
                return BadCall(**base, arg="output", fault="dtype", value="complex64",
                               error="TypeError")
            arg = draw(st.sampled_from(["output", "input"]))
            rows = draw(st.integers(0, 3 * n).filter(lambda k: k % n))  # 2n rows are valid
            return BadCall(**base, arg=arg, fault=fault, value=rows - 2 * n,
                           error="ValueError")
        delta = draw(st.integers(-PART * n, 5).filter(lambda d: d != 0))
        return BadCall(**base, arg=arg, fault=fault, value=delta, error="ValueError",
                       root_only=(op, arg) in ROOT_ONLY_ARGS)
    if fault == "mixed dtypes":
        other = draw(st.sampled_from([d for d in DTYPES if d != dtype and d != "bool"]))
        arg = draw(st.sampled_from(TENSOR_ARGS[op]))
        if op in REDUCING:
            base["dtype"] = "float32"
            other = "float64"
        only = op in ("gather", "scatter")  # only the root has both tensors
        return BadCall(**base, arg=arg, fault=fault, value=other, error="TypeError",
                       root_only=only)
    if fault == "splits":
        arg = draw(st.sampled_from(["output_split_sizes", "input_split_sizes"]))
        value, error = draw(st.sampled_from([
            (3, "TypeError"), ([1] * (n + 1), "ValueError"), ([-1] + [3] * (n - 1), "ValueError"),
            ([1.5] * n, "ValueError"), (["1"] * n, "ValueError"), ([0] * n, "ValueError"),
            ([3] * n, "ValueError")]))
        return BadCall(**base, arg=arg, fault=fault, value=value, error=error)
    assert fault == "missing"
    arg = "output" if op == "gather" else "input"
    return BadCall(**base, arg=arg, fault=fault, error="ValueError", root_only=True)


# ---------------------------------------------------------------------------- workers
def _tensor(values: np.ndarray, kind: str) -> Any:
    if kind == "numpy":
        return values
    import torch
    if str(values.dtype) == "bfloat16":
        return torch.from_numpy(values.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def _unsupported(name: str, count: int, kind: str) -> Any:
    if kind == "torch":
        import torch
        return torch.zeros(count, dtype=getattr(torch, name))
    return np.zeros(count, dtype=name)


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object refuses to be pickled")


def _arguments(group: Any, call: BadCall) -> dict[str, Any]:
    """Valid arguments of ``call.op`` on this rank (keyword names as the API's)."""
    n, r, root = group.size, group.rank, call.root
    dt = numpy_dtype(call.dtype)

    def t(count: int) -> Any:
        return _tensor(np.ones(count, dt), call.kind)

    op = call.op
    if op in P2P:
        peer = (r + 1) % n if op in ("send", "isend") else (r - 1) % n
        return {"tensor": t(PART), P2P[op]: peer, "tag": 0}
    if op in ("broadcast", "all_reduce", "reduce"):
        args: dict[str, Any] = {"tensor": t(PART)}
        if op in ROOTED:
            args[ROOTED[op]] = root
        if op in REDUCING:
            args["op"] = ReduceOp.SUM
        return args
    if op == "all_gather":
        return {"output": t(PART * n), "input": t(PART)}
    if op == "gather":
        return {"input": t(PART), "output": t(PART * n) if r == root else None, "dst": root}
    if op == "scatter":
        return {"output": t(PART), "input": t(PART * n) if r == root else None, "src": root}
    if op == "reduce_scatter":
        return {"output": t(PART), "input": t(PART * n), "op": ReduceOp.SUM}
    if op == "all_to_all":
        return {"output": t(2 * n), "input": t(2 * n)}
    if op == "broadcast_object":
        return {"obj": {"rank": r}, "src": root}
    if op == "all_gather_object":
        return {"obj": {"rank": r}}
    assert op == "new_group", op
    return {"ranks": list(range(n))}


def _spoil(group: Any, call: BadCall, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with ``call.arg`` made wrong as ``call.fault`` says."""
    n, r = group.size, group.rank
    fault, arg, value = call.fault, call.arg, call.value
    if fault in ("type", "rank", "tag", "splits"):
        args[arg] = value
    elif fault == "dtype":
        args[arg] = _unsupported(value, int(args[arg].shape[0]), call.kind)
    elif fault == "self":
        args[arg] = r
    elif fault == "read-only":
        args[arg].flags.writeable = False
    elif fault == "size":
        good = int(args[arg].shape[0])
        args[arg] = _tensor(np.ones(good + value, numpy_dtype(call.dtype)), call.kind)
    elif fault == "mixed dtypes":
        args[arg] = _tensor(np.ones(int(args[arg].shape[0]), numpy_dtype(value)), call.kind)
    elif fault == "op":
        args["op"] = ReduceOp[value] if value in ReduceOp.__members__ else value
    elif fault == "missing":
        args[arg] = None
    elif fault == "members":
        args[arg] = [x for x in range(n) if x != r] if value == "not me" else value
    elif fault == "unpicklable":
        args[arg] = _Unpicklable() if r % 2 == 0 else threading.Lock()
    else:
        raise AssertionError(fault)
    return args


def _invoke(group: Any, call: BadCall) -> Any:
    args = _spoil(group, call, _arguments(group, call))
    if call.async_op:
        args["async_op"] = True
    return getattr(group, call.op)(**args)


def _check_usable(group: Any) -> None:
    """A correct all_reduce and a ring of sends, results checked."""
    n, r = group.size, group.rank
    a = np.full(3, r + 1, np.int64)
    group.all_reduce(a)
    assert (a == n * (n + 1) // 2).all(), f"rank {r}: all_reduce after the bad call: {a}"
    if n > 1:
        got = np.empty(2, np.int64)
        work = group.irecv(got, src=(r - 1) % n)
        group.send(np.full(2, r, np.int64), dst=(r + 1) % n)
        work.wait()
        assert (got == (r - 1) % n).all(), f"rank {r}: ring after the bad call: {got}"


def bad_call_on_rank(group: Any, call: BadCall) -> Optional[tuple[str, str]]:
    """Make ``call`` (where this rank calls) and then the usability check; return the
    exception raised as ``(type name, message)``, ``("returned", repr)`` if the call
    returned, or None where this rank does not call."""
    outcome: Optional[tuple[str, str]] = None
    if call.calls_on(group.rank):
        try:
            result = _invoke(group, call)
            outcome = ("returned", repr(result))
        except Exception as exc:  # noqa: BLE001 - judged by the test
            outcome = (type(exc).__name__, str(exc))
    if outcome is None or outcome[0] != "returned":
        _check_usable(group)
    return outcome


# ------------------------------------------------------------------------------- tests
def _judge(call: BadCall, outcomes: list[Any], n: int) -> None:
    for rank, outcome in enumerate(outcomes):
        if not call.calls_on(rank):
            assert outcome is None, outcome
            continue
        kind, message = outcome
        assert kind == call.error, (f"rank {rank}: {call!r} should raise {call.error}, "
                                    f"got {kind}: {message}")
        # (send and recv report as isend and irecv, which they call)
        for part in (f"[rank {rank}/{n}]", call.op, f"`{call.arg}`"):
            assert part in message, (f"rank {rank}: the message of {call!r} does not name "
                                     f"{part!r}: {message}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=["n1", "n2", "n3", "n4"])
def test_bad_arguments_raise_before_any_communication(pool: WorldPool, world_size: int) -> None:
    starts = pool.starts

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(call=bad_calls(world_size))
    def rejected(call: BadCall) -> None:
        outcomes = pool.call(bad_call_on_rank, call, timeout=CHECK_TIMEOUT,
                             raise_errors=True)
        _judge(call, outcomes, world_size)

    rejected()
    assert pool.starts == starts, "the world had to be restarted after a bad call"


# ------------------------------------------------ start-up: init_process_group and spawn
@st.composite
def _bad_init_arguments(draw: st.DrawFn) -> tuple[dict[str, Any], str, str]:
    """(kwargs of init_process_group, argument named, expected error)."""
    # (a bad `timeout`: test_init_process_group_names_the_argument)
    which = draw(st.sampled_from(["rank", "world_size", "both"]))
    if which == "both":
        return ({"rank": draw(st.integers(0, 3))}
                if draw(st.booleans()) else {"world_size": draw(st.integers(1, 3))},
                "world_size" if draw(st.booleans()) else "rank", "ValueError")
    size = draw(st.integers(1, 4))
    if which == "rank":
        value = draw(st.one_of(st.integers(size, 100), st.integers(-100, -1),
                               st.sampled_from(["0", 0.0, True, None])))
        error = "ValueError" if isinstance(value, int) and not isinstance(value, bool) \
            else "TypeError"
        if value is None:
            return {"rank": None, "world_size": size}, "rank", "ValueError"
        return {"rank": value, "world_size": size}, "rank", error
    # (world_size < 1: test_init_process_group_names_the_argument)
    value = draw(st.sampled_from(["2", 2.0, False, None, [2]]))
    if value is None:
        return {"rank": 0, "world_size": None}, "world_size", "ValueError"
    return {"rank": 0, "world_size": value}, "world_size", "TypeError"


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(_bad_init_arguments())
def test_bad_init_process_group_arguments(bad: tuple[dict[str, Any], str, str]) -> None:
    kwargs, arg, error = bad
    with pytest.raises((TypeError, ValueError)) as info:
        collectives.init_process_group("shm", **kwargs)
    assert type(info.value).__name__ == error, (kwargs, info.value)
    message = str(info.value)
    assert "init_process_group" in message and arg in message, (kwargs, message)


@pytest.mark.parametrize("kwargs,error,arg", [
    ({"timeout": "x"}, TypeError, "timeout"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"backend": 3}, TypeError, "backend"),
    ({"backend": "no-such-backend"}, ValueError, "backend"),
    ({"world_size": 0}, ValueError, "world_size"),
    ({"world_size": -3}, ValueError, "world_size"),
])
def test_init_process_group_names_the_argument(kwargs: dict, error: type, arg: str) -> None:
    kwargs = {"backend": "shm", "rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(error) as info:
        collectives.init_process_group(kwargs.pop("backend"), **kwargs)
    assert "init_process_group" in str(info.value) and f"`{arg}`" in str(info.value)


def _never_called() -> None:  # pragma: no cover - spawn must refuse before starting it
    raise AssertionError("spawn started a rank despite bad arguments")


@pytest.mark.parametrize("kwargs,error,arg", [
    ({"nproc": 0}, ValueError, "nproc"),
    ({"nproc": "2"}, ValueError, "nproc"),
    ({"nproc": True}, ValueError, "nproc"),
    ({"fn": 3}, TypeError, "fn"),
    ({"backend": 3}, TypeError, "backend"),
    ({"backend": "no-such-backend"}, ValueError, "backend"),
    ({"timeout": "x"}, TypeError, "timeout"),
    ({"timeout": -1.0}, ValueError, "timeout"),
    ({"join_timeout": "x"}, TypeError, "join_timeout"),
    ({"args": 3}, TypeError, "args"),
    ({"env": 3}, TypeError, "env"),
])
def test_bad_spawn_arguments(kwargs: dict, error: type, arg: str) -> None:
    call = {"fn": _never_called, "nproc": 1, **kwargs}
    with pytest.raises(error) as info:
        collectives.spawn(call.pop("fn"), call.pop("nproc"), join_timeout=30.0
                          if "join_timeout" not in call else call.pop("join_timeout"), **call)
    assert "spawn" in str(info.value) and f"`{arg}`" in str(info.value), str(info.value)
    if kwargs.get("backend") == "no-such-backend":  # the names to choose from
        assert "available here: " + ", ".join(collectives.available_backends()) \
            in str(info.value), str(info.value)


def test_pickling_errors_are_type_errors_here() -> None:
    """The workers' two unpicklable objects fail to pickle with TypeError, as the
    strategies assume (independent of any backend)."""
    for obj in (_Unpicklable(), threading.Lock()):
        with pytest.raises(TypeError):
            pickle.dumps(obj)


@pytest.mark.parametrize("op", ["broadcast_object", "all_gather_object"])
def test_an_object_one_rank_cannot_pickle_fails_every_rank_not_a_hang(op: str) -> None:
    """Object collectives send lengths first: a rank that cannot pickle its object sends
    -1, so it raises TypeError and every other rank a CollectiveError naming it, at once;
    then the group goes on."""
    from collectives import CollectiveError
    from collectives.testing.threads import run_threads

    def body(pg: Any) -> tuple:
        obj = _Unpicklable() if pg.rank == 1 else {"rank": pg.rank}
        try:
            if op == "broadcast_object":
                pg.broadcast_object(obj, src=1)
            else:
                pg.all_gather_object(obj)
            outcome: tuple = ("no error",)
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome = (type(exc).__name__, str(exc))
        return outcome + (pg.all_gather_object(pg.rank),)

    started = time.monotonic()
    results = run_threads(body, 3, timeout=20)
    assert time.monotonic() - started < 10
    for rank, (kind, *rest) in enumerate(results):
        message, after = rest
        assert after == [0, 1, 2]
        if rank == 1:
            assert kind == "TypeError" and f"[rank 1/3] {op}" in message and "`obj`" in message
        else:
            assert kind == CollectiveError.__name__, (rank, kind, message)
            assert f"[rank {rank}/3] {op}" in message and "1" in message and "pickle" in message
