"""What expert parallelism asks of all_to_all, on every backend at world sizes 1 to 4:
uneven split sizes with zeros, a rank that sends nothing while others send to it (a rank
with no tokens), a rank that receives nothing (experts nobody chose), nobody sending
anything, and uneven parts on both sides of every size line the group draws for
all_to_all (``pg.size_thresholds()``), in several dtypes, numpy and torch, contiguous
and strided.

:func:`uneven_cases` is a fixed list, so every backend and world size runs all of them
(the hypothesis sweep of tests/test_conformance.py draws uneven splits too, but which
ones it draws for a given backend is up to hypothesis). The ``pool`` fixture runs the
test once per backend and world size, in the worlds the conformance suite uses.

Also: the sweep's strategy does draw zeros, silent senders and deaf receivers (counted
over a few seeds).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, seed, settings

from collectives.testing import CollectiveCase, WorldPool, collective_cases

EXAMPLES = 200       # tests/test_conformance.py's MAX_EXAMPLES default


def _size_thresholds(group) -> tuple:
    return tuple(group.size_thresholds())


def _silent_and_deaf(n: int) -> tuple:
    """Rank n-1 sends nothing but receives; rank 0 receives nothing but sends (where
    there are two ranks or more); the rest 0 to 3 rows."""
    return tuple(tuple(0 if i == n - 1 or (j == 0 and n > 1) else (i + 2 * j) % 4
                       for j in range(n)) for i in range(n))


def _straddling(n: int) -> tuple:
    """Rank i sends 1 row to itself and 2 to the next rank; for n > 2 rank n-1 sends
    nothing (so with rows of 2/3 of a line, parts of 1 row are below it, of 2 above)."""
    return tuple(tuple(0 if i == n - 1 and n > 2 else
                       (2 if j == (i + 1) % n and n > 1 else 1 if j == i else 0)
                       for j in range(n)) for i in range(n))


def uneven_cases(thresholds, world_size: int) -> list:
    """The fixed uneven all_to_all cases of a world of ``world_size`` (see the module's
    docstring); ``thresholds``: the group's size lines."""
    n = world_size
    silent_deaf = _silent_and_deaf(n)
    cases = [
        CollectiveCase("all_to_all", (1,), "int64", splits=silent_deaf, seed=1),
        CollectiveCase("all_to_all", (1, 3, 2), "float32", splits=silent_deaf, seed=2,
                       layout="strided", kind="torch"),
        CollectiveCase("all_to_all", (1, 5), "bool", splits=silent_deaf, seed=3),
        CollectiveCase("all_to_all", (1, 7), "bfloat16", splits=silent_deaf, seed=4,
                       kind="torch", async_op=True),
        CollectiveCase("all_to_all", (1, 4), "int8", seed=5,
                       splits=tuple(tuple(0 for _ in range(n)) for _ in range(n))),
        CollectiveCase("all_to_all", (1, 1000), "float64", splits=_straddling(n), seed=6),
    ]
    for i, line in enumerate(t for t in thresholds if t.applies("all_to_all", n)):
        row = max(1, line.nbytes * 2 // 3 // 4)          # float32 elements
        cases.append(CollectiveCase("all_to_all", (1, row), "float32", seed=10 + i,
                                    splits=_straddling(n), kind="torch",
                                    layout="strided" if i % 2 else "contiguous"))
    return cases


def test_uneven_all_to_all_matches_the_reference(pool: WorldPool, world_size: int):
    thresholds = pool.call(_size_thresholds)[0]
    cases = uneven_cases(thresholds, world_size)
    for case in cases:
        pool.check(case, name="uneven all_to_all")
    lines = [t for t in thresholds if t.applies("all_to_all", world_size)]
    for line in lines:   # each line has parts on both of its sides in one call
        sides = {line.side(s * c.shape[1] * 4) for c in cases[6:] for row in c.splits
                 for s in row if s}
        assert {"below", "above"} <= sides, (line.name, sides)


def test_fixed_cases_have_what_they_claim():
    for n in (1, 2, 3, 4):
        cases = uneven_cases((), n)
        splits = cases[0].splits
        assert not any(splits[n - 1]), "rank n-1 sends nothing"
        if n > 1:
            assert any(splits[i][n - 1] for i in range(n)), "... but receives"
            assert not any(row[0] for row in splits) and any(splits[0]), "rank 0 is deaf"
            assert len({sum(row) for row in splits}) > 1
        assert not any(map(any, cases[4].splits))


def _drawn_uneven(world_size: int, draw_seed: int) -> list:
    cases = []

    @seed(draw_seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=collective_cases(world_size))
    def collect(case):
        if case.op == "all_to_all" and case.splits is not None:
            cases.append(case)

    collect()
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sweep_draws_silent_and_deaf_ranks(world_size):
    n = world_size
    cases = [c for s in range(3) for c in _drawn_uneven(n, s)]
    received = lambda c, i: sum(c.splits[j][i] for j in range(n))  # noqa: E731
    silent = [(c, i) for c in cases for i in range(n) if not any(c.splits[i])]
    assert any(received(c, i) for c, i in silent), "a silent rank that still receives"
    assert any(received(c, i) == 0 and any(c.splits[i]) for c in cases for i in range(n)), \
        "a deaf rank that still sends"
    assert any(0 in row for c in cases for row in c.splits)
