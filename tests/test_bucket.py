"""parallel.bucket: the pure bucket assignment (property-tested) and the Bucket's life cycle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import ReduceOp
from parallel.bucket import Bucket, assign_buckets


@st.composite
def _tensor_lists(draw):
    n = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(0, 2000), min_size=n, max_size=n))
    keys = draw(st.lists(st.sampled_from(["f32", "f64", "bf16"]), min_size=n, max_size=n))
    cap = draw(st.integers(1, 3000))
    return sizes, keys, cap


@settings(max_examples=300, deadline=None)
@given(_tensor_lists())
def test_assignment_properties(case):
    sizes, keys, cap = case
    buckets = assign_buckets(sizes, cap, keys=keys)
    # A partition of the indices, each bucket in the order given.
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(sizes)))
    assert all(b and b == sorted(b) for b in buckets)
    # One key per bucket; over the cap only when alone.
    for b in buckets:
        assert len({keys[i] for i in b}) == 1
        assert len(b) == 1 or sum(sizes[i] for i in b) <= cap
    # Launch order: by last index, which is when a bucket is expected to be full.
    lasts = [b[-1] for b in buckets]
    assert lasts == sorted(lasts)
    # Greedy: within a key, the buckets are consecutive runs, and each next bucket's
    # first tensor would not have fitted into the bucket before it.
    for key in set(keys):
        mine = [b for b in buckets if keys[b[0]] == key]
        assert [i for b in mine for i in b] == [i for i, k in enumerate(keys) if k == key]
        for prev, nxt in zip(mine, mine[1:]):
            assert sum(sizes[i] for i in prev) + sizes[nxt[0]] > cap


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 200))
def test_assignment_without_keys_is_a_single_key(sizes, cap):
    assert assign_buckets(sizes, cap) == assign_buckets(sizes, cap, keys=["k"] * len(sizes))


def test_assignment_examples():
    assert assign_buckets([], 10) == []
    assert assign_buckets([4, 4, 4, 12, 4], 8) == [[0, 1], [2], [3], [4]]
    assert assign_buckets([4, 8, 4, 8], 16, keys=["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    # Ordered by expected completion: the f64 bucket fills at index 2, the f32 one at 3.
    assert assign_buckets([1, 1, 1, 1], 100, keys=["a", "b", "b", "a"]) == [[1, 2], [0, 3]]
    assert assign_buckets([0, 0, 5], 5) == [[0, 1, 2]]


@pytest.mark.parametrize("cap", [0, -1, None, True, "8"])
def test_assignment_rejects_bad_cap(cap):
    with pytest.raises(ValueError, match="cap_bytes"):
        assign_buckets([1, 2], cap)


def test_assignment_rejects_bad_sizes_and_keys():
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        assign_buckets([1, -2], 8)
    with pytest.raises(ValueError, match="keys"):
        assign_buckets([1, 2], 8, keys=["a"])


class _LoopbackGroup:
    """A world of one that records the all-reduces it is asked for."""

    rank, size = 0, 1

    def __init__(self):
        self.calls = []

    def all_reduce(self, t, op=ReduceOp.SUM, *, async_op=False):
        self.calls.append((t.data_ptr(), t.numel(), op))

        class _Done:
            def wait(self, timeout=None):
                pass

        return _Done() if async_op else None


def test_bucket_life_cycle():
    a = torch.nn.Parameter(torch.ones(2, 3))
    b = torch.nn.Parameter(torch.ones(4))
    c = torch.nn.Parameter(torch.ones(1))
    group = _LoopbackGroup()
    bucket = Bucket(0, [a, b, c], group)
    assert bucket.flat.numel() == 6 + 4 + 1 + 3  # gradients, then one flag each
    assert bucket.nbytes == 11 * 4

    a.grad = torch.full((2, 3), 2.0)               # a fresh tensor: copied in
    assert bucket.adopt(0) and a.grad.data_ptr() == bucket.flat.data_ptr()
    assert not bucket.mark_ready(0)
    with pytest.raises(RuntimeError, match="twice"):
        bucket.mark_ready(0)
    b.grad = bucket.views[1]
    b.grad.fill_(3.0)
    assert bucket.adopt(1) and bucket.mark_ready(1) is False
    assert group.calls == []
    bucket.fill_missing()                          # c has no gradient: zeros, flag 0
    bucket.launch()
    assert group.calls == [(bucket.flat.data_ptr(), 14, ReduceOp.AVG)]
    assert bucket.flat[-3:].tolist() == [1.0, 1.0, 0.0]
    bucket.finish()
    assert torch.equal(a.grad, torch.full((2, 3), 2.0))
    assert torch.equal(b.grad, torch.full((4,), 3.0))
    assert c.grad is None                          # no rank had one: stays None
    assert not bucket.launched and "3 pending" in repr(bucket)


def test_bucket_flags_follow_every_pass_and_blocking_launches_run_now():
    """The flags are written only when they change: all gradients, then one missing, then
    all again must each reach the all-reduce as they are (1, 0, 1), through async and
    blocking launches alike; a failed round leaves the next pass writing them afresh."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    group = _LoopbackGroup()
    bucket = Bucket(0, [a, b], group)
    seen = []
    for missing, blocking in ((None, False), (1, True), (None, True), (None, False)):
        for slot, p in enumerate((a, b)):
            p.grad = None if slot == missing else torch.ones_like(p)
            if slot != missing:
                bucket.adopt(slot)
                bucket.mark_ready(slot)
        bucket.fill_missing()
        bucket.launch(blocking=blocking)
        assert bucket.launched != blocking   # a blocking launch is over when it returns
        seen.append(bucket.flat[-2:].tolist())
        bucket.finish()
        assert (b.grad is None) == (missing == 1)
    assert seen == [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert len(group.calls) == 4
    bucket.flat[-2:] = 0.5                   # what a failed round may leave behind
    bucket.reset()
    for slot in (0, 1):
        bucket.adopt(slot)
        bucket.mark_ready(slot)
    bucket.launch()
    assert bucket.flat[-2:].tolist() == [1.0, 1.0]


def test_bucket_launch_refuses_missing_gradients():
    p = torch.nn.Parameter(torch.ones(3))
    bucket = Bucket(0, [p], _LoopbackGroup())
    with pytest.raises(RuntimeError, match="1 gradients missing"):
        bucket.launch()


def test_bucket_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="share dtype"):
        Bucket(0, [torch.nn.Parameter(torch.ones(1)),
                   torch.nn.Parameter(torch.ones(1, dtype=torch.float64))], _LoopbackGroup())
    with pytest.raises(ValueError, match="at least one"):
        Bucket(0, [], _LoopbackGroup())

