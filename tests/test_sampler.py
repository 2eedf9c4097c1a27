"""parallel.ShardSampler: every rank's shard, property-tested."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel import ShardSampler

_cases = st.tuples(st.integers(0, 300), st.integers(1, 9), st.booleans(), st.booleans(),
                   st.integers(0, 2**32), st.integers(0, 50))


def _shards(n, world, shuffle, drop_last, seed, epoch):
    shards = []
    for rank in range(world):
        s = ShardSampler(n, rank, world, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        shards.append(list(s))
        assert len(shards[-1]) == len(s)
    return shards


@settings(max_examples=300, deadline=None)
@given(_cases)
def test_shard_properties(case):
    n, world, shuffle, drop_last, seed, epoch = case
    shards = _shards(n, world, shuffle, drop_last, seed, epoch)
    # Equal lengths, so the ranks take equally many steps.
    expected = n // world if drop_last else -(-n // world)
    assert all(len(s) == expected for s in shards)
    everything = [i for s in shards for i in s]
    assert all(0 <= i < n for i in everything)
    if not drop_last:
        assert set(everything) == set(range(n))          # the union covers the dataset
        # padding by wrapping repeats at most world - 1 indices, each at most once more
        # (or, for a dataset smaller than the world, as often as wrapping needs)
        extra = len(everything) - n
        assert 0 <= extra < world
        if n >= world:
            assert all(c <= 2 for c in Counter(everything).values())
    if drop_last or (n % world == 0):
        assert len(set(everything)) == len(everything)   # disjoint shards
    if drop_last:
        assert n - len(everything) < world               # at most world - 1 left out
    # Deterministic: another sampler (another process) with the same arguments agrees.
    assert shards == _shards(n, world, shuffle, drop_last, seed, epoch)
    # Rank r holds every world-th element of one epoch order.
    order = ShardSampler(n, 0, world, shuffle=shuffle, seed=seed, drop_last=drop_last)
    order.set_epoch(epoch)
    full = order.epoch_order().tolist()
    assert all(shards[r] == full[r::world] for r in range(world))
    if not shuffle:
        assert full[:min(n, len(full))] == list(range(min(n, len(full))))


@settings(max_examples=100, deadline=None)
@given(st.integers(20, 500), st.integers(1, 4), st.integers(0, 2**32), st.integers(0, 100))
def test_epochs_reorder(n, world, seed, epoch):
    a = ShardSampler(n, 0, world, seed=seed)
    a.set_epoch(epoch)
    b = ShardSampler(n, 0, world, seed=seed)
    b.set_epoch(epoch + 1)
    assert a.epoch_order().tolist() != b.epoch_order().tolist()  # 1/20! odds of a clash
    # ... and different seeds give different orders too.
    c = ShardSampler(n, 0, world, seed=seed + 1)
    c.set_epoch(epoch)
    assert a.epoch_order().tolist() != c.epoch_order().tolist()


def test_seed_and_epoch_do_not_alias():
    a = ShardSampler(100, 0, 1, seed=0)
    a.set_epoch(1)
    b = ShardSampler(100, 0, 1, seed=1)
    assert list(a) != list(b)


def test_small_examples():
    assert [list(ShardSampler(5, r, 2, shuffle=False)) for r in range(2)] == [[0, 2, 4], [1, 3, 0]]
    assert [list(ShardSampler(5, r, 2, shuffle=False, drop_last=True)) for r in range(2)] == \
        [[0, 2], [1, 3]]
    assert [list(ShardSampler(2, r, 5, shuffle=False)) for r in range(5)] == \
        [[0], [1], [0], [1], [0]]
    assert [list(ShardSampler(2, r, 5, drop_last=True)) for r in range(5)] == [[]] * 5
    assert list(ShardSampler(0, 0, 3)) == [] and len(ShardSampler(0, 0, 3)) == 0


def test_works_with_torch_data_loading():
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    sampler = ShardSampler(len(data), 1, 3, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    seen = torch.cat([x for (x,) in loader]).long().tolist()
    assert seen == list(sampler) and len(seen) == 4
    batches = list(torch.utils.data.BatchSampler(sampler, batch_size=3, drop_last=False))
    assert [i for b in batches for i in b] == list(sampler)
    assert isinstance(sampler, torch.utils.data.Sampler)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dataset_len=-1, rank=0, world_size=1), "dataset_len"),
    (dict(dataset_len=3, rank=2, world_size=2), "rank"),
    (dict(dataset_len=3, rank=-1, world_size=2), "rank"),
    (dict(dataset_len=3, rank=0, world_size=0), "world_size"),
    (dict(dataset_len=3.0, rank=0, world_size=1), "dataset_len"),
    (dict(dataset_len=3, rank=0, world_size=1, seed=-1), "seed"),
])
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardSampler(**kwargs)


def test_set_epoch_validates():
    s = ShardSampler(4, 0, 2)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)
    s.set_epoch(3)
    assert s.epoch == 3 and "epoch=3" in repr(s)
